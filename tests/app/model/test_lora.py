"""The LoRA layer over paged device memory: token segments, wrapped linears against the per-row loop, the CPU
path against the reference loop, the slot writes, and how the pool is sized."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from app.model.kernels.lora import Group, gather_rows, host_lora, host_segments, lora_group_reference
from app.model.lora import (MAX_RESIDENT_ADAPTERS, LinearGroup, LoRAContext, LoRALinear, LoRAMetadata, LoRASlots,
                            pool_size, segments)
from app.adapters.targets import target_shapes
from app.model.fp8 import quantize_linears
from prefetch.layout import PageLayout


def test_segments_group_tokens_by_slot_and_pad():
    order, starts, slots = segments([2, -1, 0, 2, 2, 0], t_cap=8, s_cap=4)
    assert order == [0, 3, 4, 2, 5, 0, 0, 0]
    assert starts == [0, 3, 5, 5, 5] and slots == [2, 0, -1, -1]


def test_segments_of_at_most_max_rows_split_one_adapter_s_rows():
    order, starts, slots = segments([2, -1, 2, 2, 0, 2, 2], t_cap=8, s_cap=6, max_rows=2)
    assert order == [0, 2, 3, 5, 6, 4, 0, 0]
    assert starts == [0, 2, 4, 5, 6, 6, 6] and slots == [2, 2, 2, 0, -1, -1]
    with pytest.raises(AssertionError, match="4 segments > 3"):
        segments([2, -1, 2, 2, 0, 2, 2], t_cap=8, s_cap=3, max_rows=2)
    order, starts, slots = segments([2, -1, 2, 2, 0, 2, 2], t_cap=7, s_cap=None, max_rows=2)  # no padding
    assert order == [0, 2, 3, 5, 6, 4, 0] and starts == [0, 2, 4, 5, 6] and slots == [2, 2, 2, 0]


def test_wrapped_linear_equals_the_per_token_loop_with_mixed_ranks():
    gen = torch.Generator().manual_seed(0)
    slots, max_rank, page_rows, n_in, n_out = 4, 16, 4, 32, 24
    base = nn.Linear(n_in, n_out, bias=False)
    ranks = [4, 16, 7, 16]
    dense_A = [torch.randn(r, n_in, generator=gen) for r in ranks]
    dense_BT = [torch.randn(r, n_out, generator=gen) for r in ranks]
    A = torch.full((12, page_rows, n_in), float("nan"))  # rows no adapter owns must never be read
    BT = torch.full((12, page_rows, n_out), float("nan"))
    ctx = LoRAContext(slots, 1, max_rank // page_rows, use_kernel=False, device=torch.device("cpu"), workspace=None)
    free = iter(torch.randperm(12, generator=gen).tolist())  # pages anywhere in the pool
    for s, r in enumerate(ranks):
        pages = [next(free) for _ in range(-(-r // page_rows))]
        ctx.page_table[s, : len(pages)] = torch.tensor(pages)
        ctx.slot_ranks[s] = r
        for k in range(r):
            A[pages[k // page_rows], k % page_rows] = dense_A[s][k]
            BT[pages[k // page_rows], k % page_rows] = dense_BT[s][k]
    ctx.scales[0] = torch.tensor([0.5, 2.0, 1.0, 4.0])
    layer = LoRALinear(base, LinearGroup([base], {0: (0, A, BT)}, ctx), 0)
    token_slots = [2, -1, 0, 2, 3, 1, 1]
    order, starts, seg_slots = segments(token_slots, 7, 7)
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    ctx.meta = LoRAMetadata(t(order), t(starts), t(seg_slots))
    x = torch.randn(1, 7, n_in, generator=gen)
    with torch.no_grad():
        got = layer(x)[0]
        for i, s in enumerate(token_slots):
            expected = base(x[0, i])
            if s >= 0:
                expected = expected + ctx.scales[0, s] * (x[0, i] @ dense_A[s].T) @ dense_BT[s]
            torch.testing.assert_close(got[i], expected, rtol=1e-4, atol=1e-4)  # float32 summation order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_path_equals_the_reference_loop_for_a_group(dtype):
    """`host_lora` (segments read once a step) adds what `lora_group_reference` adds, to the last bit: two members
    on their columns, ranks over one page and under it, a slot's tokens apart and together."""
    gen = torch.Generator().manual_seed(1)
    page_rows, n_in, widths = 4, 8, (6, 10)
    pool = torch.randn(9, page_rows, n_in + sum(widths), generator=gen).to(dtype)
    group = Group((pool[..., :n_in],) * 2, (pool[..., n_in: n_in + widths[0]], pool[..., n_in + widths[0]:]), (0, 1),
                  (0, widths[0]))
    page_table = torch.tensor([[4, 0, 0], [7, 2, 5], [1, 8, 0]], dtype=torch.int32)
    slot_ranks = torch.tensor([3, 11, 6], dtype=torch.int32)
    scales = torch.tensor([[0.5, 2.0, 1.5], [1.0, 0.25, 3.0]])  # [module, slot]
    # tokens' slots [1, 0, 1, -1, 2, 2, 1]: token_order, seg_starts, seg_slots as `segments` gives
    tables = [torch.tensor(v, dtype=torch.int32) for v in ([0, 2, 6, 1, 4, 5, 0], [0, 3, 4, 6], [1, 0, 2])]
    x = torch.randn(7, n_in, generator=gen).to(dtype)
    y = torch.randn(7, sum(widths), generator=gen).to(dtype)
    expected = y.clone()
    lora_group_reference(expected, x, group, scales, slot_ranks, page_table, *tables)
    host_lora(y, x, group, host_segments(*tables, slot_ranks, page_table, scales))
    assert torch.equal(y, expected)


