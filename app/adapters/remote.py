"""Adapters kept where users keep them: object stores (s3://, gs://), the Hugging Face Hub (hf://) and HTTP servers.

Every protocol goes through fsspec and its maintained filesystems (s3fs, gcsfs, huggingface_hub's HfFileSystem,
fsspec's HTTPFileSystem); nothing here speaks a protocol itself but one ranged HTTP GET (`_http_range`).
Credentials and endpoints come from the environment and the usual config files (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN, HF_ENDPOINT, ...), never from a request: a URI that
carries credentials, a query or a fragment is refused. A URI is served only under one of the configured remote
roots, judged on its normalized form, and an HTTP redirect is followed only to a target under them too
(app/adapters/uris.py). A ranged read holds no more than its range, even from a server
that ignores Range.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.asyn import sync

from app.adapters import part_process
from app.adapters.part_digests import PartDigests, part_digest
from app.adapters.uris import check_redirect, is_under, normalize_uri
from app.adapters.urgent_pool import UrgentFirstPool
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
_S3_CONNECTIONS = 96
_STREAM_CHUNK = 1024 * 1024  # what an HTTP read takes from its connection at once


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
    """The remote adapter roots, and reads under them through fsspec (filesystems made once per protocol and
    host, so connections are reused)."""

    def __init__(self, roots: Sequence[str], timeout_s: float = 60.0, workers: int = 8, part_process: bool = True):
        self.roots = tuple(normalize_uri(root) for root in roots)
        self.timeout_s, self.workers = timeout_s, workers
        self.part_process = part_process  # downloads' ranged GETs in a helper process (part_process.py)
        self._filesystems: dict[str, fsspec.AbstractFileSystem] = {}
        self._lock = threading.Lock()
        self._parts = UrgentFirstPool(workers, "adapter-fetch-part")

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
                                      "retries": {"max_attempts": 2}, "max_pool_connections": _S3_CONNECTIONS}}
        if scheme in ("http", "https"):
            import aiohttp

            return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=self.timeout_s, connect=10),
                                      "trace_configs": [_redirect_guard(self.roots)]}}
        if scheme == "gs":
            return {"timeout": self.timeout_s}
        return {}

    def stat(self, uri: str) -> RemoteObject:
        fs, path = self.filesystem(uri)
        with store_errors(uri):
            fs.invalidate_cache(path)  # listings are cached by fsspec; a changed object must show as changed
            return describe(uri, fs.info(path))

    def read(self, uri: str, start: int, end: int) -> bytes:
        fs, path = self.filesystem(uri)
        with store_errors(uri):
            return _cat_range(fs, path, start, end)

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

    def prepare_downloads(self) -> None:
        """Start the helper process that downloads' ranges go through, and have it make its clients for the
        remote roots, so that the first download waits for neither (about a second of imports, and up to a second
        for an S3 client); returns at once."""
        if self.part_process:
            part_process.helper().prepare(self.roots, self.timeout_s)

    def download(self, obj: RemoteObject, dest: Path) -> None:
        self.download_all([(obj, dest)])

    def download_all(self, files: Sequence[tuple[RemoteObject, Path]],
                     is_urgent: Callable[[], bool] = lambda: True) -> dict[Path, PartDigests]:
        """Write each object to its path, the PART_BYTES ranges of all of them fetched at once (so that one
        first-byte delay covers them all), then check each one's size and, where the store gives one, its
        checksum. The bytes are checked against the object as described, with no request to the store first:
        ObjectChanged where they are another version's. The caller owns the paths (temporary names it renames
        once this returns). Parts go ahead of those of other downloads while `is_urgent()` holds and theirs
        does not: a fetch ahead yields the connections to one that a request waits for. Returns each path's
        digests, hashed from the parts as they arrived."""
        part_bytes = PART_BYTES
        for obj, dest in files:
            with open(dest, "wb") as f:
                f.truncate(obj.size)
        parts = [(obj, dest, start, min(start + part_bytes, obj.size))
                 for obj, dest in files for start in range(0, obj.size, part_bytes)]
        futures = [self._parts.submit(is_urgent, self._write_part, *part) for part in parts]
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
        if self.part_process:
            return part_process.helper().fetch(obj, dest, start, end, self.roots, self.timeout_s)
        return write_part(self, obj, dest, start, end)

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
        self._parts.shutdown()


def write_part(store: RemoteStore, obj: RemoteObject, dest: Path, start: int, end: int) -> str:
    """Fetch bytes [start, end) of `obj` and write them into `dest` (already at its full size) at `start`; their
    digest. ObjectChanged where the store holds fewer bytes than `obj` says, as another version would."""
    fs, path = store.filesystem(obj.uri)
    try:
        with store_errors(obj.uri):
            data = _cat_range(fs, path, start, end)
    except AdapterStoreUnavailable as e:
        if any(_is_past_end(error) for error in _chain(e.__cause__)):
            raise ObjectChanged(f"{obj.uri}: bytes {start}-{end} lie past its end (did it change?)") from e
        raise
    if len(data) != end - start:
        raise ObjectChanged(f"{obj.uri}: bytes {start}-{end} came back as {len(data)} bytes (did it change?)")
    fd = os.open(dest, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.pwrite(fd, view, end - len(view)):]
    finally:
        os.close(fd)
    return part_digest(data)


def _cat_range(fs, path: str, start: int, end: int) -> bytes:
    if start >= end:
        return b""
    if path.startswith(("http://", "https://")):
        return sync(fs.loop, _http_range, fs, path, start, end)
    data = fs.cat_file(path, start=start, end=end)
    return data[start:end] if len(data) > end - start else data  # a store that ignored Range: the whole object


async def _http_range(fs, url: str, start: int, end: int) -> bytearray:
    """Bytes [start, end) of `url`, holding no more than those. Written here, on fsspec's session (its
    connections, timeout and redirect guard), because fsspec's HTTP cat_file reads the whole body: a server that
    ignores Range (python -m http.server) answers 200 with the whole object. Its bytes before `start` are
    dropped as they arrive and those after `end` are never read (leaving the block closes the connection), which
    keeps such servers usable at the price of the bytes skipped."""
    import aiohttp

    session = await fs.set_session()
    headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
    async with session.get(fs.encode_url(url), headers=headers) as r:
        r.raise_for_status()
        skip = 0 if r.status == 206 else start
        if r.status == 206 and not r.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
            raise AdapterStoreUnavailable(f"{url}: the store answered another range than bytes {start}-{end - 1}")
        data, received = bytearray(), 0
        try:
            while received < skip + end - start:
                # While skipping, never past `start`: every chunk after it lies in the range.
                until = skip if received < skip else skip + end - start
                chunk = await r.content.read(min(_STREAM_CHUNK, until - received))
                if not chunk:
                    break
                received += len(chunk)
                if received > skip:
                    data += chunk
        except (aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
            if r.content_length is None or received >= r.content_length:
                raise
            how = ("closed the connection" if isinstance(e, aiohttp.ClientPayloadError)
                   else "sent nothing more before the timeout")
            raise AdapterStoreUnavailable(f"{url}: the store sent fewer bytes than it announced ({received} of the "
                                          f"{r.content_length} in its Content-Length) and {how}") from e
    return data


@functools.cache
def _redirect_guard(roots: tuple[str, ...]):
    """An aiohttp trace that refuses each redirect before it is followed, unless its target lies under `roots`
    (check_redirect), for every request of the client it is given to: fsspec's stats and listings, and the
    ranged GETs here. One per set of roots, so that fsspec still shares a filesystem between like stores."""
    import aiohttp
    from yarl import URL

    async def on_redirect(session, context, params) -> None:
        context.hops = getattr(context, "hops", 0) + 1
        location = params.response.headers.get("Location") or params.response.headers.get("URI") or ""
        check_redirect(roots, str(params.url), str(params.url.join(URL(location))), context.hops)

    guard = aiohttp.TraceConfig()
    guard.on_request_redirect.append(on_redirect)
    return guard


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
           "GatedRepoError", "InvalidCredentials"}
_DENIED_WORDS = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "401 Unauthorized", "403 Forbidden")


def _is_missing(error: BaseException) -> bool:
    return (isinstance(error, FileNotFoundError) or getattr(error, "status", None) in (404, 410)
            or type(error).__name__.endswith("NotFoundError")  # the Hub's repository, revision and entry
            or "NoSuchBucket" in str(error))  # s3fs's listings pass it on untranslated


def _is_past_end(error: BaseException) -> bool:
    """A range the object no longer reaches: HTTP 416, which s3fs passes on as InvalidRange."""
    return getattr(error, "status", None) == 416 or "InvalidRange" in str(error) or "not satisfiable" in str(error)


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _brief(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
