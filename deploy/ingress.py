"""OpenAI-compatible HTTP ingress (FastAPI through serve.ingress)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.actor import ActorHandle
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle
from transformers import AutoConfig, AutoTokenizer

from app.adapters.registry import AdapterRegistry, validate_adapter_id
from app.api import responses
from app.api.fanout import merge_chunks
from app.api import schemas as api
from app.api.wire import ErrorReply, GenerateCall
from app.engine.registry_mirror import refused_error
from app.errors import (AdapterAlreadyExists, AdapterNotFound, CapacityExceeded, EngineUnavailable, Forbidden,
                        InvalidRequest, ModelNotFound)
from deploy import metrics
from deploy.args import AppArgs
from deploy.haproxy import HAPROXY_ENV
from deploy.http_edge import RequestGuard, error_response, install_error_handlers
from deploy.replica_health import ReplicaHealth
from deploy.state import REPLICA_DEPLOYMENT, find_router_state

log = logging.getLogger("ray.serve")
REPLICA_DEATH_RETRIES = 1
REPLICA_WAIT_CHECK_S = 1.0  # waiting this long for a replica's first answer, ask Serve whether any can start
REPLICA_FAILED_RETRY_AFTER_S = 10
REGISTRY_SYNC_TIMEOUT_S = 5.0  # below _call_state's 10 s
fastapi_app = FastAPI(title="lora-serve", description="OpenAI-compatible multi-LoRA serving on Ray Serve.")


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


install_error_handlers(fastapi_app)


@serve.ingress(fastapi_app)
class Ingress:
    def __init__(self, replicas: DeploymentHandle, args: dict):
        self.args = AppArgs(**args)
        # By value: each call goes straight to the replica's gRPC server instead of Ray's actor calls.
        self.replicas = replicas.options(_by_reference=self.args.replica_transport == "actor")
        self.stream_handle = self.replicas.options(stream=True, method_name="stream")  # made once, not per request
        self.model_id = self.args.served_model_id
        self.tokenizer = AutoTokenizer.from_pretrained(self.args.base_model)
        base_config = AutoConfig.from_pretrained(self.args.base_model)
        self.vocab_size = base_config.vocab_size
        self.validator = AdapterRegistry(self.args.adapter_roots, base_config, self.args.max_rank,
                                         self.args.max_adapter_bytes, fetch_timeout_s=self.args.adapter_fetch_timeout_s)
        self.adapters: dict[str, str] = {}  # the router actor's registry, as last read (on demand)
        self.refused: dict[str, str] = {}  # its adapters that every replica refused, with a reason, as last read
        context = serve.get_replica_context()
        self.app_name, self.code_version = context.app_name, context.code_version
        self._router_state: ActorHandle | None = None
        self.replica_health = ReplicaHealth(self.app_name, REPLICA_DEPLOYMENT)
        self.in_flight = 0
        # Registered on the shared app object, hence here with the args rather than at import.
        fastapi_app.add_middleware(RequestGuard, api_key=self.args.api_key, max_body_bytes=self.args.max_body_bytes)
        if os.environ.get(HAPROXY_ENV) != "1":
            log.info("HTTP comes through Serve's proxy; start Ray with %s=1 (as `make serve` does) for HAProxy "
                     "straight to this ingress, less TTFT", HAPROXY_ENV)

    # --- models and adapters --------------------------------------------------------------------

    async def _state(self) -> ActorHandle:
        """The router actor, looked up again after a call to it fails (Serve recreates it)."""
        if self._router_state is None:
            try:
                self._router_state = await asyncio.to_thread(find_router_state, self.app_name, self.code_version)
            except ValueError as e:
                raise EngineUnavailable("the router actor is not available; retry shortly", retry_after_s=1) from e
        return self._router_state

    async def _call_state(self, method: str, *args):
        actor = await self._state()
        try:
            return await asyncio.wait_for(getattr(actor, method).remote(*args), timeout=10)
        except (RayActorError, ValueError, asyncio.TimeoutError) as e:
            self._router_state = None
            raise EngineUnavailable(f"the router actor is restarting ({type(e).__name__}); retry shortly",
                                    retry_after_s=1) from e

    async def _refresh_adapters(self) -> None:
        try:
            snapshot = await self._call_state("adapters_snapshot")
            # The previous code version's actor, during a rolling update, reports no refusals.
            self.adapters, self.refused = snapshot["adapters"], snapshot.get("refused", {})
        except EngineUnavailable as e:
            log.info("adapter registry unavailable, using the cached one: %s", e)

    async def _resolve_model(self, model: str) -> str | None:
        if model == self.model_id:
            return None
        if any(c in model for c in ("/", "\x00")) or ".." in model:
            raise ModelNotFound(f"model {model!r} does not exist (names cannot contain '/', '..' or NUL)")
        if model not in self.adapters or model in self.refused:  # a refused adapter may have been fixed since
            await self._refresh_adapters()
        if model not in self.adapters:
            raise AdapterNotFound(f"model {model!r} does not exist; GET /v1/models lists "
                                  f"{len(self.adapters) - len(self.refused) + 1} models")
        if model in self.refused:
            raise refused_error(model, self.refused[model])
        return model

    @fastapi_app.get("/health")
    async def health(self):
        return {"status": "ok"}

    @fastapi_app.get("/v1/models")
    async def models(self):
        await self._refresh_adapters()
        created = responses.now()
        base = {"id": self.model_id, "object": "model", "created": created, "owned_by": "lora-serve",
                "root": self.args.base_model, "parent": None}
        return {"object": "list", "data": [base] + [
            {"id": name, "object": "model", "created": created, "owned_by": "lora-serve", "root": path,
             "parent": self.model_id} for name, path in sorted(self.adapters.items()) if name not in self.refused]}

    async def _register(self, name: str, path: str) -> dict:
        if not self.args.allow_adapter_registration:
            raise Forbidden("adapter registration is disabled (allow_adapter_registration: false)")
        validate_adapter_id(name)
        if name == self.model_id:
            raise InvalidRequest(f"{name!r} is the base model's name")
        await self._refresh_adapters()
        if name in self.adapters:
            raise AdapterAlreadyExists(f"adapter {name!r} is already registered; unload it first")
        spec = await asyncio.to_thread(self.validator.validate, name, path)
        # The check above only spares a validation; the router actor's answer is the one that counts, as another
        # registration of the name may have landed during the validation.
        version = await self._call_state("register", name, str(spec.path))
        if version is None:
            raise AdapterAlreadyExists(f"adapter {name!r} is already registered; unload it first")
        self.adapters[name] = str(spec.path)
        await self._wait_synced(version)
        return {"id": name, "object": "model", "root": str(spec.path), "parent": self.model_id,
                "rank": spec.rank, "target_modules": sorted(spec.target_modules)}

    async def _unregister(self, name: str) -> None:
        if not self.args.allow_adapter_registration:
            raise Forbidden("adapter registration is disabled (allow_adapter_registration: false)")
        version = await self._call_state("unregister", name)
        if version is None:
            raise AdapterNotFound(f"adapter {name!r} is not registered")
        self.adapters.pop(name, None)
        await self._wait_synced(version)

    async def _wait_synced(self, version: int) -> None:
        """Answer a registry change once every replica has taken it, so that a request sent after the answer
        never meets the name's previous weights. A replica that takes longer catches up on its own."""
        try:
            if not await self._call_state("wait_synced", version, REGISTRY_SYNC_TIMEOUT_S):
                log.warning("not every replica took registry version %d within %.0f s", version,
                            REGISTRY_SYNC_TIMEOUT_S)
        except EngineUnavailable as e:
            log.warning("could not confirm that replicas took registry version %d: %s", version, e)

    @fastapi_app.post("/v1/adapters", status_code=201)
    async def register(self, body: api.AdapterRegistration):
        return await self._register(body.name, body.path)

    @fastapi_app.delete("/v1/adapters/{name}")
    async def unregister(self, name: str):
        await self._unregister(name)
        return {"id": name, "object": "model", "deleted": True}

    # vLLM's runtime routes, which cluster LoRA controllers call; success is vLLM's plain-text message.
    @fastapi_app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(self, body: api.LoadLoRAAdapterRequest):
        body.check_supported()
        await self._register(body.lora_name, body.lora_path)
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @fastapi_app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(self, body: api.UnloadLoRAAdapterRequest):
        body.check_supported()
        await self._unregister(body.lora_name)
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    @fastapi_app.get("/v1/debug/replicas")
    async def debug_replicas(self):
        """Each replica's last report: residency, queue and engine metrics (for operators and tests)."""
        return (await self._call_state("view")).to_dict()

    # --- generation -----------------------------------------------------------------------------

    @fastapi_app.post("/v1/completions")
    async def completions(self, body: api.CompletionRequest):
        body.check_supported()
        prompts = body.prompts()
        for prompt in prompts:
            if isinstance(prompt, list):
                self._check_vocabulary(prompt)
        echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts] if body.echo else None
        return await self._generate(body, prompts, chat=False, echo=echo)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, body: api.ChatCompletionRequest):
        body.check_supported()
        # The chat template and the tokenizer take seconds on a long conversation: off the event loop.
        prompt = await asyncio.to_thread(self._chat_prompt, body.conversation())
        return await self._generate(body, [prompt], chat=True)

    def _chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True,
                     add_special_tokens: bool = False) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]  # the template holds BOS

    def _check_vocabulary(self, token_ids: list[int]) -> None:
        if token_ids and max(token_ids) >= self.vocab_size:
            raise InvalidRequest(f"token id {max(token_ids)} is outside the vocabulary ({self.vocab_size} tokens)")

    @fastapi_app.post("/tokenize")
    async def tokenize(self, body: api.TokenizeRequest):
        """vLLM's route; max_model_len is the longest prompt accepted (max_input_tokens)."""
        body.check_supported()
        await self._resolve_model(body.model)
        # A megabyte of text takes the tokenizer about a second, and FastAPI's encoding of its half a million ids a
        # third of one more: both off the event loop, so /health and streams go on.
        return Response(await asyncio.to_thread(self._tokenize_json, body), media_type="application/json")

    def _tokenize_json(self, body: api.TokenizeRequest) -> bytes:
        if body.messages is None:
            tokens = self.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens is not False)["input_ids"]
        else:
            tokens = self._chat_prompt(api.conversation(body.messages), body.add_generation_prompt,
                                       bool(body.add_special_tokens))
        return json.dumps({"count": len(tokens), "max_model_len": self.args.max_input_tokens,
                           "tokens": tokens}).encode()

    @fastapi_app.post("/detokenize")
    async def detokenize(self, body: api.DetokenizeRequest):
        body.check_supported()
        await self._resolve_model(body.model)
        self._check_vocabulary(body.tokens)
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def _generate(self, body, prompts, chat: bool, echo=None):
        if self.in_flight >= self.args.max_pending_requests:
            raise CapacityExceeded(f"{self.in_flight} requests are in flight at this ingress "
                                   f"(max_pending_requests); retry later", retry_after_s=1)
        self.in_flight += 1
        streaming = False
        try:
            response = await self._dispatch(body, prompts, chat, echo)
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:
                self.in_flight -= 1

    def _choices(self, generation, prompts, chat: bool, echo) -> list[responses.Choice]:
        n = generation.n
        return [responses.Choice(i, self.tokenizer, generation, chat, echo[i // n] if echo else None)
                for i in range(len(prompts) * n)]

    async def _dispatch(self, body, prompts, chat: bool, echo):
        route = "/v1/chat/completions" if chat else "/v1/completions"
        adapter_id = await self._resolve_model(body.model)
        generation = body.generation(self.args.default_max_tokens)
        request_id = api.new_id("chatcmpl" if chat else "cmpl")
        call = GenerateCall(prompts=prompts, params=generation.params, n=generation.n, adapter_id=adapter_id,
                            request_id=request_id)
        choices = self._choices(generation, prompts, chat, echo)
        handle = self.stream_handle
        if self.args.router == "adapter_affinity":
            handle = handle.options(multiplexed_model_id=adapter_id or "")
        started = time.perf_counter()
        for attempt in range(1 + REPLICA_DEATH_RETRIES):
            try:
                stream = handle.remote(call)
                first = await self._first_answer(stream.__anext__(), stream)
                if isinstance(first, ErrorReply):
                    metrics.requests().inc(tags={"route": route, "status": str(first.status)})
                    return error_response(first)
                if body.stream:
                    metrics.ttft().observe(time.perf_counter() - started, tags={"model": body.model})
                    return StreamingResponse(self._sse(body, chat, request_id, choices, first, stream, route),
                                             media_type="text/event-stream",
                                             headers={"x-replica-id": first.replica})
                chunks = await self._rest(stream, first)
                break
            except RayActorError as e:
                # The client has seen nothing yet, so another replica may serve the request afresh.
                if attempt == REPLICA_DEATH_RETRIES:
                    raise EngineUnavailable(f"the replica serving this request died: {e}", retry_after_s=1) from e
                log.warning("replica died before answering %s; retrying on another replica", request_id)
        if isinstance(chunks[-1], ErrorReply):
            metrics.requests().inc(tags={"route": route, "status": str(chunks[-1].status)})
            return error_response(chunks[-1])
        metrics.requests().inc(tags={"route": route, "status": "200"})
        merged = merge_chunks(chunks)
        content = responses.body(request_id, body.model, chat, [choices[c.index].body(c) for c in merged],
                                 responses.total_usage(merged, generation.n))
        return JSONResponse(content, headers={"x-replica-id": first.replica})

    @staticmethod
    async def _rest(stream, first) -> list:
        """A whole reply, merged here from the replica's chunks: as one message it may pass gRPC's 4 MiB cap
        between replica and ingress (echoed prompts with 20 logprobs a token, n x long completions)."""
        chunks = [first]
        try:
            async for chunk in stream:
                chunks.append(chunk)
                if isinstance(chunk, ErrorReply):
                    break
        except BaseException:
            stream.cancel()  # the client is gone, or the replica died: free its rows
            raise
        return chunks

    async def _first_answer(self, answer, call):
        """The replica's first answer. Serve retries a replica that fails to start for good while requests wait for
        it: while none runs and they have failed, a 503 that carries their error instead (`call` is cancelled)."""
        answer = asyncio.ensure_future(answer)
        while True:
            done, _ = await asyncio.wait({answer}, timeout=REPLICA_WAIT_CHECK_S)
            if done:
                return answer.result()
            failure = await self.replica_health.failure()
            if failure is not None:
                call.cancel()
                answer.cancel()
                raise EngineUnavailable(f"no replica of {REPLICA_DEPLOYMENT} is running; they fail to start: "
                                        f"{failure}", retry_after_s=REPLICA_FAILED_RETRY_AFTER_S)

    async def _sse(self, body, chat, request_id, choices, first, stream, route):
        last_at, status = time.perf_counter(), "200"
        if chat:
            for c in choices:
                yield _event(responses.chunk(request_id, body.model, chat, [
                    {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}]))
        chunk, finished = first, {}
        try:
            while True:
                if isinstance(chunk, ErrorReply):
                    status = str(chunk.status)
                    yield _event(chunk.body)
                    break
                delta = choices[chunk.index].delta(chunk)
                if delta is not None:
                    yield _event(responses.chunk(request_id, body.model, chat, [delta]))
                if chunk.finish_reason:
                    finished[chunk.index] = chunk
                if len(finished) == len(choices):
                    if body.include_usage:
                        yield _event(responses.chunk(request_id, body.model, chat, [], responses.total_usage(
                            list(finished.values()), body.n)))
                    break
                try:
                    chunk = await stream.__anext__()
                except StopAsyncIteration:
                    break
                now = time.perf_counter()
                metrics.itl().observe(now - last_at, tags={"model": body.model})
                last_at = now
        except RayActorError as e:
            died = ErrorReply.of(EngineUnavailable(f"the replica serving this stream died: {e}"))
            status = str(died.status)
            yield _event(died.body)
        finally:
            self.in_flight -= 1
            stream.cancel()  # the client may be gone: free the row and slot pin on the replica
            metrics.requests().inc(tags={"route": route, "status": status})
        yield "data: [DONE]\n\n"
