"""The replica engine: tiered adapter residency, async prefetch and mixed-adapter continuous batching.

`LLMEngine` is synchronous and single-owner: one thread calls `step()`, and every piece of mutable
state (scheduler, KV blocks, slot pool, pipeline) is touched only from there. `AsyncEngine`
(app/engine/async_engine.py) runs it on a thread and streams results to asyncio callers. The core splits as
nano-vllm's does: app/engine/builder.py builds the engine's parts from its config, the scheduler
(app/engine/scheduler.py) plans each step over the KV block manager (app/engine/kv_blocks.py), the model runner
(app/engine/model_runner.py) runs it (CUDA graphs for decode), the sampler (app/sampling/sampler.py) picks every
row's token on the device, and app/engine/outputs.py turns each token into the request's text, stops and output.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from app.engine import prompt_logits, report
from app.engine.admission import Limits, check_request
from app.engine.builder import EngineParts, build_parts
from app.engine.config import EngineConfig
from app.engine.outputs import append_token, make_output
from app.engine.request import PromptIndex, Request, RequestOutput
from app.engine.scheduler import Scheduler, StepPlan
from app.engine.stall_sampler import StallSampler
from app.engine.step_timing import StepTiming
from app.errors import AdapterInUse, AdapterLoadFailed
from app.sampling.logprobs import EchoRows
from app.sampling.params import SamplingParams
from app.sampling.sampler import ReadbackBuffers, SampledRows, launch_sampling, seed_for
from prefetch.hints import HintBook
from prefetch.metrics import Histogram
from routing.wire import Hint, HintKind, ReplicaStats

STALL_POLL_S = 0.002  # how long one step waits for a loading adapter when nothing else can run
SECONDS_BUCKETS = (  # hint lead and adapter wait histograms
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class InFlight:
    """A step launched on the device and not yet read back: its sampled requests, in row order, its echo rows and
    its sampling."""

    sampled: list[Request]
    echo: EchoRows
    rows: SampledRows
    decode_only: bool
    launched_at: float
    # Its host parts' seconds before the launch (StepTiming), and the engine thread's CPU time over them.
    admit_s: float = 0.0
    launch_s: float = 0.0
    host_cpu_s: float = 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig, parts: EngineParts | None = None):
        """parts: the model, adapter pool, KV cache and runner (app/engine/builder.py); built from config if None."""
        parts = build_parts(config) if parts is None else parts
        self.config = config
        self.device, self.dtype, self.model_config = parts.device, parts.dtype, parts.model_config
        self.tokenizer, self.eos_ids, self.max_model_len = parts.tokenizer, parts.eos_ids, parts.max_model_len
        self.registry, self.grammars, self.lora = parts.registry, parts.grammars, parts.lora
        self.residency, self.blocks, self.runner = parts.residency, parts.blocks, parts.runner
        # The loop's own state is built here, not by the builder: the scheduler calls back into the engine.
        self.scheduler = Scheduler(self.blocks, config.max_batch_size, config.max_prefill_tokens_per_step,
                                   self._acquire, self._release)
        self.requests: dict[str, Request] = {}
        self.prompt_index = PromptIndex(config.block_size)
        self.hints = HintBook(config.hint_ttl_s)  # what the router holds for this replica
        self.hint_lead = Histogram(SECONDS_BUCKETS)
        # From a request's arrival here to its adapter's slot being ready, and the part before that load began.
        self.adapter_wait = Histogram(SECONDS_BUCKETS)
        self.adapter_wait_before_load = Histogram(SECONDS_BUCKETS)
        # From a request's arrival here to its first token, and to its end: with the adapter wait, where a request's
        # time at its replica goes (the router's hints change only the adapter wait directly).
        self.first_token_time = Histogram(SECONDS_BUCKETS)
        self.request_time = Histogram(SECONDS_BUCKETS)
        self.steps = 0
        self.overlapped_steps = 0  # launched while the step before ran, not yet read back
        sampler = StallSampler(threshold_s=config.sample_stalls_ms / 1e3) if config.sample_stalls_ms > 0 else None
        self.timing = StepTiming(sampler=sampler)
        self.invariants = report.InvariantReport()
        self._stalled_since: float | None = None  # when the engine last had nothing it could run
        self._ids = itertools.count()
        self.overlap = config.overlap_steps  # the host prepares and launches a step while the GPU runs the last
        self._in_flight: InFlight | None = None  # the step launched and not yet read back
        self.readback = ReadbackBuffers(config.max_batch_size) if self.device.type == "cuda" else None

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
        limits = Limits.of(self.config, self.model_config.vocab_size, self.max_model_len, self.blocks.capacity_tokens)
        prompt_ids = check_request(prompt, adapter_id, params, self.registry, self.tokenizer, limits,
                                   len(self.waiting))
        # Compiled beside the loop by compile_grammar first, when it comes through an AsyncEngine: a cache hit.
        grammar = None if params.response_format is None else self.grammars.grammar(params.response_format)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, adapter_id, prompt_ids, params, seed_for(params), grammar=grammar)
        self.prompt_index.link(request)
        if adapter_id is not None:
            hinted_at = self.hints.arrived(adapter_id, time.monotonic(), hint_id)
            self.residency.classify_arrival(adapter_id, hinted=hinted_at is not None)
            if hinted_at is not None:
                self.hint_lead.observe(time.monotonic() - hinted_at)
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request

    def compile_grammar(self, spec: str) -> None:
        """Compile a response_format spec into the cache (thread-safe: runs beside the loop, as a big schema at
        a large vocabulary takes long enough to stall steps); InvalidResponseFormat if it does not compile."""
        self.grammars.compile(spec)

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None or request.finish_reason is not None:
            return None
        request.finish_reason = "abort"
        self._finish(request)
        return make_output(request, "", (), error=None)

    def hint(self, hints: Iterable[Hint]) -> None:
        """The router's hints, applied in the order it sent them: adapters to make resident (WAITING) or to fetch
        to the node (AHEAD) ahead of a request, to keep for a request that may spread here (INCOMING), and hints
        whose request went elsewhere (WITHDRAWN). A request that brings a hint's id consumes that hint."""
        now = time.monotonic()
        for hint in hints:
            if hint.kind is HintKind.WITHDRAWN:
                self.hints.withdraw(hint.adapter_id, hint.request_id)
            elif hint.adapter_id not in self.registry:
                continue
            elif hint.kind is HintKind.INCOMING:
                self.hints.add_incoming(hint.adapter_id, now)
            else:
                near = hint.kind is HintKind.WAITING
                self.residency.metrics.count_hint(self.hints.add(hint.adapter_id, now, hint.request_id, near))
        if self.config.prefetch:
            self._prefetch()  # start now: the request may be right behind

    def has_work(self) -> bool:
        return self.has_requests() or self.residency.is_loading()

    def has_requests(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # --- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit, schedule, launch the forward and the sampling, then stream the tokens of the step launched
        before (of this one, where steps do not overlap)."""
        try:
            return self._step()
        except BaseException:
            self._in_flight = None  # its requests fail with the step (AsyncEngine)
            raise
        finally:
            self.timing.mark(None)

    def _step(self) -> list[RequestOutput]:
        self.timing.mark("admit")
        self.steps += 1
        started, cpu_started = time.perf_counter(), time.thread_time()
        outputs = self._admit()
        overlap = self._may_overlap()
        if self._in_flight is not None and not overlap:
            outputs += self._read_back()
        scheduled_at = admitted_at = time.perf_counter()
        cpu_at = time.thread_time()
        host_cpu = cpu_at - cpu_started  # the engine thread's CPU time over the parts timed as the host's
        self.timing.mark("before")
        plan = self.scheduler.schedule()
        if plan.is_empty and self._in_flight is not None:  # what it ends frees rows, blocks and slots: admit again
            outputs += self._read_back()
            outputs += self._admit()
            scheduled_at, cpu_at = time.perf_counter(), time.thread_time()
            plan = self.scheduler.schedule()
        if plan.is_empty and self.waiting:
            outputs += self._stall()
            scheduled_at, cpu_at = time.perf_counter(), time.thread_time()
            plan = self.scheduler.schedule()
        self._end_stall(plan)
        if plan.is_empty:
            return outputs
        launched = self._launch(plan)
        if launched is not None:
            launched.admit_s, launched.launch_s = admitted_at - started, launched.launched_at - scheduled_at
            launched.host_cpu_s = host_cpu + time.thread_time() - cpu_at
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            self.overlapped_steps += 1
            outputs += self._read(previous)
        if not overlap and self._in_flight is not None:  # read back at once
            outputs += self._read_back()
        return outputs

    def _may_overlap(self) -> bool:
        """Can the next step launch before the one in flight is read back? Not where a running request's sampling
        reads its own output (penalties, a grammar's matcher): that needs every token on the host."""
        return self.overlap and not any(r.params.has_penalties or r.grammar is not None for r in self.running)

    def _launch(self, plan: StepPlan) -> InFlight | None:
        """The step's forward and sampling, launched; the tokens it samples are pending on their requests until
        its read-back. None where it samples nothing."""
        logits, echo = self._run(plan)
        sampled = [c.request for c in plan.chunks if c.samples]
        if not sampled and not echo.rows:
            return None
        rows = launch_sampling(logits[:len(sampled)], sampled, sorted(self.eos_ids), echo, logits[len(sampled):],
                               self.readback)
        if sampled and self.overlap and self.runner.workers is not None:  # the workers' pending inputs
            self.runner.workers.share_tokens(rows.tokens)
        for row, request in enumerate(sampled):
            request.pending += 1
            request.pending_row = row
        return InFlight(sampled, echo, rows, plan.is_decode_only, time.perf_counter())

    def _read_back(self) -> list[RequestOutput]:
        in_flight, self._in_flight = self._in_flight, None
        return self._read(in_flight)

    def _read(self, step: InFlight) -> list[RequestOutput]:
        """A launched step's tokens, read back (the step's one host sync: they must reach the client) and
        streamed."""
        self.timing.mark(None)
        waited_from = time.perf_counter()
        choices, prompt_logprobs = step.rows.read()
        synced_at, cpu_at = time.perf_counter(), time.thread_time()
        self.timing.mark("after")
        outputs = self._stream(step, choices, prompt_logprobs)
        self.timing.observe(step.admit_s, step.launch_s, synced_at - waited_from, time.perf_counter() - synced_at,
                            step.decode_only, len(step.sampled), step.host_cpu_s + time.thread_time() - cpu_at)
        return outputs

    def _admit(self) -> list[RequestOutput]:
        """Take in what changed since the last step: adapters that failed to load fail their waiting requests,
        finished loads make their slots usable, and prefetches start for what is wanted next."""
        outputs = self._fail_broken_adapters()
        self.residency.poll()
        if self.config.prefetch:
            self._prefetch()
        return outputs

    def _stall(self) -> list[RequestOutput]:
        """Nothing can run: wait briefly for the head's adapter (its load is under way), then come back, so
        requests that arrive meanwhile are seen within STALL_POLL_S."""
        if self._stalled_since is None:
            self._stalled_since = time.perf_counter()
        self.residency.stall_for(self.waiting[0].adapter_id, STALL_POLL_S)
        return self._fail_broken_adapters()

    def _end_stall(self, plan: StepPlan) -> None:
        if self._stalled_since is not None and (not plan.is_empty or not self.waiting):
            self.residency.metrics.observe_stall(time.perf_counter() - self._stalled_since)
            self._stalled_since = None

    def _run(self, plan: StepPlan) -> tuple[torch.Tensor, EchoRows]:
        """The step's forward: logits of its sampled rows, then of the prompt rows echo's logprobs need."""
        slots = sorted({c.request.slot for c in plan.chunks if c.request.slot is not None})
        self.residency.before_forward(slots)
        echo = EchoRows.of(plan.chunks)  # prompt positions whose logits echo's logprobs need
        previous = None if self._in_flight is None else self._in_flight.rows.tokens
        logits = self.runner.execute(plan, extra_rows=echo.rows, previous=previous)
        self.residency.after_forward(slots)
        for chunk in plan.chunks:
            chunk.request.num_cached = chunk.end
        return logits, echo

    def _stream(self, step: InFlight, choices, prompt_logprobs) -> list[RequestOutput]:
        """Each sampled token into its request's output; requests that it ends finish. A request that ended after
        the step launched (a stop in the step before, an abort) drops its token."""
        for owner, logprob in zip(step.echo.owners, prompt_logprobs):
            owner.prompt_logprobs.append(logprob)
        outputs = []
        for request, (token, logprob) in zip(step.sampled, choices):
            request.pending -= 1
            if request.finish_reason is None:
                outputs.append(append_token(request, token, logprob, self.tokenizer, self.eos_ids,
                                            self.max_model_len))
                if request.finish_reason is not None:
                    self._finish(request)
        return outputs

    def _prefetch(self) -> None:
        """Prefetch for every request that wants an adapter: queued here first, then waiting in the router."""
        self.hints.expire(time.monotonic())
        queued = [r.adapter_id for r in self.waiting if r.adapter_id is not None]
        self.residency.prefetch(queued, self.hints.demand(), self.hints.incoming(), self.hints.ahead())

    def _acquire(self, request: Request) -> bool:
        """Scheduler callback: may `request` start running now? Pins its adapter's slot if so."""
        if request.adapter_id is None:
            return True
        slot = self.residency.acquire(request.adapter_id, may_block=not self.config.prefetch,
                                      steps_left=self._steps_left)
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

    def _steps_left(self, slot: int) -> int:
        """Decode steps until every running request on `slot` ends, at most (max_tokens; stops may come sooner)."""
        return max((r.params.max_tokens - len(r.output_ids) for r in self.running if r.slot == slot), default=0)

    def _finish(self, request: Request) -> None:
        if request.first_token_at is not None:
            self.first_token_time.observe(request.first_token_at - request.arrival)
        self.request_time.observe(time.perf_counter() - request.arrival)
        self.scheduler.remove(request)
        self.requests.pop(request.request_id, None)
        self.prompt_index.forget(request)

    def _fail_broken_adapters(self) -> list[RequestOutput]:
        outputs = []
        for adapter_id, cause in self.residency.take_failures().items():
            # A store's fault keeps its own status (503 with Retry-After); anything else is the adapter's (422).
            kind = type(cause) if isinstance(cause, AdapterLoadFailed) else AdapterLoadFailed
            error = kind(f"adapter {adapter_id!r} could not be loaded: {getattr(cause, 'message', cause)}",
                         retry_after_s=getattr(cause, "retry_after_s", None))
            for request in [r for r in self.waiting if r.adapter_id == adapter_id]:
                request.finish_reason = "error"
                self._finish(request)
                outputs.append(make_output(request, "", (), error=error))
        return outputs

    # --- adapters, introspection ----------------------------------------------------------------

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
        request = Request(f"logits-{next(self._ids)}", adapter_id, self.tokenizer(prompt)["input_ids"],
                          SamplingParams(max_tokens=1))
        if adapter_id is not None:
            self.registry.get(adapter_id)  # AdapterNotFound
        return prompt_logits.outside_batch(request, self.runner, self.blocks, self.residency, self._steps_left,
                                           self._release)

    def check_invariants(self) -> None:
        self.residency.check_invariants()
        self.scheduler.check_invariants()
        slots = self.residency.pool.slots
        pins = [0] * len(slots)
        for request in self.running:
            assert request.finish_reason is None, f"finished {request.request_id} still running"
            if request.adapter_id is not None:
                assert request.slot is not None and slots[request.slot].adapter_id == request.adapter_id, request
                pins[request.slot] += 1
        assert pins == [s.pins for s in slots], f"pins {pins} != pool"
        assert all(r.slot is None for r in self.waiting), "a waiting request holds a slot"

    def routing_stats(self) -> ReplicaStats:
        """What the router needs to know about this replica."""
        return report.routing_stats(self)

    def metrics(self, drain_stalls: bool = False) -> dict:
        """drain_stalls: also return (and forget) the stall durations not yet reported, as "stalls"."""
        return report.metrics(self, drain_stalls)

    def shutdown(self) -> None:
        if self.timing.sampler is not None:
            self.timing.sampler.stop()
        self.residency.shutdown()
        self.registry.shutdown()
        self.runner.shutdown()
