"""One step's inputs as host-side arrays, built from its plan. Pure Python, no torch: the model runner copies them
to the device, eagerly or into a CUDA graph's static buffers (app/engine/cuda_graphs.py).

Every step's tokens are flattened into one row: decode rows first, one token each, then prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from app.engine.scheduler import StepPlan


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
    # (token index, row): inputs whose token the previous step sampled and has not read back yet; the runner
    # takes them from that step's sampled tokens on the device (input_ids holds PENDING_TOKEN there).
    pending: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, plan: StepPlan, tables: dict[str, list[int]], block_size: int) -> StepInputs:
        """tables: each request's KV block table (BlockManager.tables)."""
        bs = block_size
        inputs = cls([], [], [], [], len(plan.decode), [], [], [], [0], [], [])
        for i, chunk in enumerate(plan.chunks):  # decode rows first
            request, table = chunk.request, tables[chunk.request.request_id]
            first = len(inputs.input_ids)
            inputs.input_ids += request.token_ids(chunk.start, chunk.end)
            known = len(request.prompt_ids) + len(request.output_ids)
            if chunk.end > known:  # only the newest token can be pending: one step is read back at a time
                inputs.pending.append((first + known - chunk.start, request.pending_row))
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
