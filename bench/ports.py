"""Free TCP ports for servers that another process starts later (moto shards, proxies, Ray nodes, `serve run`)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

FIRST_PORT = 20000  # the lowest port handed out


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int) -> list[int]:
    """`count` distinct ports on 127.0.0.1 that nothing holds now, chosen at random below the kernel's ephemeral
    range. Outgoing connections and binds to port 0 take their ports from that range, so none of them can take a
    port from here in the time before its server binds it (many processes at once, as in `make test`, would)."""
    end, rng, ports = _ephemeral_start(), random.SystemRandom(), []
    if end - FIRST_PORT < 1024:  # an unusual range: take ports from the kernel, as a bind to port 0 does
        return _kernel_ports(count)
    while len(ports) < count:
        port = rng.randrange(FIRST_PORT, end)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def _kernel_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
