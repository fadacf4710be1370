"""The n choices of a prompt prefill it once: later choices start from the first one's cached blocks, shared
by reference count, and prefill only the rest (app/engine/kv_blocks.py, app/engine/scheduler.py)."""

from app.api.fanout import choice_params
from app.engine.kv_blocks import BlockManager
from app.sampling.params import SamplingParams
from engine_helpers import greedy, run_all

BLOCK = 16  # the engine's default block_size


def long_prompt(manifest) -> str:
    return " ".join(manifest["prompts"] * 2)  # over two KV blocks


def test_shared_blocks_are_freed_by_the_last_table_that_holds_them():
    blocks = BlockManager(num_blocks=10, block_size=BLOCK)  # 9 usable
    blocks.allocate("a", 40)  # 3 blocks
    assert blocks.share("b", "a", 2) == blocks.tables["a"][:2]
    blocks.allocate("b", 60)  # b grows past the shared prefix with blocks of its own
    blocks.check_invariants()
    assert blocks.free_count() == 9 - 3 - 2
    blocks.release("a")  # a's own last block goes back; the two shared stay with b
    blocks.check_invariants()
    assert blocks.free_count() == 9 - 4 and len(blocks.tables["b"]) == 4
    blocks.release("b")
    blocks.check_invariants()
    assert blocks.free_count() == 9 and not blocks.refs


def test_n_choices_prefill_the_prompt_once_and_equal_separate_requests(make_engine, manifest, adapter_names):
    prompt, adapter = long_prompt(manifest), adapter_names[0]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True)
    engine = make_engine(num_slots=4)
    choices = [engine.add_request(prompt, adapter, choice_params(params, j)) for j in range(4)]  # as fanout does
    tokens = run_all(engine, check=True)
    shared = (len(choices[0].prompt_ids) - 1) // BLOCK * BLOCK
    assert shared >= 2 * BLOCK, "the prompt is too short to share a block"
    assert engine.metrics()["prefix_shared_tokens"] == 3 * shared  # choices 1-3 each start past the prefix
    alone = make_engine(num_slots=4)
    for j, request in enumerate(choices):
        one = alone.add_request(prompt, adapter, choice_params(params, j))
        assert run_all(alone)[one.request_id] == tokens[request.request_id], j
    assert alone.metrics()["prefix_shared_tokens"] == 0


def test_shared_prefixes_under_kv_exhaustion_keep_outputs_exact(make_engine, manifest, adapter_names):
    prompt = long_prompt(manifest)
    work = [(prompt, adapter_names[0])] * 4 + [(prompt, None)] * 2 + [(manifest["prompts"][0], adapter_names[1])] * 2

    def generate(engine):
        requests = [engine.add_request(p, a, greedy(24, ignore_eos=True)) for p, a in work]
        tokens = run_all(engine, check=True)  # block reference counts checked after every step
        return [tokens[r.request_id] for r in requests]

    roomy = generate(make_engine(num_slots=8))
    tight = make_engine(num_slots=8, max_total_tokens=192, max_input_tokens=128)
    assert generate(tight) == roomy
    metrics = tight.metrics()
    assert metrics["preemptions"] > 0 and metrics["prefix_shared_tokens"] > 0
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"]


def test_a_choice_whose_source_is_aborted_prefills_alone(make_engine, manifest, adapter_names):
    prompt, adapter = long_prompt(manifest), adapter_names[0]
    engine = make_engine(num_slots=4, max_prefill_tokens_per_step=8)  # the source prefills over several steps
    source = engine.add_request(prompt, adapter, greedy(6))
    follower = engine.add_request(prompt, adapter, greedy(6))
    engine.step()
    assert follower in engine.waiting, "the follower did not wait for the source's prefill"
    engine.abort(source.request_id)
    tokens = run_all(engine, check=True)
    reference = make_engine(num_slots=4)
    alone = reference.add_request(prompt, adapter, greedy(6))
    assert tokens[follower.request_id] == run_all(reference)[alone.request_id]
    assert engine.metrics()["prefix_shared_tokens"] == 0


def test_echo_requests_compute_their_own_prompt(make_engine, manifest):
    prompt = long_prompt(manifest)
    engine = make_engine(num_slots=4)
    engine.add_request(prompt, None, greedy(2))
    echo = engine.add_request(prompt, None, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    run_all(engine, check=True)
    assert engine.metrics()["prefix_shared_tokens"] == 0
    assert len(echo.prompt_logprobs) == len(echo.prompt_ids) - 1
