"""Hints reach the tiers they can: a slot when one is free, else at least the host cache."""

import time

from engine_helpers import greedy, run_all
from routing.wire import Hint, HintKind


def test_hint_warms_host_cache_when_every_slot_is_pinned(make_engine, manifest, adapter_names):
    engine = make_engine(num_slots=1)
    busy, hinted = adapter_names[0], adapter_names[1]
    engine.add_request(manifest["prompts"][0], busy, greedy(60, ignore_eos=True))
    engine.step()  # running: the only slot is pinned
    engine.hint([Hint(hinted)])
    deadline = time.time() + 10
    while hinted not in engine.residency.host_cache and time.time() < deadline:
        engine.step()
    assert hinted in engine.residency.host_cache, "the hint did not start a disk read"
    assert engine.residency.pool.lookup(hinted) is None, "no slot was free, so nothing may be evicted"
    engine.check_invariants()
    run_all(engine, check=True)
    reads = engine.residency.host_cache.stats["reads"]
    request = engine.add_request(manifest["prompts"][0], hinted, greedy(4))
    assert len(run_all(engine, check=True)[request.request_id]) == 4
    assert engine.residency.host_cache.stats["reads"] == reads, "the load re-read the adapter from disk"


def test_hint_loads_into_a_free_slot(make_engine, adapter_names):
    engine = make_engine(num_slots=2)
    engine.hint([Hint(adapter_names[2])])
    deadline = time.time() + 10
    while engine.residency.is_loading() and time.time() < deadline:
        engine.step()
    assert adapter_names[2] in engine.routing_stats().resident
    metrics = engine.metrics()
    assert metrics["hints_received"] == 1 and metrics["loads_started"] == 1


def test_a_request_consumes_its_own_hint_by_id_and_a_hint_after_its_request_is_dropped(make_engine, manifest,
                                                                                       adapter_names):
    engine = make_engine(num_slots=2)
    prompt, adapter = manifest["prompts"][0], adapter_names[1]
    engine.hint([Hint(adapter, "r1"), Hint(adapter, "r2")])
    engine.hint([Hint(adapter, "r1")])  # r1 hinted again (a router that forgot it): kept once
    engine.add_request(prompt, adapter, greedy(2), hint_id="r2")
    assert engine.hints.demand() == [adapter]  # r1 is still on its way
    engine.add_request(prompt, adapter, greedy(2), hint_id="r3")  # it overtook its hint
    engine.hint([Hint(adapter, "r3")])
    assert engine.hints.demand() == [adapter] and engine.hint_lead.count == 1
    metrics = engine.metrics()
    assert (metrics["hints_received"], metrics["hints_late"], metrics["hints_duplicate"]) == (3, 1, 1)
    assert engine.routing_stats().arrivals["hints_late"] == 1
    engine.hint([Hint(adapter, "r1", HintKind.WITHDRAWN)])  # r1 went to another replica
    assert adapter not in engine.hints
    run_all(engine, check=True)


def test_metrics_snapshot_reports_every_tier(make_engine, manifest, adapter_names):
    engine = make_engine(num_slots=2)
    for adapter in adapter_names[:4]:
        engine.add_request(manifest["prompts"][0], adapter, greedy(3))
    run_all(engine, check=True)
    metrics = engine.metrics()
    assert metrics["loads_started"] == 4 and metrics["evictions"] == 2
    assert metrics["load_seconds"]["count"] == 4 and metrics["load_seconds"]["p50"] > 0
    assert metrics["tiers"]["disk_to_host"]["reads"] == 4 and metrics["tiers"]["disk_to_host"]["bytes"] > 0
    assert metrics["tiers"]["host_to_device"]["bytes"] == metrics["tiers"]["disk_to_host"]["bytes"]
    assert metrics["misses"] + metrics["hint_hits"] + metrics["inflight_hits"] == 4
    assert metrics["queue_length"] == 0 and metrics["batch_size"] == 0


