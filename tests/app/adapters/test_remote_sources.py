"""Adapters in remote stores, against real servers: moto's S3 server and a server that never answers (HTTP roots:
test_remote_http.py).

A remote adapter registers from ranged reads and is refused as a local one would be; its bytes come through the
node cache, byte for byte those of the same adapter on disk; a store's faults reach clients as 404, 400 or 503
with Retry-After, and never for adapters already on the node.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import replace

import pytest
from transformers import AutoConfig

from adapter_helpers import edit_config, edit_tensors, llama_config, make_adapter
from app.adapters import fetcher, remote
from app.adapters.node_cache import NodeCache
from app.adapters.registry import CONFIG_NAME, WEIGHTS_NAME
from app.adapters.remote import RemoteObject, RemoteStore
from app.errors import (
    AdapterConfigMismatch,
    AdapterFormatError,
    AdapterInvalid,
    AdapterLoadFailed,
    AdapterRankTooHigh,
    AdapterShapeMismatch,
    AdapterSourceDenied,
    AdapterSourceMissing,
    AdapterStoreUnavailable,
)
from deploy.args import AppArgs
import store_helpers
from store_helpers import assert_same_bytes, silent_server, use_s3_endpoint, wait_for_fetches


moto_server, s3, spare_moto, file_server, foreign_server, registries = (  # the fixtures, under their names
    store_helpers.moto_server, store_helpers.s3, store_helpers.spare_moto, store_helpers.file_server,
    store_helpers.foreign_server, store_helpers.registries)


# --- S3 -------------------------------------------------------------------------------------------


def test_s3_adapters_register_from_ranges_and_read_like_local(s3, registries, tmp_path, demo_dir):
    base, adapters = AutoConfig.from_pretrained(demo_dir / "base"), demo_dir / "adapters"
    names = sorted(folder.name for folder in adapters.iterdir() if (folder / CONFIG_NAME).is_file())
    for name in names:
        s3.put_folder(adapters / name, f"adapters/{name}")
    cache = NodeCache(tmp_path / "cache", 1 << 24)
    registry, local = registries([s3.uri("adapters")], base, cache=cache), registries([adapters], base)
    for name in names:
        spec, twin = registry.register(name, s3.uri("adapters", name)), local.register(name, name)
        assert (spec.path, spec.weights_file) == (s3.uri("adapters", name), None)
        for field in ("rank", "target_modules", "module_ranks", "module_scales", "module_shapes", "nbytes"):
            assert getattr(spec, field) == getattr(twin, field), field
        md5 = hashlib.md5((adapters / name / WEIGHTS_NAME).read_bytes()).hexdigest()
        assert spec.remote.weights.checksum == ("md5", md5)
    assert registry.validate("again", names[0]).path == s3.uri("adapters", names[0])  # a bare name, under the root
    assert cache.snapshot()["downloads"] == 0 and cache.used_bytes() == 0  # registration only read ranges
    for name in names:
        assert not registry.on_node(name)
        assert_same_bytes(registry.read(registry.get(name), check_finite=True), local.read(local.get(name)))
        assert registry.on_node(name)
    assert_same_bytes(registry.read(registry.get(names[0])), local.read(local.get(names[0])))
    snapshot = registry.node_snapshot()
    assert (snapshot["downloads"], snapshot["hits"]) == (len(names), 1)
    files = [adapters / name / file for name in names for file in (CONFIG_NAME, WEIGHTS_NAME)]
    assert snapshot["used_bytes"] == sum(file.stat().st_size for file in files)


def test_large_files_come_in_checked_ranged_parts(s3, registries, tmp_path, monkeypatch):
    make_adapter(tmp_path / "local" / "a", r=16, target_modules="all-linear")
    uri = s3.put_folder(tmp_path / "local" / "a", "adapters/a")
    monkeypatch.setattr(remote, "PART_BYTES", 4096)
    registry = registries([s3.uri("adapters")], cache=NodeCache(tmp_path / "cache", 1 << 24), fetch_workers=4)
    spec = registry.register("a", uri)
    assert spec.nbytes > 10 * remote.PART_BYTES
    local = registries([tmp_path / "local"])
    assert_same_bytes(registry.read(spec, check_finite=True), local.read(local.register("a", "a")))
    weights = spec.remote.weights
    # Bytes that miss the ETag's MD5 while the object has changed since its stat: refused.
    with pytest.raises(AdapterStoreUnavailable, match="do not match the store's md5"):
        registry.store.download(replace(weights, checksum=("md5", "0" * 32), version="etag:older/1"), tmp_path / "w1")
    # The same miss on an unchanged object: its ETag is not an MD5 (SSE-KMS, SSE-C); the size is what is checked.
    registry.store.download(replace(weights, checksum=("md5", "0" * 32)), tmp_path / "w3")
    assert (tmp_path / "w3").read_bytes() == (tmp_path / "local" / "a" / WEIGHTS_NAME).read_bytes()
    with pytest.raises(AdapterStoreUnavailable, match=r"came back as \d+ bytes"):
        registry.store.download(replace(weights, size=weights.size + 1), tmp_path / "w2")


def _unlink(name):
    return lambda folder: (folder / name).unlink()


@pytest.mark.parametrize("make, edit, error", [
    (dict(base=llama_config(hidden=32), r=4), None, AdapterShapeMismatch),
    (dict(r=32), None, AdapterRankTooHigh),
    (dict(r=8), lambda folder: edit_config(folder, r=4), AdapterConfigMismatch),
    (dict(r=4, safe=False), None, AdapterFormatError),  # pickle weights only
    (dict(r=4), _unlink(CONFIG_NAME), AdapterFormatError),
    (dict(r=4), _unlink(WEIGHTS_NAME), AdapterFormatError),
    (dict(r=4), lambda f: (f / WEIGHTS_NAME).write_bytes((f / WEIGHTS_NAME).read_bytes()[:-100]), AdapterFormatError),
    (dict(r=4), lambda f: (f / WEIGHTS_NAME).write_bytes(b""), AdapterFormatError),  # a store refuses its ranges
    (dict(r=4), lambda f: (f / CONFIG_NAME).write_bytes(b""), AdapterFormatError),
], ids=["shapes", "rank", "config-rank", "pickle-only", "no-config", "no-weights", "truncated", "empty-weights",
        "empty-config"])
def test_s3_bad_adapters_are_refused_as_local_ones(s3, registries, tmp_path, make, edit, error):
    folder = tmp_path / "local" / "bad"
    make_adapter(folder, **make)
    if edit is not None:
        edit(folder)
    uri = s3.put_folder(folder, "adapters/bad")
    with pytest.raises(AdapterInvalid) as local:
        registries([tmp_path / "local"]).register("bad", "bad")
    with pytest.raises(AdapterInvalid) as remote_error:
        registries([s3.uri("adapters")]).register("bad", uri)
    assert type(local.value) is type(remote_error.value) is error
    assert remote_error.value.message.replace(uri, "FOLDER") == local.value.message.replace(str(folder), "FOLDER")


def test_s3_oversized_config_is_refused_before_it_is_read(s3, registries, tmp_path):
    make_adapter(tmp_path / "local" / "big", r=4)
    edit_config(tmp_path / "local" / "big", padding="x" * (1 << 20))
    uri = s3.put_folder(tmp_path / "local" / "big", "adapters/big")
    with pytest.raises(AdapterFormatError, match=f"{uri}/{CONFIG_NAME} is \\d+ bytes; at most 1048576 are read"):
        registries([s3.uri("adapters")]).register("big", uri)


def test_s3_nan_is_found_when_the_weights_arrive(s3, registries, tmp_path):
    make_adapter(tmp_path / "local" / "nan", r=4)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    edit_tensors(tmp_path / "local" / "nan", lambda t: t[key].view(-1).__setitem__(3, float("nan")))
    uri = s3.put_folder(tmp_path / "local" / "nan", "adapters/nan")
    registry = registries([s3.uri("adapters")], cache=NodeCache(tmp_path / "cache", 1 << 20))
    spec = registry.register("nan", uri)  # the header alone is read: the values are not
    with pytest.raises(AdapterLoadFailed, match=f"{key}' has 1 NaN/Inf"):
        registry.read(spec, check_finite=True)
    registry.read(spec)  # the engine's reads leave the check to the residency's bound check


def test_s3_missing_sources_are_404(s3, registries, tmp_path):
    registry = registries([s3.uri("adapters"), "s3://no-such-bucket/adapters"])
    for uri in (s3.uri("adapters", "nope"), "s3://no-such-bucket/adapters/a"):
        with pytest.raises(AdapterSourceMissing) as error:
            registry.register("x", uri)
        assert error.value.status_code == 404
        assert error.value.message.startswith(f"adapter 'x': {uri}/") and "does not exist" in error.value.message
        gone = RemoteObject(f"{uri}/{WEIGHTS_NAME}", 10, "etag:x/10", None)
        with pytest.raises(AdapterSourceMissing) as error:  # a download of an object deleted since its stat
            registry.store.download(gone, tmp_path / "gone")
        assert error.value.status_code == 404 and gone.uri in error.value.message
    with pytest.raises(AdapterFormatError, match=r"no such directory 'nope' under \['s3://"):
        registry.register("x", "nope")  # a bare name that no root holds, as with local roots


def test_s3_refused_credentials_are_400(spare_moto, monkeypatch, registries, tmp_path):
    spare_moto.enforce_auth()
    spare_moto.use(monkeypatch)
    bucket = spare_moto.bucket()
    make_adapter(tmp_path / "local" / "a", r=4)
    uri = bucket.put_folder(tmp_path / "local" / "a", "adapters/a")
    assert registries([bucket.uri("adapters")]).register("a", uri).rank == 4
    weights = registries([bucket.uri("adapters")]).register("a", uri).remote.weights
    for key_id, secret in (("AKIAUNKNOWNKEY000000", "whatever"), (spare_moto.key_id, "not the secret")):
        spare_moto.use(monkeypatch, key_id, secret)
        with pytest.raises(AdapterSourceDenied) as error:
            registries([bucket.uri("adapters")]).register("a", uri)
        assert error.value.status_code == 400
        assert uri in error.value.message and "check the credentials" in error.value.message
        store = RemoteStore([bucket.uri("adapters")])
        try:  # a download's ranged reads (obstore's client) are refused alike
            with pytest.raises(AdapterSourceDenied) as error:
                store.download(weights, tmp_path / "weights")
        finally:
            store.shutdown()
        assert error.value.status_code == 400 and weights.uri in error.value.message
        assert "<" not in error.value.message  # the store's answer is not quoted


def _count_stats(registry, monkeypatch) -> list[str]:
    asked, stat = [], registry.store.stat
    monkeypatch.setattr(registry.store, "stat", lambda uri: asked.append(uri) or stat(uri))
    return asked


def test_s3_miss_asks_the_store_nothing_before_its_download(s3, registries, tmp_path, monkeypatch):
    # One first-byte delay per adapter: both files' ranged GETs go at once, checked against the registered ETags.
    make_adapter(tmp_path / "local" / "a", r=4)
    uri = s3.put_folder(tmp_path / "local" / "a", "adapters/a")
    registry = registries([s3.uri("adapters")], cache=NodeCache(tmp_path / "cache", 1 << 20))
    spec = registry.register("a", uri)
    asked = _count_stats(registry, monkeypatch)
    local = registries([tmp_path / "local"])
    assert_same_bytes(registry.read(spec, check_finite=True), local.read(local.register("a", "a")))
    assert asked == []


def test_s3_changed_object_is_revalidated_and_its_new_bytes_served(s3, registries, tmp_path, monkeypatch):
    folder = tmp_path / "local" / "a"
    make_adapter(folder, r=4)
    uri = s3.put_folder(folder, "adapters/a")
    cache = NodeCache(tmp_path / "cache", 1 << 20)
    registry = registries([s3.uri("adapters")], cache=cache)
    spec = registry.register("a", uri)
    edit_tensors(folder, lambda tensors: [t.mul_(2) for k, t in tensors.items() if "lora_B" in k])
    s3.put_folder(folder, "adapters/a")  # same shapes and sizes, new bytes
    asked = _count_stats(registry, monkeypatch)
    local = registries([tmp_path / "local"])
    assert_same_bytes(registry.read(spec, check_finite=True), local.read(local.register("a", "a")))
    assert registry.is_cached(spec) and cache.stats.downloads == 1  # the new version, which the node now serves
    # The weights missed the registered ETag, so the store was asked for their version, then for the config's.
    assert sorted(asked) == sorted([spec.remote.config.uri, spec.remote.weights.uri])
    registry.read(spec)
    assert (cache.stats.downloads, cache.stats.hits) == (1, 1)


@pytest.mark.parametrize("change, phrase", [
    (lambda folder: make_adapter(folder, r=8), "its ranks no longer match"),
    (lambda folder: make_adapter(folder, r=4, lora_alpha=32), "its scales no longer match"),
    (lambda folder: edit_tensors(folder, lambda t: next(iter(t.values())).view(-1).__setitem__(0, float("inf"))),
     "NaN/Inf.*its new version in the store: replace it there"),
], ids=["rank", "scale", "inf"])
def test_s3_changed_object_that_no_longer_matches_is_refused(s3, registries, tmp_path, change, phrase):
    folder = tmp_path / "local" / "a"
    make_adapter(folder, r=4)
    uri = s3.put_folder(folder, "adapters/a")
    cache = NodeCache(tmp_path / "cache", 1 << 20)
    registry = registries([s3.uri("adapters")], cache=cache)
    spec = registry.register("a", uri)
    change(folder)
    s3.put_folder(folder, "adapters/a")
    with pytest.raises(AdapterLoadFailed, match=phrase) as error:
        registry.read(spec)
    assert error.value.status_code == 422
    assert cache.used_bytes() == 0 and list(cache.tmp.iterdir()) == []


def test_s3_object_shrunk_to_a_range_boundary_is_revalidated(s3, registries, tmp_path, monkeypatch):
    # Its first range comes back whole and the next lies past the new end: the store answers 416, which here
    # means "changed", not "down".
    folder = tmp_path / "local" / "a"
    make_adapter(folder, r=16, target_modules="all-linear")
    uri = s3.put_folder(folder, "adapters/a")
    registry = registries([s3.uri("adapters")], cache=NodeCache(tmp_path / "cache", 1 << 24))
    spec = registry.register("a", uri)
    make_adapter(folder, r=12, target_modules="all-linear")  # a config of the same size: its range comes back whole
    s3.put_folder(folder, "adapters/a")
    monkeypatch.setattr(remote, "PART_BYTES", (folder / WEIGHTS_NAME).stat().st_size)
    assert spec.remote.weights.size > remote.PART_BYTES
    assert spec.remote.config.size == (folder / CONFIG_NAME).stat().st_size
    with pytest.raises(AdapterLoadFailed, match="its ranks no longer match"):
        registry.read(spec)


def test_s3_store_down_fails_only_uncached_adapters(spare_moto, monkeypatch, registries, tmp_path, caplog):
    spare_moto.use(monkeypatch)
    bucket = spare_moto.bucket()
    for name, rank in (("a", 4), ("b", 2)):
        make_adapter(tmp_path / "local" / name, r=rank)
        bucket.put_folder(tmp_path / "local" / name, f"adapters/{name}")
    registry = registries([bucket.uri("adapters")], cache=NodeCache(tmp_path / "cache", 1 << 20))
    a, b = (registry.register(name, bucket.uri("adapters", name)) for name in "ab")
    registry.read(a)
    spare_moto.stop()
    started = time.monotonic()
    with pytest.raises(AdapterStoreUnavailable) as error:
        registry.read(b)
    assert error.value.status_code == 503 and error.value.retry_after_s > 0
    assert bucket.uri("adapters", "b") in error.value.message and "did not answer" in error.value.message
    with pytest.raises(AdapterStoreUnavailable, match="adapter 'c': .*did not answer"):
        registry.register("c", bucket.uri("adapters", "a"))
    local = registries([tmp_path / "local"])
    assert_same_bytes(registry.read(a), local.read(local.register("a", "a")))  # on the node: no store needed
    with caplog.at_level(logging.WARNING, logger="app.adapters.fetcher"):
        assert registry.fetch_ahead(["b"]) == 1  # starts, and never raises
        wait_for_fetches(registry)
    assert "fetching adapter 'b' ahead failed" in caplog.text and not registry.on_node("b")
    # for FAILED_FETCH_PAUSE_S, no fetch asks the store for it again: the read of a request that wants it does
    assert registry.fetch_ahead(["b"], urgent={"b"}) == 0 and not registry.is_fetching("b")
    monkeypatch.setattr(fetcher, "FAILED_FETCH_PAUSE_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="app.adapters.fetcher"):
        assert registry.fetch_ahead(["b"], urgent={"b"}) == 1
        wait_for_fetches(registry)
    assert "fetching adapter 'b' for a request queued here failed" in caplog.text
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_hung_store_fails_within_its_timeout(scheme, registries, monkeypatch, tmp_path):
    with silent_server() as url:
        root = f"{url}/adapters"
        if scheme == "s3":
            use_s3_endpoint(monkeypatch, url)
            root = "s3://bucket/adapters"
        registry = registries([root], fetch_timeout_s=1)
        hung = RemoteObject(f"{root}/a/{WEIGHTS_NAME}", 3 * remote.PART_BYTES, "etag:x/1", None)
        for what, attempt in (("registration", lambda: registry.register("a", f"{root}/a")),
                              ("download", lambda: registry.store.download(hung, tmp_path / "hung"))):
            # The first attempt also imports the store's client and builds it: seconds of CPU on a busy machine.
            # The second, timed, waits on the store alone.
            for _ in range(2):
                started = time.monotonic()
                with pytest.raises(AdapterStoreUnavailable) as error:
                    attempt()
                elapsed = time.monotonic() - started
            assert error.value.status_code == 503 and error.value.retry_after_s > 0
            assert elapsed < 10, f"a store that hangs held a {what} for {elapsed:.1f} s with a 1 s timeout"


# --- deployment arguments, fetches ahead ----------------------------------------------------------


def test_app_args_discover_the_adapters_in_a_bucket(s3, demo_dir, tmp_path):
    names = sorted(folder.name for folder in (demo_dir / "adapters").iterdir() if (folder / CONFIG_NAME).is_file())
    for name in names:
        s3.put_folder(demo_dir / "adapters" / name, f"adapters/{name}")
    s3.client.put_object(Bucket=s3.name, Key="adapters/README.md", Body=b"not an adapter")
    s3.client.put_object(Bucket=s3.name, Key="adapters/notes/todo.txt", Body=b"nor this")
    for name in (names[0], "extra"):  # a name under both roots is the first root's
        make_adapter(tmp_path / "local" / name, r=4)
    found = AppArgs(adapter_roots=[s3.uri("adapters"), str(tmp_path / "local")]).initial_adapters()
    assert found == {**{name: s3.uri("adapters", name) for name in names}, "extra": str(tmp_path / "local" / "extra")}
