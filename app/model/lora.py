"""Batched multi-adapter LoRA over paged device memory: every token may use a different adapter.

Each target linear of the base model is wrapped: y = base(x), then for every token t whose sequence
runs on slot s,
    y[t] += scale[s] * (x[t] @ A_s.T) @ BT_s
where A_s and BT_s are slot s's rank rows, gathered from its pages of the shared page pool through the
page table (prefetch/layout.py), by the segmented kernels of app/model/kernels/lora.py: tokens are grouped into
segments by slot once per step (`LoRAMetadata`), and each segment's adapter is read once, so the cost
grows with the distinct adapters in the batch, not with the slot count. CUDA runs the Triton pair
(capturable in a CUDA graph); CPU runs the same sums in plain torch (`kernels.host_lora`).
"""

from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from app.model.architectures import UnsupportedModel, check_supported
from app.model.fp8 import Fp8Linear, Fp8Weight, Quantized, base_linear, quantize_rows
from app.model.tensor_parallel import RowParallel, RowParallelFp8Linear, RowParallelLinear
from app.model.kernels import lora as kernels
from prefetch.layout import PageLayout

log = logging.getLogger(__name__)
MAX_RESIDENT_ADAPTERS = 4096  # caps the side tables (and, for tiny adapters on a big GPU, the pool)


@dataclass
class LoRAMetadata:
    token_order: torch.Tensor  # [T_cap] int32: token indices grouped by segment
    seg_starts: torch.Tensor  # [S_cap + 1] int32
    seg_slots: torch.Tensor  # [S_cap] int32, -1: no adapter
    config: kernels.KernelConfig | None = None  # the kernels' tiles; None: picked by T_cap (`pick_config`)
    host: tuple[kernels.HostSegment, ...] | None = None  # the CPU path's segments, read at its first LoRA call


