"""What the router has told one replica: the requests it holds for this replica's adapters.

The router hints once per request waiting in front of this replica (it is full), so an adapter hinted
three times has three requests on their way; when such a request goes to another replica after all, the
router withdraws its hint, so the adapter is not read or kept for a request that will not come. It also tells
a replica about requests waiting at another, saturated replica that would spread here (`incoming`). Both feed
the hint policy (prefetch/policy.py): hinted adapters are loaded ahead of need, and an adapter with several
requests on their way, or an incoming one, is not evicted for a one-off. Entries expire after ttl_s (a request
may be cancelled, or spread elsewhere); an arriving request consumes its own hint, and a hint whose request has
arrived already is dropped (`HintBook`).

A request far back in the router's queue is hinted `ahead`: its adapter is fetched to the node's disk (where it is
remote) and enters neither the host cache nor a device slot, where it would evict adapters of requests due sooner.
When the request nears the front, the router hints it again as `waiting`, which upgrades its entry in place.
"""

from __future__ import annotations

from collections import OrderedDict, deque

INCOMING_TTL_S = 5.0  # a spread usually happens within spread_after_s (0.2 s) of waiting, or not at all


class HintBook:
    """Waiting hints per adapter, each with the id of the request it is for (the router's, which the replica
    also sees as the request's Serve id), or None where the caller has no ids (the engine bench's driver).

    A hint travels router -> router actor -> this replica's poll -> the engine thread; its request travels
    router -> replica -> the engine thread. When the replica frees a place moments after the router hinted, the
    request can win: it arrives before its hint. Without ids, that hint would wait for the adapter's next request,
    often many seconds later, and keep the adapter in the prefetch demand meanwhile. With ids, an arrival
    consumes exactly its own hint, and a hint whose request has already arrived is dropped (counted late)."""

    def __init__(self, ttl_s: float, incoming_ttl_s: float = INCOMING_TTL_S):
        self.ttl_s, self.incoming_ttl_s = ttl_s, min(ttl_s, incoming_ttl_s)
        # adapter -> (when hinted, request id, near the front) per waiting request, oldest first
        self._waiting: OrderedDict[str, deque[tuple[float, str | None, bool]]] = OrderedDict()
        self._incoming: dict[str, float] = {}  # adapter -> when last announced
        self._arrived: OrderedDict[str, float] = OrderedDict()  # request id -> when it arrived with no hint here

    def add(self, adapter_id: str, now: float, request_id: str | None = None, near: bool = True) -> str:
        """A request for adapter_id waits in the router for this replica: near its front (near), or far back (its
        adapter is only fetched to the node). Returns "added"; "late" if that request has arrived already (its
        hint is dropped); "upgraded" if it was hinted far back and is now near (its entry keeps its time);
        "duplicate" if its hint is here already (kept once: a second entry would outlive the request's arrival,
        which consumes one, and stay in the demand until it expired)."""
        if request_id is not None:
            if self._arrived.pop(request_id, None) is not None:
                return "late"
            entries = self._waiting.get(adapter_id, ())
            index = next((i for i, (_, rid, _) in enumerate(entries) if rid == request_id), None)
            if index is not None:
                hinted_at, _, was_near = entries[index]
                if near and not was_near:
                    entries[index] = (hinted_at, request_id, True)
                    return "upgraded"
                return "duplicate"
        self._waiting.setdefault(adapter_id, deque()).append((now, request_id, near))
        self._waiting.move_to_end(adapter_id)
        return "added"

    def add_incoming(self, adapter_id: str, now: float) -> None:
        """A request waiting at another replica may be sent here."""
        self._incoming[adapter_id] = now

    def arrived(self, adapter_id: str, now: float, request_id: str | None = None) -> float | None:
        """A request for adapter_id reached this replica: it consumes its own hint (by request id; without an id,
        the oldest hint without one). Returns when that hint came (for the hint lead time), or None if there was
        none (then, with an id, its hint may still come, late)."""
        self._incoming.pop(adapter_id, None)
        entries = self._waiting.get(adapter_id, ())
        index = next((i for i, (_, rid, _) in enumerate(entries) if rid == request_id), None)
        if index is None and request_id is not None:  # else a hint sent without an id
            index = next((i for i, (_, rid, _) in enumerate(entries) if rid is None), None)
        if index is None:
            if request_id is not None:
                self._arrived[request_id] = now
                self._expire_arrived(now)
            return None
        hinted_at = entries[index][0]
        del entries[index]
        if not entries:
            del self._waiting[adapter_id]
        return hinted_at

    def withdraw(self, adapter_id: str, request_id: str | None = None) -> None:
        """A request hinted here went elsewhere: drop its hint (by id; without one, adapter_id's newest)."""
        entries = self._waiting.get(adapter_id)
        if not entries:
            return
        if request_id is None:
            entries.pop()
        else:
            index = next((i for i, (_, rid, _) in enumerate(entries) if rid == request_id), None)
            if index is None:
                return
            del entries[index]
        if not entries:
            del self._waiting[adapter_id]

    def clear(self) -> None:
        self._waiting.clear()
        self._incoming.clear()
        self._arrived.clear()

    def forget(self, adapter_id: str) -> None:
        self._waiting.pop(adapter_id, None)
        self._incoming.pop(adapter_id, None)

    def expire(self, now: float) -> None:
        for adapter_id, entries in list(self._waiting.items()):
            while entries and now - entries[0][0] > self.ttl_s:
                entries.popleft()
            if not entries:
                del self._waiting[adapter_id]
        self._incoming = {a: at for a, at in self._incoming.items() if now - at <= self.incoming_ttl_s}
        self._expire_arrived(now)

    def _expire_arrived(self, now: float) -> None:
        while self._arrived and now - next(iter(self._arrived.values())) > self.ttl_s:
            self._arrived.popitem(last=False)

    def demand(self) -> list[str]:
        """One entry per request waiting near the router's front, in the order the requests should arrive: the
        adapter whose oldest such hint is oldest first (the router sends waiting requests first in, first out).
        Oldest first: a request hinted later must not take the slot of one due sooner, which would then miss."""
        return self._in_order(near=True)

    def ahead(self) -> list[str]:
        """One entry per request hinted far back in the router's queue, in the same order: adapters to fetch to
        the node, and no further."""
        return self._in_order(near=False)

    def _in_order(self, near: bool) -> list[str]:
        # entries are oldest first: an adapter's first entry of the tier is its oldest
        firsts = {a: next(t for t, _, n in entries if n == near) for a, entries in self._waiting.items()
                  if any(n == near for _, _, n in entries)}
        return [a for a in sorted(firsts, key=firsts.get) for _, _, n in self._waiting[a] if n == near]

    def incoming(self) -> frozenset:
        return frozenset(self._incoming)

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self._waiting


def in_order_batches(hints: list[dict]) -> list[list[dict]]:
    """Split a mailbox's hints (dicts with "kind", in the order the router sent them) so that applying each batch's
    "ahead" and "waiting" hints before its "withdrawn" ones (Engine.hint) gives what applying them one by one
    would: a batch ends where such a hint follows a "withdrawn" one. A request hinted here, withdrawn, and hinted
    here again in one poll then keeps its hint, where adds-then-withdrawals would count a duplicate and drop it."""
    batches: list[list[dict]] = [[]]
    for hint in hints:
        kind = hint.get("kind", "waiting")
        if kind in ("waiting", "ahead") and any(h.get("kind") == "withdrawn" for h in batches[-1]):
            batches.append([])
        batches[-1].append(hint)
    return [batch for batch in batches if batch]
