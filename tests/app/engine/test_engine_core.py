"""The engine core on the tiny demo: chunked prefill, KV exhaustion (preemption and refusal), batched prefill."""

import pytest

from app.errors import InvalidRequest
from engine_helpers import greedy, jobs, packed_reference, run_all


def generate(engine, work, max_tokens=10):
    requests = [engine.add_request(p, a, greedy(max_tokens, ignore_eos=True)) for p, a in work]
    tokens = run_all(engine, check=True)
    return [tokens[r.request_id] for r in requests]


def test_chunked_prefill_equals_unchunked(make_engine, manifest, adapter_names):
    work = jobs(manifest, adapter_names)
    whole = generate(make_engine(num_slots=8), work)
    chunked_engine = make_engine(num_slots=8, max_prefill_tokens_per_step=7)
    chunked = generate(chunked_engine, work)
    assert chunked == whole
    assert max(len(chunked_engine.tokenizer(p)["input_ids"]) for p, _ in work) > 7, "no prompt was chunked"


def test_batched_prefill_runs_several_requests_in_one_step(make_engine, manifest, adapter_names):
    engine = make_engine(num_slots=8)
    work = jobs(manifest, adapter_names, 6)
    generate(engine, work, max_tokens=1)  # make the adapters resident first
    requests = [engine.add_request(prompt, adapter, greedy(4)) for prompt, adapter in work]
    outputs = engine.step()
    assert len({a for _, a in work}) == 6
    assert len(engine.running) == 6, "the six prefills did not share one step"
    outputs += engine.step()  # with overlapped steps, the first tokens stream at the next step
    assert {o.request_id for o in outputs} == {r.request_id for r in requests}


def test_kv_exhaustion_preempts_and_outputs_stay_exact(make_engine, manifest, adapter_names):
    work = jobs(manifest, adapter_names, 8)
    roomy = generate(make_engine(num_slots=8), work, max_tokens=24)
    # 12 blocks of 16 tokens for 8 requests of up to ~70 tokens each: they cannot all stay resident.
    tight = make_engine(num_slots=8, max_total_tokens=192, max_input_tokens=128)
    assert generate(tight, work, max_tokens=24) == roomy
    metrics = tight.metrics()
    assert metrics["preemptions"] > 0, "the cache never ran out"
    assert metrics["kv_blocks_free"] == metrics["kv_blocks_total"] and metrics["slots_pinned"] == 0


def test_a_request_that_can_never_fit_is_refused_at_submission(make_engine, manifest):
    engine = make_engine(max_total_tokens=64, max_input_tokens=32)
    with pytest.raises(InvalidRequest, match="KV cache"):
        engine.add_request(manifest["prompts"][0], None, greedy(60))
    assert not engine.has_requests()


def test_packed_varlen_prefill_equals_per_sequence(make_engine, manifest, adapter_names, monkeypatch):
    """The runner's packing for one varlen call per layer (context rows gathered from the paged cache,
    query and context offsets) against the per-sequence path, with chunks that continue earlier ones.
    CUDA runs torch's flash varlen here (a GPU test checks it); on CPU its contract stands in."""
    from app.model import attention

    work = jobs(manifest, adapter_names)
    whole = generate(make_engine(num_slots=8), work)
    engine = make_engine(num_slots=8, max_prefill_tokens_per_step=7)
    calls = []
    monkeypatch.setattr(attention, "VARLEN", lambda *args: calls.append(1) or packed_reference(*args))
    engine.runner.use_varlen = True
    assert generate(engine, work) == whole
    assert calls, "the packed path never ran"


def test_start_up_warm_step_touches_only_scratch(make_engine, manifest, adapter_names):
    """The runner's start-up eager step (CUDA runs it to compile the LoRA kernels' configs) writes only the
    scratch block and reads slot 0: requests before and after it, and around it mid-flight, are unchanged."""
    work = jobs(manifest, adapter_names, 6)
    engine = make_engine(num_slots=8)
    before = generate(engine, work)
    requests = [engine.add_request(p, a, greedy(10, ignore_eos=True)) for p, a in work]
    tokens = {}
    for _ in range(3):
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
    engine.runner._warm_eager()
    for request_id, more in run_all(engine, check=True).items():
        tokens.setdefault(request_id, []).extend(more)
    assert [tokens[r.request_id] for r in requests] == before