def segments(token_slots: list[int], t_cap: int, s_cap: int | None,
             max_rows: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """Group token indices by slot (-1 = base): (token_order [t_cap], seg_starts [s_cap + 1], seg_slots [s_cap]).
    Base tokens are left out; unused entries are padding (empty segments of slot -1). With max_rows, a slot's
    tokens form segments of at most that many rows, so that one adapter's many rows run in as many programs
    (the decode kernels give a segment one program, which would loop over its tiles one after another);
    s_cap must then hold that many segments (at most one per token). s_cap None: exactly the segments there are."""
    by_slot: dict[int, list[int]] = {}
    for t, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(t)
    order, starts, slots = [], [0], []
    for slot, tokens in by_slot.items():
        step = max_rows or len(tokens)
        for i in range(0, len(tokens), step):
            order += tokens[i:i + step]
            starts.append(len(order))
            slots.append(slot)
    if s_cap is None:
        s_cap = len(slots)
    assert len(slots) <= s_cap, f"{len(slots)} segments > {s_cap}"
    pad = s_cap - len(slots)
    return order + [0] * (t_cap - len(order)), starts + [len(order)] * pad, slots + [-1] * pad


def pool_size(config, layout: PageLayout, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(pages, slots) of the device adapter pool.

    num_slots: that many adapters, each with the pages of a max_rank one (no adapter waits for room while
    a slot is free). Else adapter_memory_bytes, else adapter_memory_fraction of the GPU memory free now
    (after the weights; the KV cache is sized after this), else on CPU the pages of 8 max_rank adapters;
    then any adapter fits in as many pages as its rank needs, as many adapters as the pages hold.
    """
    if config.num_slots is not None:
        return config.num_slots * layout.max_pages, config.num_slots
    page_nbytes = layout.page_nbytes(dtype)
    if config.adapter_memory_bytes is not None:
        nbytes = config.adapter_memory_bytes
    elif device.type == "cuda":
        nbytes = int(torch.cuda.mem_get_info(device)[0] * config.adapter_memory_fraction)
    else:
        nbytes = CPU_DEFAULT_MAX_RANK_ADAPTERS * layout.max_pages * page_nbytes
    pages = min(nbytes // page_nbytes, MAX_RESIDENT_ADAPTERS * layout.max_pages)
    if pages < layout.max_pages:
        raise ValueError(f"adapter memory ({nbytes} bytes) holds {pages} pages of {page_nbytes} bytes; one adapter "
                         f"at max_rank {layout.max_rank} needs {layout.max_pages}")
    return pages, min(pages, MAX_RESIDENT_ADAPTERS)


CPU_DEFAULT_MAX_RANK_ADAPTERS = 8


class LoRAContext:
    """Per-forward routing shared by every wrapped layer, and the slots' side tables."""

    def __init__(self, num_slots: int, n_modules: int, max_pages: int, use_kernel: bool, device: torch.device,
                 workspace: kernels.LoRAWorkspace | None):
        self.meta: LoRAMetadata | None = None
        self.use_kernel = use_kernel
        self.workspace = workspace
        self.scales = torch.zeros(n_modules, num_slots, dtype=torch.float32, device=device)  # [module, slot]
        # Each slot's rank and pages: the kernels read only its rank rows, wherever its pages are.
        self.slot_ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)  # [num_slots]
        self.page_table = torch.zeros(num_slots, max_pages, dtype=torch.int32, device=device)  # [num_slots, max_pages]
        self.side_stream = torch.cuda.Stream(device) if use_kernel else None
        self.overlap = False  # the shrink beside the GEMM, on side_stream: set while decode graphs are captured

    def linear(self, x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None,
               group: kernels.Group | None, quantized: Quantized | None = None) -> torch.Tensor:
        """F.linear(x, weight, bias) (an FP8 GEMM for an FP8 weight, over `quantized` where given) plus every
        member's LoRA of x on its columns of the output.

        While the model runner captures its decode graphs (`overlap`), the shrink, which reads only x, runs
        on a side stream beside the GEMM (it fills the GEMM's idle SMs and hides its chain of dependent loads
        behind it; the graph keeps the fork and the join), and the expand adds into the GEMM's output after
        the join. Running the expand beside the GEMM too, into a delta buffer added afterwards, would be
        slower: next to the GEMM's large tiles the expand gets few SMs and finishes after it. Eager steps keep
        one stream: there the fork and join cost host time."""
        meta = self.meta
        if group is None or meta is None:
            return base_linear(x, weight, bias, quantized)
        x2 = x.reshape(-1, x.shape[-1])
        tables = (self.slot_ranks, self.page_table, meta.token_order, meta.seg_starts, meta.seg_slots)
        if not self.use_kernel:
            y = base_linear(x, weight, bias, quantized)
            if meta.host is None:
                meta.host = kernels.host_segments(meta.token_order, meta.seg_starts, meta.seg_slots, self.slot_ranks,
                                                  self.page_table, self.scales)
            kernels.host_lora(y.view(-1, y.shape[-1]), x2, group, meta.host)
            return y
        if not self.overlap:
            y = base_linear(x, weight, bias, quantized)
            kernels.lora_group_apply(y.view(-1, y.shape[-1]), x2, group, self.scales, *tables, self.workspace,
                                     meta.config)
            return y
        main = torch.cuda.current_stream()
        self.side_stream.wait_stream(main)
        with torch.cuda.stream(self.side_stream):
            splits = kernels.lora_shrink(x2, group, *tables, self.workspace, meta.config)
        y = base_linear(x, weight, bias, quantized)
        main.wait_stream(self.side_stream)
        kernels.lora_expand(y.view(-1, y.shape[-1]), group, self.scales, *tables, self.workspace, splits,
                            meta.config)
        return y


_GROUPS: weakref.WeakValueDictionary[int, LinearGroup] = weakref.WeakValueDictionary()  # handle -> group
_HANDLES = itertools.count()


@torch.library.custom_op("lora_serve::linear", mutates_args=())
def _linear_op(x: torch.Tensor, handle: torch.Tensor, position: int, width: int, xq: torch.Tensor | None,
               x_scale: torch.Tensor | None) -> torch.Tensor:
    """A LinearGroup's GEMM and LoRA as one op, opaque to torch.compile: position -1 gives every member's output
    (the group's whole width), a member's position that member's alone; `width` is the output's. The group is
    named by a tensor, not an int: torch.compile guards on an int's value, and would compile each layer anew.
    For FP8 weights, (xq, x_scale) is x quantized per token (`quantize_rows`), else None."""
    group = _GROUPS[int(handle)]
    quantized = None if xq is None else (xq, x_scale)
    return group._run_whole(x, quantized) if position < 0 else group._run_alone(position, x, quantized)


@_linear_op.register_fake
def _(x: torch.Tensor, handle: torch.Tensor, position: int, width: int, xq: torch.Tensor | None,
      x_scale: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], width)


