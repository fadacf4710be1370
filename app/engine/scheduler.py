"""The step scheduler: which requests feed which tokens this step. Pure Python, no torch.

Every running request is a sequence of token ids (prompt, then output) of which the first `num_cached`
are in the KV cache. A step feeds each scheduled request a chunk `ids[num_cached : num_cached + n]`;
when the chunk reaches the end of the sequence, the step samples the request's next token.
- A decode row feeds its one newest token. Every decode row runs every step.
- Prefill chunks (new requests, long prompts split into pieces, preempted requests re-reading their
  tokens) share a per-step token budget, so a long prompt never freezes the decode rows for its whole
  prefill: a step with prefill work also decodes every running row (Sarathi-style mixed steps).
- KV blocks are taken as chunks need them. When a running request needs a block and none is free, the
  youngest running request is preempted: its blocks are freed and it waits at the head of the
  queue to recompute its tokens later (vLLM's recompute preemption).
- A request with a `prefix_source` (another request with the same prompt and adapter, e.g. an earlier
  choice of the same API request) waits until that source has cached its first `prefix_tokens` prompt
  tokens (whole blocks), then starts from those blocks, shared, and prefills only the rest: the n
  choices of a prompt prefill it once. If the source ends first, the request prefills alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from app.engine.kv_blocks import BlockManager


class Sequence(Protocol):
    request_id: str
    num_cached: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def has_all_tokens(self) -> bool:
        """Its last token is sampled (by a step not yet read back): nothing is left to feed it."""


@dataclass(frozen=True)
class Chunk:
    request: Sequence
    start: int  # first position fed (tokens before it are cached)
    length: int  # tokens fed this step

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def samples(self) -> bool:
        """Does this chunk finish the sequence, so the step samples a token for it?"""
        return self.end == self.request.num_tokens


@dataclass
class StepPlan:
    decode: list[Chunk] = field(default_factory=list)  # one token each
    prefill: list[Chunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def chunks(self) -> list[Chunk]:
        """Decode rows first, then prefill chunks: the order of the step's tokens."""
        return self.decode + self.prefill

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def is_decode_only(self) -> bool:
        return bool(self.decode) and not self.prefill


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, max_tokens_per_step: int,
                 acquire: Callable[[Sequence], bool], release: Callable[[Sequence], None]):
        """acquire(request) -> whether it may run now (its adapter slot is pinned); release undoes it."""
        self.blocks = blocks
        self.max_batch_size = max_batch_size
        self.max_tokens_per_step = max_tokens_per_step
        self._acquire, self._release = acquire, release
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in admission order: the last is the youngest
        self.preemptions = 0
        self.shared_prefix_tokens = 0  # prompt tokens requests started from a sibling's blocks

    def add(self, request: Sequence) -> None:
        self.waiting.append(request)

    def remove(self, request: Sequence) -> None:
        """A request ended (finished, aborted, failed): free what it holds."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
            self._release(request)
        self.blocks.release(request.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        decoding = [r for r in self.running if r.num_tokens - r.num_cached == 1 and not r.has_all_tokens]
        for request in decoding:
            if request not in self.running:  # preempted for an older row earlier in this loop
                continue
            if not self._make_room(request, request.num_tokens, plan):
                continue
            plan.decode.append(Chunk(request, request.num_cached, 1))
        budget = self.max_tokens_per_step
        for request in [r for r in self.running if r.num_tokens - r.num_cached > 1]:
            if budget <= 0:
                break
            if request in self.running:  # not preempted by an older one in this loop
                budget -= self._schedule_prefill(request, budget, plan, may_preempt=True)
        for request in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_batch_size:
                break
            shared = self._shared_prefix(request)
            if shared is None:
                continue  # its prefix source is still prefilling the same prompt
            if shared:
                self.blocks.share(request.request_id, request.prefix_source.request_id,
                                  shared // self.blocks.block_size)
                request.num_cached = shared
            if not self._can_admit(request, budget):
                self._unshare(request, shared)
                break  # first come, first served for KV space: later requests do not overtake
            if not self._acquire(request):
                self._unshare(request, shared)
                continue  # its adapter is not ready; later requests may run meanwhile
            if shared:
                request.prefix_source = None
                self.shared_prefix_tokens += shared
            self.waiting.remove(request)
            self.running.append(request)
            budget -= self._schedule_prefill(request, budget, plan)
        return plan

    def _shared_prefix(self, request: Sequence) -> int | None:
        """Prompt tokens `request` can start from, cached in its prefix source's blocks; None: wait for the
        source, which is still on its way to caching them."""
        source = getattr(request, "prefix_source", None)
        if source is None or request.num_cached:
            return 0
        if source in self.running:
            return request.prefix_tokens if source.num_cached >= request.prefix_tokens else None
        if source in self.waiting:
            return None
        request.prefix_source = None  # the source ended: prefill alone
        return 0

    def _unshare(self, request: Sequence, shared: int) -> None:
        if shared:
            self.blocks.release(request.request_id)
            request.num_cached = 0

    def _can_admit(self, request: Sequence, budget: int) -> bool:
        first = min(request.num_tokens - request.num_cached, budget)
        # Keep one block per running row in reserve, so admitting does not force the next decode
        # steps to preempt at once.
        return self.blocks.can_allocate(request.request_id, request.num_cached + first, reserve=len(self.running))

    def _schedule_prefill(self, request: Sequence, budget: int, plan: StepPlan, may_preempt: bool = False) -> int:
        """Schedule the next chunk of `request`, as long as the budget and the free blocks allow.

        may_preempt: a running request that gets no block at all preempts younger ones, so requests
        stuck mid-prefill with the cache full cannot wait on each other forever (the oldest goes on)."""
        length = min(request.num_tokens - request.num_cached, budget, self._room(request))
        if length <= 0:
            if not may_preempt or not self._make_room(request, request.num_cached + 1, plan):
                return 0
            length = min(request.num_tokens - request.num_cached, budget, self._room(request))
        self.blocks.allocate(request.request_id, request.num_cached + length)
        plan.prefill.append(Chunk(request, request.num_cached, length))
        return length

    def _room(self, request: Sequence) -> int:
        """Tokens `request` could add with its blocks and every free one."""
        have = len(self.blocks.tables.get(request.request_id, ()))
        return (have + self.blocks.free_count()) * self.blocks.block_size - request.num_cached

    def _make_room(self, request: Sequence, tokens: int, plan: StepPlan) -> bool:
        """Allocate KV for `tokens` tokens of `request`, preempting younger requests; False if it was
        the youngest and was preempted itself."""
        while not self.blocks.can_allocate(request.request_id, tokens):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        self.blocks.allocate(request.request_id, tokens)
        return True

    def _preempt(self, request: Sequence, plan: StepPlan) -> None:
        self.running.remove(request)
        self._release(request)
        self.blocks.release(request.request_id)
        request.num_cached = 0
        self.waiting.insert(0, request)
        plan.decode = [c for c in plan.decode if c.request is not request]
        plan.prefill = [c for c in plan.prefill if c.request is not request]
        plan.preempted.append(request)
        self.preemptions += 1

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        assert not set(map(id, self.running)) & set(map(id, self.waiting)), "a request both runs and waits"
        assert len(self.running) <= self.max_batch_size, f"{len(self.running)} rows > {self.max_batch_size}"
        for request in self.running:
            table = self.blocks.tables.get(request.request_id, [])
            assert len(table) * self.blocks.block_size >= request.num_cached, f"{request.request_id} lost KV"
        for request in self.waiting:
            assert request.request_id not in self.blocks.tables, f"waiting {request.request_id} holds blocks"