def test_waiting_adapter_takes_the_slot_that_frees_soonest(make_engine, manifest, adapter_names):
    """Every slot pinned: the slot whose requests end first stops taking new ones, not the least recently used."""
    engine = make_engine(num_slots=2)
    long_run, short_run, waiting = adapter_names[:3]
    prompt = manifest["prompts"][0]
    engine.add_request(prompt, long_run, greedy(40, ignore_eos=True))  # least recently used once both run
    engine.add_request(prompt, short_run, greedy(6, ignore_eos=True))
    while len(engine.running) < 2:
        engine.step()
    request = engine.add_request(prompt, waiting, greedy(2))
    engine.step()
    short_slot = engine.residency.pool.lookup(short_run)
    assert engine.residency.draining == short_slot
    outputs = run_all(engine, check=True)
    assert len(outputs[request.request_id]) == 2
    assert engine.residency.pool.lookup(waiting) == short_slot


def test_slots_record_each_adapters_rank_for_the_kernels(make_engine, manifest):
    """Mixed ranks share max_rank slots; the rank a load records lets the kernels skip the padding rows."""
    engine = make_engine(num_slots=8)
    ranks = {a["name"]: a["rank"] for a in manifest["adapters"]}
    assert len(set(ranks.values())) > 1, "the demo should mix ranks"
    for name in ranks:
        engine.add_request(manifest["prompts"][0], name, greedy(1))
    run_all(engine)
    for slot, state in enumerate(engine.residency.pool.slots):
        if state.adapter_id is not None:
            assert engine.lora.ctx.slot_ranks[slot].item() == ranks[state.adapter_id], state.adapter_id


def test_adapter_the_router_holds_requests_for_is_not_evicted_for_a_one_off(make_engine, manifest, adapter_names):
    """Two requests for `kept` wait in the router (two hints), or one waits at another replica and may spread
    here (incoming): a one-off queued request waits for a slot to free instead of evicting it."""
    prompt = manifest["prompts"][0]
    busy, kept, one_off = adapter_names[:3]
    for hints in ([Hint(kept), Hint(kept)], [Hint(kept, kind=HintKind.INCOMING)]):
        engine = make_engine(num_slots=2)
        engine.add_request(prompt, kept, greedy(1))
        run_all(engine)
        engine.add_request(prompt, busy, greedy(12, ignore_eos=True))  # pins the other slot
        engine.step()
        engine.hint(hints)
        request = engine.add_request(prompt, one_off, greedy(2))
        for _ in range(6):
            engine.step()
            assert engine.residency.pool.lookup(kept) is not None, "evicted for a one-off"
            assert engine.residency.pool.lookup(one_off) is None
        tokens = run_all(engine, check=True)
        assert len(tokens[request.request_id]) == 2  # it ran once the busy slot freed
        assert engine.residency.pool.lookup(kept) is not None, "the one-off took the busy adapter's slot"


def test_queued_adapter_cached_on_the_host_runs_in_the_step_that_loads_it(make_engine, manifest, adapter_names):
    """Prefetch from the queue issues the device copy at once when the host already holds the adapter, so the
    request is admitted in that step, as a synchronous load would be, not one forward later."""
    engine = make_engine(num_slots=2)
    busy, queued = adapter_names[0], adapter_names[1]
    engine.residency.host_cache.fetch(queued).result()
    engine.add_request(manifest["prompts"][0], busy, greedy(30, ignore_eos=True))
    engine.step()  # something runs, so the step below takes no stall path
    request = engine.add_request(manifest["prompts"][0], queued, greedy(2))
    engine.step()
    assert request in engine.running or request.output_ids, "the request waited a step for its copy to be issued"
    run_all(engine, check=True)


def test_a_hint_withdrawn_in_the_same_batch_leaves_no_demand(make_engine, adapter_names):
    engine = make_engine(num_slots=2)
    engine.hint([Hint(adapter_names[0]), Hint(adapter_names[1]), Hint(adapter_names[0], kind=HintKind.WITHDRAWN)])
    assert engine.hints.demand() == [adapter_names[1]]