def test_prefill_tokens_as_decode_rows_equal_prefill(make_engine, manifest, adapter_names, monkeypatch):
    """What a graph replays for a step that prefills: every prompt token as a decode row with its sequence's
    block table and context position + 1 (`as_decode_rows`), here through the decode reference on CPU,
    with chunks that continue earlier ones and decode rows beside them."""
    from app.engine.step_inputs import as_decode_rows

    work = jobs(manifest, adapter_names)
    whole = generate(make_engine(num_slots=8), work)
    engine = make_engine(num_slots=8, max_prefill_tokens_per_step=7)
    forward, converted = engine.runner._forward_eager, []

    def rows_forward(inputs, previous=None):
        if inputs.prefill_tables:
            converted.append(inputs.num_decode)
            inputs = as_decode_rows(inputs)
            assert not inputs.prefill_tables and inputs.num_decode == len(inputs.input_ids)
        return forward(inputs, previous)

    monkeypatch.setattr(engine.runner, "_forward_eager", rows_forward)
    assert generate(engine, work) == whole
    assert converted and max(converted) > 0, "no step mixed decode rows with prefill tokens"


def test_block_tables_fill_a_graphs_buffer_row_by_row():
    """Decode rows (a table each) and prefill chunks as decode rows (one table object per chunk) land in the
    graph's table buffer as their rows, zero-padded, whichever copy carries them."""
    import torch

    from app.engine.cuda_graphs import fill_tables

    chunk_a, chunk_b = [7, 8, 9], [4]
    for rows in ([[1, 2], [3], [5, 6, 10, 11]] + [chunk_a] * 3 + [chunk_b] * 2 + [[12]],
                 [chunk_a] * 2 + [[1], [2, 3]], [[1, 2, 3]], []):
        tables = torch.zeros(10, 6, dtype=torch.int32)
        fill_tables(tables, rows)
        expected = torch.zeros(10, 6, dtype=torch.int32)
        for i, table in enumerate(rows):
            expected[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        assert torch.equal(tables, expected), rows


def test_graph_buckets_cover_decode_batches_then_step_tokens():
    from app.engine.cuda_graphs import graph_buckets

    assert graph_buckets(32, 512) == [1, 2, 4, 8, 16, 24, 32, 64, 128, 256, 512]
    assert graph_buckets(32, 0) == graph_buckets(32, 32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_buckets(64, 100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 100]


def test_lora_segments_of_a_bucket_are_capped_by_requests_slots_and_tiles():
    from app.engine.cuda_graphs import segment_cap
    from app.model.lora import segments

    assert segment_cap(128, 128, 4096) == 128  # one segment per row at most
    assert segment_cap(128, 128, 32) == 32 + 8  # 32 adapters at most, and one more per 16-row tile
    assert segment_cap(32, 256, 8) == 8 + 2
    assert segment_cap(512, 128, 4096) == 128 + 32  # a bucket that prefills: its prompt tokens in tiles too
    slots = [row % 32 for row in range(96)] + [0] * 32  # 32 adapters, one of them on 35 rows: in 3 tiles
    order, starts, seg_slots = segments(slots, 128, segment_cap(128, 128, 32), max_rows=16)
    assert sum(slot >= 0 for slot in seg_slots) == 31 + 3
    slots = [row % 32 for row in range(127)] + [5] * 384  # and a 384-token prompt of adapter 5: 388 rows
    order, starts, seg_slots = segments(slots, 512, segment_cap(512, 128, 32), max_rows=16)
    assert sum(slot >= 0 for slot in seg_slots) == 31 + 25 and max(b - a for a, b in zip(starts, starts[1:])) == 16
