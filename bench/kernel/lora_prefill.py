"""A prefill step's LoRA at Llama-3-8B shapes, three ways, against the base GEMMs alone: 32 layers of the four linear
groups the engine runs (q/k/v fused, o, gate/up fused, down), M prompt tokens in segments of one adapter each, rank
16 on all seven targets, each way in one CUDA graph.

    python -m bench.kernel.lora_prefill [--tokens 4096] [--distinct 1 4 8] [--out-dir bench/results]   # CUDA only

Ways, each printed as its time and its cost over `base` (one cuBLAS GEMM per group):
- `kernels`: the GEMM, then the segmented shrink and expand (app/model/kernels/lora.py) in the prefill tiles, 4
  programs along M, which read and write the GEMM's output once more; `kernels_m<m>` (--m-programs): m programs;
- `addmm`: the GEMM, then two cuBLAS GEMMs over every segment's adapter at once: x @ A^T for all of them
  (`distinct` x members x rank columns), each row's other adapters' columns zeroed and its own scaled, then
  y += that @ B (cuBLAS reads and writes y once more, as the expand does);
- `wide_k`: one GEMM over [x | x @ A^T masked] and [W | B^T]: the base weight with `distinct` x members x rank
  spare columns that hold the step's adapters' B, so no pass over y follows the GEMM. Timed with the copies it
  needs each step: x into the wide input, and the adapters' B into the spare columns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from app.model.kernels.lora import PREFILL, Group, LoRAWorkspace, lora_group_apply
from bench.common import RESULTS, write_result
from bench.kernel.fp8 import graph_ms

GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}  # (in, each member's out)
LAYERS, RANK, PAGE_ROWS = 32, 16, 4
DTYPE = torch.bfloat16


class Layer:
    """One layer-group's weights: the base weight with spare columns, and the adapters' pages in one pool."""

    def __init__(self, k: int, widths: tuple[int, ...], distinct: int):
        n, members = sum(widths), len(widths)
        self.k, self.n, self.widths, self.spare = k, n, widths, distinct * members * RANK
        self.w_ext = torch.randn(n, k + self.spare, dtype=DTYPE, device="cuda").mul_(0.02)
        self.w = self.w_ext[:, :k]  # what the base GEMM (and decode) reads: a strided view
        pages = distinct * RANK // PAGE_ROWS
        self.pool = torch.randn(pages, PAGE_ROWS, members * k + n, dtype=DTYPE, device="cuda").mul_(0.02)
        views_a = [self.pool[..., m * k:(m + 1) * k] for m in range(members)]
        starts = [members * k + sum(widths[:m]) for m in range(members)]
        views_b = [self.pool[..., s:s + w] for s, w in zip(starts, widths)]
        columns = tuple(sum(widths[:m]) for m in range(members))
        self.group = Group(tuple(views_a), tuple(views_b), tuple(range(members)), columns)

    def dense(self, distinct: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A^T [k, spare] and B [spare, n] of the step's adapters, block by block (adapter, member); B's block is
        zero outside its member's columns."""
        members = len(self.widths)
        a_t = torch.zeros(self.k, self.spare, dtype=DTYPE, device="cuda")
        b = torch.zeros(self.spare, self.n, dtype=DTYPE, device="cuda")
        for s in range(distinct):
            rows = slice(s * RANK // PAGE_ROWS, (s + 1) * RANK // PAGE_ROWS)
            for m in range(members):
                c = (s * members + m) * RANK
                a_t[:, c:c + RANK] = self.group.A[m][rows].flatten(0, 1).T
                b[c:c + RANK, self.group.columns[m]:self.group.columns[m] + self.widths[m]] = \
                    self.group.BT[m][rows].flatten(0, 1)
        return a_t, b


def run(tokens: int, distinct: int, m_programs: list[int]) -> dict:
    torch.manual_seed(0)
    layers = [{name: Layer(k, widths, distinct) for name, (k, widths) in GROUPS.items()} for _ in range(LAYERS)]
    xs = {k: torch.randn(tokens, k, dtype=DTYPE, device="cuda") for k in {4096, 14336}}
    ys = {name: torch.empty(tokens, sum(widths), dtype=DTYPE, device="cuda") for name, (_, widths) in GROUPS.items()}
    seg = tokens // distinct
    slot_of_token = torch.arange(tokens, device="cuda") // seg  # segment i holds slot i's tokens
    # The engine's tables: slot s's rank rows in pages s * RANK / PAGE_ROWS onwards, scale 2 for every member.
    page_table = torch.arange(distinct * RANK // PAGE_ROWS, dtype=torch.int32, device="cuda").view(distinct, -1)
    ranks = torch.full((distinct,), RANK, dtype=torch.int32, device="cuda")
    scales = torch.full((3, distinct), 2.0, device="cuda")
    token_order = torch.arange(tokens, dtype=torch.int32, device="cuda")
    seg_starts = torch.arange(0, tokens + 1, seg, dtype=torch.int32, device="cuda")
    seg_slots = torch.arange(distinct, dtype=torch.int32, device="cuda")
    workspace = LoRAWorkspace.allocate(tokens, RANK, [4096, 14336], "cuda", configs=(PREFILL,))
    dense = [{name: layer.dense(distinct) for name, layer in group.items()} for group in layers]
    masks, wide_x = {}, {}
    for name, (k, widths) in GROUPS.items():  # each row keeps its own adapter's columns, scaled
        members = len(widths)
        owner = torch.arange(distinct * members * RANK, device="cuda") // (members * RANK)
        masks[name] = ((owner[None, :] == slot_of_token[:, None]) * 2.0).to(DTYPE)
        wide_x[name] = torch.empty(tokens, k + layers[0][name].spare, dtype=DTYPE, device="cuda")
    b_t = [{name: b.T.contiguous() for name, (_, b) in group.items()} for group in dense]  # [n, spare] per step

    def base(i: int, name: str) -> None:
        layer = layers[i][name]
        torch.mm(xs[layer.k], layer.w.T, out=ys[name])

    def kernels(m: int):
        config = dataclasses.replace(PREFILL, m_programs=m)

        def one(i: int, name: str) -> None:
            base(i, name)
            layer = layers[i][name]
            lora_group_apply(ys[name], xs[layer.k], layer.group, scales, ranks, page_table, token_order, seg_starts,
                             seg_slots, workspace, config)
        return one

    def addmm(i: int, name: str) -> None:
        base(i, name)
        a_t, b = dense[i][name]
        ys[name].addmm_(torch.mm(xs[layers[i][name].k], a_t).mul_(masks[name]), b)

    def wide_k(i: int, name: str) -> None:
        layer, (a_t, _) = layers[i][name], dense[i][name]
        x, wide = xs[layer.k], wide_x[name]
        layer.w_ext[:, layer.k:].copy_(b_t[i][name])  # the step's adapters into the spare columns
        wide[:, :layer.k].copy_(x)  # in the engine the op before would write here
        torch.mm(x, a_t, out=wide[:, layer.k:]).mul_(masks[name])
        torch.mm(wide, layer.w_ext.T, out=ys[name])

    # The three LoRA ways give the same y, up to bf16 rounding.
    outs = []
    for way in (kernels(PREFILL.m_programs), addmm, wide_k):
        way(0, "qkv")
        outs.append(ys["qkv"].float().clone())
    base_y = xs[4096].float() @ layers[0]["qkv"].w.float().T
    lora_norm = (outs[0] - base_y).norm().item()
    agree = {name: ((out - outs[0]).norm() / (outs[0] - base_y).norm()).item()
             for name, out in zip(("addmm", "wide_k"), outs[1:])}

    ways = {"base": base, "kernels": kernels(PREFILL.m_programs),
            **{f"kernels_m{m}": kernels(m) for m in m_programs}, "addmm": addmm, "wide_k": wide_k}
    times = {}
    for label, one in ways.items():
        times[label] = graph_ms(lambda: [one(i, name) for i in range(LAYERS) for name in GROUPS])
    flops = 2 * tokens * LAYERS * sum(k * sum(w) for k, w in GROUPS.values())
    row = {"tokens": tokens, "distinct": distinct, "ms": times,
           "lora_ms": {way: times[way] - times["base"] for way in times if way != "base"},
           "base_tflops": flops / (times["base"] * 1e-3) / 1e12,
           "lora_norm": lora_norm, "relative_difference_from_kernels": agree}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--distinct", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--m-programs", type=int, nargs="*", default=[],
                        help="also the kernels with these programs along M per segment (the prefill tiles' 4)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for distinct in args.distinct:
        row = run(args.tokens, distinct, args.m_programs)
        torch.cuda.empty_cache()  # the run's weights, before the next run's
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_result("lora-prefill", {"tokens": args.tokens, "rank": RANK, "layers": LAYERS, "rows": rows}, args.out_dir)


if __name__ == "__main__":
    main()
