"""The serve bench's emulated remote store without Ray: moto's S3 server behind the proxy delays each response's
first byte and caps each connection's bandwidth as configured, every shard holds each distinct weights file that
the adapters' weights keys alias, the proxies spread one object's ranges over the shards, the bench's adapters
upload to it, and a run's node cache counters add up over replicas."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.adapter_pool import CONFIG_NAME, WEIGHTS_NAME
from bench.serve.arms import NODE_CACHE_COUNTERS, hinted_hit_rate, remote_delta, remote_summary
from bench.serve.remote_adapters import RemoteAdapters, _run_on
from bench.serve.store import BUCKET, SOURCES, EmulatedStore, StoreConfig
from bench.serve.store_proxy import route

pytest.importorskip("moto.server")

LATENCY_MS, MBPS = 100.0, 20.0


@pytest.fixture
def store_env(monkeypatch):
    """The store's environment, which RemoteAdapters sets for the Ray workers to come, gone after the test."""
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION"):
        monkeypatch.delenv(key, raising=False)


def tiny_adapter(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.randn(2, 8, generator=gen)},
              folder / WEIGHTS_NAME)
    (folder / CONFIG_NAME).write_text('{"r": 2}')
    return folder


def test_proxy_delays_first_bytes_and_caps_bandwidth(tmp_path):
    blob = tmp_path / "blob"
    blob.mkdir()
    (blob / CONFIG_NAME).write_text("{}")
    (blob / WEIGHTS_NAME).write_bytes(os.urandom(6_000_000))
    with EmulatedStore(StoreConfig(LATENCY_MS, MBPS, shards=1, proxies=1)) as store:
        store.upload([blob], ["blob"])
        floor = store.measure([f"{store.root}/blob/{WEIGHTS_NAME}"], repeats=3, connections=2)
    assert LATENCY_MS <= floor["ttfb_ms_p50"] < LATENCY_MS + 1000
    # One GET of 6 MB at 20 MB/s takes 0.3 s after its first byte; moto alone is several times faster.
    assert MBPS / 3 < floor["single_connection_mb_per_s_after_first_byte"] <= MBPS * 1.15
    assert floor["parallel_mb_per_s"] <= 2 * MBPS * 1.15  # two connections, each capped
    assert floor["app_download_s"] >= LATENCY_MS / 1e3


