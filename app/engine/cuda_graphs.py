"""The model runner's CUDA graphs: one per token bucket, with and without LoRA, captured at start-up over static
input buffers, and replayed for every step that fits one.

A step replays the graph captured for the smallest bucket that holds its tokens, with every per-step input
(token ids, positions, cache slots, block tables, context lengths, LoRA segments) copied into that bucket's
static buffers; padded rows write their K/V into the scratch block 0 and attend to nothing. The graphs run
every token as a decode row: a prefill token at position p is a row with its sequence's block table and
context p + 1, which the paged decode kernel attends causally once the step's K/V are written. Buckets above
max_batch_size exist for steps that prefill (up to `max_graph_tokens`): run eagerly, such a step costs tens of
ms of host launches for a few ms of GPU work. Larger steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from itertools import groupby

import torch

from app.engine.step_inputs import StepInputs, as_decode_rows
from app.model.attention import AttentionMetadata, AttentionState
from app.model.kernels import attention as attention_kernels
from app.model.kernels.attention import DecodeWorkspace
from app.model.kernels import lora as lora_kernels
from app.model.lora import LoRAMetadata, LoRASlots, segments

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048)  # above max_batch_size: steps that prefill
# In a graph each prefill token reads its whole context as a decode row, where flash reads a chunk's context
# once: beyond this many context tokens over a step's prefill rows (a 512-token prompt has 131k), that reading
# (4 KB per token and layer at Llama-3-8B shapes) outgrows the host time a replay saves (a bound set by estimate).
MAX_GRAPH_PREFILL_CONTEXT = 1 << 17
# The LoRA kernels' tiles in every bucket: the decode config, whose grids give each segment of at most one M tile a
# program, a slot's rows being cut into such segments. A bucket's rows are decode rows and a few prompt chunks (see
# above), which the prefill config, striding a segment's tiles over programs along M, runs slower: its programs sit
# idle for the many short segments of decode rows. One H200, 127 decode rows at context 512 over 32 adapters and a
# 384-token chunk, in the 512-token graph: 22.1 ms with the decode config, 25.9 with the prefill config, 19.7 for
# the base model (bench/results/h200-x1-mixed-step-lora-config.log).
GRAPH_LORA = lora_kernels.DECODE


def buckets_up_to(max_batch_size: int) -> list[int]:
    return sorted({b for b in BUCKETS if b < max_batch_size} | {max_batch_size})


def graph_buckets(max_batch_size: int, max_graph_tokens: int) -> list[int]:
    """Decode buckets up to max_batch_size, then coarser token buckets up to max_graph_tokens."""
    tokens = {b for b in TOKEN_BUCKETS if max_batch_size < b < max_graph_tokens}
    top = {max_graph_tokens} if max_graph_tokens > max_batch_size else set()
    return sorted(set(buckets_up_to(max_batch_size)) | tokens | top)


class DecodeGraph:
    """One captured step of `batch` decode rows; it reads the static buffers, writes `logits` (every row's, or
    for a bucket above max_batch_size the rows of `static_sample`). A `lora` graph runs the LoRA kernels; the
    other, for steps whose rows all use the base model, skips them."""

    def __init__(self, batch: int, lora: bool):
        self.batch, self.lora = batch, lora
        self.graph = torch.cuda.CUDAGraph()
        self.logits: torch.Tensor | None = None
        # The attention kernels' split-K scratch, allocated outside the graph's pool: each replay writes into it, so
        # it lives as long as the graph (freed, its memory would go to other tensors that replays then overwrite).
        self.attention_workspace: DecodeWorkspace | None = None


class CudaGraphs:
    """Every bucket's graphs and the static buffers they read; building this captures them."""

    def __init__(self, model, attention: AttentionState, lora: LoRASlots, buckets: list[int], max_batch_size: int,
                 max_blocks: int, block_size: int, head_dim: int, compile_decode: bool):
        self.model, self.attention, self.lora = model, attention, lora
        self.device = next(model.parameters()).device
        self.buckets, self.max_batch_size = buckets, max_batch_size
        self.max_blocks, self.block_size, self.head_dim = max_blocks, block_size, head_dim
        self.graphs: dict[tuple[int, bool], DecodeGraph] = {}  # (batch, lora) -> graph
        self.mixed_replays = 0  # steps that prefill, replayed in a graph
        # The graphs replay what this callable launches at capture, and the model runner's eager steps run it:
        # transformers' decoder as it is, or compiled by torch.compile, whose inductor fuses the elementwise work
        # between the GEMMs (RMSNorm with its residual add, RoPE, SiLU with its product). Our attention and LoRA
        # kernels stay opaque to it. Compiled with dynamic shapes, one compilation serves every bucket and step.
        self.compiled = compile_decode
        self.decoder = torch.compile(model.model, dynamic=True) if compile_decode else model.model
        self.capture_seconds = 0.0
        self._capture_all()

    # --- replay ---------------------------------------------------------------------------------

    def replay(self, inputs: StepInputs, decode_only: bool,
               previous: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits of the step's sampled rows, from the smallest graph that holds the step; None: run it eagerly.
        previous: the sampled tokens of the step before, for inputs.pending."""
        if len(inputs.logits_index) > self.max_batch_size:
            return None
        rows = inputs if decode_only else as_decode_rows(inputs)
        cheap = decode_only or sum(rows.decode_lens[inputs.num_decode:]) <= MAX_GRAPH_PREFILL_CONTEXT
        graph = self.graph_for(rows) if cheap else None
        if graph is None:
            return None
        self.fill(rows, graph.batch, previous)
        graph.graph.replay()
        if decode_only:
            return graph.logits[: inputs.num_decode]
        self.mixed_replays += 1
        if graph.batch > self.max_batch_size:  # the graph gathered the sampled rows (static_sample)
            return graph.logits[: len(inputs.logits_index)]
        index = torch.tensor(inputs.logits_index, dtype=torch.long).to(self.device, non_blocking=True)
        return graph.logits[index]

    def graph_for(self, inputs: StepInputs) -> DecodeGraph | None:
        """The smallest captured bucket that holds the step's rows (all decode rows), with LoRA if any uses it."""
        lora = any(slot >= 0 for slot in inputs.token_slots)
        for batch, with_lora in sorted(self.graphs):
            if batch >= inputs.num_decode and with_lora == lora:
                return self.graphs[batch, lora]
        return None

    def fill(self, inputs: StepInputs, batch: int, previous: torch.Tensor | None = None) -> None:
        """Copy the step's inputs into the bucket's static buffers: one pinned staging buffer, one copy; then the
        pending inputs from `previous`, the sampled tokens of the step before."""
        pad = [0] * (batch - inputs.num_decode)
        s_cap = self._segment_cap(batch)
        order, starts, slots = segments(inputs.token_slots, batch, s_cap, GRAPH_LORA.block_m)
        sample = inputs.logits_index + [0] * (self.max_batch_size - len(inputs.logits_index))
        pending_at, pending_rows = [i for i, _ in inputs.pending], [row for _, row in inputs.pending]
        values = (inputs.input_ids + pad + inputs.positions + pad + inputs.slot_mapping + pad
                  + inputs.decode_lens + pad + order + starts + slots + sample + pending_at + pending_rows)
        # Two staging buffers in turn, so that a step fills one while the copy out of the other, for the step in
        # flight, may still run; the copy out of this one, two fills ago, is done (its event).
        staging = self._staging
        self._staging ^= 1
        if self.staged[staging] is not None:
            self.staged[staging].synchronize()
        ints = self.host_ints[staging][: len(values)]
        tables = self.host_tables[staging][:batch]
        ints.copy_(torch.tensor(values, dtype=torch.long))
        tables.zero_()
        fill_tables(tables, inputs.decode_tables)
        staged = ints.to(self.device, non_blocking=True)
        sizes = ((self.static_ids, batch), (self.static_positions, batch), (self.static_slot_mapping, batch),
                 (self.static_lens, batch), (self.static_order, batch), (self.static_starts, s_cap + 1),
                 (self.static_slots, s_cap), (self.static_sample, self.max_batch_size))
        offset = 0
        for tensor, n in sizes:
            tensor[:n].copy_(staged[offset:offset + n])
            offset += n
        self.static_tables[:batch].copy_(tables, non_blocking=True)
        self.staged[staging] = torch.cuda.Event()
        self.staged[staging].record()
        if inputs.pending:
            n = len(inputs.pending)
            at, rows = staged[offset:offset + n], staged[offset + n:offset + 2 * n]
            self.static_ids.index_copy_(0, at, previous.index_select(0, rows))

    def _segment_cap(self, batch: int) -> int:
        return segment_cap(batch, self.max_batch_size, self.lora.num_slots)

    # --- capture --------------------------------------------------------------------------------

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
        # Host staging for one non-blocking copy per step, two sets used in turn (fill).
        self.host_ints = [torch.zeros(9 * n + 1 + self.max_batch_size, dtype=torch.long, pin_memory=True)
                          for _ in range(2)]
        self.host_tables = [torch.zeros(n, self.max_blocks, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.staged: list[torch.cuda.Event | None] = [None, None]  # each one's copies to the device, recorded
        self._staging = 0

    def _capture_all(self) -> None:
        start = time.perf_counter()
        self._allocate_static()
        self.lora.ctx.overlap = True  # the LoRA shrink beside each GEMM, in the graphs only (app/model/lora.py)
        pool = None
        for batch, lora in [(b, lora) for b in reversed(self.buckets) for lora in (True, False)]:
            graph = DecodeGraph(batch, lora)
            graph.attention_workspace = self._bind_static(batch, lora)
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

    def _bind_static(self, batch: int, lora: bool) -> DecodeWorkspace:
        """Point the attention and LoRA metadata at the static buffers' first `batch` rows; returns the attention
        workspace that the bucket's graph writes into."""
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
                                          self.static_slots[:s_cap], GRAPH_LORA) if lora else None
        return workspace

    def _static_forward(self, batch: int) -> torch.Tensor:
        out = self.decoder(input_ids=self.static_ids[None, :batch],
                           position_ids=self.static_positions[None, :batch], use_cache=False)
        hidden = out.last_hidden_state[0]
        if batch > self.max_batch_size:  # a step that prefills samples at most max_batch_size rows
            hidden = hidden.index_select(0, self.static_sample)
        return self.model.lm_head(hidden)


def segment_cap(batch: int, max_batch_size: int, num_slots: int) -> int:
    """The LoRA segments a bucket's kernels are launched for: one per adapter in the step, which has at most one per
    request and one per slot of the pool, and one more per M tile (`GRAPH_LORA`'s segments hold one tile at most).
    Every segment past the step's own is a program that starts and exits: the fewer, the shorter the launch."""
    return min(batch, min(max_batch_size, num_slots) + -(-batch // GRAPH_LORA.block_m))


def fill_tables(tables: torch.Tensor, rows: list[list[int]]) -> None:
    """Each row's block table into `tables` (zeroed, [>= len(rows), max blocks]). The leading rows, decode rows
    with a table each, go in one copy (a copy per row costs ~8 us of host time, 1 ms at 128 rows); the rows of a
    prefill chunk, which share one table object, in one broadcast copy per chunk."""
    lead = 0
    while lead < len(rows) and (lead + 1 == len(rows) or rows[lead + 1] is not rows[lead]):
        lead += 1
    if lead:
        width = max(map(len, rows[:lead]))
        flat = []
        for table in rows[:lead]:
            flat += table
            flat += [0] * (width - len(table))
        tables[:lead, :width] = torch.tensor(flat, dtype=torch.int32).view(lead, width)
    row = lead
    for _, run in groupby(rows[lead:], key=id):
        run = list(run)
        tables[row: row + len(run), : len(run[0])] = torch.tensor(run[0], dtype=torch.int32)
        row += len(run)
