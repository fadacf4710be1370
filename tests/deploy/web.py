"""The deploy tests' HTTP calls: get, post, delete and stream, each on a client of its own, as httpx.get and
httpx.post make one. Each request opens a connection of its own, closed after it, and any number run at once from
any threads. One client shared by threads, with keep-alive off, can hand a request a connection that another
thread's clean-up closes under it (httpcore 1.0: the read fails with EBADF), so no client is shared.

httpx.get and httpx.post would each load the CA bundle into a new SSL context, about 40 ms of CPU; these clients share
one, loaded once, and cost 0.5 ms each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

_SSL = httpx.create_ssl_context()


class _PerCall:
    def request(self, method: str, url: str, **kwargs) -> httpx.Response:
        with httpx.Client(verify=_SSL) as client:
            return client.request(method, url, **kwargs)

    def get(self, url: str, **kwargs) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def delete(self, url: str, **kwargs) -> httpx.Response:
        return self.request("DELETE", url, **kwargs)

    @contextlib.contextmanager
    def stream(self, method: str, url: str, **kwargs) -> Iterator[httpx.Response]:
        with httpx.Client(verify=_SSL) as client, client.stream(method, url, **kwargs) as response:
            yield response


HTTP = _PerCall()