def test_adapters_upload_and_repeat_under_their_own_names(tmp_path, store_env):
    first, second = tiny_adapter(tmp_path / "a", 0), tiny_adapter(tmp_path / "b", 1)
    remote = RemoteAdapters(StoreConfig(0.0, 1000.0, shards=2, proxies=2), [first, second, first],
                            ["x-0", "x-1", "x-2"], cache_adapters=None, cache_root=str(tmp_path))
    try:
        # the two distinct weights files in both shards, the three configs in shard 0 (one a copy), three aliases
        assert remote.upload["distinct"] == 2 and remote.upload["aliases"] == 3
        assert remote.upload["uploaded_objects"] == 2 * 2 + 2 and remote.upload["copied_in_store"] == 1
        assert os.environ["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{remote.store.proxy_port}"
        through_proxy = remote.store.filesystem(direct=False)
        root = remote.root.removeprefix("s3://")
        assert sorted(p.rsplit("/", 1)[1] for p in through_proxy.ls(root)) == ["x-0", "x-1", "x-2"]
        assert through_proxy.cat_file(f"{root}/x-2/{WEIGHTS_NAME}") == (first / WEIGHTS_NAME).read_bytes()
        assert through_proxy.cat_file(f"{root}/x-1/{WEIGHTS_NAME}") == (second / WEIGHTS_NAME).read_bytes()
        entry = sum(os.path.getsize(first / n) for n in (CONFIG_NAME, WEIGHTS_NAME))
        assert remote.cache_bytes == 3 * entry  # every adapter fits by default
        fields = remote.fresh_cache()
        assert fields["adapter_cache_bytes"] == remote.cache_bytes and not os.listdir(fields["adapter_cache_dir"])
        again = remote.fresh_cache()["adapter_cache_dir"]  # the next arm's: a new, empty folder
        assert again != fields["adapter_cache_dir"] and not os.path.exists(fields["adapter_cache_dir"])
    finally:
        remote.close()
    assert not os.path.exists(again)


def test_one_objects_ranges_go_to_several_shards_and_read_its_bytes(tmp_path):
    key, source = f"b/p/a-0/{WEIGHTS_NAME}", f"b/{SOURCES}/0/{WEIGHTS_NAME}"
    head = f"GET /{key}?x=1 HTTP/1.1\r\nHost: h\r\nRange: bytes={{}}-{{}}\r\n\r\n"
    routes = [route(head.format(start, start + 99).encode(), {key: source}, 4) for start in range(0, 6400, 100)]
    assert len({shard for shard, _ in routes}) == 4
    assert all(sent.startswith(f"GET /{source}?x=1 HTTP/1.1\r\n".encode()) and sent.endswith(b"\r\n\r\n")
               for _, sent in routes)
    listing = b"GET /b?list-type=2&prefix=p%2F HTTP/1.1\r\n\r\n"
    assert route(listing, {key: source}, 4) == (0, listing) and route(b"garbage", {}, 4) == (0, b"garbage")

    folders = [tiny_adapter(tmp_path / f"a{i}", i) for i in range(3)]
    folders[2] = folders[0]  # repeats its bytes under another name
    names = [f"adapter-{i}" for i in range(3)]
    with EmulatedStore(StoreConfig(0.0, 1000.0, shards=3, proxies=2)) as store:
        store.upload(folders, names)
        root = store.root.removeprefix("s3://")
        for shard in range(3):
            direct = store.filesystem(direct=True, shard=shard)
            assert len(direct.ls(f"{BUCKET}/{SOURCES}")) == 2  # the distinct weights, in every shard
            assert not direct.exists(f"{root}/{names[0]}/{WEIGHTS_NAME}")  # only an alias
        through_proxies = store.filesystem(direct=False)
        assert sorted(p.rsplit("/", 1)[1] for p in through_proxies.ls(root)) == names
        for folder, name in zip(folders, names):
            weights = (folder / WEIGHTS_NAME).read_bytes()
            assert through_proxies.cat_file(f"{root}/{name}/{CONFIG_NAME}") == (folder / CONFIG_NAME).read_bytes()
            assert through_proxies.cat_file(f"{root}/{name}/{WEIGHTS_NAME}") == weights
            assert all(through_proxies.cat_file(f"{root}/{name}/{WEIGHTS_NAME}", start=i, end=i + 7) ==
                       weights[i:i + 7] for i in range(0, len(weights) - 7, 7))
            assert through_proxies.info(f"{root}/{name}/{WEIGHTS_NAME}")["size"] == len(weights)


def test_a_remote_registration_waits_about_one_round_trip(tmp_path, monkeypatch, demo_dir):
    """The registry's four reads (both files' stats, the config, the header) go out at once: through a store that
    delays every response by 300 ms, one registration takes well under the 1.5 s that five reads in turn take."""
    from transformers import AutoConfig

    from app.adapters.registry import AdapterRegistry

    latency_s = 0.3
    with EmulatedStore(StoreConfig(latency_s * 1e3, 1000.0, shards=1, proxies=1)) as store:
        store.upload([Path(demo_dir) / "adapters" / "pirate"], ["pirate"])
        for key, value in store.env().items():
            monkeypatch.setenv(key, value)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches filesystems by arguments, not by environment
        registry = AdapterRegistry([store.root], AutoConfig.from_pretrained(Path(demo_dir) / "base"), 16)
        try:
            registry.register("warm", f"{store.root}/pirate")  # opens the connections
            started = time.perf_counter()
            spec = registry.register("pirate", f"{store.root}/pirate")
            elapsed = time.perf_counter() - started
        finally:
            registry.shutdown()
            s3fs.S3FileSystem.clear_instance_cache()
    assert spec.remote is not None and spec.rank > 0
    assert latency_s <= elapsed < 2.5 * latency_s, elapsed


def test_remote_counters_are_the_node_caches_summed_over_replicas():
    def snapshot(downloads: int, ahead: int, used: int, from_store: int) -> dict:
        cache = {k: 0 for k in NODE_CACHE_COUNTERS}
        cache.update(downloads=downloads, downloaded_bytes=100 * downloads, fetched_ahead=ahead,
                     fetched_ahead_bytes=100 * ahead, fetched_ahead_used=used, fetched_ahead_used_bytes=100 * used)
        return {"node_cache": cache, "hinted_from_store": from_store}

    first = remote_delta(snapshot(1, 1, 0, 0), snapshot(5, 4, 2, 1))  # 4 downloads, 3 ahead, 2 used
    second = remote_delta(snapshot(0, 0, 0, 0), snapshot(2, 2, 2, 1))
    assert remote_delta({}, {}) == {**{k: 0 for k in NODE_CACHE_COUNTERS}, "hinted_from_store": 0}  # local adapters
    delta = {"hinted_on_device": 3, "hinted_in_host": 1, "hinted_from_disk": 2,
             "remote": {**{k: first[k] + second[k] for k in first}, "adapters_requested": 5}}
    summary = remote_summary(delta)
    assert summary["downloads"] == 6 and summary["fetched_bytes"] == 600 and summary["extra_downloads"] == 1
    assert summary["wasted_fetches"] == 1 and summary["wasted_fetch_bytes"] == 100  # 5 ahead, 4 used
    assert summary["wasted_remote_bytes"] == 100 and summary["wasted_remote_share"] == 100 / 600  # 1 extra
    delta["remote"]["adapters_requested"] = 7  # a request may fail before its fetch: no negative waste
    assert remote_summary(delta)["wasted_remote_bytes"] == 0 == remote_summary(delta)["wasted_remote_share"]
    assert summary["hinted_from_store"] == 2 and summary["hinted_on_node_share"] == 6 / 8
    assert hinted_hit_rate(delta) == 3 / 8  # the store tier counts among the hinted arrivals
    assert remote_summary({"hinted_on_device": 0}) is None


def test_fetch_contention_times_the_loop_in_every_phase(tmp_path):
    from bench.serve import fetch_contention

    path = fetch_contention.main(["--downloads", "2", "--object-mb", "1", "--rounds", "1", "--repeats", "1",
                                  "--shards", "1", "--proxies", "1", "--latency-ms", "10", "--step-ops", "20",
                                  "--idle-s", "1", "--results-dir", str(tmp_path)])
    phases = json.loads(path.read_text())["phases"]
    assert [p["phase"] for p in phases] == ["idle", "2 downloads in the loop's process",
                                            "2 downloads in a child process"]
    assert all(p["steps"] > 0 and p["step_ms_p50"] >= 7.0 for p in phases)  # 2 ms of Python + 7 ms asleep, at least
    assert all(p["download_mb_per_s"] > 0 for p in phases[1:])
    assert all(p["gil_wait_ms"]["wakes"] > 0 and p["gil_wait_ms"]["mean"] >= 0 for p in phases)


def test_fetch_contention_reads_the_store_as_an_http_root(tmp_path):
    from bench.serve import fetch_contention

    path = fetch_contention.main(["--downloads", "1", "--object-mb", "1", "--rounds", "1", "--repeats", "1",
                                  "--shards", "1", "--proxies", "1", "--latency-ms", "10", "--idle-s", "0.5",
                                  "--scheme", "http", "--results-dir", str(tmp_path)])
    assert path.name.endswith("-fetch-contention-http.json")
    assert all(p["download_mb_per_s"] > 0 for p in json.loads(path.read_text())["phases"][1:])


def test_urgent_fetch_times_the_waited_download_each_way(tmp_path):
    from bench.serve import urgent_fetch

    path = urgent_fetch.main(["--ahead", "2", "--object-mb", "1", "--repeats", "1", "--shards", "1", "--proxies", "1",
                              "--latency-ms", "10", "--after-s", "0.05", "--results-dir", str(tmp_path)])
    waited = json.loads(path.read_text())["waited_download"]
    assert sorted(waited) == ["alone", "in order", "urgent"]
    assert all(len(w["runs_s"]) == (2 if name == "alone" else 1) and w["median_s"] > 0 for name, w in waited.items())


def test_the_store_runs_on_its_own_cores(tmp_path, store_env):
    mine = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="at least one"):
        StoreConfig(cores=len(mine))
    if len(mine) < 2:
        pytest.skip("one core: nothing to split")
    with EmulatedStore(StoreConfig(0.0, 1000.0, shards=1, proxies=1, cores=1)) as store:
        store.upload([tiny_adapter(tmp_path / "a", 0)], ["a"])
        assert store.cores == {mine[-1]} and store.other_cores == set(mine[:-1])
        assert all(os.sched_getaffinity(pid) == {mine[-1]} for pid in store.pids())
        assert store.filesystem(direct=False).cat_file(f"{store.root.removeprefix('s3://')}/a/{CONFIG_NAME}")
    assert os.sched_getaffinity(0) == set(mine)  # the store alone moves nothing else
    remote = RemoteAdapters(StoreConfig(0.0, 1000.0, shards=1, proxies=1, cores=1), [tmp_path / "a"], ["b"],
                            cache_adapters=None, cache_root=str(tmp_path))
    try:  # the bench's process, and the Ray cluster it starts next, on the other cores
        assert os.sched_getaffinity(0) == set(mine[:-1])
        assert all(os.sched_getaffinity(pid) == {mine[-1]} for pid in remote.store.pids())
    finally:
        remote.close()
        _run_on(set(mine))
