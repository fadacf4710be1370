"""Remote adapter URIs, without a server: the one form they are judged on, the roots that hold them, the Hub's
filesystem and obstore's clients made offline, and the size, version and checksum each store's file listing gives."""

from __future__ import annotations

import socket

import pytest

from adapter_helpers import BASE
from app.adapters.ranged_reads import ObjectStores
from app.adapters.registry import AdapterRegistry
from app.adapters.remote import RemoteObject, RemoteStore, describe
from app.adapters.uris import normalize_uri
from app.errors import AdapterFormatError, AdapterPathOutsideRoots, AdapterSourceDenied, AdapterStoreUnavailable


@pytest.mark.parametrize("uri, normalized", [
    ("s3://bucket/adapters/", "s3://bucket/adapters"),
    ("S3://bucket/Adapters/a", "s3://bucket/Adapters/a"),
    ("s3a://bucket/a", "s3://bucket/a"),
    ("gcs://bucket/a", "gs://bucket/a"),
    ("gs://bucket/a/", "gs://bucket/a"),
    ("hf://org/repo@v1/sub", "hf://org/repo@v1/sub"),
    ("hf://datasets/org/repo/sub", "hf://datasets/org/repo/sub"),
    ("HTTPS://Models.Example.COM:8443/Path/a/", "https://models.example.com:8443/Path/a"),
])
def test_accepted_uri_forms(uri, normalized):
    assert normalize_uri(uri) == normalized


@pytest.mark.parametrize("uri, phrase", [
    ("s3://key:secret@bucket/a", "credentials"),
    ("http://user:pw@host/a", "credentials"),
    ("hf://token@org/repo", "credentials"),
    ("s3://bucket/a?versionId=1", "queries"),
    ("https://host/a#part", "fragments"),
    ("s3://bucket/a/../b", "'..'"),
    ("s3://bucket/./a", "'.'"),
    ("s3://bucket//a", "empty"),
    ("s3:///a", "empty"),
    ("s3://bucket/a\\b", "backslashes"),
    ("s3://bucket/a\x00b", "control characters"),
    ("s3://bucket/a\nb", "control characters"),
    ("s3://bucket/a b", "spaces"),
    ("http://host/a/%2e%2e/b", "percent-encoding"),
    ("ftp://host/a", "scheme 'ftp' is not served"),
    ("file:///etc/passwd", "scheme 'file' is not served"),
    ("bucket/a", "not a URI"),
])
def test_refused_uri_forms(uri, phrase):
    with pytest.raises(ValueError, match=phrase):
        normalize_uri(uri)


def test_uris_are_served_only_under_the_roots():
    store = RemoteStore(["s3://bucket/adapters", "hf://org", "https://host/models", "gs://other"])
    for uri, resolved in [
        ("s3://bucket/adapters/a", "s3://bucket/adapters/a"),
        ("S3://bucket/adapters/a/", "s3://bucket/adapters/a"),
        ("hf://org/repo@v1/sub", "hf://org/repo@v1/sub"),
        ("hf://org/repo", "hf://org/repo"),
        ("https://HOST/models/a", "https://host/models/a"),
        ("gcs://other/x", "gs://other/x"),
    ]:
        assert store.resolve("x", uri) == resolved
    for uri in ["s3://bucket/adaptersX/a", "s3://bucket/adapters-old/a", "s3://bucket/other/a",
                "s3://bucketX/adapters/a",
                "hf://orgX/repo", "hf://other/repo@v1", "https://host/modelsX/a", "http://host/models/a",
                "https://host:444/models/a", "https://evil.example/host/models/a", "gs://otherX/a"]:
        with pytest.raises(AdapterPathOutsideRoots, match="outside the adapter roots"):
            store.resolve("x", uri)
    with pytest.raises(AdapterFormatError, match="adapter 'x': .*'..'"):
        store.resolve("x", "s3://bucket/adapters/../secret")


def test_hub_roots_and_revisions():
    repo = RemoteStore(["hf://org/repo"])
    assert repo.resolve("x", "hf://org/repo@v1/a") == "hf://org/repo@v1/a"
    assert repo.resolve("x", "hf://org/repo/a") == "hf://org/repo/a"
    pinned = RemoteStore(["hf://org/repo@v1"])  # a root that names a revision admits that revision only
    assert pinned.resolve("x", "hf://org/repo@v1/a") == "hf://org/repo@v1/a"
    for uri in ("hf://org/repo@v2/a", "hf://org/repo/a", "hf://org/repo@v10/a", "hf://org/repo2@v1/a"):
        with pytest.raises(AdapterPathOutsideRoots):
            pinned.resolve("x", uri)