class LinearGroup:
    """Linears that read the same input, run as one: one GEMM over their concatenated weights (as vLLM's
    fused QKV and gate/up projections), then one LoRA shrink and one expand launch for the members that
    adapters target, instead of a GEMM and two launches per linear. The first member's call computes every
    member's output; the others' calls, which the model makes next with the same input, slice theirs from it.
    A member called without that (another call order, another input) computes its own output alone.

    Under torch.compile the group's work is one opaque op (`_linear_op`) whose output the members slice, so the
    compiled graph does not break at each member's call: the elementwise work between them (SiLU of gate and its
    product with up, q's and k's RoPE) fuses into one kernel. Over FP8 weights the graph also quantizes the op's
    input per token (`quantize_rows`), which inductor fuses into the kernel that computes the input (the RMSNorm
    before q/k/v and gate/up, SiLU·product before down): no kernel of its own, and x is read once for it."""

    def __init__(self, linears: list[nn.Linear], lora: dict[int, tuple[int, torch.Tensor, torch.Tensor]],
                 ctx: LoRAContext):
        """lora: member position -> (module index, A, BT) for the members that adapters target."""
        self.ctx = ctx
        self.linears = linears
        widths = [linear.out_features for linear in linears]
        if len(linears) > 1:  # one weight; each linear keeps a view of its rows (no extra memory)
            fp8 = isinstance(linears[0], Fp8Linear)
            weight = Fp8Weight.cat([linear.fp8 for linear in linears]) if fp8 else \
                torch.cat([linear.weight.detach() for linear in linears])
            biases = [linear.bias for linear in linears]
            bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
            for linear, w, b in zip(linears, weight.split(widths), bias.split(widths) if bias is not None
                                    else [None] * len(linears)):
                if fp8:
                    linear.set_fp8(w)
                else:
                    linear.weight = nn.Parameter(w, requires_grad=False)
                if b is not None:
                    linear.bias = nn.Parameter(b, requires_grad=False)
            self.weight, self.bias = weight, bias
        self.widths = widths
        self.fp8 = isinstance(base_weight(linears[0]), Fp8Weight)
        columns = [sum(widths[:i]) for i in range(len(widths))]
        positions = sorted(lora)
        self.group = kernels.Group(tuple(lora[p][1] for p in positions), tuple(lora[p][2] for p in positions),
                                   tuple(lora[p][0] for p in positions), tuple(columns[p] for p in positions)) \
            if lora else None
        self.alone = {p: kernels.Group.single(A, BT, module) for p, (module, A, BT) in lora.items()}
        self.columns = columns
        self.held: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, whole output) of the first member's call
        handle = next(_HANDLES)
        self.handle = torch.tensor(handle)  # [] int64, on the host
        _GROUPS[handle] = self

    def output(self, position: int, x: torch.Tensor) -> torch.Tensor:
        """Member `position`'s output for input x. The first member's call leaves (input, whole output) for the
        others, and the last member's call clears it, so that no activation outlives the forward. Under
        torch.compile, which traces this, the work runs as `_linear_op`."""
        last = len(self.widths) - 1
        compiling = torch.compiler.is_compiling()
        if position == 0 and last > 0:
            y = self._traced(x, -1, sum(self.widths)) if compiling else self._run_whole(x)
            self.held = (x, y)
            return y[..., : self.widths[0]]
        held = self.held
        if position > 0 and held is not None and held[0] is x:
            if position == last:
                self.held = None
            start = self.columns[position]
            return held[1][..., start: start + self.widths[position]]
        if compiling:
            return self._traced(x, position, self.widths[position])
        return self._run_alone(position, x)

    def _traced(self, x: torch.Tensor, position: int, width: int) -> torch.Tensor:
        xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1])) if self.fp8 else (None, None)
        return torch.ops.lora_serve.linear(x, self.handle, position, width, xq, x_scale)

    def _run_whole(self, x: torch.Tensor, quantized: Quantized | None = None) -> torch.Tensor:
        return self.ctx.linear(x, self.weight, self.bias, self.group, quantized)

    def _run_alone(self, position: int, x: torch.Tensor, quantized: Quantized | None = None) -> torch.Tensor:
        linear = self.linears[position]
        if isinstance(linear, RowParallel):  # this rank's base and LoRA shares, summed over ranks at once
            return linear.reduce(self.ctx.linear(x, base_weight(linear), None, self.alone.get(position), quantized))
        return self.ctx.linear(x, base_weight(linear), linear.bias, self.alone.get(position), quantized)


class LoRALinear(nn.Module):
    """A target linear (or a sibling of one) of the model: its call goes to its LinearGroup."""

    def __init__(self, base: nn.Linear, group: LinearGroup, position: int):
        super().__init__()
        self.base = base
        self.group = group
        self.position = position

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(self.position, x)


