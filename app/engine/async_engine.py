"""Runs an LLMEngine on its own thread and streams each request's outputs to asyncio callers.
(app/engine/process.py runs it in a child process instead, behind the same interface.)

The engine thread owns the engine. Callers talk to it through a command queue; results come back
through per-request asyncio queues (`call_soon_threadsafe`), so no state is shared under locks.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from operator import methodcaller
from typing import AsyncIterator, Callable

from app.engine.engine import LLMEngine
from app.engine.workers import WorkerLost
from app.errors import EngineUnavailable, ServingError
from app.engine.request import RequestOutput
from app.sampling.params import SamplingParams
from prefetch.threads import one_cpu_thread
from routing.wire import Hint

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.002  # how often an idle engine looks at in-flight loads
# The GIL's switch interval in a process that runs an engine loop. The loop lets go of the GIL at every torch
# call, CUDA sync and system call, and takes it back only once the thread that took it lets go: with Python's
# default 5 ms, any busy thread of the process (an event loop, adapter downloads, host reads) can hold the
# engine back for 5 ms each time.
SWITCH_INTERVAL_S = 0.0005


def freeze_heap(engine: LLMEngine | None = None) -> None:
    """Move every object alive now out of the garbage collector's sight, for a process that holds one engine for
    its life: call it once the model is built and the adapters registered. A full collection stops every thread of
    the process while it scans all tracked objects, which with a built engine is a long stall of every request;
    frozen objects are still freed by reference counting, never by the cycle collector."""
    gc.collect()
    gc.freeze()


class EngineStreams:
    """What the asyncio side of an engine runner shares: per-request output queues and `generate`.
    Subclasses say how a request reaches the engine (`_submit`), how it is aborted, and deliver
    outputs through `_deliver` from any thread."""

    def __init__(self):
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # After a request's first output, its later ones go out at most this often, merged (0: each as it
        # comes). Each output crosses the replica -> ingress -> client path as one message; the replica sets
        # this from its `stream_interval_ms`.
        self.stream_interval_s = 0.0

    async def generate(self, prompt: str | list[int], adapter_id: str | None, params: SamplingParams,
                       request_id: str | None = None, hint_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Validation errors raise before the first output.

        Leaving the iterator early (client gone, task cancelled) aborts the request, which frees
        its batch row and slot pin at the next engine step.
        """
        request_id = request_id or uuid.uuid4().hex
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        self._streams[request_id] = (loop, outputs)
        finished, sent_at = False, None
        try:
            if params.response_format is not None:  # compiled beside the engine loop: it may take a second
                await self.call_aside(methodcaller("compile_grammar", params.response_format))
            await self._submit(prompt, adapter_id, params, request_id, hint_id)
            while not finished:
                output = await outputs.get()
                if sent_at is not None and output.error is None and not output.finished:
                    wait = sent_at + self.stream_interval_s - loop.time()
                    if wait > 0:  # the first output never waits, nor the last (a finish or an error)
                        await asyncio.sleep(wait)
                while output.error is None and not output.finished and not outputs.empty():
                    output = _merge(output, outputs.get_nowait())  # a slow reader gets fewer, larger chunks
                if output.error is not None:
                    finished = True
                    raise output.error
                finished = output.finished
                sent_at = loop.time()
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abort(request_id)

    async def _submit(self, prompt, adapter_id, params, request_id, hint_id=None) -> None:
        raise NotImplementedError

    def _abort(self, request_id: str) -> None:
        raise NotImplementedError

    def _deliver(self, output: RequestOutput) -> None:
        self._deliver_many([output])

    def _deliver_many(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams: one wake-up of each event loop for all of them (a step's outputs
        woke the loop once per row before)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((stream[1], output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


class AsyncEngine(EngineStreams):
    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._awaiting_first: set[str] = set()  # engine thread only: requests added, no output delivered yet
        self._stepped_at: float | None = None  # engine thread only: when the last step ended, requests remaining
        self._stepped_cpu = 0.0  # engine thread only: the thread's CPU time then
        self.lost: WorkerLost | None = None  # set when a tensor-parallel worker ended and the loop with it
        self._aside = ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-aside", initializer=one_cpu_thread)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- public API (any thread / event loop) ----------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on the engine thread and return its result (or raise its error)."""
        if self._stopped.is_set():
            raise EngineUnavailable("the engine is shut down")
        future: Future = Future()
        self._commands.put((fn, future))
        return await asyncio.wrap_future(future)

    async def call_aside(self, fn: Callable[[LLMEngine], object]):
        """Run fn(engine) on a worker thread, beside the engine loop (thread-safe work such as validating
        and registering an adapter, which reads files)."""
        return await asyncio.get_running_loop().run_in_executor(self._aside, fn, self.engine)

    def hint(self, hints: list[Hint]) -> None:
        def hint(engine: LLMEngine) -> None:
            engine.hint(hints)

        self._commands.put(hint)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        self._thread.join(timeout=30)
        self._aside.shutdown(wait=False)
        self.engine.shutdown()

    async def _submit(self, prompt, adapter_id, params, request_id, hint_id=None) -> None:
        self.submit(prompt, adapter_id, params, request_id, hint_id)

    def submit(self, prompt, adapter_id, params, request_id, hint_id=None) -> None:
        """Queue a request without waiting for the engine thread: a refusal comes back as the stream's first
        output (an error, raised before anything is yielded). Awaiting the add would wake the event loop in the middle
        of the request's first step, which would then run slower for the GIL."""
        if self._stopped.is_set():
            raise EngineUnavailable("the engine is shut down")

        def add(engine: LLMEngine) -> RequestOutput | None:
            try:
                engine.add_request(prompt, adapter_id, params, request_id, hint_id)
            except Exception as e:  # noqa: BLE001 - the caller's stream raises it
                return RequestOutput(request_id, "", (), True, "error", error=e)
            self._awaiting_first.add(request_id)
            return None

        self._commands.put(add)

    def _abort(self, request_id: str) -> None:
        def abort(engine: LLMEngine) -> RequestOutput | None:
            self._awaiting_first.discard(request_id)
            return engine.abort(request_id)

        self._commands.put(abort)

    # --- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped.is_set():
            # Loads in flight alone are no reason to step: poll them every IDLE_POLL_S instead of
            # spinning (a spinning loop starves the disk-read threads and the event loop).
            timeout = IDLE_POLL_S if engine.residency.is_loading() else None
            if not engine.has_requests():
                try:
                    self._handle(self._commands.get(timeout=timeout))
                except queue.Empty:
                    pass
            while True:
                try:
                    self._handle(self._commands.get_nowait())
                except queue.Empty:
                    break
            if engine.has_work() and not self._stopped.is_set():
                self._step()

    def _handle(self, command) -> None:
        if command is None:
            return
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            self._run_command(command)
        finally:
            self.engine.timing.work(_command_name(command), time.perf_counter() - started, time.thread_time() - cpu)

    def _run_command(self, command) -> None:
        if isinstance(command, tuple):
            fn, future = command
            try:
                future.set_result(fn(self.engine))
            except Exception as e:
                future.set_exception(e)
            return
        try:
            output = command(self.engine)
        except Exception:
            log.exception("engine command failed")
            return
        if isinstance(output, RequestOutput):
            self._deliver(output)

    def _step(self) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        if self._stepped_at is not None:  # requests have been in the engine since the last step ended
            self.engine.timing.between(started - self._stepped_at, cpu - self._stepped_cpu)
        try:
            outputs = self.engine.step()
        except WorkerLost as e:  # no step can run again: fail what is in flight and end the loop (health check)
            log.exception("engine step failed")
            outputs = self._fail_all(e)
            self.lost = e
            self._stopped.set()
        except Exception as e:  # a bug or device fault: fail what is in flight, keep serving
            log.exception("engine step failed")
            outputs = self._fail_all(e)
        ended, cpu = time.perf_counter(), time.thread_time()
        self._stepped_at, self._stepped_cpu = (ended, cpu) if self.engine.has_requests() else (None, 0.0)
        self.engine.timing.mark("between" if self._stepped_at is not None else None)
        self._deliver_all(outputs)
        self.engine.timing.work("deliver", time.perf_counter() - ended, time.thread_time() - cpu)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        first = self._has_first(outputs)
        self._deliver_many(outputs)
        if first:
            # A first token is what a client waits for most. The event loop that sends it wakes on the
            # self-pipe and then needs the GIL, which this thread, going straight into its next step, would
            # hold until the switch interval ran out. Let it take the GIL now.
            time.sleep(0)

    def _has_first(self, outputs: list[RequestOutput]) -> bool:
        """Whether any output is its request's first (those requests are then no longer awaited)."""
        first = False
        for output in outputs:
            if output.request_id in self._awaiting_first:
                self._awaiting_first.discard(output.request_id)
                first = True
        return first

    def _fail_all(self, cause: Exception) -> list[RequestOutput]:
        error = cause if isinstance(cause, ServingError) else EngineUnavailable(f"engine step failed: {cause}")
        outputs = []
        for request_id in list(self.engine.requests):
            if self.engine.abort(request_id) is not None:
                outputs.append(RequestOutput(request_id, "", (), True, "error", error=error))
        return outputs



def _command_name(command) -> str:
    """A command's name for the step timing: the engine method a call names, else its function's name."""
    fn = command[0] if isinstance(command, tuple) else command
    if isinstance(fn, methodcaller):  # its repr is "operator.methodcaller('name', ...)"
        return repr(fn).split("'", 2)[1]
    return getattr(fn, "__name__", type(fn).__name__)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for outputs, output in items:
        outputs.put_nowait(output)


def _merge(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    if second.error is not None:
        return second
    return replace(second, text=first.text + second.text, token_ids=first.token_ids + second.token_ids,
                   logprobs=first.logprobs + second.logprobs,
                   prompt_logprobs=first.prompt_logprobs or second.prompt_logprobs)