def test_remote_uri_without_a_remote_root(tmp_path):
    with pytest.raises(AdapterPathOutsideRoots, match="is remote, and no adapter root is"):
        AdapterRegistry([tmp_path], BASE, max_rank=16).register("x", "s3://bucket/adapters/a")


def test_hub_filesystem_is_made_without_the_network(monkeypatch):
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    fs, path = RemoteStore(["hf://org"]).filesystem("hf://org/repo@v1/a")
    assert type(fs).__name__ == "HfFileSystem" and path == "org/repo@v1/a"
    assert calls == []


def test_object_store_clients_come_from_the_environment_with_bounded_waits(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    stores = ObjectStores(timeout_s=7)
    s3, gcs = stores._make("s3", "bucket"), stores._make("gs", "bucket")  # no request goes out for either
    assert (type(s3).__name__, type(gcs).__name__) == ("S3Store", "GCSStore")
    for store in (s3, gcs):
        assert store.client_options["timeout"] == "7s" and store.retry_config["max_retries"] == 1
    assert (s3.client_options["allow_http"], gcs.client_options["allow_http"]) == ("true", "false")  # http:// endpoint


def test_s3_reads_without_credentials_are_denied(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(AdapterSourceDenied, match="no AWS credentials") as error:
        RemoteStore(["s3://bucket/adapters"]).read("s3://bucket/adapters/a/w", 0, 10)
    assert error.value.status_code == 400


_MD5 = "915a2ed4a335df2d6064afd6a4a21757"
_SHA256 = "5c2d1d9a5e1a1e0c3a8a3b1c0f1e2d3c4b5a69788796a5b4c3d2e1f0a9b8c7d6"
_BLOB = "0a1b2c3d4e5f60718293a4b5c6d7e8f901234567"
_MODIFIED = "Wed, 25 Nov 2026 17:30:21 GMT"


@pytest.mark.parametrize("info, version, checksum", [
    pytest.param({"ETag": f'"{_MD5}"', "LastModified": "2026-11-25T17:28:16Z", "size": 8192, "type": "file",
                  "name": "bucket/a/w", "StorageClass": "STANDARD", "VersionId": None},
                 f"etag:{_MD5}/8192", ("md5", _MD5), id="s3-single-part"),
    pytest.param({"ETag": f'"{_MD5}-3"', "LastModified": "2026-11-25T17:28:16Z", "size": 8192, "type": "file",
                  "name": "bucket/a/w"},
                 f"etag:{_MD5}-3/8192", None, id="s3-multipart"),
    pytest.param({"kind": "storage#object", "name": "bucket/a/w", "bucket": "bucket", "generation": "1764091696123456",
                  "metageneration": "1", "size": 8192, "md5Hash": "kVou1KM13y1gZK/WpKIXVw==", "crc32c": "yZRlqg==",
                  "etag": "CMDk5pXr0ZEDEAE=", "updated": "2026-11-25T17:28:16.123Z", "type": "file"},
                 "generation:1764091696123456/8192", ("md5", _MD5), id="gcs"),
    pytest.param({"name": "org/repo/w", "size": 8192, "type": "file", "blob_id": _BLOB,
                  "lfs": {"size": 8192, "sha256": _SHA256, "pointer_size": 134}, "last_commit": None, "security": None},
                 f"sha256:{_SHA256}/8192", ("sha256", _SHA256), id="hub-lfs"),
    pytest.param({"name": "org/repo/adapter_config.json", "size": 1181, "type": "file", "blob_id": _BLOB, "lfs": None},
                 f"blob:{_BLOB}/1181", None, id="hub-git"),
    pytest.param({"name": "http://h/a/w", "size": 8192, "mimetype": "application/octet-stream", "url": "http://h/a/w",
                  "ETag": f'"{_MD5}"', "Last-Modified": _MODIFIED, "type": "file"},
                 f"etag:{_MD5}/8192", None, id="http-etag"),  # an HTTP ETag is no promise of an MD5
    pytest.param({"name": "http://h/a/w", "size": 8192, "mimetype": "application/octet-stream", "url": "http://h/a/w",
                  "Last-Modified": _MODIFIED, "type": "file"},
                 f"modified:{_MODIFIED}/8192", None, id="http-no-etag"),
    pytest.param({"name": "http://h/a/w", "size": 8192, "type": "file"}, "size:8192/8192", None, id="http-bare"),
])
def test_describe_what_each_store_says(info, version, checksum):
    assert describe("u://x", info) == RemoteObject("u://x", info["size"], version, checksum)


def test_describe_without_a_size():
    with pytest.raises(AdapterStoreUnavailable, match="gave no size"):
        describe("http://h/a/w", {"name": "http://h/a/w", "size": None, "type": "file"})
