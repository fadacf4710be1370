"""The engine loop in a child process, as vLLM's engine core runs: same interface as AsyncEngine.

In a Serve replica the engine thread shares one GIL with the replica's event loop, which turns every
step's outputs into stream chunks for dozens of requests. Under HTTP load that contention makes the
host's part of a decode step several times longer than the engine's alone. Here the LLMEngine and its
AsyncEngine loop run in a spawned process (CUDA needs spawn, not fork) and the parent keeps only the asyncio
side: commands go down a pipe as pickled (method name, args) calls, and each step's outputs come back as one message
that a reader thread hands to the waiting streams.

Calls must be picklable: use `operator.methodcaller("routing_stats")` rather than a lambda.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import multiprocessing as mp
import pickle
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable

from app.engine.async_engine import SWITCH_INTERVAL_S, AsyncEngine, EngineStreams
from app.engine.config import EngineConfig
from app.errors import EngineUnavailable, InternalError, picklable
from app.engine.request import RequestOutput
from prefetch.threads import one_cpu_thread
from routing.wire import Hint

log = logging.getLogger(__name__)
START_TIMEOUT_S = 1800.0  # model load, graph capture and torch.compile


class EngineProcess(EngineStreams):
    def __init__(self, config: EngineConfig, start_timeout_s: float = START_TIMEOUT_S):
        super().__init__()
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child_main, args=(config, child_conn), name="engine-core",
                                        daemon=True)
        self._process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._stopped = threading.Event()
        if not self._conn.poll(start_timeout_s):
            self._process.kill()
            raise EngineUnavailable(f"the engine process did not start in {start_timeout_s:.0f} s")
        try:
            kind, payload = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self._process.join(timeout=5)
            raise EngineUnavailable(f"the engine process exited while starting (exit code "
                                    f"{self._process.exitcode})") from None
        if kind != "ready":
            self._process.join(timeout=5)
            raise payload
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    # --- the AsyncEngine interface ----------------------------------------------------------------

    async def call(self, fn: Callable):
        """Run fn(engine) on the engine loop in the child and return its (picklable) result."""
        return await self._request("call", fn)

    async def call_aside(self, fn: Callable):
        """Run fn(engine) on a worker thread of the child, beside the engine loop."""
        return await self._request("aside", fn)

    def hint(self, hints: list[Hint]) -> None:
        try:
            self._send(("hint", hints))
        except EngineUnavailable:
            pass  # a hint is advice: a dead engine fails its requests, not the caller of hint

    def is_alive(self) -> bool:
        return self._process.is_alive() and not self._stopped.is_set()

    def shutdown(self) -> None:
        if not self._stopped.is_set():
            try:
                self._send(("stop",))
            except EngineUnavailable:
                pass
        self._stopped.set()
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()

    async def _submit(self, prompt, adapter_id, params, request_id, hint_id=None) -> None:
        """Sent without waiting for the child, as AsyncEngine queues it: a refusal is the stream's first output."""
        self._send(("submit", prompt, adapter_id, params, request_id, hint_id))

    def _abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except EngineUnavailable:
            pass

    # --- the pipe -------------------------------------------------------------------------------

    async def _request(self, kind: str, fn: Callable):
        call_id, future = next(self._ids), Future()
        self._calls[call_id] = future
        try:
            self._send((kind, call_id, fn))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        return await asyncio.wrap_future(future)

    def _send(self, message: tuple) -> None:
        if self._stopped.is_set():
            raise EngineUnavailable("the engine is shut down")
        data = pickle.dumps(message)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError) as e:
            raise EngineUnavailable(f"the engine process is gone: {e}") from e

    def _read(self) -> None:
        while True:
            try:
                kind, payload = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            if kind == "outputs":
                self._deliver_many(payload)
            elif kind == "result":
                call_id, ok, value = payload
                future = self._calls.pop(call_id, None)
                if future is not None:
                    future.set_result(value) if ok else future.set_exception(value)
        self._fail_everything()

    def _fail_everything(self) -> None:
        """The child died (or shut down): fail every call and stream instead of leaving them waiting."""
        died = not self._stopped.is_set()
        self._stopped.set()
        error = EngineUnavailable("the engine process exited" + (f" (exit code {self._process.exitcode})"
                                                                 if died else ""))
        if died:
            log.error("the engine process died: exit code %s", self._process.exitcode)
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        for request_id in list(self._streams):
            self._deliver(RequestOutput(request_id, "", (), True, "error", error=error))


class DiscardResult:
    """Picklable wrapper: run fn(engine) and send nothing back (for results that do not pickle)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, engine) -> None:
        self.fn(engine)


# --- the child --------------------------------------------------------------------------------------


class _ChildLoop(AsyncEngine):
    """The AsyncEngine loop in the child: outputs go up the pipe, one message per step."""

    def __init__(self, engine, send):
        self._send = send
        super().__init__(engine)

    def _deliver(self, output: RequestOutput) -> None:
        self._deliver_all([output])

    def _run(self) -> None:
        super()._run()
        if self.lost is not None:  # the failed requests went up the pipe: the process ends, and with it is_alive
            os._exit(1)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._has_first(outputs)  # the parent's event loop has its own GIL: no need to yield it here
            self._send(("outputs", [o if o.error is None else replace(o, error=picklable(o.error)) for o in outputs]))


def _child_main(config: EngineConfig, conn) -> None:
    from app.engine.engine import LLMEngine  # imports torch in the child only

    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # adapter downloads and host reads run on this process's threads
    lock = threading.Lock()

    def send(message) -> None:
        data = pickle.dumps(message)
        with lock:
            conn.send_bytes(data)

    try:
        engine = LLMEngine(config)
    except BaseException as e:
        send(("failed", picklable(e)))
        return
    loop = _ChildLoop(engine, send)
    # Asides are mostly adapter validations, which wait on disks and stores: a replica syncs up to 16 at once.
    aside = ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-aside", initializer=one_cpu_thread)

    def reply(call_id: int, future: Future) -> None:
        error = future.exception()
        try:
            send(("result", (call_id, error is None, future.result() if error is None else picklable(error))))
        except Exception as e:  # an unpicklable result: the caller must not wait forever
            send(("result", (call_id, False, InternalError(f"the engine's reply could not be sent: {e}"))))

    send(("ready", None))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the parent is gone
        kind = message[0]
        if kind == "stop":
            break
        if kind == "call":
            _, call_id, fn = message
            future = Future()
            future.add_done_callback(lambda f, i=call_id: reply(i, f))
            loop._commands.put((fn, future))
        elif kind == "aside":
            _, call_id, fn = message
            aside.submit(fn, engine).add_done_callback(lambda f, i=call_id: reply(i, f))
        elif kind == "submit":
            loop.submit(*message[1:])
        elif kind == "abort":
            loop._abort(message[1])
        elif kind == "hint":
            loop.hint(message[1])
    aside.shutdown(wait=False)
    loop.shutdown()
