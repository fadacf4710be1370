"""Ranged reads of remote objects, chunk by chunk as they arrive, each holding no more than its range.

Downloads run in the engine's own process, so their reads must not hold its GIL: s3:// and gs:// go through
obstore (Rust: its client waits, parses and copies with the GIL released), http(s):// through urllib3
(`HTTPRanges`: socket reads with the GIL released, each redirect checked before it is followed). Chunks of
_STREAM_CHUNK keep every allocation small: reading a part whole, the process allocates and frees tens of MB at
a time, which lengthened the engine thread's steps more than the reads. fsspec's HTTP filesystem, which stats
and lists http(s):// roots, checks its redirects through `redirect_guard`. hf:// reads stay with
huggingface_hub's filesystem (RemoteStore).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING
from urllib.parse import urljoin

import urllib3

from app.adapters.uris import check_redirect
from app.errors import AdapterSourceDenied, AdapterStoreUnavailable

if TYPE_CHECKING:
    import obstore
    from obstore.store import GCSStore, S3Store

OBJECT_STORE_SCHEMES = ("s3", "gs")
_STREAM_CHUNK = 1024 * 1024  # what a read takes from its connection at once
_REDIRECTS = (301, 302, 303, 307, 308)
_CREDENTIALS_TTL = timedelta(minutes=5)  # how long obstore keeps credentials before it asks botocore again


class ObjectStores:
    """obstore's clients for s3:// and gs://, one per bucket (each keeps its connections), made from the
    environment as s3fs and gcsfs make theirs: S3's endpoint from AWS_ENDPOINT_URL, its credentials and region
    as botocore resolves them (environment, config files, instance roles); GCS's credentials from
    GOOGLE_APPLICATION_CREDENTIALS or the machine's default ones. Each request is bounded by `timeout_s`, and
    retried once within it."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._stores: dict[tuple[str, str], S3Store | GCSStore] = {}
        self._lock = threading.Lock()

    def chunks(self, uri: str, start: int, end: int) -> Iterator[obstore.Bytes]:
        """Bytes [start, end) of `uri` as they arrive, in chunks of about _STREAM_CHUNK, fewer where the object ends
        sooner; obstore's errors as raised."""
        import obstore  # here, so that a node without obstore serves every other root

        scheme, rest = uri.split("://", 1)
        bucket, path = rest.split("/", 1)
        with self._lock:
            store = self._stores.get((scheme, bucket))
            if store is None:
                store = self._stores[scheme, bucket] = self._make(scheme, bucket)
        return iter(obstore.get(store, path, options={"range": (start, end)}).stream(min_chunk_size=_STREAM_CHUNK))

    def _make(self, scheme: str, bucket: str) -> S3Store | GCSStore:
        from obstore.store import GCSStore, S3Store

        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        client = {"timeout": timedelta(seconds=self.timeout_s),
                  "connect_timeout": timedelta(seconds=min(10.0, self.timeout_s)),
                  "allow_http": scheme == "s3" and endpoint.startswith("http://")}
        retry = {"max_retries": 1, "retry_timeout": timedelta(seconds=self.timeout_s)}
        if scheme == "gs":
            return GCSStore(bucket, client_options=client, retry_config=retry)
        import botocore.session  # s3fs's own dependency: the credentials s3fs's stats and listings use

        session = botocore.session.Session()
        credentials = session.get_credentials()
        if credentials is None:
            raise AdapterSourceDenied(f"s3://{bucket}: no AWS credentials in this node's environment")
        region = session.get_config_variable("region")

        def provide() -> dict:
            frozen = credentials.get_frozen_credentials()  # refreshed by botocore where they expire
            return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                    "token": frozen.token, "expires_at": datetime.now(timezone.utc) + _CREDENTIALS_TTL}

        return S3Store(bucket, client_options=client, retry_config=retry, credential_provider=provide,
                       **({"region": region} if region else {}))


