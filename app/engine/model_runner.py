"""The model runner: turns a step plan into input tensors, runs transformers' model, returns logits.

The only place that knows about CUDA graphs and static buffers: on CUDA a step replays the graph captured at
start-up for the smallest bucket that holds its tokens (app/engine/cuda_graphs.py). Larger steps, and every
step on CPU, run eagerly (through the graphs' compiled decoder where there is one), all of a step's tokens
flattened into one row ([1, T]: decode rows first, then prefill chunks; app/engine/step_inputs.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence

import torch

from app.engine.cuda_graphs import CudaGraphs, DecodeGraph, fill_tables, graph_buckets
from app.engine.kv_blocks import BlockManager
from app.engine.scheduler import StepPlan
from app.engine.step_inputs import StepInputs
from app.model.architectures import check_supported, head_dim
from app.model.attention import (AttentionMetadata, AttentionState, PagedKVCache, install, kernel_supports,
                                 varlen_supports)
from app.model.kernels import attention as attention_kernels
from app.model.kernels import lora as lora_kernels
from app.model.lora import LoRAMetadata, LoRASlots, segments
from app.model.norms import fuse_rms_norms
from app.model.softcap import install_logit_softcap

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model, lora: LoRASlots, blocks: BlockManager, cache: PagedKVCache, max_batch_size: int,
                 max_model_len: int, use_graphs: bool, compile_decode: bool = False, max_graph_tokens: int = 0,
                 workers=None):
        """workers: a tensor-parallel engine's other ranks (app/engine/workers.py's Workers), this runner being
        rank 0's."""
        self.model, self.lora, self.blocks, self.cache = model, lora, blocks, cache
        self.workers = workers
        self.device = next(model.parameters()).device
        config = model.config
        self.arch = check_supported(config)
        self.head_dim = head_dim(config)
        self.use_kernel = kernel_supports(self.head_dim, self.device)
        # One varlen flash call per layer for all prefill chunks, instead of an SDPA call per sequence
        # (host-bound: tens of launches per sequence and layer). VARLEN_PREFILL=0 turns it off (benches).
        self.use_varlen = (self.device.type == "cuda" and varlen_supports(self.arch, config)
                           and os.environ.get("VARLEN_PREFILL", "1") != "0")
        self.attention = AttentionState(cache)
        install(model, self.attention, self.arch)
        install_logit_softcap(model, self.arch.logit_softcap(config))
        # CUDA only: one kernel per RMSNorm (app/model/norms.py), for the x * w convention it computes.
        self.fused_norms = fuse_rms_norms(model) if self.arch.norm == "x*w" else 0
        self.block_size = cache.block_size
        self.max_blocks = -(-max_model_len // self.block_size)
        self.max_batch_size = max_batch_size
        self.cuda_graphs: CudaGraphs | None = None
        if use_graphs and self.device.type == "cuda" and self.use_kernel:
            buckets = graph_buckets(max_batch_size, max_graph_tokens)
            self.cuda_graphs = CudaGraphs(model, self.attention, lora, buckets, max_batch_size, self.max_blocks,
                                          self.block_size, self.head_dim, compile_decode)
        if self.device.type == "cuda":
            self._warm_eager()

    def prepare(self, plan: StepPlan) -> StepInputs:
        return StepInputs.of(plan, self.blocks.tables, self.block_size)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, logits_all: bool = False, extra_rows: Sequence[int] = (),
                previous: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [sampled chunks + len(extra_rows), vocab] (or [T, vocab] with logits_all) for the step; the
        cache is updated. extra_rows: flat token indices (plan.chunks order) whose logits follow the sampled
        rows' (echo's prompt logprobs), so only the requests that ask pay for them. previous: the sampled tokens
        [rows] of the step before, on the device, where that step is not read back yet (StepInputs.pending)."""
        inputs = self.prepare(plan)
        if self.workers is not None:  # tensor parallelism: the other ranks run the same forward on their shards
            self.workers.run(inputs, logits_all, extra_rows)
        return self.run(inputs, logits_all, extra_rows, previous)

    @torch.inference_mode()
    def run(self, inputs: StepInputs, logits_all: bool = False, extra_rows: Sequence[int] = (),
            previous: torch.Tensor | None = None) -> torch.Tensor:
        """execute's forward, from the step's inputs (a tensor-parallel worker runs rank 0's)."""
        if self.cuda_graphs is not None and not logits_all and not extra_rows:
            logits = self.cuda_graphs.replay(inputs, inputs.num_decode > 0 and not inputs.prefill_lens, previous)
            if logits is not None:
                return logits
        hidden = self._forward_eager(inputs, previous)
        if not logits_all:
            hidden = hidden[torch.tensor(inputs.logits_index + list(extra_rows), dtype=torch.long, device=self.device)]
        return self.model.lm_head(hidden)

    def _forward_eager(self, inputs: StepInputs, previous: torch.Tensor | None = None) -> torch.Tensor:
        dev, nd = self.device, inputs.num_decode
        t = lambda values, dtype=torch.long: torch.tensor(values, dtype=dtype, device=dev)  # noqa: E731
        decode_tables = None
        if nd:
            # Full width, as in the graphs: Triton specializes the decode kernel on the table's width and
            # stride, so a width that followed the longest row would compile new variants mid-serving.
            decode_tables = torch.zeros(nd, self.max_blocks, dtype=torch.int32)
            fill_tables(decode_tables, inputs.decode_tables)
            decode_tables = decode_tables.to(dev)
        self.attention.meta = AttentionMetadata(
            slot_mapping=t(inputs.slot_mapping), num_decode=nd, decode_block_tables=decode_tables,
            decode_context_lens=t(inputs.decode_lens, torch.int32) if nd else None, decode_workspace=None,
            prefill_blocks=[t(table) for table in inputs.prefill_tables],
            prefill_query_starts=inputs.prefill_query_starts, prefill_context_lens=inputs.prefill_lens,
            use_kernel=self.use_kernel)
        if inputs.prefill_lens and self.use_varlen:
            self._set_varlen(inputs)
        self._set_lora(inputs.token_slots)
        input_ids = t(inputs.input_ids)
        if inputs.pending:
            at, rows = zip(*inputs.pending)
            input_ids[t(at)] = previous[t(rows)]
        decoder = self.model.model if self.cuda_graphs is None else self.cuda_graphs.decoder
        try:
            out = decoder(input_ids=input_ids[None], position_ids=t(inputs.positions)[None], use_cache=False)
        finally:
            self.attention.meta, self.lora.ctx.meta = None, None
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def _warm_eager(self) -> None:
        """Eager steps at start-up, on the scratch block 0 and slot 0, that make Triton compile every variant
        an eager step can need: the LoRA kernels' two tile configs (decode- and prefill-sized steps), the
        prefill tiles at each count of programs along M that a step's size can give (`prefill_m_programs`), and
        the decode attention at each split count the batch size can give. Compiled in the first requests'
        steps instead, they would stall those requests."""
        start, bs = time.perf_counter(), self.block_size
        steps = [(2, 8), (2, lora_kernels.DECODE_T_MAX + 8)]  # (decode rows, prefill tokens)
        steps += [(0, rows) for m in lora_kernels.PREFILL_M_PROGRAMS[1:]
                  if (rows := lora_kernels.prefill_rows(m)) <= self.lora.t_cap]
        if self.use_kernel:
            kv_heads = self.model.config.num_key_value_heads
            by_splits = {attention_kernels.num_kv_splits(b, kv_heads, self.max_blocks, bs, self.device): b
                         for b in range(1, self.max_batch_size + 1)}
            steps += [(b, 0) for b in by_splits.values()]
        longest = self.max_blocks * bs  # a warm-up prompt is at most as long as the model allows
        for rows, length in steps:
            lengths = [min(longest, length - done) for done in range(0, length, longest)]
            positions = [0] * rows + [p for n in lengths for p in range(n)]
            inputs = StepInputs(input_ids=[0] * len(positions), positions=positions,
                                slot_mapping=[p % bs for p in positions], token_slots=[0] * len(positions),
                                num_decode=rows, decode_tables=[[0]] * rows, decode_lens=[1] * rows,
                                prefill_tables=[[0] * -(-n // bs) for n in lengths],
                                prefill_query_starts=[sum(lengths[:i]) for i in range(len(lengths) + 1)]
                                if lengths else [0],
                                prefill_lens=lengths, logits_index=[len(positions) - 1])
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

    def _set_lora(self, token_slots: list[int]) -> None:
        """The step's LoRA segments, exactly as many as it needs (the kernels' grids scale with the segment count):
        one per adapter, or, where the step's size picks the decode config, one per M tile of each adapter's rows,
        as that config gives a segment one program (on CUDA; the CPU path takes an adapter's rows at once)."""
        if all(slot < 0 for slot in token_slots):
            self.lora.ctx.meta = None
            return
        config = lora_kernels.pick_config(len(token_slots))
        rows = config.block_m if config.m_programs == 1 and self.lora.ctx.use_kernel else None
        order, starts, slots = segments(token_slots, len(token_slots), None, rows)
        if config.m_programs > 1:  # as many programs along M as the longest segment's tiles keep busy
            longest = max(end - begin for begin, end in zip(starts, starts[1:]))
            config = dataclasses.replace(config, m_programs=lora_kernels.prefill_m_programs(longest, config))
        t = lambda values: torch.tensor(values, dtype=torch.int32, device=self.device)  # noqa: E731
        self.lora.ctx.meta = LoRAMetadata(t(order), t(starts), t(slots), config)

    def shutdown(self) -> None:
        if self.workers is not None:
            self.workers.stop()

    # --- what the engine reports of its graphs --------------------------------------------------

    @property
    def graphs(self) -> dict[tuple[int, bool], DecodeGraph]:
        """(batch, lora) -> captured graph; empty where every step runs eagerly."""
        return {} if self.cuda_graphs is None else self.cuda_graphs.graphs

    @property
    def graph_batches(self) -> list[int]:
        return sorted({batch for batch, _ in self.graphs})

    @property
    def compiled(self) -> bool:
        return self.cuda_graphs is not None and self.cuda_graphs.compiled

    @property
    def capture_seconds(self) -> float:
        return 0.0 if self.cuda_graphs is None else self.cuda_graphs.capture_seconds

    @property
    def mixed_replays(self) -> int:
        """Steps that prefill, replayed in a graph."""
        return 0 if self.cuda_graphs is None else self.cuda_graphs.mixed_replays
