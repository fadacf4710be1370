"""Overlapped steps (EngineConfig.overlap_steps): each step launches before the one before it is read back, its
decode rows' inputs taken from that step's tokens on the device. Every request's output equals the output of an
engine that runs its steps one at a time: tokens, text, finish reasons and logprobs, under stops, EOS, sampling
with seeds, echo, shared prompt prefixes, penalties (which run their steps one at a time), preemption and abort."""

from dataclasses import replace

import pytest

from app.sampling.params import SamplingParams
from engine_helpers import greedy, run_all

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def workload(manifest, adapter_names) -> list[tuple[str, str | None, SamplingParams]]:
    prompts, adapters = manifest["prompts"], [None, *adapter_names]
    kinds = [
        greedy(14),  # EOS may end it
        greedy(9, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        greedy(12, stop=("e",), ignore_eos=True),  # a stop string ends it mid-stream
        greedy(0, prompt_logprobs=1),  # echo: prompt logprobs, no token
        greedy(5, ignore_eos=True, prompt_logprobs=2, logprobs=1),
        greedy(1, ignore_eos=True),
    ]
    work = [(prompts[i % len(prompts)] * (1 + i % 2), adapters[i % len(adapters)], kinds[i % len(kinds)])
            for i in range(14)]
    return work + [work[0], work[1]]  # the same prompt and adapter again: they start from the first's blocks


def serve(engine, work, abort_after: dict[int, int] | None = None) -> list[tuple]:
    """Each request's (token ids, text, finish reason, logprobs, prompt logprobs), all added at once; abort_after:
    request index -> abort it once it has streamed that many tokens."""
    requests = [engine.add_request(prompt, adapter, params) for prompt, adapter, params in work]
    index = {r.request_id: i for i, r in enumerate(requests)}
    got = [([], "", None, [], None) for _ in requests]
    while engine.has_work():
        outputs = engine.step()
        for output in outputs:
            i = index[output.request_id]
            tokens, text, _, logprobs, prompt = got[i]
            got[i] = (tokens + list(output.token_ids), text + output.text, output.finish_reason,
                      logprobs + list(output.logprobs), prompt or output.prompt_logprobs)
        for i, count in (abort_after or {}).items():
            if len(got[i][0]) >= count and got[i][2] is None:
                aborted = engine.abort(requests[i].request_id)
                got[i] = (*got[i][:2], aborted.finish_reason, *got[i][3:])
        engine.check_invariants()
    return got


def assert_same(got: list[tuple], expected: list[tuple]) -> None:
    """Equal tokens, text and finish reasons; logprobs of the same tokens within 1e-4 (a batch of other rows
    rounds float32 sums differently)."""
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    for (*_, logprobs, prompt), (*_, want, want_prompt) in zip(got, expected):
        for mine, theirs in zip(logprobs + list(prompt or ()), want + list(want_prompt or ())):
            assert mine.token_id == theirs.token_id and [t for t, _ in mine.top] == [t for t, _ in theirs.top]
            values = [mine.logprob, *(lp for _, lp in mine.top)]
            assert values == pytest.approx([theirs.logprob, *(lp for _, lp in theirs.top)], abs=1e-4)


def test_overlapped_steps_serve_what_steps_one_at_a_time_serve(make_engine, manifest, adapter_names):
    work = workload(manifest, adapter_names)
    alone = serve(make_engine(num_slots=4, overlap_steps=False), work)
    engine = make_engine(num_slots=4, overlap_steps=True)
    assert engine.overlap
    assert_same(serve(engine, work), alone)
    assert engine.overlapped_steps > engine.steps // 2, (engine.overlapped_steps, engine.steps)
    assert {reason for _, _, reason, _, _ in alone} >= {"stop", "length"}
    assert any(logprobs for _, _, _, logprobs, _ in alone) and any(prompt for *_, prompt in alone)


def test_a_request_with_penalties_runs_its_steps_one_at_a_time(make_engine, manifest, adapter_names):
    """Penalties read the request's own output: while it runs no step overlaps, and every output still equals
    the one-at-a-time engine's."""
    work = workload(manifest, adapter_names)[:6]
    work[2] = (work[2][0], work[2][1], replace(work[2][2], repetition_penalty=1.3, frequency_penalty=0.5))
    alone = serve(make_engine(num_slots=4, overlap_steps=False), work)
    engine = make_engine(num_slots=4, overlap_steps=True)
    assert_same(serve(engine, work), alone)
    assert engine.overlapped_steps < engine.steps
    lone = make_engine(num_slots=4, overlap_steps=True)
    assert_same(serve(lone, work[2:3]), alone[2:3])
    assert lone.steps > 1 and lone.overlapped_steps == 0  # alone, it never overlaps a step


def test_preemption_and_abort_under_overlapped_steps(make_engine, manifest, adapter_names):
    """A KV cache too small for every running request preempts the youngest (it recomputes its tokens, the
    newest of which may still be on the device); an aborted request streams nothing after its abort, and the
    others are as if it had never been there."""
    work = [(p, a, greedy(24, ignore_eos=True)) for p, a, _ in workload(manifest, adapter_names)[:8]]
    small = dict(num_slots=4, max_total_tokens=160, max_input_tokens=64, block_size=16)
    alone = serve(make_engine(**small, overlap_steps=False), work)
    engine = make_engine(**small, overlap_steps=True)
    assert_same(serve(engine, work), alone)
    assert engine.scheduler.preemptions > 0 and engine.overlapped_steps > 0

    engine = make_engine(num_slots=4, overlap_steps=True)
    got = serve(engine, work, abort_after={3: 4})
    tokens, _, reason, _, _ = got[3]
    assert reason == "abort" and 4 <= len(tokens) < 24
    assert_same([g for i, g in enumerate(got) if i != 3], [g for i, g in enumerate(alone) if i != 3])
    assert run_all(engine) == {}
