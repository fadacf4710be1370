"""The model runner: turns a step plan into input tensors, runs transformers' model, returns logits.

The only place that knows about CUDA graphs and static buffers. Every step's tokens are flattened into
one row ([1, T]: decode rows first, then prefill chunks). A step on CUDA replays the graph captured at
start-up for the smallest bucket that holds its tokens, with every per-step input (token ids, positions,
cache slots, block tables, context lengths, LoRA segments) copied into that bucket's static buffers;
padded rows write their K/V into the scratch block 0 and attend to nothing. The graphs run every token as
a decode row: a prefill token at position p is a row with its sequence's block table and context p + 1,
which the paged decode kernel attends causally once the step's K/V are written. Buckets above
max_batch_size exist for steps that prefill (up to `max_graph_tokens`): run eagerly, such a step costs
tens of ms of host launches for a few ms of GPU work. Larger steps, and every step on CPU, run eagerly.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import groupby

import torch

from app.model import attention as attention_module
from app.model.attention import AttentionMetadata, AttentionState, PagedKVCache, install, kernel_supports
from app.model.kernels import attention as attention_kernels
from app.model.kernels import lora as lora_kernels
from app.engine.kv_blocks import BlockManager
from app.model.lora import LoRAMetadata, LoRASlots, segments
from app.model.norms import fuse_rms_norms
from app.engine.scheduler import StepPlan

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048)  # above max_batch_size: steps that prefill
# In a graph each prefill token reads its whole context as a decode row, where flash reads a chunk's context
# once: beyond this many context tokens over a step's prefill rows (a 512-token prompt has 131k), that reading
# (4 KB per token and layer at Llama-3-8B shapes) outgrows the host time a replay saves (a bound set by estimate,
# not measured: the 2 x 224-token step, 50k context tokens, replayed 3x faster than eager).
MAX_GRAPH_PREFILL_CONTEXT = 1 << 17


def buckets_up_to(max_batch_size: int) -> list[int]:
    return sorted({b for b in BUCKETS if b < max_batch_size} | {max_batch_size})


def graph_buckets(max_batch_size: int, max_graph_tokens: int) -> list[int]:
    """Decode buckets up to max_batch_size, then coarser token buckets up to max_graph_tokens."""
    tokens = {b for b in TOKEN_BUCKETS if max_batch_size < b < max_graph_tokens}
    top = {max_graph_tokens} if max_graph_tokens > max_batch_size else set()
    return sorted(set(buckets_up_to(max_batch_size)) | tokens | top)


def as_decode_rows(inputs: StepInputs) -> StepInputs:
    """The step with every prefill token as a decode row: its sequence's block table (the same list object
    for a chunk's rows) and context position + 1, so the paged decode attention masks it causally."""
    tables, lens = list(inputs.decode_tables), list(inputs.decode_lens)
    starts, nd = inputs.prefill_query_starts, inputs.num_decode
    for i, table in enumerate(inputs.prefill_tables):
        first = inputs.positions[nd + starts[i]]
        n = starts[i + 1] - starts[i]
        tables += [table] * n
        lens += range(first + 1, first + n + 1)
    return replace(inputs, num_decode=len(inputs.input_ids), decode_tables=tables, decode_lens=lens,
                   prefill_tables=[], prefill_query_starts=[0], prefill_lens=[])


