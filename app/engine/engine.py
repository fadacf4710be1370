"""The replica engine: tiered adapter residency, async prefetch and mixed-adapter continuous batching.

`LLMEngine` is synchronous and single-owner: one thread calls `step()`, and every piece of mutable
state (scheduler, KV blocks, slot pool, pipeline) is touched only from there. `AsyncEngine`
(app/engine/async_engine.py) runs it on a thread and streams results to asyncio callers. The core splits as
nano-vllm's does: the scheduler (app/engine/scheduler.py) plans each step over the KV block manager
(app/engine/kv_blocks.py), the model runner (app/engine/model_runner.py) runs it (CUDA graphs for decode), the
sampler (app/sampling/sampler.py) picks every row's token on the device, and app/engine/outputs.py turns each token into
the request's text, stops and output.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.model.attention import PagedKVCache, kv_cache_blocks
from app.engine import report
from app.engine.config import EngineConfig
from app.errors import AdapterInUse, AdapterLoadFailed, CapacityExceeded, InvalidRequest, PromptTooLong
from app.engine.kv_blocks import BlockManager
from app.model.lora import LoRASlots, pool_size
from app.engine.model_runner import ModelRunner
from app.engine.outputs import append_token, make_output
from app.adapters.registry import AdapterRegistry, read_adapter
from app.engine.request import Request, RequestOutput
from app.sampling.logprobs import EchoRows
from app.sampling.sampler import sample_batch, seed_for
from app.sampling.params import SamplingParams
from app.engine.scheduler import Scheduler, StepPlan
from app.engine.step_timing import StepTiming
from app.sampling.structured import GrammarCompiler
from app.adapters.targets import target_shapes
from prefetch.hints import HintBook
from prefetch.layout import PageLayout
from prefetch.metrics import Histogram
from prefetch.residency import Residency
from prefetch.slot_pool import SlotPool

log = logging.getLogger(__name__)
STALL_POLL_S = 0.002  # how long one step waits for a loading adapter when nothing else can run
SECONDS_BUCKETS = (  # hint lead and adapter wait histograms
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.base_model)
        model = AutoModelForCausalLM.from_pretrained(config.base_model, dtype=self.dtype).to(self.device).eval()
        self.model_config = model.config
        self.max_model_len = model.config.max_position_embeddings
        shapes = {m: s for m, s in target_shapes(model.config).items() if m.rsplit(".", 1)[1] in config.target_modules}
        self.registry = AdapterRegistry(
            config.adapter_roots, model.config, config.max_rank, config.max_adapter_bytes, config.target_modules
        )
        # The adapter pool is sized (and allocated) before the KV cache, which takes a share of what is left.
        layout = PageLayout(shapes, config.max_rank, config.adapter_page_rows)
        num_pages, num_slots = pool_size(config, layout, self.dtype, self.device)
        self.residency = Residency(config, layout, SlotPool(num_pages, num_slots), self._read_parts,
                                   lambda adapter_id: self.registry.get(adapter_id).rank, self.device, self.dtype,
                                   self._steps_left)
        # A step feeds at most the prefill budget plus one token per decode row; prompt_logits feeds a whole prompt.
        max_step_tokens = max(max(config.max_prefill_tokens_per_step, config.max_input_tokens) + config.max_batch_size,
                              config.max_graph_tokens)  # a graph bucket's padded rows too
        self.lora = LoRASlots(model, layout, num_pages, num_slots, t_cap=max_step_tokens)
        self.residency.attach(self.lora.write_slot)
        self.blocks = BlockManager(kv_cache_blocks(config, model.config, self.dtype, self.device, self.max_model_len),
                                   config.block_size)
        cache = PagedKVCache.for_model(model.config, self.blocks.num_blocks, config.block_size, self.dtype, self.device)
        self.scheduler = Scheduler(self.blocks, config.max_batch_size, config.max_prefill_tokens_per_step,
                                   self._acquire, self._release)
        self.runner = ModelRunner(model, self.lora, self.blocks, cache, config.max_batch_size, self.max_model_len,
                                  use_graphs=config.cuda_graphs, compile_decode=config.compile_decode,
                                  max_graph_tokens=config.max_graph_tokens)
        log.info("KV cache: %d blocks of %d tokens (%.2f GB); adapter pool: %d pages, up to %d adapters (%.2f GB); "
                 "decode graphs: %s", self.blocks.num_blocks, config.block_size,
                 cache.k.numel() * cache.k.element_size() * 2 / 1e9, num_pages, num_slots, self.lora.nbytes() / 1e9,
                 self.runner.graph_batches or "none")
        self.eos_ids = _eos_ids(model, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, model.config.vocab_size, self.eos_ids)
        self.requests: dict[str, Request] = {}
        self._by_prompt: dict[tuple, Request] = {}  # (adapter, prompt ids) -> the latest live request with them
        self.hints = HintBook(config.hint_ttl_s)  # what the router holds for this replica
        self.hint_lead = Histogram(SECONDS_BUCKETS)
        # From a request's arrival here to its adapter's slot being ready for it, and the part of that before its
        # adapter's load began (no slot for it yet; a read into the host cache may run meanwhile).
        self.adapter_wait = Histogram(SECONDS_BUCKETS)
        self.adapter_wait_before_load = Histogram(SECONDS_BUCKETS)
        # From a request's arrival here to its first token, and to its end: with the adapter wait, where a request's
        # time at its replica goes (the router's hints change only the adapter wait directly).
        self.first_token_time = Histogram(SECONDS_BUCKETS)
        self.request_time = Histogram(SECONDS_BUCKETS)
        self.steps = 0
        self.timing = StepTiming()
        self.invariants = report.InvariantReport()
        self._stalled_since: float | None = None  # when the engine last had nothing it could run
        self._ids = itertools.count()

    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], adapter_id: str | None, params: SamplingParams,
                    request_id: str | None = None, hint_id: str | None = None) -> Request:
        """hint_id: the id the router's hint for this request carries (its Serve request id), if any."""
        if adapter_id is not None:
            self.registry.get(adapter_id)  # AdapterNotFound
        if isinstance(prompt, list):
            prompt_ids = list(prompt)
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
                raise InvalidRequest(f"token ids must be integers in [0, {vocab})")
        else:
            try:
                prompt_ids = self.tokenizer(prompt)["input_ids"]
            except Exception as e:  # e.g. lone surrogates the tokenizer cannot encode
                raise InvalidRequest(f"the prompt could not be tokenized: {e}") from e
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        params.token_ids_in(self.model_config.vocab_size)
        limit = min(self.config.max_input_tokens, self.max_model_len - 1)
        if len(prompt_ids) > limit:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; the limit is {limit}")
        capacity = self.blocks.capacity_tokens
        if len(prompt_ids) + params.max_tokens - 1 > capacity:  # the last token is sampled, never cached
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the KV cache of "
                f"this replica ({capacity} tokens); lower max_tokens"
            )
        if len(self.waiting) >= self.config.max_queue:
            raise CapacityExceeded(f"the queue holds {len(self.waiting)} requests (max_queue)", retry_after_s=1.0)
        # Compiled beside the loop by compile_grammar first, when it comes through an AsyncEngine: a cache hit.
        grammar = None if params.response_format is None else self.grammars.grammar(params.response_format)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, adapter_id, prompt_ids, params, seed_for(params), grammar=grammar)
        self._link_prefix(request)
        if adapter_id is not None:
            hinted_at = self.hints.arrived(adapter_id, time.monotonic(), hint_id)
            self.residency.classify_arrival(adapter_id, hinted=hinted_at is not None)
            if hinted_at is not None:
                self.hint_lead.observe(time.monotonic() - hinted_at)
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request

    def _link_prefix(self, request: Request) -> None:
        """Point `request` at the latest live request with the same adapter and prompt, so that it starts from
        that one's cached prompt blocks: the n choices of a prompt (and identical prompts) prefill it once.
        A request that wants its prompt's logprobs (echo) computes them itself."""
        key = (request.adapter_id, tuple(request.prompt_ids))
        source = self._by_prompt.get(key)
        tokens = (len(request.prompt_ids) - 1) // self.config.block_size * self.config.block_size
        if source is not None and source.finish_reason is None and tokens and request.params.prompt_logprobs is None:
            request.prefix_source, request.prefix_tokens = source, tokens
        self._by_prompt[key] = request

    def compile_grammar(self, spec: str) -> None:
        """Compile a response_format spec into the cache (thread-safe: runs beside the loop, as a big schema at
        a 128k vocabulary takes up to a second); InvalidResponseFormat if it does not compile."""
        self.grammars.compile(spec)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None or request.finish_reason is not None:
            return None
        request.finish_reason = "abort"
        self._finish(request)
        return make_output(request, "", (), error=None)

    def hint(self, adapter_ids, incoming=(), withdrawn=(), hint_ids=None, withdrawn_ids=None) -> None:
        """Ask for adapters to be made resident ahead of need (the router's hint): one entry per request
        waiting in the router for this replica. incoming: adapters of requests waiting at another replica
        that may be sent here; they are protected from eviction for a one-off. withdrawn: one entry per
        hinted request that went to another replica after all. hint_ids, withdrawn_ids: the request id of each
        entry of adapter_ids and withdrawn (None: no ids); a request that brings the same id consumes its hint."""
        now = time.monotonic()
        for adapter_id, hint_id in zip(adapter_ids, hint_ids or [None] * len(adapter_ids)):
            if adapter_id in self.registry:
                outcome = self.hints.add(adapter_id, now, hint_id)
                if outcome == "duplicate":
                    self.residency.metrics.hints_duplicate += 1
                    continue
                self.residency.metrics.hints_received += 1
                if outcome == "late":
                    self.residency.metrics.hints_late += 1
        for adapter_id, hint_id in zip(withdrawn, withdrawn_ids or [None] * len(withdrawn)):
            self.hints.withdraw(adapter_id, hint_id)  # after the adds: a hint and its withdrawal may come together
        for adapter_id in incoming:
            if adapter_id in self.registry:
                self.hints.add_incoming(adapter_id, now)
        if self.config.prefetch:
            self._prefetch()  # start now: the request may be right behind

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.residency.is_loading()

    def has_requests(self) -> bool:
        return self.scheduler.has_work()

    # --- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        outputs = self._fail_broken_adapters()
        self.residency.poll()
        if self.config.prefetch:
            self._prefetch()
        scheduled_at = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan.is_empty and self.waiting:
            # Nothing can run: wait briefly for the head's adapter (its load is under way), then come
            # back, so requests that arrive meanwhile are seen within STALL_POLL_S.
            if self._stalled_since is None:
                self._stalled_since = time.perf_counter()
            self.residency.stall_for(self.waiting[0].adapter_id, STALL_POLL_S)
            outputs += self._fail_broken_adapters()
            scheduled_at = time.perf_counter()
            plan = self.scheduler.schedule()
        if self._stalled_since is not None and (not plan.is_empty or not self.waiting):
            self.residency.metrics.observe_stall(time.perf_counter() - self._stalled_since)
            self._stalled_since = None
        if not plan.is_empty:
            outputs += self._run(plan, scheduled_at)
        return outputs

    def _run(self, plan: StepPlan, scheduled_at: float) -> list[RequestOutput]:
        slots = sorted({c.request.slot for c in plan.chunks if c.request.slot is not None})
        self.residency.before_forward(slots)
        echo = EchoRows.of(plan.chunks)  # prompt positions whose logits echo's logprobs need
        logits = self.runner.execute(plan, extra_rows=echo.rows)
        launched_at = time.perf_counter()
        self.residency.after_forward(slots)
        for chunk in plan.chunks:
            chunk.request.num_cached = chunk.end
        sampled = [c.request for c in plan.chunks if c.samples]
        if not sampled and not echo.rows:
            return []
        # The step's one host sync: the tokens (and any logprobs) must reach the client.
        choices, prompt_logprobs = sample_batch(logits[:len(sampled)], sampled, sorted(self.eos_ids), echo,
                                                logits[len(sampled):])
        synced_at = time.perf_counter()
        for owner, logprob in zip(echo.owners, prompt_logprobs):
            owner.prompt_logprobs.append(logprob)
        outputs = [append_token(r, t, lp, self.tokenizer, self.eos_ids, self.max_model_len)
                   for r, (t, lp) in zip(sampled, choices)]
        for request in sampled:
            if request.finish_reason is not None:
                self._finish(request)
        self.timing.observe(launched_at - scheduled_at, synced_at - launched_at, time.perf_counter() - synced_at,
                            plan.is_decode_only)
        return outputs

    def _prefetch(self) -> None:
        """Prefetch for every request that wants an adapter: queued here first, then waiting in the router."""
        self.hints.expire(time.monotonic())
        queued = [r.adapter_id for r in self.waiting if r.adapter_id is not None]
        self.residency.prefetch(queued, self.hints.demand(), self.hints.incoming())

    def _acquire(self, request: Request) -> bool:
        """Scheduler callback: may `request` start running now? Pins its adapter's slot if so."""
        if request.adapter_id is None:
            return True
        slot = self.residency.acquire(request.adapter_id, may_block=not self.config.prefetch)
        if slot is None:
            return False  # deferred: its adapter is not ready
        request.slot = slot
        if not request.adapter_waited:
            request.adapter_waited = True
            waited = time.perf_counter() - request.arrival
            began = self.residency.load_started_at(slot) or request.arrival
            self.adapter_wait.observe(waited)
            self.adapter_wait_before_load.observe(min(waited, max(0.0, began - request.arrival)))
        return True

    def _release(self, request: Request) -> None:
        if request.slot is not None:
            self.residency.release(request.slot)
            request.slot = None

    def _finish(self, request: Request) -> None:
        if request.first_token_at is not None:
            self.first_token_time.observe(request.first_token_at - request.arrival)
        self.request_time.observe(time.perf_counter() - request.arrival)
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)
        key = (request.adapter_id, tuple(request.prompt_ids))
        if self._by_prompt.get(key) is request:
            del self._by_prompt[key]

    def _steps_left(self, slot: int) -> int:
        """Decode steps until every running request on `slot` ends, at most (max_tokens; stops may come sooner)."""
        return max((r.params.max_tokens - len(r.output_ids) for r in self.running if r.slot == slot), default=0)

    def _fail_broken_adapters(self) -> list[RequestOutput]:
        outputs = []
        for adapter_id, cause in self.residency.take_failures().items():
            error = AdapterLoadFailed(f"adapter {adapter_id!r} could not be loaded: {cause}")
            for request in [r for r in self.waiting if r.adapter_id == adapter_id]:
                request.finish_reason = "error"
                self._finish(request)
                outputs.append(make_output(request, "", (), error=error))
        return outputs

    # --- adapters, introspection ----------------------------------------------------------------

    def _read_parts(self, adapter_id: str):
        # Worker thread. The residency bound-checks the packed weights (NaN/Inf included), so the
        # registry's own NaN scan would only read every byte a second time.
        return read_adapter(self.registry.get(adapter_id), check_finite=False).flat_parts()

    def register_adapter(self, adapter_id: str, path: str):
        return self.registry.register(adapter_id, path)

    def unregister_adapter(self, adapter_id: str):
        users = [r for r in self.requests.values() if r.adapter_id == adapter_id and r.finish_reason is None]
        if users:
            raise AdapterInUse(f"adapter {adapter_id!r} is used by {len(users)} running or queued requests; "
                               "retry when they finish")
        spec = self.registry.unregister(adapter_id)
        self.residency.forget(adapter_id)
        self.hints.forget(adapter_id)
        return spec

    def prompt_logits(self, prompt: str, adapter_id: str | None = None) -> torch.Tensor:
        """Logits [tokens, vocab] at every prompt position, outside the batch (tests, debugging)."""
        return report.prompt_logits(self, prompt, adapter_id)

    def check_invariants(self) -> None:
        self.residency.check_invariants()
        self.scheduler.check_invariants()
        pins = [0] * len(self.residency.pool)
        for request in self.running:
            assert request.finish_reason is None, f"finished {request.request_id} still running"
            if request.adapter_id is not None:
                assert request.slot is not None and self.residency.pool.slots[request.slot].adapter_id == request.adapter_id
                pins[request.slot] += 1
        assert pins == [s.pins for s in self.residency.pool.slots], f"pins {pins} != pool"
        assert all(r.slot is None for r in self.waiting), "a waiting request holds a slot"

    def routing_stats(self) -> dict:
        """What the router needs to know about this replica."""
        return report.routing_stats(self)

    def metrics(self, drain_stalls: bool = False) -> dict:
        """drain_stalls: also return (and forget) the stall durations not yet reported, as "stalls"."""
        return report.metrics(self, drain_stalls)

    def shutdown(self) -> None:
        self.residency.shutdown()


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id if model.generation_config else None
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
