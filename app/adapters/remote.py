"""Adapters kept where users keep them: object stores (s3://, gs://), the Hugging Face Hub (hf://) and HTTP servers.

Sizes, versions and listings come through fsspec and its maintained filesystems (s3fs, gcsfs, huggingface_hub's
HfFileSystem, fsspec's HTTPFileSystem); ranged reads through obstore for s3:// and gs://, through urllib3 for
http(s):// and through HfFileSystem for hf:// (app/adapters/ranged_reads.py). Credentials and endpoints come from
the environment and the usual config files (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS,
HF_TOKEN, HF_ENDPOINT, ...), never from a request: a URI that carries credentials, a query or a fragment is
refused. A URI is served only under one of the configured remote roots, judged on its normalized form, and an
HTTP redirect is followed only to a target under them too (app/adapters/uris.py). A ranged read holds no more
than its range, even from a server that ignores Range.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path

import fsspec

from app.adapters.part_digests import PartDigests, part_hasher
from app.adapters.part_pool import PartPool
from app.adapters.ranged_reads import OBJECT_STORE_SCHEMES, HTTPRanges, ObjectStores, redirect_guard
from app.adapters.uris import is_under, normalize_uri
from app.errors import (
    AdapterFormatError,
    AdapterPathOutsideRoots,
    AdapterSourceDenied,
    AdapterSourceMissing,
    AdapterStoreUnavailable,
    ServingError,
)

log = logging.getLogger(__name__)
PART_BYTES = 16 * 1024 * 1024  # one ranged GET of a large file; parts of one file are fetched at once
_CONNECTIONS = 96  # per host: more than the reads that registrations and downloads run at once


@dataclass(frozen=True)
class RemoteObject:
    """One remote file as the store describes it."""

    uri: str
    size: int
    version: str  # what changes when the content does: an ETag, a GCS generation, a Hub blob hash
    checksum: tuple[str, str] | None  # (hashlib algorithm, hex digest) the bytes must have, where the store says


def describe(uri: str, info: dict) -> RemoteObject:
    """The size, version and checksum of a file from its fsspec `info` (the fields differ per store)."""
    size = info.get("size")
    if not isinstance(size, int) or size < 0:
        raise AdapterStoreUnavailable(f"{uri}: the store gave no size for it")
    lfs = info.get("lfs") or {}
    checksum = None
    if isinstance(lfs, dict) and lfs.get("sha256"):  # the Hub: an LFS file's content hash
        checksum = ("sha256", str(lfs["sha256"]))
    elif info.get("md5Hash"):  # GCS: base64 of the MD5
        checksum = ("md5", base64.b64decode(info["md5Hash"]).hex())
    etag = str(info.get("ETag") or info.get("etag") or "").strip('"')
    if checksum is None and re.fullmatch(r"[0-9a-f]{32}", etag) and info.get("type") == "file" and "LastModified" in info:
        checksum = ("md5", etag)  # S3: a single-part upload's ETag is its MD5 (a multipart one ends in -N)
    version = next((f"{name}:{value}" for name, value in (
        ("sha256", checksum[1] if checksum and checksum[0] == "sha256" else None),
        ("blob", info.get("blob_id")),
        ("generation", info.get("generation")),
        ("etag", etag or None),
        ("modified", info.get("LastModified") or info.get("Last-Modified") or info.get("last_modified")
         or info.get("mtime")),
    ) if value), f"size:{size}")
    return RemoteObject(uri, size, f"{version}/{size}", checksum)


class ObjectChanged(AdapterStoreUnavailable):
    """The bytes that came back are not those of the version asked for: the object changed in its store.
    `current`: the object as the store described it when the check asked it (None where it was not asked)."""

    def __init__(self, message: str, *, retry_after_s: float | None = AdapterStoreUnavailable.RETRY_AFTER_S,
                 current: RemoteObject | None = None):
        super().__init__(message, retry_after_s=retry_after_s)
        self.current = current


class RemoteStore:
    """The remote adapter roots, and reads under them: fsspec's filesystems (made once per protocol and host),
    obstore's clients (once per bucket) and urllib3's pools (once per host), so connections are reused.
    Downloads' parts run on `parts`, `workers` at once, those of adapters that requests wait for first."""

    def __init__(self, roots: Sequence[str], timeout_s: float = 60.0, workers: int = 8):
        self.roots = tuple(normalize_uri(root) for root in roots)
        self.timeout_s = timeout_s
        self._filesystems: dict[str, fsspec.AbstractFileSystem] = {}
        self._lock = threading.Lock()
        self._objects = ObjectStores(timeout_s)
        self._http = HTTPRanges(self.roots, timeout_s, _CONNECTIONS)
        self.parts = PartPool(workers, "adapter-fetch-part")

    def resolve(self, adapter_id: str, uri: str) -> str:
        """The normalized URI, if it lies under a remote root; AdapterPathOutsideRoots otherwise."""
        try:
            normalized = normalize_uri(uri)
        except ValueError as e:
            raise AdapterFormatError(f"adapter '{adapter_id}': {e}") from e
        if not any(is_under(normalized, root) for root in self.roots):
            raise AdapterPathOutsideRoots(
                f"adapter '{adapter_id}': {normalized} is outside the adapter roots {list(self.roots)}")
        return normalized

    def under_roots(self, name: str) -> list[str]:
        """Where a bare name (no scheme, no '/') may lie: under each remote root, in order."""
        return [f"{root}/{name}" for root in self.roots]

    def filesystem(self, uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
        scheme, rest = uri.split("://", 1)
        key = f"{scheme}://{rest.split('/', 1)[0]}" if scheme in ("http", "https") else scheme
        with self._lock:
            fs = self._filesystems.get(key)
            if fs is None:
                fs = self._filesystems[key] = fsspec.filesystem(scheme, **self._options(scheme))
                if scheme == "s3":  # botocore retries already (config_kwargs): s3fs's own 5 on top would make
                    fs.retries = 1  # a store that hangs take 15 timeouts (fsspec shares `fs` only with like options)
        return fs, fs._strip_protocol(uri) if scheme not in ("http", "https") else uri

    def _options(self, scheme: str) -> dict:
        # Bounded waits, so that a store that hangs fails its requests instead of holding them.
        if scheme == "s3":
            # botocore's pool holds 10 connections: fewer than the reads that registrations and downloads run at once
            return {"config_kwargs": {"connect_timeout": min(10.0, self.timeout_s), "read_timeout": self.timeout_s,
                                      "retries": {"max_attempts": 2}, "max_pool_connections": _CONNECTIONS}}
        if scheme in ("http", "https"):
            import aiohttp

            return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=self.timeout_s, connect=10),
                                      "trace_configs": [redirect_guard(self.roots)]}}
        if scheme == "gs":
            return {"timeout": self.timeout_s}
        return {}

    def stat(self, uri: str) -> RemoteObject:
        fs, path = self.filesystem(uri)
        with store_errors(uri):
            fs.invalidate_cache(path)  # listings are cached by fsspec; a changed object must show as changed
            return describe(uri, fs.info(path))

    def read(self, uri: str, start: int, end: int) -> bytes:
        with store_errors(uri):
            return b"".join(self._chunks(uri, start, end))

    def names(self, uri: str) -> list[str]:
        """The names right under the folder `uri`; [] where there is no such folder."""
        fs, path = self.filesystem(uri)
        try:
            with store_errors(uri):
                fs.invalidate_cache(path)
                return sorted({name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(path, detail=False)})
        except AdapterSourceMissing:
            return []

    def discover(self, root: str, config_name: str) -> dict[str, str]:
        """name -> URI of every folder right under `root` that holds `config_name` (one listing on S3 and GCS)."""
        fs, path = self.filesystem(root)
        with store_errors(root):
            fs.invalidate_cache(path)
            found = fs.glob(f"{path.rstrip('/')}/*/{config_name}")
        scheme = root.split("://", 1)[0]
        out = {}
        for name in sorted(found):
            folder = name.rsplit("/", 1)[0]
            uri = folder if "://" in folder else f"{scheme}://{folder}"
            out.setdefault(uri.rsplit("/", 1)[-1], uri)
        return out

    def download(self, obj: RemoteObject, dest: Path) -> None:
        self.download_all([(obj, dest)])

    def download_all(self, files: Sequence[tuple[RemoteObject, Path]], key: str | None = None
                     ) -> dict[Path, PartDigests]:
        """Write each object to its path, the PART_BYTES ranges of all of them fetched at once (so that one
        first-byte delay covers them all), then check each one's size and, where the store gives one, its
        checksum. The bytes are checked against the object as described, with no request to the store first:
        ObjectChanged where they are another version's. The caller owns the paths (temporary names it renames
        once this returns). The parts are queued on `parts` under `key` (the adapter's URI; each object's own
        URI where None): they go ahead of other downloads' while a request waits for `key`. Returns each path's
        digests, hashed from the parts as they arrived."""
        part_bytes = PART_BYTES
        for obj, dest in files:
            with open(dest, "wb") as f:
                f.truncate(obj.size)
        parts = [(obj, dest, start, min(start + part_bytes, obj.size))
                 for obj, dest in files for start in range(0, obj.size, part_bytes)]
        futures = [self.parts.submit(key or part[0].uri, self._write_part, *part) for part in parts]
        try:
            dest_to_digests: dict[Path, list[str]] = {dest: [] for _, dest in files}
            for (_, dest, _, _), future in zip(parts, futures):
                dest_to_digests[dest].append(future.result())
        finally:  # the caller may remove the files once this returns: no part may still be writing
            for future in futures:
                future.cancel()
            wait(futures)
        for obj, dest in files:
            fd = os.open(dest, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._check(obj, dest)
        return {dest: PartDigests(obj.size, part_bytes, tuple(dest_to_digests[dest])) for obj, dest in files}

    def _write_part(self, obj: RemoteObject, dest: Path, start: int, end: int) -> str:
        """Fetch bytes [start, end) of `obj` and write them into `dest` (already at its full size) at `start`,
        chunk by chunk as they arrive; their digest. ObjectChanged where the store holds fewer bytes than `obj`
        says, as another version would. Hashing and writing let go of the GIL, as obstore's reads do, and no
        chunk outlives its write: the process never allocates or frees a whole part at once."""
        hasher, at = part_hasher(), start
        fd = os.open(dest, os.O_WRONLY)
        try:
            with store_errors(obj.uri):
                chunks = self._chunks(obj.uri, start, end)
            while True:
                with store_errors(obj.uri):
                    chunk = next(chunks, None)
                if chunk is None:
                    break
                view = memoryview(chunk)[:end - at]  # a store that sent more than the range: the rest dropped
                hasher.update(view)
                while view:
                    written = os.pwrite(fd, view, at)
                    view, at = view[written:], at + written
        except AdapterStoreUnavailable as e:
            if any(_is_past_end(error) for error in _chain(e.__cause__)):
                raise ObjectChanged(f"{obj.uri}: bytes {start}-{end} lie past its end (did it change?)") from e
            raise
        finally:
            os.close(fd)
        if at != end:
            raise ObjectChanged(f"{obj.uri}: bytes {start}-{end} came back as {at - start} bytes (did it change?)")
        return hasher.hexdigest()

    def _chunks(self, uri: str, start: int, end: int) -> Iterator:
        """Bytes [start, end) of `uri` (fewer where it ends sooner), as bytes-like chunks; the store's errors
        unmapped, raised when the chunk that meets them is asked for."""
        if start >= end:
            return iter(())
        scheme = uri.split("://", 1)[0]
        if scheme in OBJECT_STORE_SCHEMES:
            return self._objects.chunks(uri, start, end)
        if scheme in ("http", "https"):
            return self._http.chunks(uri, start, end)
        fs, path = self.filesystem(uri)
        data = fs.cat_file(path, start=start, end=end)
        return iter((data[start:end] if len(data) > end - start else data,))  # a store that ignored Range

    def _check(self, obj: RemoteObject, dest: Path) -> None:
        if os.stat(dest).st_size != obj.size:
            raise AdapterStoreUnavailable(f"{obj.uri}: downloaded {os.stat(dest).st_size} of {obj.size} bytes")
        if obj.checksum is not None:
            algorithm, expected = obj.checksum
            digest = hashlib.new(algorithm)
            with open(dest, "rb") as f:
                while chunk := f.read(8 * 1024 * 1024):
                    digest.update(chunk)
            if digest.hexdigest() == expected:
                return
            current = self.stat(obj.uri) if obj.version.startswith("etag:") else None
            if current is None or current.version != obj.version:
                raise ObjectChanged(f"{obj.uri}: the downloaded bytes do not match the store's {algorithm} "
                                    "(the object changed?)", current=current)
            # Unchanged, so this S3 ETag is not an MD5 (objects encrypted with SSE-KMS or SSE-C): trust the size.
            log.info("%s: its ETag is not the MD5 of its bytes (an encrypted object); checked by size", obj.uri)
            return
        self.check_unchanged(obj)  # no checksum: at least, the parts all came from one version

    def check_unchanged(self, obj: RemoteObject) -> None:
        """ObjectChanged where the store no longer holds the version `obj` describes."""
        current = self.stat(obj.uri)
        if current.version == obj.version:
            return
        change = (f"its size went from {obj.size} to {current.size} bytes" if current.size != obj.size
                  else f"its version went from {obj.version} to {current.version}")
        raise ObjectChanged(f"{obj.uri} changed between reads: {change}", current=current)

    def shutdown(self) -> None:
        self.parts.shutdown()


class store_errors:
    """Maps what a filesystem raises to the errors a client sees, each naming the URI: missing -> 404,
    denied (credentials, permissions) -> 400, anything else (down, slow, throttled) -> 503 with Retry-After."""

    def __init__(self, uri: str):
        self.uri = uri

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if error is None or not isinstance(error, Exception):
            return False
        if isinstance(error, ServingError):
            return False
        fault = error
        if isinstance(error, FileNotFoundError) and error.__cause__ is not None and not _is_missing(error.__cause__):
            fault = error.__cause__  # fsspec's HTTP `info` turns every failure (a timeout, a 403) into this
        if isinstance(fault, ServingError):  # a refused redirect, from within fsspec's `info`
            raise fault from None
        if _is_missing(fault):
            raise AdapterSourceMissing(f"{self.uri} does not exist") from error
        status = getattr(fault, "status", None)  # aiohttp's, from fsspec's HTTP filesystem
        names = {type(e).__name__ for e in _chain(fault)}
        text = str(fault)
        if (isinstance(fault, PermissionError) or status in (401, 403) or names & _DENIED
                or any(w in text for w in _DENIED_WORDS)):
            raise AdapterSourceDenied(f"{self.uri}: the store refused access ({_brief(fault)}); check the "
                                      "credentials in this node's environment") from error
        raise AdapterStoreUnavailable(f"{self.uri}: the store did not answer ({_brief(fault)})") from error


_DENIED = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId", "SignatureDoesNotMatch",
           "GatedRepoError", "InvalidCredentials", "PermissionDeniedError", "UnauthenticatedError"}
_DENIED_WORDS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "401 Unauthorized", "403 Forbidden")


def _is_missing(error: BaseException) -> bool:
    return (isinstance(error, FileNotFoundError) or getattr(error, "status", None) in (404, 410)
            or type(error).__name__.endswith("NotFoundError")  # the Hub's repository, revision and entry
            or "NoSuchBucket" in str(error))  # s3fs's listings pass it on untranslated


def _is_past_end(error: BaseException) -> bool:
    """A range the object no longer reaches: HTTP 416, which s3fs passes on as InvalidRange and obstore in its
    message."""
    text = str(error)
    return (getattr(error, "status", None) == 416 or "InvalidRange" in text or "status code: 416" in text
            or "not satisfiable" in text)


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _brief(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = _STORE_BODY.sub(r"\1", text)  # obstore's message goes on with the store's answer: not quoted
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


_STORE_BODY = re.compile(r"(status code: \d{3}[^:]*):.*")