TINY = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1)


def test_write_slot_fills_its_pages_and_side_tables():
    layout = PageLayout(target_shapes(TINY), max_rank=8, page_rows=4)
    lora = LoRASlots(LlamaForCausalLM(TINY).eval(), layout, num_pages=5, num_slots=3, t_cap=8)
    gen = torch.Generator().manual_seed(0)
    module = "model.layers.0.self_attn.q_proj"
    a, b = torch.randn(6, 16, generator=gen), torch.randn(16, 6, generator=gen)
    host = [torch.empty(layout.page_numel) for _ in range(2)]
    scales = layout.pack({module: (a.flatten(), b.flatten(), 6, 0.5)}, host)
    lora.write_slot(1, [4, 2], host, scales, 6)
    assert torch.equal(lora.pool[4], host[0]) and torch.equal(lora.pool[2], host[1])
    assert lora.ctx.page_table[1].tolist() == [4, 2] and lora.ctx.slot_ranks.tolist() == [0, 6, 0]
    index = layout.module_index[module]
    assert lora.ctx.scales[index, 1] == 0.5 and lora.ctx.scales[:, 1].count_nonzero() == 1
    A, BT = layout.module_views(lora.pool)[index]
    assert torch.equal(gather_rows(A, lora.ctx.page_table, 1, 6), a)
    assert torch.equal(gather_rows(BT, lora.ctx.page_table, 1, 6), b.T)


def sizing(**fields):
    return SimpleNamespace(**{"num_slots": None, "adapter_memory_bytes": None, "adapter_memory_fraction": 0.2,
                              **fields})


def test_pool_size_from_bytes_fraction_or_slot_override(monkeypatch):
    layout = PageLayout(target_shapes(TINY), max_rank=16, page_rows=4)  # 4 pages per max-rank adapter
    page = layout.page_nbytes(torch.bfloat16)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pool_size(sizing(num_slots=3), layout, torch.bfloat16, cpu) == (12, 3)
    assert pool_size(sizing(adapter_memory_bytes=10 * page + page // 2), layout, torch.bfloat16, cpu) == (10, 10)
    assert pool_size(sizing(), layout, torch.bfloat16, cpu) == (32, 32)  # CPU: 8 max-rank adapters' worth
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1000 * page, 2000 * page))
    assert pool_size(sizing(adapter_memory_fraction=0.25), layout, torch.bfloat16, cuda) == (250, 250)
    huge = sizing(adapter_memory_bytes=1 << 50)  # tiny adapters on a big GPU: the side tables stay bounded
    assert pool_size(huge, layout, torch.bfloat16, cpu) == (4 * MAX_RESIDENT_ADAPTERS, MAX_RESIDENT_ADAPTERS)
    with pytest.raises(ValueError, match=f"holds 3 pages of {page} bytes; one adapter at max_rank 16 needs 4"):
        pool_size(sizing(adapter_memory_bytes=3 * page), layout, torch.bfloat16, cpu)


