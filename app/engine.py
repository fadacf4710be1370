"""The replica engine: tiered adapter residency, async prefetch and mixed-adapter continuous batching.

`LLMEngine` is synchronous and single-owner: one thread calls `step()`, and every piece of
mutable state (queue, batch, slot pool, pipeline) is touched only from there. `AsyncEngine`
(app/async_engine.py) runs it on a thread and streams results to asyncio callers.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from app.batch import DecodeBatch
from app.config import EngineConfig
from app.errors import AdapterInUse, AdapterLoadFailed, CapacityExceeded, InvalidRequest, PromptTooLong
from app.lora import BASE_ROW, FusedBackend, PeftBackend
from app.registry import AdapterRegistry, read_adapter
from app.request import Request, RequestOutput
from prefetch.residency import Residency
from app.sampling import SamplingParams, make_generator, sample
from app.targets import target_shapes
from prefetch.metrics import Histogram

# cuDNN attention, which torch prefers on Hopper, plans a graph per new sequence length; a decode step's
# KV length grows by one every step, so on the H100 each of the 32 layers spent ~1.9 ms of CPU in planning
# and an 8B decode step took 90-130 ms instead of ~30 (bench/step_profile.py). Flash / memory-efficient
# kernels need no plan. MATH stays last for CPU.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
STALL_POLL_S = 0.002  # how long one step waits for a loading adapter when nothing else can run
HINT_LEAD_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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
        self.residency = Residency(config, shapes, self._read_parts, self.device, self.dtype, self._steps_left)
        layout = self.residency.layout
        if config.backend == "fused":
            self.backend = FusedBackend(model, layout, config.num_slots)
        else:
            self.backend = PeftBackend(model, layout, config.num_slots, config.target_modules)
        self.residency.attach(self.backend.write_slot)
        self.eos_ids = _eos_ids(model, self.tokenizer)
        self.waiting: list[Request] = []
        self.batch = DecodeBatch(model.config, self.device)
        self.requests: dict[str, Request] = {}
        self.hints: OrderedDict[str, float] = OrderedDict()  # adapter_id -> when hinted
        self.hint_lead = Histogram(HINT_LEAD_BUCKETS_S)
        self.steps = 0
        self._stalled_since: float | None = None  # when the engine last had nothing it could run
        self._ids = itertools.count()

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], adapter_id: str | None, params: SamplingParams,
                    request_id: str | None = None) -> Request:
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
        limit = min(self.config.max_input_tokens, self.max_model_len - 1)
        if len(prompt_ids) > limit:
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens; the limit is {limit}")
        if len(prompt_ids) + params.max_tokens > self.config.max_total_tokens:
            raise InvalidRequest(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_total_tokens ({self.config.max_total_tokens})"
            )
        if len(self.waiting) >= self.config.max_queue:
            raise CapacityExceeded(f"the queue holds {len(self.waiting)} requests (max_queue)", retry_after_s=1.0)
        request_id = request_id or f"req-{next(self._ids)}"
        request = Request(request_id, adapter_id, prompt_ids, params, make_generator(params, self.device))
        if adapter_id is not None:
            self.residency.classify_arrival(adapter_id)
            hinted_at = self.hints.pop(adapter_id, None)
            if hinted_at is not None:
                self.hint_lead.observe(time.monotonic() - hinted_at)
        self.waiting.append(request)
        self.requests[request_id] = request
        return request

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None or request.finish_reason is not None:
            return None
        request.finish_reason = "abort"
        if request in self.waiting:
            self.waiting.remove(request)
            del self.requests[request_id]
        else:
            self._retire()
        return self._output(request, "", (), error=None)

    def hint(self, adapter_ids) -> None:
        """Ask for adapters to be made resident ahead of need (the router's hint)."""
        now = time.monotonic()
        for adapter_id in adapter_ids:
            if adapter_id in self.registry:
                self.hints[adapter_id] = now
                self.hints.move_to_end(adapter_id)
                self.residency.metrics.hints_received += 1
        if self.config.prefetch:
            self.residency.prefetch(self._demand())  # start now: the request may be right behind

    def has_work(self) -> bool:
        return bool(self.waiting or self.batch.rows or self.residency.is_loading())

    def has_requests(self) -> bool:
        return bool(self.waiting or self.batch.rows)

    # --- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        outputs = self._fail_broken_adapters()
        self.residency.poll()
        if self.config.prefetch:
            self.residency.prefetch(self._demand())
        admitted = self._admit()
        if not admitted and not self.batch.rows and self.waiting:
            # Nothing can run: wait briefly for the head's adapter (its load is under way), then
            # come back, so requests that arrive meanwhile are seen within STALL_POLL_S.
            if self._stalled_since is None:
                self._stalled_since = time.perf_counter()
            self.residency.stall_for(self.waiting[0].adapter_id, STALL_POLL_S)
            outputs += self._fail_broken_adapters()
            admitted = self._admit()
        if self._stalled_since is not None and (admitted or not self.waiting):
            self.residency.metrics.observe_stall(time.perf_counter() - self._stalled_since)
            self._stalled_since = None
        for request in admitted:
            outputs.append(self._prefill(request))
        if self.batch.rows:
            outputs += self._decode()
        self._retire()
        return outputs

    def _demand(self) -> list[str]:
        now = time.monotonic()
        while self.hints and now - next(iter(self.hints.values())) > self.config.hint_ttl_s:
            self.hints.popitem(last=False)
        queued = [r.adapter_id for r in self.waiting if r.adapter_id is not None]
        return queued + list(reversed(self.hints))

    def _admit(self) -> list[Request]:
        config, admitted = self.config, []
        tokens = sum(r.budget_tokens for r in self.batch.rows)
        prefill_tokens = 0
        for request in list(self.waiting):
            if len(self.batch.rows) + len(admitted) >= config.max_batch_size:
                break
            if tokens + request.budget_tokens > config.max_total_tokens:
                break
            if admitted and prefill_tokens + len(request.prompt_ids) > config.max_prefill_tokens_per_step:
                break
            if request.adapter_id is not None:
                slot = self.residency.acquire(request.adapter_id, may_block=not config.prefetch)
                if slot is None:
                    continue  # deferred: its adapter is not ready; later requests may run
                request.slot = slot
            self.waiting.remove(request)
            admitted.append(request)
            tokens += request.budget_tokens
            prefill_tokens += len(request.prompt_ids)
        return admitted

    def _forward(self, rows: list[Request], **inputs) -> torch.Tensor:
        slots = sorted({r.slot for r in rows if r.slot is not None})
        self.residency.before_forward(slots)
        with torch.inference_mode(), sdpa_kernel(ATTENTION_BACKENDS):
            logits = self.backend.forward([r.slot if r.slot is not None else BASE_ROW for r in rows], **inputs)
        self.residency.after_forward(slots)
        return logits[:, -1]

    def _prefill(self, request: Request) -> RequestOutput:
        ids = torch.tensor([request.prompt_ids], device=self.device)
        cache = DynamicCache(config=self.model_config)
        positions = torch.arange(ids.shape[1], device=self.device)[None]
        logits = self._forward([request], input_ids=ids, position_ids=positions, past_key_values=cache,
                               use_cache=True, logits_to_keep=1)
        request.cache_length = ids.shape[1]
        output = self._append(request, int(self._choose([request], logits)[0]))
        if request.finish_reason is None:
            self.batch.join(request, cache)
        return output

    def _decode(self) -> list[RequestOutput]:
        rows = self.batch.rows
        ids = torch.tensor([[r.output_ids[-1]] for r in rows], device=self.device)
        positions = self.batch.mask.sum(1, keepdim=True)
        mask = torch.nn.functional.pad(self.batch.mask, (0, 1), value=1)
        logits = self._forward(rows, input_ids=ids, attention_mask=mask, position_ids=positions,
                               past_key_values=self.batch.cache, use_cache=True, logits_to_keep=1)
        self.batch.grow()
        return [self._append(r, t) for r, t in zip(rows, self._choose(rows, logits))]

    def _choose(self, rows: list[Request], logits: torch.Tensor) -> list[int]:
        tokens = logits.argmax(-1)
        for i, request in enumerate(rows):
            if not request.params.is_greedy:
                tokens[i] = sample(logits[i], request.params, request.generator)
        return tokens.tolist()  # the step's one host sync: the tokens must reach the client

    def _append(self, request: Request, token: int) -> RequestOutput:
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        request.output_ids.append(token)
        params = request.params
        finish = None
        if token in self.eos_ids and not params.ignore_eos:
            finish = "stop"
        text = self.tokenizer.decode(request.output_ids, skip_special_tokens=True)
        stop_at = request.stop_checker.find(text, request.emitted)
        if stop_at is not None:
            text, finish = text[:stop_at], "stop"
        elif finish is None and (len(request.output_ids) >= params.max_tokens
                                 or request.cache_length + 1 >= self.max_model_len):
            finish = "length"
        end = len(text) if finish else request.stop_checker.safe_end(text)
        delta = text[request.emitted:end]
        request.emitted = max(request.emitted, end)
        request.finish_reason = finish
        return self._output(request, delta, (token,))

    def _output(self, request: Request, text: str, tokens: tuple, error=None) -> RequestOutput:
        return RequestOutput(request.request_id, text, tokens, request.finish_reason is not None,
                             request.finish_reason, len(request.prompt_ids), len(request.output_ids), error)

    def _retire(self) -> None:
        """Drop finished rows from the batch and release their slots."""
        keep = []
        for i, request in enumerate(self.batch.rows):
            if request.finish_reason is None:
                keep.append(i)
            else:
                self._release(request)
        self.batch.keep(keep)
        for request in list(self.requests.values()):
            if request.finish_reason is not None and request not in self.batch.rows:
                self._release(request)

    def _steps_left(self, slot: int) -> int:
        """Decode steps until every running request on `slot` ends, at most (max_tokens; stops may come sooner)."""
        return max((r.params.max_tokens - len(r.output_ids) for r in self.batch.rows if r.slot == slot), default=0)

    def _release(self, request: Request) -> None:
        if request.slot is not None:
            self.residency.release(request.slot)
            request.slot = None
        self.requests.pop(request.request_id, None)

    def _fail_broken_adapters(self) -> list[RequestOutput]:
        outputs = []
        for adapter_id, cause in self.residency.take_failures().items():
            error = AdapterLoadFailed(f"adapter {adapter_id!r} could not be loaded: {cause}")
            for request in [r for r in self.waiting if r.adapter_id == adapter_id]:
                self.waiting.remove(request)
                request.finish_reason = "error"
                self.requests.pop(request.request_id, None)
                outputs.append(self._output(request, "", (), error=error))
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
        self.hints.pop(adapter_id, None)
        return spec

    def prompt_logits(self, prompt: str, adapter_id: str | None = None) -> torch.Tensor:
        """Logits [tokens, vocab] at every prompt position, outside the batch (tests, debugging)."""
        ids = torch.tensor([self.tokenizer(prompt)["input_ids"]], device=self.device)
        slot = None
        if adapter_id is not None:
            self.registry.get(adapter_id)
            while (slot := self.residency.acquire(adapter_id, may_block=True)) is None:
                self.residency.stall_for(adapter_id)
                self.residency.poll()
                if failure := self.residency.take_failures().get(adapter_id):
                    raise AdapterLoadFailed(f"adapter {adapter_id!r} could not be loaded: {failure}")
        try:
            self.residency.before_forward([slot] if slot is not None else [])
            with torch.inference_mode(), sdpa_kernel(ATTENTION_BACKENDS):
                positions = torch.arange(ids.shape[1], device=self.device)[None]
                return self.backend.forward([slot], input_ids=ids, position_ids=positions)[0].float().cpu()
        finally:
            if slot is not None:
                self.residency.release(slot)

    def check_invariants(self) -> None:
        self.residency.check_invariants()
        pins = [0] * self.config.num_slots
        for request in self.batch.rows:
            assert request.finish_reason is None, f"finished {request.request_id} still in the batch"
            if request.adapter_id is not None:
                assert request.slot is not None and self.residency.pool.slots[request.slot].adapter_id == request.adapter_id
                pins[request.slot] += 1
        assert pins == [s.pins for s in self.residency.pool.slots], f"pins {pins} != pool"
        assert all(r.slot is None for r in self.waiting), "a waiting request holds a slot"
        assert self.batch.mask.shape[0] == len(self.batch.rows)

    def routing_stats(self) -> dict:
        """What the router needs to know about this replica."""
        snapshot = self.residency.snapshot()
        try:
            self.check_invariants()
            invariants = "ok"
        except AssertionError as e:
            invariants = f"violated: {e}"
        return {
            "invariants": invariants,
            "pinned_slots": snapshot["slots_pinned"],
            "host_cache_bytes": snapshot["host_cache_bytes"],
            "resident": snapshot["resident_adapters"],
            "loading": snapshot["loading_adapters"],
            "queued": sorted({r.adapter_id for r in self.waiting if r.adapter_id is not None}),
            "running": len(self.batch.rows),
            "waiting": len(self.waiting),
            "free_slots": self.residency.pool.free_count(),
            "device": str(self.device),
            "arrivals": {k: snapshot[k] for k in ("hint_hits", "inflight_hits", "misses", "hints_received")},
            "hint_lead_seconds": self.hint_lead.as_dict(),
        }

    def metrics(self) -> dict:
        return {
            "steps": self.steps,
            "queue_length": len(self.waiting),
            "batch_size": len(self.batch.rows),
            "hint_lead_seconds": self.hint_lead.as_dict(),
            **self.residency.snapshot(),
        }

    def shutdown(self) -> None:
        self.residency.shutdown()


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id if model.generation_config else None
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
