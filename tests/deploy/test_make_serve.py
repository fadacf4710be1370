"""`make serve` (`python -m deploy serve`) as a user runs it, in one app's life.

It starts again after it was killed without a graceful shutdown (SIGKILL): Serve's HAProxy outlives the cluster and
keeps the ports, and deploy/preflight.py ends it before the next start. Each start says when the app answers. A port
held by any other process stops the start at once with a message naming it.

Its HAProxy stands against hostile clients and local users (deploy/haproxy.py). Clients that send part of their
headers and stall, or trickle them a line at a time, fill every connection slot and are dropped after the client
timeout or the header timeout, so a normal request goes through within it instead of waiting for an hour; one client
address cannot hold more than its share of the slots. The client timeout does not cut a long completion: it applies
only while HAProxy waits for the client. The admin socket is closed to other users, and the stats page and metrics
exporter listen on localhost. The app runs with HAProxy's slots and timeouts shrunk, to run quickly; the stalled
clients come from distinct loopback addresses (127.0.0.2, ...), as from many machines.

Ctrl-C, last, with requests in flight lets them finish, says so in one line, and stops within seconds of the last
one, HAProxy included, saying when it is done."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from deploy import haproxy, preflight
from ray_nodes import RAY_ENV, free_ports, stop_serve_run, write_serve_config
from traffic import wait_for
from web import HTTP

pytestmark = pytest.mark.skipif(not haproxy.available(), reason="no HAProxy binary on this machine")
SLOTS, CLIENT_TIMEOUT_S, HEADER_TIMEOUT_S, PER_SOURCE = 40, 1, 2, 20
STOP_S = 5  # from the last request's end to the stopped app, HAProxy included
STREAMS = 8  # together several seconds of decoding: in flight when Ctrl-C comes


@pytest.fixture(scope="module")
def ports() -> list[int]:
    return free_ports(3)  # HTTP, HAProxy's stats page, its metrics exporter


def _start(config: Path, env: dict, log: Path) -> subprocess.Popen:
    """What `make serve` runs: the checks, then `serve run` (which starts its own local cluster) as a child, both
    in a process group of their own, as a terminal would hold them."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "deploy", "serve", str(config)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _ready_lines(log: Path) -> list[str]:
    """The start's ready lines that name the base model's adapter, one replica and the docs."""
    return [line for line in log.read_text().splitlines()
            if line.startswith("ready: ") and "1 adapters, 1 replica;" in line and "/docs" in line]


def _answers(port: int) -> bool:
    response = HTTP.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    return response.status_code == 200 and "pirate" in response.text


class Served:
    """The app of the second start, after the first was killed; `process` is that start's `make serve`."""

    def __init__(self, url: str, process: subprocess.Popen, log: Path, orphans: list):
        self.url, self.process, self.log, self.orphans = url, process, log, orphans


@pytest.fixture(scope="module")
def started(tmp_path_factory, demo_dir, ports):
    """`make serve`, killed with SIGKILL once its app answers, then started again: the second start's app."""
    tmp = tmp_path_factory.mktemp("make_serve")
    http, stats, metrics = ports
    config = write_serve_config(tmp / "serve_config.yaml", http,
                                {"base_model": str(demo_dir / "base"), "adapter_roots": [str(demo_dir / "adapters")],
                                 "adapters": {"pirate": "pirate"}, "num_slots": 2, "device": "cpu"},
                                [{"name": "LoRAReplica", "num_replicas": 1}, {"name": "Ingress", "num_replicas": 1}])
    env = {**os.environ, **RAY_ENV, **haproxy.environment(), "RAY_ADDRESS": "local",
           "RAY_SERVE_HAPROXY_STATS_PORT": str(stats), "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
           "RAY_SERVE_HAPROXY_MAXCONN": str(SLOTS), "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(CLIENT_TIMEOUT_S),
           haproxy.HTTP_REQUEST_TIMEOUT_ENV: str(HEADER_TIMEOUT_S), haproxy.PER_SOURCE_ENV: str(PER_SOURCE)}
    log = tmp / "serve.log"
    first = _start(config, env, log)
    second = None
    try:
        wait_for(lambda: len(_ready_lines(log)) >= 1, 240, what="the first start says it is ready")
        assert _answers(http)
        for pid in [first.pid, *map(int, subprocess.check_output(["pgrep", "-P", str(first.pid)]).split())]:
            os.kill(pid, signal.SIGKILL)  # `make serve` and its `serve run`, without their shutdown
        first.wait(timeout=30)
        orphans = [h for h in preflight.holders(http) if h.pid is not None]
        second = _start(config, env, log)  # the preflight ends what the first start left behind
        wait_for(lambda: len(_ready_lines(log)) >= 2, 240, what="the second start says it is ready")
        yield Served(f"http://127.0.0.1:{http}", second, log, orphans)
    finally:
        for process in (second, first):
            if process is not None:
                stop_serve_run(process)
        for port in ports:
            for holder in preflight.holders(port):
                if holder.is_orphaned_serve_haproxy:
                    os.kill(holder.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def served(started) -> str:
    return started.url


def test_make_serve_starts_again_after_serve_run_was_killed(started):
    print(f"after SIGKILL the HTTP port was held by {started.orphans}")
    assert _answers(int(started.url.rsplit(":", 1)[1]))
    assert "Address already in use" not in started.log.read_text()


def test_a_port_held_by_another_program_stops_the_start_with_its_pid(tmp_path):
    [port] = free_ports(1)
    config = write_serve_config(tmp_path / "serve_config.yaml", port, {}, [])
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        start = time.monotonic()
        check = subprocess.run([sys.executable, "-m", "deploy.preflight", str(config)], capture_output=True,
                               text=True, timeout=60, env={**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": "0"})
    assert check.returncode == 1 and time.monotonic() - start < 30
    assert f":{port} is held by pid {os.getpid()}" in check.stderr and "serve shutdown" in check.stderr


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


def _stream(url: str, lines: list[str], ended: list[float]) -> None:
    """A completion of 400 tokens, streamed; its lines go to `lines` as they arrive, its end time to `ended`."""
    body = {"model": "pirate", "prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)
    ended.append(time.monotonic())


def test_ctrl_c_lets_the_streams_in_flight_finish_then_stops_within_seconds(started, ports):
    """Runs last: it stops the app."""
    streams, ended = [[] for _ in range(STREAMS)], []
    threads = [threading.Thread(target=_stream, args=(started.url, lines, ended)) for lines in streams]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(len(lines) >= 2 for lines in streams), 60, what="the streams have begun")
    time.sleep(1.2)  # the replica reports its calls (within a second)
    asked = time.monotonic()
    os.killpg(started.process.pid, signal.SIGINT)  # Ctrl-C in its terminal
    started.process.wait(timeout=60)
    stopped = time.monotonic()
    for thread in threads:
        thread.join(60)
    text = started.log.read_text()
    print(f"Ctrl-C stopped it in {stopped - asked:.1f} s, {stopped - max(ended):.1f} s after the last stream ended")
    assert re.search(r"^stopping: \d+ requests? in flight may finish first \(up to 30 s\)", text, re.M), text[-2000:]
    assert all(lines[-1] == "data: [DONE]" for lines in streams), [lines[-2:] for lines in streams]
    assert re.search(r"^stopped in \d+ s$", text, re.M), text[-2000:]
    assert len(ended) == STREAMS and stopped - max(ended) <= STOP_S
    assert not any(preflight.holders(port) for port in ports)
