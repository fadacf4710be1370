"""The model runner: turns a step plan into input tensors, runs transformers' model, returns logits.

The only place that knows about CUDA graphs and static buffers. Every step's tokens are flattened into
one row ([1, T]: decode rows first, then prefill chunks). A decode-only step on CUDA replays the graph
captured at start-up for the smallest batch bucket that holds it, with every per-step input (token ids,
positions, cache slots, block tables, context lengths, LoRA segments) copied into that bucket's
static buffers; padded rows write their K/V into the scratch block 0 and attend to nothing. Steps with
prefill work, and every step on CPU, run the same code eagerly.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app import attention as attention_module
from app.attention import AttentionMetadata, AttentionState, PagedKVCache, install, kernel_supports
from app.kernels import attention as attention_kernels
from app.kernels import lora as lora_kernels
from app.kv_blocks import BlockManager
from app.lora import LoRAMetadata, LoRASlots, segments
from app.norms import fuse_rms_norms
from app.scheduler import StepPlan

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def buckets_up_to(max_batch_size: int) -> list[int]:
    return sorted({b for b in BUCKETS if b < max_batch_size} | {max_batch_size})


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
    """One captured decode step for `batch` rows; it reads the runner's static buffers, writes `logits`.
    A `lora` graph runs the LoRA kernels; the other, for steps whose rows all use the base model, skips them."""

    def __init__(self, batch: int, lora: bool):
        self.batch, self.lora = batch, lora
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model, lora: LoRASlots, blocks: BlockManager, cache: PagedKVCache, max_batch_size: int,
                 max_model_len: int, use_graphs: bool, compile_decode: bool = False):
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
        self.fused_norms = fuse_rms_norms(model)  # CUDA only: one kernel per RMSNorm (app/norms.py)
        self.block_size = cache.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_batch_size = max_batch_size
        self.graphs: dict[tuple[int, bool], DecodeGraph] = {}  # (batch, lora) -> graph
        self.capture_seconds = 0.0
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
        graph = self._graph_for(inputs) if plan.is_decode_only and not logits_all and not extra_rows else None
        if graph is not None:
            self._fill_static(inputs, graph.batch)
            graph.graph.replay()
            return graph.logits[: inputs.num_decode]
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
        lora = any(slot >= 0 for slot in inputs.token_slots)
        for batch, with_lora in sorted(self.graphs):
            if batch >= inputs.num_decode and with_lora == lora:
                return self.graphs[batch, lora]
        return None

    def _allocate_static(self) -> None:
        n, dev = self.max_batch_size, self.device
        self.static_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.static_positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.static_slot_mapping = torch.zeros(n, dtype=torch.long, device=dev)
        self.static_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.static_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.static_order = torch.zeros(n, dtype=torch.int32, device=dev)
        self.static_starts = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.static_slots = torch.full((n,), -1, dtype=torch.int32, device=dev)
        # Host staging for one non-blocking copy per step.
        self.host_ints = torch.zeros(7 * n + 1, dtype=torch.long, pin_memory=True)
        self.host_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=True)

    def _fill_static(self, inputs: StepInputs, batch: int) -> None:
        """Copy the step's inputs into the bucket's static buffers: one pinned staging buffer, one copy."""
        pad = [0] * (batch - inputs.num_decode)
        order, starts, slots = segments(inputs.token_slots, batch, batch)
        values = (inputs.input_ids + pad + inputs.positions + pad + inputs.slot_mapping + pad
                  + inputs.decode_lens + pad + order + starts + slots)
        # The previous step's copies from these pinned buffers are complete: each step ends by reading its
        # sampled tokens back, which waits for the stream.
        ints = self.host_ints[: len(values)]
        ints.copy_(torch.tensor(values, dtype=torch.long))
        tables = self.host_tables[:batch]
        tables.zero_()
        for i, table in enumerate(inputs.decode_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        staged = ints.to(self.device, non_blocking=True)
        destinations = (self.static_ids, self.static_positions, self.static_slot_mapping, self.static_lens,
                        self.static_order, self.static_starts, self.static_slots)
        offset = 0
        for tensor in destinations:
            n = batch + 1 if tensor is self.static_starts else batch
            tensor[:n].copy_(staged[offset:offset + n])
            offset += n
        self.static_tables[:batch].copy_(tables, non_blocking=True)

    def _capture_all(self) -> None:
        start = time.perf_counter()
        self._allocate_static()
        self.lora.ctx.overlap = True  # the LoRA shrink beside each GEMM, in the graphs only (app/lora.py)
        pool = None
        for batch, lora in [(b, lora) for b in reversed(buckets_up_to(self.max_batch_size)) for lora in (True, False)]:
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
        log.info("captured %d decode graphs (batch %s, with and without LoRA%s) in %.1f s", len(self.graphs),
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
        self.lora.ctx.meta = LoRAMetadata(self.static_order[:batch], self.static_starts[:batch + 1],
                                          self.static_slots[:batch]) if lora else None

    def _static_forward(self, batch: int) -> torch.Tensor:
        out = self._decoder(input_ids=self.static_ids[None, :batch],
                               position_ids=self.static_positions[None, :batch], use_cache=False)
        return self.model.lm_head(out.last_hidden_state[0])
