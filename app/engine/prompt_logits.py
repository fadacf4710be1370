"""One prompt's logits at every position, computed outside the batch (tests, debugging)."""

from __future__ import annotations

from typing import Callable

import torch

from app.engine.kv_blocks import BlockManager
from app.engine.model_runner import ModelRunner
from app.engine.request import Request
from app.engine.scheduler import Chunk, StepPlan
from app.errors import AdapterLoadFailed, CapacityExceeded
from prefetch.residency import Residency


def outside_batch(request: Request, runner: ModelRunner, blocks: BlockManager, residency: Residency,
                  steps_left: Callable[[int], int], release: Callable[[Request], None]) -> torch.Tensor:
    """Logits [tokens, vocab] of `request`'s prompt, its adapter (registered) made resident first, waiting as long
    as that takes; its KV blocks are taken for the forward only. steps_left: as Residency.acquire takes it;
    release(request) unpins the slot a request holds, as for the scheduler."""
    adapter_id = request.adapter_id
    if adapter_id is not None:
        while (slot := residency.acquire(adapter_id, may_block=True, steps_left=steps_left)) is None:
            residency.stall_for(adapter_id)
            residency.poll()
            if failure := residency.take_failures().get(adapter_id):
                raise AdapterLoadFailed(f"adapter {adapter_id!r} could not be loaded: {failure}")
        request.slot = slot
    n = request.num_tokens
    if not blocks.can_allocate(request.request_id, n):
        release(request)
        raise CapacityExceeded(f"the KV cache has no room for {n} tokens now", retry_after_s=1.0)
    blocks.allocate(request.request_id, n)
    try:
        residency.before_forward([request.slot] if request.slot is not None else [])
        return runner.execute(StepPlan(prefill=[Chunk(request, 0, n)]), logits_all=True).float().cpu()
    finally:
        blocks.release(request.request_id)
        release(request)

