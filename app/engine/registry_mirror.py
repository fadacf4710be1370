"""A replica's copy of the application's adapter registry, kept equal to it in the replica's engine.

The registry's one owner is the router's state actor; a replica holds a snapshot of it (`wanted`) and registers each
adapter with its engine (`held`). An adapter whose entry changes while requests use its old weights keeps them
until those requests finish (`deferred`); meanwhile a request for it is refused rather than served with weights the
registry no longer names. An adapter the engine refuses (a missing folder, a rank past max_rank) is kept out with
its reason (`refused`); one refused for its files is tried again every RETRY_REFUSED_S, so fixing them needs no
restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from operator import methodcaller

from app.adapters.registry import VALIDATIONS_AT_ONCE
from app.errors import (AdapterError, AdapterInUse, AdapterInvalid, AdapterNotFound, EngineUnavailable,
                        ServingError)

log = logging.getLogger(__name__)
Snapshot = Callable[[], Awaitable[dict[str, str] | None]]  # the owner's registry now; None where it is unreachable
RETRY_REFUSED_S = 30.0  # how often a replica registers again the adapters refused for their files


def is_lasting(error: ServingError) -> bool:
    """A refusal that stands until the adapter's files change (missing or invalid), rather than a store or an engine
    that fails for now (a 5xx), which the next request for the adapter tries again."""
    return isinstance(error, AdapterError) and error.status_code < 500


def refused_error(adapter_id: str, reason: str) -> AdapterInvalid:
    return AdapterInvalid(f"adapter {adapter_id!r} is registered, but the replicas refused it (they try again every "
                          f"{RETRY_REFUSED_S:.0f} s): {reason}")


class RegistryMirror:
    def __init__(self, engine, snapshot: Snapshot):
        """engine: an AsyncEngine or EngineProcess. snapshot: asks the registry's owner for its entries."""
        self.engine = engine
        self._snapshot = snapshot
        self.held: dict[str, str] = {}  # name -> path, as the engine has it registered
        self.wanted: dict[str, str] = {}  # name -> path, as the application's registry has it
        self.deferred: set[str] = set()  # names whose change waits for their requests to finish
        self.refused: dict[str, ServingError] = {}  # name -> why the engine refused its current path
        self._lock = asyncio.Lock()

    def is_current(self, name: str) -> bool:
        return name in self.held and self.wanted.get(name) == self.held[name]

    def refusals(self) -> dict[str, str]:
        """name -> reason, for the adapters refused for their files (what the replica reports)."""
        return {name: str(error) for name, error in self.refused.items() if is_lasting(error)}

    async def sync(self, wanted: dict[str, str]) -> None:
        """Make the engine's registry equal `wanted`, as far as it can now."""
        async with self._lock:
            self.wanted = dict(wanted)
            self.refused = {name: why for name, why in self.refused.items() if name in wanted}
            for name in [n for n in self.held if n not in wanted]:
                await self._sync_one(name)
            await self._sync_many(list(wanted))

    async def retry_refused(self) -> None:
        """Register again the adapters refused for their files, which may have been fixed since."""
        async with self._lock:
            await self._sync_many(list(self.refusals()))

    async def retry_deferred(self) -> None:
        async with self._lock:
            for name in list(self.deferred):
                await self._sync_one(name)

    async def adopt(self, adapter_id: str) -> None:
        """A request for a name this replica does not hold as the registry does: registered moments ago and not
        yet synced here, or changed while requests use its old weights. Serve it from the registry's current
        entry, or refuse it; never with weights the registry no longer names."""
        async with self._lock:
            snapshot = await self._snapshot()  # None: go by the last registry this replica saw
            if snapshot is not None:
                if adapter_id in snapshot:
                    self.wanted[adapter_id] = snapshot[adapter_id]
                else:
                    self.wanted.pop(adapter_id, None)
            await self._sync_one(adapter_id)
            refusal = self.refused.get(adapter_id)
            if adapter_id in self.wanted and refusal is not None and is_lasting(refusal):
                raise refused_error(adapter_id, str(refusal))
            if adapter_id not in self.held or self.is_current(adapter_id):
                return  # current, or the engine answers with its own AdapterNotFound
            if adapter_id not in self.wanted:
                raise AdapterNotFound(f"adapter {adapter_id!r} is not registered")
            raise EngineUnavailable(f"adapter {adapter_id!r} was registered again to {self.wanted[adapter_id]}; "
                                    "requests still use its previous weights here; retry shortly", retry_after_s=1)

    async def _sync_many(self, names: list[str]) -> None:
        """At once, a few at a time (the caller holds the lock): a remote adapter's validation waits a round trip
        to its store, and hundreds of them one after another would hold a replica's start for a minute."""
        gate = asyncio.Semaphore(VALIDATIONS_AT_ONCE)

        async def sync(name: str) -> None:
            async with gate:
                await self._sync_one(name)

        await asyncio.gather(*(sync(name) for name in names))

    async def _sync_one(self, name: str) -> None:
        """Bring the engine's registration of `name` to `wanted`'s (the caller holds the lock). The engine keeps
        an adapter while requests use it; until they finish, the name stays deferred and retry_deferred retries."""
        held, path = self.held.get(name), self.wanted.get(name)
        if held == path:
            self.deferred.discard(name)
            return
        if held is not None:
            try:
                await self.engine.call(methodcaller("unregister_adapter", name))
            except AdapterInUse as e:
                if name not in self.deferred:
                    log.info("deferring the change of adapter %s until its requests finish: %s", name, e)
                    self.deferred.add(name)
                return
            except AdapterNotFound:
                pass
            del self.held[name]
            self.deferred.discard(name)
        if path is not None:
            from app.engine.process import DiscardResult  # here: the ingress imports this module, not the engine's

            try:
                await self.engine.call_aside(DiscardResult(methodcaller("register_adapter", name, path)))
            except ServingError as e:
                if str(self.refused.get(name)) != str(e):  # once per reason, not at every retry
                    log.warning("adapter %s at %s refused: %s", name, path, e)
                self.refused[name] = e.with_traceback(None)  # kept for its type and text, not its frames
                return
            self.held[name] = path
            if self.refused.pop(name, None) is not None:
                log.info("adapter %s at %s registered; it was refused before", name, path)
