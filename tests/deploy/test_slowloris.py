"""`make serve`'s HAProxy against hostile clients and local users (deploy/haproxy.py). Clients that send part of
their headers and stall, or trickle them a line at a time, fill every connection slot and are dropped after the
client timeout or the header timeout, so a normal request goes through within it instead of waiting for an hour;
one client address cannot hold more than its share of the slots. The client timeout does not cut a long
completion: it applies only while HAProxy waits for the client. The admin socket is closed to other users, and
the stats page and metrics exporter listen on localhost. The test shrinks HAProxy's slots and timeouts to run
quickly. The stalled clients come from distinct loopback addresses (127.0.0.2, ...), as from many machines. The app
runs as `make serve` runs it, and Ctrl-C stops it, idle, within 5 s, HAProxy included."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from deploy import haproxy, preflight
from ray_nodes import RAY_ENV, free_ports, stop_serve_run, write_serve_config
from traffic import wait_for
from web import HTTP

pytestmark = pytest.mark.skipif(not haproxy.available(), reason="no HAProxy binary on this machine")
SLOTS, CLIENT_TIMEOUT_S, HEADER_TIMEOUT_S, PER_SOURCE = 40, 1, 2, 20
IDLE_STOP_S = 5


@pytest.fixture(scope="module")
def ports() -> list[int]:
    return free_ports(3)  # HTTP, HAProxy's stats page, its metrics exporter


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir, ports):
    tmp = tmp_path_factory.mktemp("slowloris")
    http, stats, metrics = ports
    config = write_serve_config(tmp / "serve_config.yaml", http,
                                {"base_model": str(demo_dir / "base"), "adapter_roots": [str(demo_dir / "adapters")],
                                 "adapters": {"pirate": "pirate"}, "num_slots": 2, "device": "cpu"},
                                [{"name": "LoRAReplica", "num_replicas": 1}, {"name": "Ingress", "num_replicas": 1}])
    env = {**os.environ, **RAY_ENV, **haproxy.environment(), "RAY_ADDRESS": "local",
           "RAY_SERVE_HAPROXY_STATS_PORT": str(stats), "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
           "RAY_SERVE_HAPROXY_MAXCONN": str(SLOTS), "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(CLIENT_TIMEOUT_S),
           haproxy.HTTP_REQUEST_TIMEOUT_ENV: str(HEADER_TIMEOUT_S), haproxy.PER_SOURCE_ENV: str(PER_SOURCE)}
    with open(tmp / "serve.log", "ab") as log:  # what `make serve` runs, in a process group as a terminal holds it
        process = subprocess.Popen([sys.executable, "-m", "deploy", "serve", str(config)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: HTTP.get(f"http://127.0.0.1:{http}/v1/models", timeout=5).status_code == 200, 240,
                 what="the app answers")
        yield f"http://127.0.0.1:{http}"
        asked = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in its terminal, nothing in flight
        process.wait(timeout=60)
        stopped_s = time.monotonic() - asked
        print(f"Ctrl-C stopped the idle app in {stopped_s:.1f} s")
        assert "\nstopping" in (tmp / "serve.log").read_text()
        assert stopped_s <= IDLE_STOP_S and not any(preflight.holders(port) for port in ports)
    finally:
        stop_serve_run(process)
        for port in (http, stats, metrics):
            for holder in preflight.holders(port):
                if holder.is_orphaned_serve_haproxy:
                    os.kill(holder.pid, signal.SIGKILL)


PARTIAL = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app"  # and never the rest


@contextmanager
def slow_clients(served: str, count: int, sources: list[str], trickle_s: float | None = None):
    """`count` connections that send part of their headers, from `sources` in turn; with trickle_s, each then
    sends one more header line every trickle_s, so that no stall is longer than that."""
    host, port = served.removeprefix("http://").split(":")
    sockets = []
    for i in range(count):
        try:
            s = socket.create_connection((host, int(port)), timeout=5, source_address=(sources[i % len(sources)], 0))
            s.sendall(PARTIAL)
        except OSError:  # refused: that source holds its share already
            continue
        sockets.append(s)
    stop = threading.Event()

    def trickle():
        while not stop.wait(trickle_s):
            for s in sockets:
                try:
                    s.sendall(b"\r\nX-Slow: 1")
                except OSError:
                    pass

    thread = threading.Thread(target=trickle, daemon=True) if trickle_s else None
    if thread:
        thread.start()
    try:
        time.sleep(0.1)
        yield sockets
    finally:
        stop.set()
        for s in sockets:
            s.close()


def timed_completion(served: str, source: str = "127.0.0.1", timeout_s: float = 30) -> float:
    transport = httpx.HTTPTransport(local_address=source)
    start = time.monotonic()
    with httpx.Client(transport=transport, timeout=timeout_s) as client:
        response = client.post(f"{served}/v1/completions", json={"model": "pirate", "prompt": "Hello!", "max_tokens": 4})
    assert response.status_code == 200, response.text
    return time.monotonic() - start


MANY = [f"127.0.0.{i}" for i in range(2, 2 + SLOTS + 10)]  # one connection from each


def test_stalled_headers_are_dropped_and_normal_requests_go_through(served):
    with slow_clients(served, SLOTS + 10, MANY) as stalled:
        waited = timed_completion(served, timeout_s=8 * CLIENT_TIMEOUT_S)
    print(f"\na normal request behind {len(stalled)} stalled clients took {waited:.1f} s")
    # With Ray's 3600 s it waited until a reload of HAProxy took new connections, and without one as long as
    # the stalled clients hold their connections.
    assert waited < 4 * CLIENT_TIMEOUT_S, f"a normal request waited {waited:.1f} s behind stalled clients"


def test_headers_trickled_a_line_at_a_time_are_cut_by_the_header_timeout(served):
    """Each trickling client sends a byte well within the client timeout: only the header timeout ends it."""
    with slow_clients(served, SLOTS + 10, MANY, trickle_s=CLIENT_TIMEOUT_S / 4) as trickling:
        waited = timed_completion(served, timeout_s=10 * HEADER_TIMEOUT_S)
    print(f"\na normal request behind {len(trickling)} trickling clients took {waited:.1f} s")
    assert waited < 2.5 * HEADER_TIMEOUT_S, f"a normal request waited {waited:.1f} s behind trickling clients"


def test_one_client_address_cannot_take_every_connection(served):
    # From an address no other test uses: HAProxy may still count a connection another test closed a moment ago
    with slow_clients(served, SLOTS + 10, ["127.0.1.1"], trickle_s=CLIENT_TIMEOUT_S / 4) as held:
        waited = timed_completion(served, source="127.0.0.2", timeout_s=10 * HEADER_TIMEOUT_S)
        # the first PER_SOURCE are held; HAProxy closes the rest on accept (which the client may see only later)
        assert len(held) >= PER_SOURCE
    print(f"\na request from another address, beside {SLOTS + 10} slow connections from one, took {waited:.1f} s")
    assert waited < HEADER_TIMEOUT_S / 2, f"one client address held every connection for {waited:.1f} s"


def listening_addresses(port: int) -> set[str]:
    """The local addresses that listen on `port` (IPv4), from /proc/net/tcp."""
    found = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def admin_socket(http_port: int) -> str:
    """The admin socket of the HAProxy that serves `http_port`: beside the config its command line names."""
    [holder, *_] = [h for h in preflight.holders(http_port) if h.is_serve_haproxy]
    args = holder.cmdline.split()
    return os.path.join(os.path.dirname(args[args.index("-f") + 1]), "admin.sock")


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_local_user_cannot_use_the_admin_socket(served):
    path = admin_socket(int(served.rsplit(":", 1)[1]))
    assert os.path.exists(path)
    probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
             f"try:\n    s.connect({path!r})\nexcept PermissionError:\n    sys.exit(13)\n"
             "s.sendall(b'show info\\n'); print(s.recv(200))")
    result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                             "-c", probe], capture_output=True, text=True, timeout=30)
    assert result.returncode == 13, f"user nobody reached HAProxy's admin socket: {result.stdout}{result.stderr}"


def test_stats_and_metrics_listen_on_localhost_only(served, ports):
    for port in ports[1:]:
        assert listening_addresses(port) == {"127.0.0.1"}, f":{port} listens on {listening_addresses(port)}"


@pytest.fixture(scope="module")
def long_tokens(served) -> int:
    """max_tokens that keep 12 choices generating for about three client timeouts on this machine, however fast."""
    body = {"model": "pirate", "prompt": "Hello!", "max_tokens": 64, "ignore_eos": True, "n": 12}
    start = time.monotonic()
    assert HTTP.post(f"{served}/v1/completions", json=body, timeout=120).status_code == 200
    per_token_s = (time.monotonic() - start) / 64
    return min(4000, max(480, round(3 * CLIENT_TIMEOUT_S / per_token_s)))


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_longer_than_the_client_timeout_is_not_cut(served, long_tokens, stream):
    body = {"model": "pirate", "prompt": "Hello!", "max_tokens": long_tokens, "ignore_eos": True, "n": 12,
            "stream": stream}
    start = time.monotonic()
    with HTTP.stream("POST", f"{served}/v1/completions", json=body, timeout=120) as response:
        text = "".join(response.iter_text())
    elapsed = time.monotonic() - start
    assert response.status_code == 200, text
    assert elapsed > CLIENT_TIMEOUT_S, f"{long_tokens} tokens took {elapsed:.1f} s: the timeout was never tested"
    assert text.count('"index"') >= 12 if not stream else text.rstrip().endswith("data: [DONE]")
