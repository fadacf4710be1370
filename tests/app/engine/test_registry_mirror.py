"""A replica's copy of the application's registry, against a real engine on its own thread: it registers and drops
what the registry says, defers a change while requests use the old weights, refuses to serve those weights for a
new entry, and keeps each refused adapter out with its reason."""

import asyncio
import shutil
from pathlib import Path

import pytest

from app.engine.async_engine import AsyncEngine
from app.engine.registry_mirror import RegistryMirror
from app.errors import AdapterInvalid, AdapterNotFound, AdapterStoreUnavailable, EngineUnavailable
from engine_helpers import greedy


@pytest.fixture
def engine(make_engine):
    engine = AsyncEngine(make_engine(register=False))
    yield engine
    engine.shutdown()


def paths(demo_dir, manifest, count: int) -> dict[str, str]:
    return {a["name"]: str(Path(demo_dir) / a["path"]) for a in manifest["adapters"][:count]}


def registered(engine) -> list[str]:
    return asyncio.run(engine.call(lambda e: sorted(spec.adapter_id for spec in e.registry.list())))


def test_sync_registers_the_registry_and_drops_what_left_it(engine, demo_dir, manifest):
    wanted = paths(demo_dir, manifest, 3)
    mirror = RegistryMirror(engine, snapshot=None)

    async def main():
        await mirror.sync(wanted)
        assert mirror.held == wanted and all(mirror.is_current(name) for name in wanted)
        await mirror.sync(dict(list(wanted.items())[1:]))

    asyncio.run(main())
    assert registered(engine) == sorted(list(wanted)[1:]) and list(wanted)[0] not in mirror.held


def test_a_refused_adapter_is_kept_out_with_its_reason(engine, demo_dir, manifest):
    wanted = {**paths(demo_dir, manifest, 1), "ghost": str(Path(demo_dir) / "adapters" / "no-such-folder")}
    mirror = RegistryMirror(engine, snapshot=None)
    asyncio.run(mirror.sync(wanted))
    assert "ghost" not in mirror.held and "no such directory" in mirror.refusals()["ghost"]
    asyncio.run(mirror.sync(paths(demo_dir, manifest, 1)))  # gone from the registry: its reason goes too
    assert mirror.refused == {}


def test_a_request_for_a_refused_adapter_gets_its_reason_and_a_fixed_folder_is_taken_on_retry(make_engine, demo_dir,
                                                                                              manifest, tmp_path):
    engine = AsyncEngine(make_engine(register=False, adapter_roots=(str(Path(demo_dir) / "adapters"), str(tmp_path))))
    good = paths(demo_dir, manifest, 1)
    wanted = {**good, "ghost": str(tmp_path / "ghost")}

    async def owner():
        return dict(wanted)

    mirror = RegistryMirror(engine, owner)

    async def main():
        await mirror.sync(wanted)
        with pytest.raises(AdapterInvalid, match="refused it .*no such directory"):
            await mirror.adopt("ghost")
        shutil.copytree(next(iter(good.values())), tmp_path / "ghost")  # the folder fixed: no restart needed
        await mirror.retry_refused()
        assert mirror.is_current("ghost") and mirror.refusals() == {}

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


class StoreDown:
    """An engine whose adapter store is down: every registration fails for now."""

    async def call_aside(self, fn):
        raise AdapterStoreUnavailable("s3://bucket/a: the store did not answer")


def test_a_store_outage_is_not_reported_as_a_refusal():
    """The replica reports only refusals that stand until the files change; a store that is down passes."""
    mirror = RegistryMirror(StoreDown(), snapshot=None)
    asyncio.run(mirror.sync({"a": "s3://bucket/a"}))
    assert "a" in mirror.refused and mirror.refusals() == {}


def test_a_change_waits_for_the_requests_on_the_old_weights(engine, demo_dir, manifest):
    """Registered again to another path while a request streams: the old weights stay until it ends; a new request
    meanwhile is refused with a retry, never served with the old weights."""
    first, second = list(paths(demo_dir, manifest, 2).items())
    name = first[0]
    snapshot = {name: first[1]}

    async def owner():
        return dict(snapshot)

    mirror = RegistryMirror(engine, owner)

    async def main():
        await mirror.sync(snapshot)
        stream = engine.generate(manifest["prompts"][0], name, greedy(400, ignore_eos=True))
        await stream.__anext__()  # running on the first path
        snapshot[name] = second[1]
        await mirror.sync(snapshot)
        assert mirror.deferred == {name} and mirror.held[name] == first[1] and not mirror.is_current(name)
        with pytest.raises(EngineUnavailable, match="registered again"):
            await mirror.adopt(name)
        await stream.aclose()
        for _ in range(100):
            await mirror.retry_deferred()
            if not mirror.deferred:
                break
            await asyncio.sleep(0.05)
        assert mirror.held[name] == second[1] and mirror.is_current(name)

    asyncio.run(main())


def test_adopt_takes_a_name_registered_moments_ago_and_refuses_one_unregistered(engine, demo_dir, manifest):
    snapshot = paths(demo_dir, manifest, 1)
    name = next(iter(snapshot))

    async def owner():
        return dict(snapshot)

    mirror = RegistryMirror(engine, owner)

    async def main():
        await mirror.adopt(name)  # not synced here yet: taken from the owner's registry
        assert mirror.is_current(name)
        snapshot.clear()
        await mirror.adopt(name)  # unregistered while held here: dropped, and the engine refuses the request
        assert name not in mirror.held
        with pytest.raises(AdapterNotFound):
            async for _ in engine.generate(manifest["prompts"][0], name, greedy(2)):
                pass

    asyncio.run(main())
    assert registered(engine) == []
