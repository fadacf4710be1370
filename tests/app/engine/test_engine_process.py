"""The engine loop in a child process (app/engine/process.py) behind AsyncEngine's interface."""

import asyncio
import os
import signal
from operator import methodcaller
from pathlib import Path

import pytest

from app.engine.process import DiscardResult, EngineProcess
from app.errors import AdapterNotFound, EngineUnavailable, InternalError, InvalidRequest
from engine_helpers import engine_config, greedy, tokens_alone
from routing.wire import Hint, HintKind


@pytest.fixture(scope="module")
def process_engine(demo_dir, manifest):
    engine = EngineProcess(engine_config(demo_dir), start_timeout_s=300)

    async def register():
        for adapter in manifest["adapters"][:3]:
            await engine.call_aside(DiscardResult(methodcaller("register_adapter", adapter["name"],
                                                               str(Path(demo_dir) / adapter["path"]))))

    asyncio.run(register())
    yield engine
    engine.shutdown()


async def collect(engine, prompt, adapter, params):
    tokens, last = [], None
    async for output in engine.generate(prompt, adapter, params):
        tokens += output.token_ids
        last = output
    return tokens, last


def test_streams_equal_the_engine_in_process(process_engine, make_engine, manifest, adapter_names):
    prompt = manifest["prompts"][0]
    sync = make_engine()
    expected = tokens_alone(sync, prompt, adapter_names[:3] + [None])

    async def main():
        return await asyncio.gather(*(collect(process_engine, prompt, a, greedy(12)) for a in expected))

    for (adapter, tokens), (got, last) in zip(expected.items(), asyncio.run(main())):
        assert got == tokens, adapter
        assert last.finished and last.completion_tokens == len(tokens)


def test_errors_and_calls_cross_the_pipe(process_engine, manifest):
    async def main():
        with pytest.raises(AdapterNotFound):
            await collect(process_engine, manifest["prompts"][0], "no-such-adapter", greedy(4))
        with pytest.raises(InvalidRequest):
            await collect(process_engine, [10**9], None, greedy(4))  # a token id past the vocabulary
        stats = await process_engine.call(methodcaller("routing_stats"))
        assert stats.invariants == "ok" and stats.running == 0
        with pytest.raises(InternalError, match="could not be sent"):  # an unpicklable result fails, not hangs
            await process_engine.call(methodcaller("__getattribute__", "residency"))  # holds locks and threads
        process_engine.hint([Hint(manifest["adapters"][0]["name"]),
                             Hint(manifest["adapters"][1]["name"], kind=HintKind.INCOMING)])
        for _ in range(100):  # the hint loads the adapter in the child
            if manifest["adapters"][0]["name"] in (await process_engine.call(methodcaller("routing_stats"))).resident:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the hinted adapter never became resident")
        metrics = await process_engine.call(methodcaller("metrics", drain_stalls=True))
        assert metrics["step_timing"]["decode"]["steps"] > 0 and "stalls" in metrics

    asyncio.run(main())


def test_leaving_a_stream_early_aborts_it_in_the_child(process_engine, manifest):
    async def main():
        stream = process_engine.generate(manifest["prompts"][0], None, greedy(200, ignore_eos=True))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(100):
            stats = await process_engine.call(methodcaller("routing_stats"))
            if stats.running == 0 and stats.waiting == 0:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the aborted request is still in the child's engine")

    asyncio.run(main())


def test_a_dead_child_fails_streams_and_calls_instead_of_hanging(demo_dir, manifest):
    engine = EngineProcess(engine_config(demo_dir), start_timeout_s=300)

    async def main():
        stream = engine.generate(manifest["prompts"][0], None, greedy(500, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine._process.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailable):
            async for _ in stream:
                pass
        with pytest.raises(EngineUnavailable):
            await engine.call(methodcaller("routing_stats"))

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
        assert not engine.is_alive()
    finally:
        engine.shutdown()