def test_hints_apply_in_the_order_the_router_sent_them(make_engine, adapter_names):
    """A request hinted, withdrawn and hinted again in one poll keeps its hint; one withdrawn last does not."""
    engine = make_engine(num_slots=2)
    a = adapter_names[0]
    engine.hint([Hint(a, "r1"), Hint(a, "r2"), Hint(a, "r1", HintKind.WITHDRAWN), Hint(a, "r3", HintKind.INCOMING),
                 Hint(a, "r1"), Hint(a, "r2", HintKind.WITHDRAWN)])
    assert engine.hints.demand() == [a] and engine.metrics()["hints_duplicate"] == 0
    assert engine.hints.arrived(a, time.monotonic(), "r1") is not None  # r1's hint is there
    assert a not in engine.hints.demand()  # and r2's is not


def test_routing_stats_report_the_hint_room(make_engine, manifest, adapter_names):
    """The router's hint budget here: host cache adapters at max_rank, less those of running and queued requests."""
    sizing = make_engine(register=False)
    layout = sizing.residency.layout
    engine = make_engine(host_cache_bytes=3 * layout.adapter_nbytes(layout.max_rank, sizing.dtype))
    stats = engine.routing_stats()
    assert (stats.host_cache_adapters, stats.hint_room) == (3, 3)
    for adapter in adapter_names[:2]:
        engine.add_request(manifest["prompts"][0], adapter, greedy(3))
    assert engine.routing_stats().hint_room == 1
    engine.add_request(manifest["prompts"][0], adapter_names[2], greedy(3))
    assert engine.routing_stats().hint_room == 0  # its own requests fill the host cache: no hints
    run_all(engine, check=True)
    assert engine.routing_stats().hint_room == 3


def test_a_hinted_read_waits_for_an_idle_disk(make_engine, manifest, adapter_names):
    """A request queued here reads first; a hint's warming read starts only once no read is under way."""
    import threading

    engine = make_engine(num_slots=1)
    busy, queued, hinted = adapter_names[:3]
    engine.add_request(manifest["prompts"][0], busy, greedy(60, ignore_eos=True))
    engine.step()  # running: the only slot is pinned
    cache, gate = engine.residency.host_cache, threading.Event()
    read = cache._read_fn
    cache._read_fn = lambda adapter_id, pages: gate.wait(10) and read(adapter_id, pages)
    engine.add_request(manifest["prompts"][0], queued, greedy(2))
    engine.hint([Hint(hinted)])
    engine.step()
    assert cache.pending_reads() == 1 and hinted not in cache, "the hinted read started beside the queued one"
    gate.set()
    deadline = time.time() + 10
    while hinted not in cache and time.time() < deadline:
        engine.step()
    assert hinted in cache, "the hinted read never started once the disk was idle"
    run_all(engine, check=True)


def test_routing_stats_check_invariants_when_idle_and_rarely_when_busy(make_engine, manifest, adapter_names,
                                                                        monkeypatch):
    """The full check walks every page; the stats, read several times a second, run it only while idle or once
    per INVARIANTS_BUSY_EVERY_S under load, and say what the last check found."""
    import app.engine.report as report

    engine = make_engine()
    calls = []
    check = engine.check_invariants
    monkeypatch.setattr(engine, "check_invariants", lambda: calls.append(1) or check())
    assert engine.routing_stats().invariants == "ok" and len(calls) == 1
    engine.routing_stats()
    assert len(calls) == 2  # idle: checked every time
    engine.add_request(manifest["prompts"][0], adapter_names[0], greedy(3))
    engine.step()
    for _ in range(3):
        assert engine.routing_stats().invariants == "ok"
    assert len(calls) == 2  # busy: the last result stands
    monkeypatch.setattr(report, "INVARIANTS_BUSY_EVERY_S", 0.0)
    engine.residency.pool.pages._free.append(engine.residency.pool.pages._free[0])  # a page free twice
    assert engine.routing_stats().invariants.startswith("violated")
    assert len(calls) == 3