class LoRASlots:
    """Wraps the model's target linears and owns the page pool and side tables they read."""

    def __init__(self, model: nn.Module, layout: PageLayout, num_pages: int, num_slots: int, t_cap: int):
        param = next(model.parameters())
        self.layout, self.num_pages, self.num_slots = layout, num_pages, num_slots
        self.t_cap = t_cap  # the most tokens a step can have
        self.device, self.dtype = param.device, param.dtype
        use_kernel = self.device.type == "cuda" and kernels.triton is not None
        workspace = None
        if use_kernel:
            in_features = sorted({shape[0] for shape in layout.shapes.values()})
            workspace = kernels.LoRAWorkspace.allocate(t_cap, layout.max_pages * layout.page_rows, in_features,
                                                       self.device)
        self.ctx = LoRAContext(num_slots, len(layout.modules), layout.max_pages, use_kernel, self.device, workspace)
        # Graphs capture pointers into this pool; loads write into it on the copy stream, ordered by events.
        self.pool = torch.zeros(num_pages, layout.page_numel, dtype=self.dtype, device=self.device)
        self.groups = wrap_targets(model, layout, layout.module_views(self.pool), self.ctx,
                                   check_supported(model.config).fused)
        log.info("adapter pool: %.2f GB in %d pages of %d rank rows (%.1f MB each): %d adapters at max_rank %d, "
                 "up to %d resident", self.nbytes() / 1e9, num_pages, layout.page_rows,
                 layout.page_nbytes(self.dtype) / 1e6, num_pages // layout.max_pages, layout.max_rank, num_slots)

    def nbytes(self) -> int:
        return self.pool.numel() * self.pool.element_size()

    def write_slot(self, slot: int, pages, host_pages, scales: torch.Tensor, rank: int) -> None:
        """Runs on the copy stream (CUDA): the same pool and side tables the captured graphs read, ordered by
        events. host_pages[i] (pinned on CUDA) goes to pool page pages[i]."""
        torch._foreach_copy_([self.pool[p] for p in pages], list(host_pages), non_blocking=True)
        row = torch.zeros(self.layout.max_pages, dtype=torch.int32)
        row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.ctx.page_table[slot].copy_(row, non_blocking=True)
        self.ctx.scales[:, slot].copy_(scales, non_blocking=True)
        self.ctx.slot_ranks[slot].fill_(min(rank, len(pages) * self.layout.page_rows))


def wrap_targets(model: nn.Module, layout: PageLayout, views, ctx: LoRAContext,
                 fused: tuple[tuple[str, ...], ...]) -> list[LinearGroup]:
    """Wrap every target linear of `model` in a LoRALinear; siblings that read the same input (`fused`, from the
    architecture's declaration) share one LinearGroup, whether the adapters target all of them or some."""
    targets: dict[str, dict[str, tuple[int, torch.Tensor, torch.Tensor]]] = {}  # parent -> child -> lora
    for index, (module, (A, BT)) in enumerate(zip(layout.modules, views)):
        parent_name, _, child = module.rpartition(".")
        targets.setdefault(parent_name, {})[child] = (index, A, BT)
    groups = []
    for parent_name, children in targets.items():
        parent = model.get_submodule(parent_name)
        for name in children:
            _check_linear(parent_name, name, getattr(parent, name, None), layout.shapes[f"{parent_name}.{name}"])
        left = dict(children)
        for names in fused:
            linears = [getattr(parent, name, None) for name in names]
            if not any(name in left for name in names) or not _fusable(linears):
                continue
            lora = {p: left.pop(name) for p, name in enumerate(names) if name in left}
            groups.append(_install(parent, names, linears, lora, ctx))
        for name, entry in left.items():
            groups.append(_install(parent, (name,), [getattr(parent, name)], {0: entry}, ctx))
    return groups


def _check_linear(parent_name: str, name: str, linear, shape: tuple[int, int]) -> None:
    """The LoRA layers compute F.linear over the module's weight: anything else (a quantized or custom linear, a
    missing module) would be served wrong, so it is refused by name."""
    if type(linear) not in (nn.Linear, Fp8Linear, RowParallelLinear, RowParallelFp8Linear):
        raise UnsupportedModel(f"{parent_name}.{name} is {type(linear).__name__}, not torch.nn.Linear; "
                               "LoRA is served on plain linears only (and on the FP8 ones of `quantization: fp8`, "
                               "and the row-parallel ones of tensor parallelism)")
    if (linear.in_features, linear.out_features) != tuple(shape):
        raise UnsupportedModel(f"{parent_name}.{name} is [{linear.in_features} -> {linear.out_features}], "
                               f"but its architecture declares {list(shape)}")


def _fusable(linears) -> bool:
    first = linears[0]
    if type(first) not in (nn.Linear, Fp8Linear) or not all(type(linear) is type(first) for linear in linears):
        return False
    weights = [base_weight(linear) for linear in linears]
    kind = lambda w: (w.q.dtype, w.q.device) if isinstance(w, Fp8Weight) else (w.dtype, w.device)  # noqa: E731
    return all(linear.in_features == first.in_features and kind(w) == kind(weights[0])
               and (linear.bias is None) == (first.bias is None) for linear, w in zip(linears, weights))


def base_weight(linear: nn.Module) -> torch.Tensor | Fp8Weight:
    return linear.fp8 if isinstance(linear, Fp8Linear) else linear.weight


def _install(parent: nn.Module, names, linears, lora, ctx: LoRAContext) -> LinearGroup:
    group = LinearGroup(linears, lora, ctx)
    for position, (name, linear) in enumerate(zip(names, linears)):
        setattr(parent, name, LoRALinear(linear, group, position))
    return group