@pytest.mark.parametrize("fp8", [False, True])
def test_sibling_linears_run_as_one_group_and_equal_the_per_module_loop(fp8):
    """q/k/v and gate/up share one GEMM and one LoRA launch pair; the model's outputs equal the unwrapped model's
    plus each module's own LoRA, for an adapter that skips some members (k, up) of a group. fp8: the same over
    FP8 base weights (app/model/fp8.py, its float32 reference arithmetic on CPU)."""
    import copy

    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY).eval()
    if fp8:
        assert quantize_linears(model, target_shapes(TINY)) == 7
    reference = copy.deepcopy(model)
    layout = PageLayout(target_shapes(TINY), max_rank=8, page_rows=4)
    lora = LoRASlots(model, layout, num_pages=6, num_slots=3, t_cap=8)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.group is attn.k_proj.group is attn.v_proj.group and len(lora.groups) == 4
    if fp8:  # views of one weight: its FP8 bytes and its scales
        assert attn.k_proj.base.weight_q.data_ptr() == attn.q_proj.base.weight_q.data_ptr() + 16 * 16
        assert attn.k_proj.base.weight_scale.data_ptr() == attn.q_proj.base.weight_scale.data_ptr() + 16 * 4
    else:
        assert attn.k_proj.base.weight.data_ptr() == attn.q_proj.base.weight.data_ptr() + 16 * 16 * 4
    gen = torch.Generator().manual_seed(1)
    skipped = ("k_proj", "up_proj")
    parts, dense = {}, {}
    for module, (n_in, n_out) in layout.shapes.items():
        if module.rsplit(".", 1)[1] in skipped:
            continue
        a, b = torch.randn(6, n_in, generator=gen), torch.randn(n_out, 6, generator=gen)
        parts[module] = (a.flatten(), b.flatten(), 6, 0.5)
        dense[module] = (a, b)
    host = [torch.empty(layout.page_numel) for _ in range(2)]
    lora.write_slot(1, [4, 2], host, layout.pack(parts, host), 6)
    token_slots = [1, -1, 1, 1]
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    order, starts, seg_slots = segments(token_slots, 4, 4)
    lora.ctx.meta = LoRAMetadata(t(order), t(starts), t(seg_slots))
    rows = torch.tensor([s >= 0 for s in token_slots])

    def add_lora(name):
        def hook(module, args, out):
            a, b = dense[name]
            return out + rows[None, :, None] * 0.5 * (args[0] @ a.T) @ b.T
        return hook

    for name in dense:
        reference.get_submodule(name).register_forward_hook(add_lora(name))
    ids = torch.tensor([[3, 7, 1, 30]])
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # A member called without its group's first member computes its own output alone.
        x = torch.randn(1, 4, 16, generator=gen)
        k_alone = attn.k_proj(x)
        torch.testing.assert_close(k_alone, reference.model.layers[0].self_attn.k_proj(x))
        v_alone = attn.v_proj(x)
        torch.testing.assert_close(v_alone, reference.model.layers[0].self_attn.v_proj(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fp8", [False, True])
def test_compiled_groups_trace_whole_and_equal_the_eager_forward(fp8):
    """Under torch.compile a group's GEMM and LoRA run as one opaque op whose output its members slice: the
    decoder traces as one graph (no break at each member's call, so the elementwise work between them can fuse),
    with one op per group, equals the eager forward with an adapter on some rows, and keeps no activation after.
    fp8: the graph quantizes each op's input per token (so that inductor can fuse it into the input's kernel) and
    hands the op the FP8 rows and their scales."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY).eval()
    if fp8:
        quantize_linears(model, target_shapes(TINY))
    layout = PageLayout(target_shapes(TINY), max_rank=8, page_rows=4)
    lora = LoRASlots(model, layout, num_pages=6, num_slots=3, t_cap=8)
    gen = torch.Generator().manual_seed(1)
    parts = {module: (torch.randn(6 * n_in, generator=gen), torch.randn(n_out * 6, generator=gen), 6, 0.5)
             for module, (n_in, n_out) in layout.shapes.items()}
    host = [torch.empty(layout.page_numel) for _ in range(2)]
    lora.write_slot(1, [4, 2], host, layout.pack(parts, host), 6)
    t = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    lora.ctx.meta = LoRAMetadata(*map(t, segments([1, -1, 1, 1], 4, 4)))
    ids = torch.tensor([[3, 7, 1, 30]])
    with torch.inference_mode():
        want = model.model(input_ids=ids).last_hidden_state
        explained = torch._dynamo.explain(model.model)(input_ids=ids)
        assert explained.graph_break_count == 0
        ops = [node for graph in explained.graphs for node in graph.graph.nodes if "lora_serve" in str(node.target)]
        assert len(ops) == len(lora.groups) == 4
        quantized = [node.args[4:] for node in ops]
        assert all((xq is not None and scale is not None) == fp8 for xq, scale in quantized)
        if fp8:
            producers = [node.target for node in explained.graphs[0].graph.nodes if node.op == "call_method"]
            assert "amax" in producers  # quantize_rows, traced beside the RMSNorm rather than inside the op
        torch._dynamo.reset()
        got = torch.compile(model.model, backend="eager", dynamic=True)(input_ids=ids).last_hidden_state
    torch.testing.assert_close(got, want)
    assert all(group.held is None for group in lora.groups)


def test_compiled_layers_share_one_compilation():
    """The engine's attention breaks the compiled graph in every layer, so dynamo compiles each layer's frames on
    their own: the layers' groups must not differ in anything dynamo guards on (an int handle would make each layer
    compile anew, and past dynamo's recompile limit run eagerly)."""
    from torch._dynamo.utils import counters

    def compiled_graphs(layers: int) -> int:
        config = LlamaConfig(**{**TINY.to_dict(), "num_hidden_layers": layers})
        model = LlamaForCausalLM(config).eval()
        LoRASlots(model, PageLayout(target_shapes(config), max_rank=8, page_rows=4), num_pages=6, num_slots=3,
                  t_cap=8)
        for layer in model.model.layers:  # as app/model/attention.py's attention: opaque to torch.compile
            layer.self_attn.forward = torch.compiler.disable(layer.self_attn.forward)
        torch._dynamo.reset()
        counters.clear()
        with torch.inference_mode():
            torch.compile(model.model, backend="eager", dynamic=True)(input_ids=torch.tensor([[3, 7, 1, 30]]))
        return counters["stats"]["unique_graphs"]

    assert compiled_graphs(2) == compiled_graphs(1)
