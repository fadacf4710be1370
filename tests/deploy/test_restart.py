"""`make serve` (`python -m deploy serve`) starts again after it was killed without a graceful shutdown
(SIGKILL): Serve's HAProxy outlives the cluster and keeps the ports, and deploy/preflight.py ends it before the
next start. Each start says when the app answers; Ctrl-C with a request in flight lets it finish, says so in one
line, and says when it is done. A port held by any other process stops the start at once with a message naming
it. (test_slowloris stops an idle `make serve` with Ctrl-C.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import threading

import pytest

from deploy import haproxy, preflight
from ray_nodes import RAY_ENV, free_ports, stop_serve_run, write_serve_config
from traffic import wait_for
from web import HTTP

pytestmark = pytest.mark.skipif(not haproxy.available(), reason="no HAProxy binary on this machine")


def _env(tmp_path: Path, stats: int, metrics: int) -> dict:
    return {**os.environ, **RAY_ENV, **haproxy.environment(), "RAY_ADDRESS": "local",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats), "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics)}


def _start(config: Path, env: dict, log: Path) -> subprocess.Popen:
    """What `make serve` runs: the checks, then `serve run` (which starts its own local cluster) as a child, both
    in a process group of their own, as a terminal would hold them."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "deploy", "serve", str(config)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _ready(log: Path, starts: int) -> bool:
    """Whether the log holds the ready line of the `starts`-th start, naming the base model and the adapter."""
    lines = [line for line in log.read_text().splitlines() if line.startswith("ready: ")]
    return len(lines) >= starts and "1 adapters, 1 replica;" in lines[-1] and "/docs" in lines[-1]


def _answers(port: int) -> bool:
    response = HTTP.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    return response.status_code == 200 and "pirate" in response.text


STREAMS = 8  # together several seconds of decoding: in flight when Ctrl-C comes


def _stream(port: int, lines: list[str]) -> None:
    """A completion of 400 tokens, streamed; its lines go to `lines` as they arrive."""
    body = {"model": "pirate", "prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with HTTP.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line:
                lines.append(line)


def test_make_serve_starts_again_after_serve_run_was_killed(tmp_path, demo_dir):
    http, stats, metrics = free_ports(3)
    config = write_serve_config(tmp_path / "serve_config.yaml", http,
                                {"base_model": str(demo_dir / "base"), "adapter_roots": [str(demo_dir / "adapters")],
                                 "adapters": {"pirate": "pirate"}, "num_slots": 2, "device": "cpu"},
                                [{"name": "LoRAReplica", "num_replicas": 1}, {"name": "Ingress", "num_replicas": 1}])
    env, log = _env(tmp_path, stats, metrics), tmp_path / "serve.log"
    first = _start(config, env, log)
    second = None
    try:
        wait_for(lambda: _ready(log, 1), 240, what="the first start says it is ready")
        assert _answers(http)
        for pid in [first.pid, *map(int, subprocess.check_output(["pgrep", "-P", str(first.pid)]).split())]:
            os.kill(pid, signal.SIGKILL)  # `make serve` and its `serve run`, without their shutdown
        first.wait(timeout=30)
        orphans = [h for h in preflight.holders(http) if h.pid is not None]
        print(f"after SIGKILL :{http} is held by {orphans}")
        second = _start(config, env, log)  # the preflight ends what the first start left behind
        wait_for(lambda: _ready(log, 2), 240, what="the second start says it is ready")
        assert _answers(http)
        streams = [[] for _ in range(STREAMS)]
        threads = [threading.Thread(target=_stream, args=(http, lines)) for lines in streams]
        for thread in threads:
            thread.start()
        wait_for(lambda: all(len(lines) >= 2 for lines in streams), 60, what="the streams have begun")
        time.sleep(1.2)  # the replica reports its calls (within a second)
        asked = time.monotonic()
        os.killpg(second.pid, signal.SIGINT)  # Ctrl-C in its terminal
        second.wait(timeout=60)
        for thread in threads:
            thread.join(60)
        print(f"Ctrl-C stopped it in {time.monotonic() - asked:.1f} s")
        text = log.read_text()
        assert re.search(r"^stopping: \d+ requests? in flight may finish first \(up to 30 s\)", text, re.M), text[-2000:]
        assert all(lines[-1] == "data: [DONE]" for lines in streams), [lines[-2:] for lines in streams]
        assert re.search(r"^stopped in \d+ s$", text, re.M), text[-2000:]
    finally:
        for process in (second, first):
            if process is not None:
                stop_serve_run(process)
        for holder in preflight.holders(http) + preflight.holders(stats):
            if holder.is_orphaned_serve_haproxy:
                os.kill(holder.pid, signal.SIGKILL)
    assert "Address already in use" not in log.read_text()


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

