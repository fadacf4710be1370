"""Segmented LoRA over paged adapter memory: `lora_reference` against the literal per-token loop (CPU), and the
Triton shrink/expand against `lora_reference`: in Triton's CPU interpreter (tests/app/lora_interpret.py, when
triton is importable) and on CUDA (marker `gpu`), eagerly and replayed under a CUDA graph with new metadata."""

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.model.kernels.lora import (DECODE, PREFILL, PREFILL_M_PROGRAMS, Group, KernelConfig, LoRAWorkspace,
                                    gather_rows, lora_group_reference, lora_reference, prefill_m_programs,
                                    prefill_rows)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # bf16: xa is rounded to bf16 before the expand


def padding_rows(slot_ranks, page_table, num_pages, page_rows):
    """[num_pages, page_rows, 1] bool: rows that hold no adapter's rank row (past a slot's rank, or unused pages)."""
    used = torch.zeros(num_pages, page_rows, dtype=torch.bool)
    table = page_table.tolist()
    for slot, rank in enumerate(slot_ranks.tolist()):
        for r in range(rank):
            used[table[slot][r // page_rows], r % page_rows] = True
    return (~used)[..., None].to(slot_ranks.device)


def random_slots(num_slots, max_rank, ranks, page_rows, gen, seed, device):
    """Each slot's rank, drawn from `ranks`, and its max_rank pages, shuffled over a pool with 3 spare pages:
    (slot_ranks [num_slots] int32, page_table [num_slots, max_pages] int32, num_pages)."""
    pick = torch.randint(len(ranks), (num_slots,), generator=gen, device=device)
    slot_ranks = torch.tensor(ranks, dtype=torch.int32, device=device)[pick]
    max_pages = -(-max_rank // page_rows)
    num_pages = num_slots * max_pages + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    page_table = order[: num_slots * max_pages].view(num_slots, max_pages).to(torch.int32).to(device)
    return slot_ranks, page_table, num_pages


def make_weights(num_slots, max_rank, in_features, out_features, dtype, device, seed, ranks=(8, 16), page_rows=4):
    """Random adapters of mixed ranks in shuffled pages of page_rows rank rows (plus spare pages), drawn on
    `device`, laid out as the slot pool lays them: (A [pages, P, in], BT [pages, P, out], scales, slot_ranks,
    page_table [num_slots, max_pages]). Rows that hold no rank row are zero, as pack leaves them."""
    gen = torch.Generator(device).manual_seed(seed)
    slot_ranks, page_table, num_pages = random_slots(num_slots, max_rank, ranks, page_rows, gen, seed, device)
    A = torch.randn(num_pages, page_rows, in_features, generator=gen, device=device) / in_features ** 0.5
    BT = torch.randn(num_pages, page_rows, out_features, generator=gen, device=device) / 4.0
    padding = padding_rows(slot_ranks, page_table, num_pages, page_rows)
    A.masked_fill_(padding, 0.0)
    BT.masked_fill_(padding, 0.0)
    scales = torch.rand(num_slots, generator=gen, device=device) + 0.5
    return A.to(dtype), BT.to(dtype), scales, slot_ranks, page_table


def make_segments(segments, t_cap, s_cap, gen, device):
    """segments: [(n_tokens, slot)], slot -1 for base rows. Tokens are shuffled; the tail is padding."""
    real = sum(n for n, _ in segments)
    token_order = torch.zeros(t_cap, dtype=torch.int32)
    token_order[:real] = torch.randperm(real, generator=gen).to(torch.int32)
    starts, slots = [0], []
    for n, slot in segments:
        starts.append(starts[-1] + n)
        slots.append(slot)
    starts += [real] * (s_cap - len(segments))  # padding segments: empty, slot -1
    slots += [-1] * (s_cap - len(segments))
    as_int = dict(dtype=torch.int32, device=device)
    return token_order.to(device), torch.tensor(starts, **as_int), torch.tensor(slots, **as_int)


def naive(y, x, A, BT, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots):
    """The module docstring's loop, token by token and rank row by rank row, in float64."""
    out = y.double()
    P = A.shape[1]
    for i in range(seg_slots.numel()):
        s = int(seg_slots[i])
        if s < 0:
            continue
        rows = [(int(page_table[s, r // P]), r % P) for r in range(int(slot_ranks[s]))]
        a = torch.stack([A[p, r] for p, r in rows]).double()
        bt = torch.stack([BT[p, r] for p, r in rows]).double()
        for t in token_order[int(seg_starts[i]):int(seg_starts[i + 1])].tolist():
            out[t] += float(scales[s]) * (x[t].double() @ a.T) @ bt
    return out


def rel_error(got, want, y0):
    return ((got.double() - want.double()).norm() / (want.double() - y0.double()).norm()).item()


def base_rows(token_order, seg_starts, seg_slots, real):
    rows = set(range(real))
    for i, s in enumerate(seg_slots.tolist()):
        if s >= 0:
            rows -= set(token_order[int(seg_starts[i]):int(seg_starts[i + 1])].tolist())
    return sorted(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_token_loop(dtype):
    gen = torch.Generator().manual_seed(0)
    weights = make_weights(6, 16, 40, 24, dtype, "cpu", seed=0, ranks=(4, 7, 16))
    segments = [(3, 2), (4, -1), (1, 5), (0, 1), (5, 0)]  # a base segment and an empty adapter segment
    real = sum(n for n, _ in segments)
    token_order, seg_starts, seg_slots = make_segments(segments, t_cap=real + 3, s_cap=8, gen=gen, device="cpu")
    x = torch.randn(real, 40, generator=gen).to(dtype)
    y0 = torch.randn(real, 24, generator=gen).to(dtype)
    y = y0.clone()
    lora_reference(y, x, *weights, token_order, seg_starts, seg_slots)
    want = naive(y0, x, *weights, token_order, seg_starts, seg_slots)
    assert rel_error(y, want, y0) < (1e-6 if dtype == torch.float32 else 1e-2)
    base = base_rows(token_order, seg_starts, seg_slots, real)
    assert len(base) == 4 and torch.equal(y[base], y0[base])


def test_reference_without_adapters_leaves_y_alone():
    gen = torch.Generator().manual_seed(1)
    weights = make_weights(2, 8, 16, 16, torch.float32, "cpu", seed=1, ranks=(4, 8))
    token_order, seg_starts, seg_slots = make_segments([(5, -1)], t_cap=8, s_cap=4, gen=gen, device="cpu")
    y0 = torch.randn(5, 16, generator=gen)
    y = y0.clone()
    lora_reference(y, torch.randn(5, 16, generator=gen), *weights, token_order, seg_starts, seg_slots)
    assert torch.equal(y, y0)


def test_gather_rows_follows_the_page_table():
    A = torch.arange(5 * 4 * 2, dtype=torch.float32).view(5, 4, 2)  # 5 pages of 4 rows
    page_table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    rows = gather_rows(A, page_table, slot=0, rank=6)  # page 3's 4 rows, then page 0's first 2
    assert torch.equal(rows, torch.cat([A[3], A[0, :2]]))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (any build) for its interpreter")
def test_triton_kernels_in_the_cpu_interpreter():
    """The same kernels the GPU runs, interpreted on CPU tensors (TRITON_INTERPRET=1, in a fresh process: the
    flag must be set before triton.jit wraps them). Covers paging, mixed and odd ranks, NaN padding rows,
    both configs and several M programs."""
    script = Path(__file__).with_name("lora_interpret.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(script.parents[2]), *sys.path])}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all interpreter cases match" in result.stdout


def test_workspace_and_config_sizes():
    ws = LoRAWorkspace.allocate(t_cap=64, max_rank=8, in_features=[4096, 14336], device="cpu")
    # rank tile padded to 16; fp32 at K=14336 fits only 512-wide K blocks in SHRINK_SMEM: 28 splits, for each of
    # up to 3 members of a group
    assert ws.xa.shape == (3 * 28, 64, 16) and ws.xa.dtype == torch.float32
    with pytest.raises(ValueError, match="block_n"):
        KernelConfig(target_splits=4, block_m=16, block_n=96, num_warps=4)


def run_kernels(dtype, in_features, out_features, max_rank, segments, t_cap, s_cap, seed, config=None,
                device="cuda", page_rows=4, ranks=(8, 16)):
    from app.model.kernels.lora import lora_apply

    gen = torch.Generator().manual_seed(seed)
    A, BT, scales, slot_ranks, page_table = make_weights(64, max_rank, in_features, out_features, dtype, device,
                                                         seed, ranks=ranks, page_rows=page_rows)
    token_order, seg_starts, seg_slots = make_segments(segments, t_cap, s_cap, gen, device)
    real = sum(n for n, _ in segments)
    x = torch.randn(real, in_features, device=device, dtype=dtype)
    y0 = torch.randn(real, out_features, device=device, dtype=dtype)
    want = y0.clone()
    lora_reference(want, x, A, BT, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots)
    padding = padding_rows(slot_ranks, page_table, A.shape[0], page_rows)  # never read: NaN would show
    A.masked_fill_(padding, float("nan"))
    BT.masked_fill_(padding, float("nan"))
    ws = LoRAWorkspace.allocate(t_cap, max_rank, [in_features], device)
    ws.xa.fill_(float("nan"))
    got = y0.clone()
    lora_apply(got, x, A, BT, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots, ws, config)
    if device == "cuda":
        torch.cuda.synchronize()
    assert rel_error(got, want, y0) < TOLERANCE[dtype]
    base = base_rows(token_order.cpu(), seg_starts.cpu(), seg_slots.cpu(), real)
    assert torch.equal(got[base], y0[base])


def make_group(num_slots, max_rank, in_features, widths, gap, dtype, device, seed, ranks=(8, 16), page_rows=4):
    """Members reading one x, as views of one page pool laid out as prefetch/layout.py lays pages (each member's
    A rows, then each member's BT rows), writing column ranges of one y with `gap` columns that no member owns
    after the first (a sibling the adapters do not target, as k between q and v). Returns (group, y width,
    scales [members + 1, num_slots] whose rows the members use out of order, slot_ranks, page_table)."""
    gen = torch.Generator(device).manual_seed(seed)
    slot_ranks, page_table, num_pages = random_slots(num_slots, max_rank, ranks, page_rows, gen, seed, device)
    cols = [in_features] * len(widths) + list(widths)

    def segments_of(pool):  # each member's A, then each member's BT: [num_pages, page_rows, cols] views
        return [v.unflatten(1, (page_rows, c)) for v, c in zip(pool.split([page_rows * c for c in cols], 1), cols)]

    pool = torch.randn(num_pages, page_rows * sum(cols), generator=gen, device=device)
    padding = padding_rows(slot_ranks, page_table, num_pages, page_rows)
    for i, view in enumerate(segments_of(pool)):
        view.mul_(in_features ** -0.5 if i < len(widths) else 0.25).masked_fill_(padding, 0.0)
    views = segments_of(pool.to(dtype))
    columns, at = [], 0
    for i, width in enumerate(widths):
        columns.append(at)
        at += width + (gap if i == 0 else 0)
    modules = tuple(range(len(widths)))[::-1]
    scales = torch.rand(len(widths) + 1, num_slots, generator=gen, device=device) + 0.5
    scales[modules[-1], 0] = 0.0  # slot 0's adapter skips the last member's module
    group = Group(tuple(views[: len(widths)]), tuple(views[len(widths):]), modules, tuple(columns))
    return group, at, scales, slot_ranks, page_table, padding


def run_group_kernels(dtype, in_features, widths, gap, max_rank, segments, t_cap, s_cap, seed, config=None,
                      device="cuda", page_rows=4, ranks=(8, 16)):
    from app.model.kernels.lora import lora_group_apply

    gen = torch.Generator().manual_seed(seed)
    group, width, scales, slot_ranks, page_table, padding = make_group(
        64, max_rank, in_features, widths, gap, dtype, device, seed, ranks=ranks, page_rows=page_rows)
    token_order, seg_starts, seg_slots = make_segments(segments, t_cap, s_cap, gen, device)
    real = sum(n for n, _ in segments)
    x = torch.randn(real, in_features, device=device, dtype=dtype)
    y0 = torch.randn(real, width, device=device, dtype=dtype)
    want = y0.clone()
    lora_group_reference(want, x, group, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots)
    for view in group.A + group.BT:  # never read: NaN would show
        view.masked_fill_(padding, float("nan"))
    ws = LoRAWorkspace.allocate(t_cap, max_rank, [in_features], device)
    ws.xa.fill_(float("nan"))
    got = y0.clone()
    lora_group_apply(got, x, group, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots, ws, config)
    if device == "cuda":
        torch.cuda.synchronize()
    assert rel_error(got, want, y0) < TOLERANCE[dtype]
    base = base_rows(token_order.cpu(), seg_starts.cpu(), seg_slots.cpu(), real)
    assert torch.equal(got[base], y0[base])
    if gap:  # columns no member owns
        lo = widths[0]
        assert torch.equal(got[:, lo: lo + gap], y0[:, lo: lo + gap])


def test_group_reference_is_each_members_reference():
    gen = torch.Generator().manual_seed(5)
    group, width, scales, slot_ranks, page_table, _ = make_group(6, 16, 24, (20, 12, 8), 4, torch.float32, "cpu", 5,
                                                                 ranks=(4, 16))
    token_order, seg_starts, seg_slots = make_segments([(3, 0), (2, -1), (4, 5)], 12, 6, gen, "cpu")
    x, y0 = torch.randn(9, 24, generator=gen), torch.randn(9, width, generator=gen)
    got = y0.clone()
    lora_group_reference(got, x, group, scales, slot_ranks, page_table, token_order, seg_starts, seg_slots)
    want = y0.clone()
    for A, BT, module, column in zip(group.A, group.BT, group.modules, group.columns):
        n = BT.shape[2]
        want[:, column: column + n] = naive(y0[:, column: column + n], x, A, BT, scales[module], slot_ranks,
                                            page_table, token_order, seg_starts, seg_slots).float()
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(got[:, 20:24], y0[:, 20:24])  # the gap


def test_group_members_must_share_one_pool():
    A, BT = torch.zeros(4, 2, 8), torch.zeros(4, 2, 6)
    with pytest.raises(ValueError, match="one page pool"):
        Group((A, A.clone()), (BT, BT.clone()), (0, 1), (0, 6))
    with pytest.raises(ValueError, match="1 to 3 members"):
        Group((), (), (), ())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("widths,gap", [((4096, 1024, 1024), 0), ((4096, 1024), 1024), ((14336, 14336), 0)])
@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_group_matches_reference(dtype, widths, gap, tokens):
    slots = torch.randint(64, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    segments = [(1, slot) for slot in dict.fromkeys(slots)] + [(1, -1)]
    run_group_kernels(dtype, 4096, widths, gap, 16, segments, t_cap=len(segments) + 5, s_cap=len(segments) + 3,
                      seed=tokens)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_rank", [16, 64])
@pytest.mark.parametrize("tokens", [1, 7, 32, 64])
@pytest.mark.parametrize("shape", [(4096, 1024), (14336, 4096), (1000, 344)])
def test_decode_matches_reference(dtype, max_rank, tokens, shape):
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(tokens))[:tokens].tolist()
    segments = [(1, slot) for slot in slots]
    if tokens > 1:
        segments[-1] = (1, -1)  # one base row
    run_kernels(dtype, *shape, max_rank, segments, t_cap=tokens + 5, s_cap=tokens + 3, seed=tokens)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_rank", [16, 64])
@pytest.mark.parametrize("shape,segments", [
    ((4096, 1024), [(3000, 5), (1200, -1), (2500, 9), (1492, 63)]),  # 8192 tokens
    ((14336, 4096), [(700, 1), (300, 2), (48, -1), (1000, 1)]),  # one slot in two segments
])
def test_prefill_matches_reference(dtype, max_rank, shape, segments):
    run_kernels(dtype, *shape, max_rank, segments, t_cap=8192, s_cap=16, seed=max_rank)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(4096, 1024), (14336, 4096)])
def test_decode_rows_of_one_adapter_in_tile_sized_segments(shape):
    """A decode bucket of 128 rows, 120 on one adapter: the graphs give it segments of one M tile each."""
    segments = [(DECODE.block_m, 5)] * 7 + [(8, 5), (8, -1)]
    run_kernels(torch.bfloat16, *shape, 16, segments, t_cap=128, s_cap=128, seed=11, config=DECODE)


def test_programs_along_m_grow_with_the_longest_segment():
    assert [prefill_m_programs(rows) for rows in (1, 300, 1024, 1025, 2048, 2049, 4096, 65536)] == \
        [4, 4, 4, 8, 8, 16, 16, 16]
    for m in PREFILL_M_PROGRAMS:  # the warm-up's step sizes: the fewest rows that give each count
        rows = prefill_rows(m)
        assert prefill_m_programs(rows) == m and (rows == 1 or prefill_m_programs(rows - 1) < m)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m_programs", PREFILL_M_PROGRAMS)
def test_one_long_segment_strided_over_the_programs_along_m(m_programs):
    """An eager step's one long chunk of an adapter, its 33 M tiles strided over 4, 8 or 16 programs."""
    run_kernels(torch.bfloat16, 4096, 1024, 16, [(2049, 3), (5, -1), (70, 4)], t_cap=2176, s_cap=4, seed=13,
                config=dataclasses.replace(PREFILL, m_programs=m_programs))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [DECODE, PREFILL])
def test_configs_agree_at_any_size(config):
    run_kernels(torch.bfloat16, 4096, 1024, 16, [(40, 3), (1, 4), (90, 5)], t_cap=160, s_cap=8, seed=7,
                config=config)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_follows_new_metadata():
    from app.model.kernels.lora import lora_apply

    gen = torch.Generator().manual_seed(3)
    t_cap, s_cap, dtype = 48, 20, torch.bfloat16
    shapes = [(4096, 1024), (14336, 4096)]
    targets = [make_weights(64, 16, k, n, dtype, "cuda", seed) for seed, (k, n) in enumerate(shapes)]
    xs = [torch.randn(t_cap, k, device="cuda", dtype=dtype) for k in (4096, 14336)]
    y0s = [torch.randn(t_cap, n, device="cuda", dtype=dtype) for n in (1024, 4096)]
    ys = [y0.clone() for y0 in y0s]
    meta = make_segments([(2, s) for s in range(s_cap)], t_cap, s_cap, gen, "cuda")  # rewritten each round
    ws = LoRAWorkspace.allocate(t_cap, 16, [4096, 14336], "cuda")

    def step():
        for weights, x, y in zip(targets, xs, ys):
            lora_apply(y, x, *weights, *meta, ws)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    rounds = [
        [(1, s) for s in torch.randperm(64, generator=gen)[:20].tolist()],  # 20 decode rows, distinct slots
        [(10, 3), (5, -1), (30, 60)],  # long segments, fewer of them
        [(48, -1)],  # no adapter at all
        [(7, 2), (0, 5), (1, 9), (12, 2)] + [(1, s) for s in range(16)],  # all 20 segments, one empty
    ]
    for segments in rounds:
        new_meta = make_segments(segments, t_cap, s_cap, gen, "cuda")
        for static, new in zip(meta, new_meta):
            static.copy_(new)
        for y, y0 in zip(ys, y0s):
            y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        for weights, x, y, y0 in zip(targets, xs, ys, y0s):
            want = y0.clone()
            lora_reference(want, x, *weights, *new_meta)
            if all(s < 0 for _, s in segments):
                assert torch.equal(y, y0)
            else:
                assert rel_error(y, want, y0) < TOLERANCE[dtype], segments