def test_hinted_arrivals_are_counted_by_where_their_adapter_was(make_engine, manifest, adapter_names):
    """An arrival that consumes a router hint is counted as on the device, in the host cache, or from disk."""
    engine = make_engine(num_slots=1)
    busy, warmed, cold = adapter_names[:3]
    engine.add_request(manifest["prompts"][0], busy, greedy(40, ignore_eos=True))
    engine.step()  # the only slot is pinned: a hint can reach the host cache at most
    engine.hint([Hint(warmed)])
    deadline = time.time() + 10
    while warmed not in engine.residency.host_cache and time.time() < deadline:
        engine.step()
    engine.add_request(manifest["prompts"][0], warmed, greedy(2))  # hinted, waited in the host cache
    engine.add_request(manifest["prompts"][0], busy, greedy(2))  # on the device, but never hinted
    engine.hints.add(cold, time.monotonic())  # hinted, but nothing read it yet
    engine.add_request(manifest["prompts"][0], cold, greedy(2))
    m = engine.metrics()
    assert (m["hinted_on_device"], m["hinted_in_host"], m["hinted_from_disk"]) == (0, 1, 1)
    run_all(engine, check=True)


def test_adapter_wait_is_recorded_once_per_request(make_engine, manifest, adapter_names):
    """From arrival to the adapter's slot being ready: one sample per request with an adapter, none for the base."""
    engine = make_engine(num_slots=1)
    for adapter in [adapter_names[0], adapter_names[1], None]:
        engine.add_request(manifest["prompts"][0], adapter, greedy(3))
    run_all(engine, check=True)
    metrics = engine.metrics()
    wait, before = metrics["adapter_wait_seconds"], metrics["adapter_wait_before_load_seconds"]
    assert wait["count"] == before["count"] == 2 and wait["sum"] > 0
    # One slot: the second adapter's load began only once the first request freed it.
    assert 0 < before["sum"] <= wait["sum"]
    first, whole = metrics["first_token_seconds"], metrics["request_seconds"]  # every request, the base one too
    assert first["count"] == whole["count"] == 3 and wait["sum"] <= first["sum"] <= whole["sum"]


def test_a_hint_from_far_back_loads_nothing_until_the_request_nears_the_front(make_engine, adapter_names):
    """An `ahead` hint only fetches a remote adapter to the node (these are local: nothing to fetch); its upgrade to
    `waiting` loads it as any hint does, and counts as the same hint."""
    engine = make_engine(num_slots=2)
    adapter = adapter_names[2]
    engine.hint([Hint(adapter, "r1", HintKind.AHEAD)])
    for _ in range(5):
        engine.step()
    assert not engine.residency.is_loading() and adapter not in engine.routing_stats().resident
    assert adapter not in engine.residency.host_cache and engine.hints.ahead() == [adapter]
    engine.hint([Hint(adapter, "r1")])  # near the front now
    deadline = time.time() + 10
    while adapter not in engine.routing_stats().resident and time.time() < deadline:
        engine.step()
    assert adapter in engine.routing_stats().resident and engine.metrics()["hints_received"] == 1


def test_remote_adapters_of_far_back_hints_are_fetched_to_the_node_after_nearer_ones(make_engine, manifest,
                                                                                    adapter_names):
    """And a queued request's adapter still downloading is loaded only once it is on the node."""
    engine = make_engine(num_slots=2)
    fetched, on_node, downloading = [], set(), set()
    # the registry's node cache, as for remote adapters
    engine.residency._fetch_ahead = lambda adapter_ids, urgent: fetched.append((adapter_ids, urgent))
    engine.residency._on_node, engine.residency._is_fetching = on_node.__contains__, downloading.__contains__
    queued, near, far = adapter_names[:3]
    engine.hint([Hint(far, "r3", HintKind.AHEAD)])
    engine.hint([Hint(near, "r2")])
    downloading.add(queued)
    engine.add_request(manifest["prompts"][0], queued, greedy(2))
    for _ in range(3):
        engine.step()
    assert fetched[-1] == ([queued, near, far], frozenset({queued}))  # nearest first; the queued one urgent
    assert not engine.residency.host_cache.has(queued) and engine.residency.pool.lookup(queued) is None
    assert engine.residency.pool.lookup(far) is None and far not in engine.residency.host_cache
    downloading.clear()
    on_node.update(adapter_names)  # on the node now: the near one goes up the tiers, the far one stays
    run_all(engine, check=True)
    assert near in engine.routing_stats().resident and engine.residency.pool.lookup(far) is None
