"""CUDA graphs (marker `gpu`): graph replay and compiled decode equal eager and PEFT, the paged adapter pool
replayed in graphs equals padded slots, and replays write only memory that their graphs hold."""

import pytest
import torch
from transformers import LlamaConfig

from app.adapters.targets import target_shapes
from engine_helpers import agrees_up_to_near_tie, bf16_reference, greedy, run_all
from prefetch.layout import PageLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
MAX_NEW = 16


def test_graph_replay_equals_eager_and_peft(make_engine, graph_model, manifest):
    names = ["a0", "a1", "a2"]
    prompts = manifest["prompts"]
    jobs = [(prompts[i % len(prompts)], ([None] + names)[i % 4]) for i in range(10)]
    outputs = {}
    for variant in ("compiled", "graphs", "eager"):
        graphs = variant != "eager"
        engine = make_engine(register=False, base_model=str(graph_model / "base"), device="cuda", dtype="bfloat16",
                             adapter_roots=(str(graph_model / "adapters"),), num_slots=4, cuda_graphs=graphs,
                             compile_decode=variant == "compiled",
                             max_prefill_tokens_per_step=16)  # prompts chunk while others decode: mixed steps
        assert bool(engine.runner.graphs) == graphs and engine.runner.compiled == (variant == "compiled")
        for name in names:
            engine.register_adapter(name, str(graph_model / "adapters" / name))
        requests = [engine.add_request(p, a, greedy(MAX_NEW, ignore_eos=True)) for p, a in jobs]
        tokens = run_all(engine, check=True)
        outputs[variant] = [tokens[r.request_id] for r in requests]
        assert (engine.runner.mixed_replays > 0) == graphs, "steps that prefill did not replay graphs"
    # Same kernels both ways except the decode attention's split count, which follows the bucket size, and
    # the prefill tokens' attention (graphs: the decode kernel, one row per token; eager: varlen flash).
    same = sum(a == b for a, b in zip(outputs["graphs"], outputs["eager"]))
    assert same >= 9, f"{same}/10 identical between graph replay and eager"
    # inductor fuses RMSNorm and RoPE: bf16 rounding may differ, so near ties may flip; PEFT decides.
    for variant in ("compiled", "graphs"):
        for (prompt, adapter), got in zip(jobs, outputs[variant]):
            tokens, scores, _ = bf16_reference(graph_model, None if adapter is None else f"adapters/{adapter}",
                                              prompt, MAX_NEW)
            assert agrees_up_to_near_tie(got, tokens, scores), (variant, adapter, got, tokens)


def test_paged_adapter_pool_under_graphs_equals_padded_slots(make_engine, graph_model, manifest):
    """Rank-aware pages (the three adapters, ranks 4/8/16, share the bytes of one rank-16 slot and a half, so
    they churn) replayed in decode graphs give the tokens of padded slots: the kernels follow the page table."""
    names = ["a0", "a1", "a2"]
    prompts = manifest["prompts"]
    jobs = [(prompts[i % len(prompts)], ([None] + names)[i % 4]) for i in range(12)]
    outputs = {}
    for variant in ("padded", "paged"):
        sizing = {"num_slots": 4} if variant == "padded" else {"num_slots": None,
                                                                "adapter_memory_bytes": 6 * _page(graph_model)}
        engine = make_engine(register=False, base_model=str(graph_model / "base"), device="cuda", dtype="bfloat16",
                             adapter_roots=(str(graph_model / "adapters"),), compile_decode=False,
                             max_prefill_tokens_per_step=16, **sizing)
        assert engine.runner.graphs
        for name in names:
            engine.register_adapter(name, str(graph_model / "adapters" / name))
        requests = [engine.add_request(p, a, greedy(MAX_NEW, ignore_eos=True)) for p, a in jobs]
        tokens = run_all(engine, check=True)
        outputs[variant] = [tokens[r.request_id] for r in requests]
        if variant == "paged":
            assert engine.residency.pool.num_pages == 6 and engine.metrics()["evictions"] > 0
    same = sum(a == b for a, b in zip(outputs["padded"], outputs["paged"]))
    assert same >= 11, f"{same}/12 identical between paged and padded slots"