class HTTPRanges:
    """Ranged GETs of http(s):// objects on urllib3's connection pools, one body chunk at a time: the waits and
    the socket reads run with the GIL released, and the parsing left in Python is a response's headers.
    urllib3 follows no redirect here: each 3xx is checked against the roots (check_redirect) before its target is
    asked, at most MAX_REDIRECTS hops. A server that ignores Range (python -m http.server) answers 200 with the
    whole object: its bytes before `start` are dropped as they arrive and those after `end` are never read (the
    connection is closed), which keeps such servers usable at the price of the bytes skipped. Written here because
    obstore's HTTP client follows redirects with no setting to stop or check them, and refuses such servers."""

    def __init__(self, roots: tuple[str, ...], timeout_s: float, connections: int):
        self.roots = roots
        self._pools = urllib3.PoolManager(maxsize=connections, retries=False,
                                          timeout=urllib3.Timeout(connect=min(10.0, timeout_s), read=timeout_s))

    def chunks(self, url: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of `url` as they arrive, fewer where the object ends sooner."""
        response, url = self._get(url, {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        try:
            if response.status == 206 and not response.headers.get("Content-Range", "").startswith(f"bytes {start}-"):
                raise AdapterStoreUnavailable(f"{url}: the store answered another range than bytes {start}-{end - 1}")
            skip, received = (0 if response.status == 206 else start), 0
            while received < skip + end - start:
                until = skip if received < skip else skip + end - start  # while skipping, never past `start`
                try:
                    chunk = response.read(min(_STREAM_CHUNK, until - received))
                except (urllib3.exceptions.ProtocolError, urllib3.exceptions.ReadTimeoutError) as e:
                    how = ("sent nothing more before the timeout"
                           if isinstance(e, urllib3.exceptions.ReadTimeoutError) else "closed the connection")
                    raise AdapterStoreUnavailable(
                        f"{url}: the store sent fewer bytes than it announced (its Content-Length: "
                        f"{response.headers.get('Content-Length')}, {received} read before this) and {how}") from e
                if not chunk:
                    break
                received += len(chunk)
                if received > skip:
                    yield chunk
        finally:
            if response.status == 206 and not response.length_remaining:
                response.release_conn()
            else:  # a body left unread (a server that ignored Range, or a fault): its connection goes
                response.close()
                response.release_conn()

    def _get(self, url: str, headers: dict) -> tuple[urllib3.BaseHTTPResponse, str]:
        """The response to a GET of `url` once its redirects are followed, and the URL that gave it; a status
        other than 200 or 206 raises HTTPStatusError."""
        for hops in itertools.count(1):
            response = self._pools.request("GET", url, headers=headers, preload_content=False, redirect=False)
            if response.status in (200, 206):
                return response, url
            response.close()
            response.release_conn()
            if response.status not in _REDIRECTS:
                raise HTTPStatusError(url, response.status, response.reason or "")
            target = urljoin(url, response.headers.get("Location") or response.headers.get("URI") or "")
            check_redirect(self.roots, url, target, hops)
            url = target


class HTTPStatusError(OSError):
    """A store's answer other than the range: its status, which store_errors maps, never its body."""

    def __init__(self, url: str, status: int, reason: str):
        super().__init__(f"{status} {reason} from {url}")
        self.status = status


@functools.cache
def redirect_guard(roots: tuple[str, ...]):
    """An aiohttp trace that refuses each redirect before it is followed, unless its target lies under `roots`
    (check_redirect), for every request of the client it is given to: fsspec's stats and listings of http(s)://
    roots. One per set of roots, so that fsspec still shares a filesystem between like stores."""
    import aiohttp
    from yarl import URL

    async def on_redirect(session, context, params) -> None:
        context.hops = getattr(context, "hops", 0) + 1
        location = params.response.headers.get("Location") or params.response.headers.get("URI") or ""
        check_redirect(roots, str(params.url), str(params.url.join(URL(location))), context.hops)

    guard = aiohttp.TraceConfig()
    guard.on_request_redirect.append(on_redirect)
    return guard
