"""Node cache entries that are not what the cache downloaded, against real stores (moto's S3 server, http.server):
an entry put there by hand or damaged on disk is never served but downloaded again, and a copy that is still bad
once downloaded again is refused with what recovers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import store_helpers
from adapter_helpers import edit_tensors, make_adapter
from app.adapters import remote
from app.adapters.node_cache import CacheKey, NodeCache
from app.adapters.registry import WEIGHTS_NAME
from app.errors import AdapterLoadFailed
from test_remote_sources import assert_same_bytes

moto_server, s3, file_server, registries = (  # the fixtures, under their names
    store_helpers.moto_server, store_helpers.s3, store_helpers.file_server, store_helpers.registries)
NAN_KEY = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"


def publish(request, tmp_path: Path, scheme: str) -> str:
    """The root URI of a store of `scheme` that holds the adapters of tmp_path / "local"."""
    if scheme == "http":
        server = request.getfixturevalue("file_server")
        shutil.copytree(tmp_path / "local", tmp_path / "www" / "adapters")
        return f"{server.url}/adapters"
    bucket = request.getfixturevalue("s3")
    for folder in sorted((tmp_path / "local").iterdir()):
        bucket.put_folder(folder, f"adapters/{folder.name}")
    return bucket.uri("adapters")


def plant(cache: NodeCache, spec, files: Path) -> Path:
    """Put a copy of the folder `files` where the cache keeps `spec`'s entry, as anything but the cache would."""
    folder = cache.path(CacheKey(str(spec.path), spec.remote.version))
    shutil.copytree(files, folder)
    return folder


def other_weights(tmp_path: Path) -> Path:
    """An adapter of the same shapes and file sizes as make_adapter(r=4)'s, with other finite weights."""
    folder = tmp_path / "other"
    make_adapter(folder, r=4)
    edit_tensors(folder, lambda tensors: [t.uniform_(-1, 1) for t in tensors.values()])
    return folder


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_an_entry_put_there_by_hand_is_downloaded_again(scheme, request, registries, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "PART_BYTES", 3000)  # several parts, hashed as each arrives
    make_adapter(tmp_path / "local" / "a", r=4)
    root = publish(request, tmp_path, scheme)
    cache = NodeCache(tmp_path / "cache", 1 << 24)
    registry = registries([root], cache=cache)
    spec = registry.register("a", f"{root}/a")
    planted = plant(cache, spec, other_weights(tmp_path))
    assert (planted / WEIGHTS_NAME).stat().st_size == spec.nbytes
    assert registry.on_node("a")  # held, as far as the node can tell without reading it
    local = registries([tmp_path / "local"])
    expected = local.read(local.register("a", "a"))
    assert_same_bytes(registry.read(spec, check_finite=True), expected)
    assert (cache.stats.failed_checks, cache.stats.downloads, cache.stats.hits) == (1, 1, 0)
    assert_same_bytes(registry.read(spec), expected)
    assert (cache.stats.failed_checks, cache.stats.downloads, cache.stats.hits) == (1, 1, 1)
    replica = registries([root], cache=NodeCache(tmp_path / "cache", 1 << 24))  # another process on the node
    assert_same_bytes(replica.read(replica.register("a", f"{root}/a")), expected)
    assert (replica.cache.stats.failed_checks, replica.cache.stats.hits) == (0, 1)  # the download's record holds


def test_a_truncated_entry_is_downloaded_again_once(request, registries, tmp_path):
    make_adapter(tmp_path / "local" / "a", r=4)
    root = publish(request, tmp_path, "http")
    registry = registries([root], cache=NodeCache(tmp_path / "cache", 1 << 24))
    spec = registry.register("a", f"{root}/a")
    registry.read(spec)
    weights = registry.cache.path(CacheKey(str(spec.path), spec.remote.version)) / WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[: spec.nbytes // 2])
    cache = NodeCache(tmp_path / "cache", 1 << 24)  # another replica of the node, or this one restarted
    replica = registries([root], cache=cache)
    spec = replica.register("a", f"{root}/a")
    server = request.getfixturevalue("file_server")
    gets = server.gets[f"/adapters/a/{WEIGHTS_NAME}"]
    local = registries([tmp_path / "local"])
    expected = local.read(local.register("a", "a"))
    for _ in range(2):
        assert_same_bytes(replica.read(spec, check_finite=True), expected)
    assert server.gets[f"/adapters/a/{WEIGHTS_NAME}"] - gets == 1
    assert (cache.stats.failed_checks, cache.stats.downloads, cache.stats.hits) == (1, 1, 1)


def test_an_entry_still_bad_once_downloaded_again_is_refused_with_what_recovers(s3, registries, tmp_path):
    make_adapter(tmp_path / "local" / "a", r=4)
    edit_tensors(tmp_path / "local" / "a", lambda t: t[NAN_KEY].view(-1).__setitem__(3, float("nan")))
    uri = s3.put_folder(tmp_path / "local" / "a", "adapters/a")
    cache = NodeCache(tmp_path / "cache", 1 << 24)
    registry = registries([s3.uri("adapters")], cache=cache)
    spec = registry.register("a", uri)  # its header is sound: the values are read when the weights arrive
    plant(cache, spec, other_weights(tmp_path))
    with pytest.raises(AdapterLoadFailed) as error:
        registry.read(spec, check_finite=True)
    assert error.value.status_code == 422 and f"{NAN_KEY}' has 1 NaN/Inf" in error.value.message
    assert f"downloaded from {uri} just now: its store holds these bytes, so replace them there" in error.value.message
    assert "re-register" not in error.value.message
    assert (cache.stats.failed_checks, cache.stats.downloads) == (1, 1)
    assert not registry.on_node("a") and cache.used_bytes() == 0  # dropped: the next read downloads it again
    make_adapter(tmp_path / "local" / "a", r=4)
    s3.put_folder(tmp_path / "local" / "a", "adapters/a")  # replaced in the store, and nothing else done
    local = registries([tmp_path / "local"])
    assert_same_bytes(registry.read(spec, check_finite=True), local.read(local.register("a", "a")))