@dataclass
class StepInputs:
    """Host-side arrays of one step."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    token_slots: list[int]  # adapter slot of each token, -1 for base
    num_decode: int
    decode_tables: list[list[int]]
    decode_lens: list[int]
    prefill_tables: list[list[int]]
    prefill_query_starts: list[int]
    prefill_lens: list[int]
    logits_index: list[int]  # token index of each sampled chunk's last token, in plan.chunks order


class DecodeGraph:
    """One captured step of `batch` decode rows; it reads the runner's static buffers, writes `logits` (every
    row's, or for a bucket above max_batch_size the rows of `static_sample`). A `lora` graph runs the LoRA
    kernels; the other, for steps whose rows all use the base model, skips them."""

    def __init__(self, batch: int, lora: bool):
        self.batch, self.lora = batch, lora
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model, lora: LoRASlots, blocks: BlockManager, cache: PagedKVCache, max_batch_size: int,
                 max_model_len: int, use_graphs: bool, compile_decode: bool = False, max_graph_tokens: int = 0):
        self.model, self.lora, self.blocks, self.cache = model, lora, blocks, cache
        self.device = next(model.parameters()).device
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.use_kernel = kernel_supports(self.head_dim, self.device)
        # One varlen flash call per layer for all prefill chunks, instead of an SDPA call per sequence
        # (host-bound: tens of launches per sequence and layer). VARLEN_PREFILL=0 turns it off (benches).
        self.use_varlen = (self.device.type == "cuda" and attention_module.VARLEN is not None
                           and os.environ.get("VARLEN_PREFILL", "1") != "0")
        self.attention = AttentionState(cache)
        install(model, self.attention)
        self.fused_norms = fuse_rms_norms(model)  # CUDA only: one kernel per RMSNorm (app/model/norms.py)
        self.block_size = cache.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_batch_size = max_batch_size
        self.buckets = graph_buckets(max_batch_size, max_graph_tokens)
        self.graphs: dict[tuple[int, bool], DecodeGraph] = {}  # (batch, lora) -> graph
        self.capture_seconds = 0.0
        self.mixed_replays = 0  # steps that prefill, replayed in a graph
        # The decode graphs replay what this callable launches at capture: transformers' decoder eagerly,
        # or compiled by torch.compile, whose inductor fuses the elementwise work between the GEMMs
        # (RMSNorm with its residual add, RoPE). Our attention and LoRA kernels stay opaque to it.
        self._decoder = model.model
        self.compiled = False
        if use_graphs and self.device.type == "cuda" and self.use_kernel:
            if compile_decode:
                self._decoder = torch.compile(model.model, dynamic=True)
                self.compiled = True
            self._capture_all()
        if self.device.type == "cuda":
            self._warm_eager()

    # --- inputs ---------------------------------------------------------------------------------

    def prepare(self, plan: StepPlan) -> StepInputs:
        bs, tables = self.block_size, self.blocks.tables
        inputs = StepInputs([], [], [], [], len(plan.decode), [], [], [], [0], [], [])
        for i, chunk in enumerate(plan.chunks):  # decode rows first
            request, table = chunk.request, tables[chunk.request.request_id]
            first = len(inputs.input_ids)
            inputs.input_ids += request.token_ids(chunk.start, chunk.end)
            positions = range(chunk.start, chunk.end)
            inputs.positions += positions
            inputs.slot_mapping += [table[p // bs] * bs + p % bs for p in positions]
            inputs.token_slots += [-1 if request.slot is None else request.slot] * chunk.length
            if i < inputs.num_decode:
                inputs.decode_tables.append(table)
                inputs.decode_lens.append(chunk.end)
            else:
                inputs.prefill_tables.append(table)
                inputs.prefill_query_starts.append(len(inputs.input_ids) - inputs.num_decode)
                inputs.prefill_lens.append(chunk.end)
            if chunk.samples:
                inputs.logits_index.append(first + chunk.length - 1)
        return inputs

    # --- running --------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan, logits_all: bool = False, extra_rows: Sequence[int] = ()) -> torch.Tensor:
        """Logits [sampled chunks + len(extra_rows), vocab] (or [T, vocab] with logits_all) for the step; the
        cache is updated. extra_rows: flat token indices (plan.chunks order) whose logits follow the sampled
        rows' (echo's prompt logprobs), so only the requests that ask pay for them."""
        inputs = self.prepare(plan)
        if self.graphs and not logits_all and not extra_rows and len(inputs.logits_index) <= self.max_batch_size:
            rows = inputs if plan.is_decode_only else as_decode_rows(inputs)
            cheap = plan.is_decode_only or sum(rows.decode_lens[inputs.num_decode:]) <= MAX_GRAPH_PREFILL_CONTEXT
            graph = self._graph_for(rows) if cheap else None
            if graph is not None:
                self._fill_static(rows, graph.batch)
                graph.graph.replay()
                if plan.is_decode_only:
                    return graph.logits[: inputs.num_decode]
                self.mixed_replays += 1
                if graph.batch > self.max_batch_size:  # the graph gathered the sampled rows (static_sample)
                    return graph.logits[: len(inputs.logits_index)]
                return graph.logits[torch.tensor(inputs.logits_index, dtype=torch.long, device=self.device)]
        hidden = self._forward_eager(inputs)
        if not logits_all:
            hidden = hidden[torch.tensor(inputs.logits_index + list(extra_rows), dtype=torch.long, device=self.device)]
        return self.model.lm_head(hidden)

    def _forward_eager(self, inputs: StepInputs) -> torch.Tensor:
        dev, nd = self.device, inputs.num_decode
        t = lambda values, dtype=torch.long: torch.tensor(values, dtype=dtype, device=dev)  # noqa: E731
        decode_tables = None
        if nd:
            # Full width, as in the graphs: Triton specializes the decode kernel on the table's width and
            # stride, so a width that followed the longest row would compile new variants mid-serving.
            decode_tables = torch.zeros(nd, self.max_blocks, dtype=torch.int32)
            for i, table in enumerate(inputs.decode_tables):
                decode_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
            decode_tables = decode_tables.to(dev)
        self.attention.meta = AttentionMetadata(
            slot_mapping=t(inputs.slot_mapping), num_decode=nd, decode_block_tables=decode_tables,
            decode_context_lens=t(inputs.decode_lens, torch.int32) if nd else None, decode_workspace=None,
            prefill_blocks=[t(table) for table in inputs.prefill_tables],
            prefill_query_starts=inputs.prefill_query_starts, prefill_context_lens=inputs.prefill_lens,
            use_kernel=self.use_kernel)
        if inputs.prefill_lens and self.use_varlen:
            self._set_varlen(inputs)
        # Eager: exactly one segment per distinct adapter (the kernels' grids scale with the segment count).
        distinct = len({slot for slot in inputs.token_slots if slot >= 0})
        self._set_lora(inputs.token_slots, len(inputs.token_slots), distinct)
        try:
            out = self.model.model(input_ids=t(inputs.input_ids)[None], position_ids=t(inputs.positions)[None],
                                   use_cache=False)
        finally:
            self.attention.meta, self.lora.ctx.meta = None, None
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def _warm_eager(self) -> None:
        """Eager steps at start-up, on the scratch block 0 and slot 0, that make Triton compile every variant
        an eager step can need: the LoRA kernels' two tile configs (decode- and prefill-sized steps) and
        the decode attention at each split count the batch size can give. Compiled in the first requests'
        steps instead, they made those steps take 0.6-1.9 s on the H100."""
        start, bs = time.perf_counter(), self.block_size
        steps = [(2, 8), (2, lora_kernels.DECODE_T_MAX + 8)]  # (decode rows, prefill tokens)
        if self.use_kernel:
            kv_heads = self.model.config.num_key_value_heads
            by_splits = {attention_kernels.num_kv_splits(b, kv_heads, self.max_blocks, bs, self.device): b
                         for b in range(1, self.max_batch_size + 1)}
            steps += [(b, 0) for b in by_splits.values()]
        for rows, length in steps:
            positions = [0] * rows + list(range(length))
            inputs = StepInputs(input_ids=[0] * len(positions), positions=positions,
                                slot_mapping=[p % bs for p in positions], token_slots=[0] * len(positions),
                                num_decode=rows, decode_tables=[[0]] * rows, decode_lens=[1] * rows,
                                prefill_tables=[[0] * -(-length // bs)] if length else [],
                                prefill_query_starts=[0, length] if length else [0],
                                prefill_lens=[length] if length else [], logits_index=[len(positions) - 1])
            self.model.lm_head(self._forward_eager(inputs)[-1:])
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        log.info("warmed the eager path (%d steps) in %.1f s", len(steps), time.perf_counter() - start)

    def _set_varlen(self, inputs: StepInputs) -> None:
        """The cache rows of every prefill chunk's whole context, packed, for one varlen flash call per layer."""
        bs, meta = self.block_size, self.attention.meta
        offsets = torch.arange(bs, dtype=torch.long)
        rows = [(torch.tensor(table, dtype=torch.long)[:, None] * bs + offsets).flatten()[:length]
                for table, length in zip(inputs.prefill_tables, inputs.prefill_lens)]
        cu_k = [0]
        for length in inputs.prefill_lens:
            cu_k.append(cu_k[-1] + length)
        meta.prefill_kv_rows = torch.cat(rows).to(self.device, non_blocking=True)
        meta.prefill_cu_q = torch.tensor(inputs.prefill_query_starts, dtype=torch.int32).to(self.device)
        meta.prefill_cu_k = torch.tensor(cu_k, dtype=torch.int32).to(self.device)

    def _set_lora(self, token_slots: list[int], t_cap: int, s_cap: int) -> None:
        if all(s < 0 for s in token_slots):
            self.lora.ctx.meta = None
            return
        order, starts, slots = segments(token_slots, t_cap, s_cap)
        t = lambda values: torch.tensor(values, dtype=torch.int32, device=self.device)  # noqa: E731
        self.lora.ctx.meta = LoRAMetadata(t(order), t(starts), t(slots))

    # --- CUDA graphs ----------------------------------------------------------------------------

    @property
    def graph_batches(self) -> list[int]:
        return sorted({batch for batch, _ in self.graphs})

    def _graph_for(self, inputs: StepInputs) -> DecodeGraph | None:
        """The smallest captured bucket that holds the step's rows (all decode rows), with LoRA if any uses it."""
        lora = any(slot >= 0 for slot in inputs.token_slots)
        for batch, with_lora in sorted(self.graphs):
            if batch >= inputs.num_decode and with_lora == lora:
                return self.graphs[batch, lora]
        return None

    def _segment_cap(self, batch: int) -> int:
        return min(batch, self.max_batch_size)  # segments are distinct adapters: at most one per request

    def _allocate_static(self) -> None:
        n, dev = max(self.buckets), self.device
        self.static_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.static_positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.static_slot_mapping = torch.zeros(n, dtype=torch.long, device=dev)
        self.static_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.static_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.static_order = torch.zeros(n, dtype=torch.int32, device=dev)
        self.static_starts = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.static_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        self.static_sample = torch.zeros(self.max_batch_size, dtype=torch.long, device=dev)  # rows to sample
        # Host staging for one non-blocking copy per step.
        self.host_ints = torch.zeros(7 * n + 1 + self.max_batch_size, dtype=torch.long, pin_memory=True)
        self.host_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=True)

    def _fill_static(self, inputs: StepInputs, batch: int) -> None:
        """Copy the step's inputs into the bucket's static buffers: one pinned staging buffer, one copy."""
        pad = [0] * (batch - inputs.num_decode)
        s_cap = self._segment_cap(batch)
        order, starts, slots = segments(inputs.token_slots, batch, s_cap)
        sample = inputs.logits_index + [0] * (self.max_batch_size - len(inputs.logits_index))
        values = (inputs.input_ids + pad + inputs.positions + pad + inputs.slot_mapping + pad
                  + inputs.decode_lens + pad + order + starts + slots + sample)
        # The previous step's copies from these pinned buffers are complete: each step ends by reading its
        # sampled tokens back, which waits for the stream.
        ints = self.host_ints[: len(values)]
        ints.copy_(torch.tensor(values, dtype=torch.long))
        tables = self.host_tables[:batch]
        tables.zero_()
        row = 0
        for _, run in groupby(inputs.decode_tables, key=id):  # a prefill chunk's rows share one table object
            run = list(run)
            tables[row: row + len(run), : len(run[0])] = torch.tensor(run[0], dtype=torch.int32)
            row += len(run)
        staged = ints.to(self.device, non_blocking=True)
        sizes = ((self.static_ids, batch), (self.static_positions, batch), (self.static_slot_mapping, batch),
                 (self.static_lens, batch), (self.static_order, batch), (self.static_starts, s_cap + 1),
                 (self.static_slots, s_cap), (self.static_sample, self.max_batch_size))
        offset = 0
        for tensor, n in sizes:
            tensor[:n].copy_(staged[offset:offset + n])
            offset += n
        self.static_tables[:batch].copy_(tables, non_blocking=True)

    def _capture_all(self) -> None:
        start = time.perf_counter()
        self._allocate_static()
        self.lora.ctx.overlap = True  # the LoRA shrink beside each GEMM, in the graphs only (app/model/lora.py)
        pool = None
        for batch, lora in [(b, lora) for b in reversed(self.buckets) for lora in (True, False)]:
            graph = DecodeGraph(batch, lora)
            self._bind_static(batch, lora)
            with torch.inference_mode():
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._static_forward(batch)  # compiles the kernels for these shapes
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(graph.graph, pool=pool):
                    graph.logits = self._static_forward(batch)
            pool = graph.graph.pool()
            self.graphs[batch, lora] = graph
        self.attention.meta, self.lora.ctx.meta, self.lora.ctx.overlap = None, None, False
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        log.info("captured %d graphs (rows %s, with and without LoRA%s) in %.1f s", len(self.graphs),
                 sorted({batch for batch, _ in self.graphs}), ", torch.compile" if self.compiled else "",
                 self.capture_seconds)

    def _bind_static(self, batch: int, lora: bool) -> None:
        config = self.model.config
        q = torch.empty(batch, config.num_attention_heads, self.head_dim, device=self.device)
        workspace = attention_kernels.decode_workspace(q, config.num_key_value_heads, self.static_tables[:batch],
                                                       self.block_size)
        self.attention.meta = AttentionMetadata(
            slot_mapping=self.static_slot_mapping[:batch], num_decode=batch,
            decode_block_tables=self.static_tables[:batch], decode_context_lens=self.static_lens[:batch],
            decode_workspace=workspace, prefill_blocks=[], prefill_query_starts=[0], prefill_context_lens=[],
            use_kernel=True)
        s_cap = self._segment_cap(batch)
        self.lora.ctx.meta = LoRAMetadata(self.static_order[:batch], self.static_starts[:s_cap + 1],
                                          self.static_slots[:s_cap]) if lora else None

    def _static_forward(self, batch: int) -> torch.Tensor:
        out = self._decoder(input_ids=self.static_ids[None, :batch],
                            position_ids=self.static_positions[None, :batch], use_cache=False)
        hidden = out.last_hidden_state[0]
        if batch > self.max_batch_size:  # a step that prefills samples at most max_batch_size rows
            hidden = hidden.index_select(0, self.static_sample)
        return self.model.lm_head(hidden)