def _page(graph_model) -> int:
    """Bytes of one page (4 rank rows of every target) of graph_model in bf16."""
    config = LlamaConfig.from_pretrained(graph_model / "base")
    return PageLayout(target_shapes(config), max_rank=16).page_nbytes(torch.bfloat16)


def test_overlapped_steps_replay_graphs_with_their_inputs_from_the_device(make_engine, graph_model, manifest):
    """Steps launched before the one before is read back (overlap_steps) take their decode rows' tokens from that
    step's sampled tokens on the device, in graph replays (decode and mixed) and eager steps alike: the tokens equal
    steps run one at a time (up to near ties, as batches of other rows round bf16 differently) and PEFT's."""
    names = ["a0", "a1", "a2"]
    prompts = manifest["prompts"]
    jobs = [(prompts[i % len(prompts)] * (1 + i % 2), ([None] + names)[i % 4]) for i in range(10)]
    outputs = {}
    for overlap in (False, True):
        engine = make_engine(register=False, base_model=str(graph_model / "base"), device="cuda", dtype="bfloat16",
                             adapter_roots=(str(graph_model / "adapters"),), num_slots=4, compile_decode=False,
                             max_prefill_tokens_per_step=16, overlap_steps=overlap)
        for name in names:
            engine.register_adapter(name, str(graph_model / "adapters" / name))
        requests = [engine.add_request(p, a, greedy(MAX_NEW, ignore_eos=True)) for p, a in jobs]
        tokens = run_all(engine, check=True)
        outputs[overlap] = [tokens[r.request_id] for r in requests]
        assert (engine.overlapped_steps > engine.steps // 2) == overlap and engine.runner.mixed_replays > 0
    same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    assert same >= 9, f"{same}/10 identical between overlapped steps and steps one at a time"
    for (prompt, adapter), got in zip(jobs, outputs[True]):
        tokens, scores, _ = bf16_reference(graph_model, None if adapter is None else f"adapters/{adapter}", prompt,
                                          MAX_NEW)
        assert agrees_up_to_near_tie(got, tokens, scores), (adapter, got, tokens)


def _take_free_blocks(value: int) -> list[torch.Tensor]:
    """Tensors of the byte `value` over every block that the caching allocator holds free for this stream outside
    graph pools (best fit hands out a free block of the size asked for)."""
    stream = torch.cuda.current_stream().cuda_stream
    taken: list[torch.Tensor] = []
    for _ in range(8):  # a pass takes the blocks listed; the next, any that rounding left
        free = [block["size"] for segment in torch.cuda.memory_snapshot()
                if tuple(segment["segment_pool_id"]) == (0, 0) and segment["stream"] == stream
                for block in segment["blocks"] if block["state"] == "inactive"]
        if not free:
            break
        taken += [torch.full((size,), value, dtype=torch.uint8, device="cuda") for size in free]
    return taken


def test_replays_write_only_memory_their_graphs_hold(make_engine, graph_model, manifest):
    """A replay writes through the pointers of its capture, so everything it writes (the attention kernels'
    split-K scratch included) must live as long as its graph. Once the graphs are captured, every block the caching
    allocator holds free is taken by a tensor of a sentinel byte: serving requests, in decode and mixed replays,
    leaves every sentinel as it was."""
    engine = make_engine(register=False, base_model=str(graph_model / "base"), device="cuda", dtype="bfloat16",
                         adapter_roots=(str(graph_model / "adapters"),), num_slots=4, compile_decode=False,
                         max_prefill_tokens_per_step=16)
    engine.register_adapter("a0", str(graph_model / "adapters" / "a0"))
    torch.cuda.synchronize()
    sentinels = _take_free_blocks(0x5A)
    assert sentinels, "the capture left no free block to watch"
    prompts = manifest["prompts"]
    for i in range(6):
        engine.add_request(prompts[i % len(prompts)], (None, "a0")[i % 2], greedy(MAX_NEW, ignore_eos=True))
    run_all(engine, check=True)
    torch.cuda.synchronize()
    assert engine.runner.graphs and engine.runner.mixed_replays > 0
    overwritten = sum(int((t != 0x5A).sum()) for t in sentinels)
    assert overwritten == 0, f"replays wrote {overwritten} bytes into memory freed after capture"
