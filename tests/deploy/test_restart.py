"""`make serve` starts again after its `serve run` was killed without a graceful shutdown (SIGKILL): Serve's
HAProxy outlives the cluster and keeps the ports, and deploy/preflight.py ends it before the next start. A
port held by any other process stops the start at once with a message naming it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deploy import haproxy, preflight
from ray_nodes import RAY_ENV, SERVE, free_ports, stop_serve_run, write_serve_config
from traffic import wait_for

pytestmark = pytest.mark.skipif(not haproxy.available(), reason="no HAProxy binary on this machine")


def _env(tmp_path: Path, stats: int, metrics: int) -> dict:
    return {**os.environ, **RAY_ENV, **haproxy.environment(), "RAY_ADDRESS": "local",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats), "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics)}


def _start(config: Path, env: dict, log: Path) -> subprocess.Popen:
    """What `make serve` runs: the preflight, then `serve run` (which starts its own local cluster)."""
    check = subprocess.run([sys.executable, "-m", "deploy.preflight", str(config)], env=env, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    with open(log, "ab") as out:
        return subprocess.Popen([SERVE, "run", str(config)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _answers(port: int) -> bool:
    response = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5)
    return response.status_code == 200 and "pirate" in response.text


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
        wait_for(lambda: _answers(http), 240, what="the first start answers")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        orphans = [h for h in preflight.holders(http) if h.pid is not None]
        print(f"after SIGKILL :{http} is held by {orphans}")
        second = _start(config, env, log)  # the preflight ends what the first start left behind
        wait_for(lambda: _answers(http), 240, what="the second start answers")
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


def test_a_second_start_on_the_same_port_stops_at_once_naming_the_first(tmp_path):
    """Two `make serve` at once: the first holds the start's lock for its command's life, so the second cannot
    also pass the check (both would, before either binds) and fail 30 s later inside Ray."""
    [port] = free_ports(1)
    config = write_serve_config(tmp_path / "serve_config.yaml", port, {}, [])
    env = {**os.environ, "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    preflight_exec = [sys.executable, "-m", "deploy.preflight", str(config), "--exec"]
    first = subprocess.Popen([*preflight_exec, "sleep", "60"], env=env)  # stands for `serve run`
    try:
        lock = haproxy.run_dir() / f"start-{port}.lock"
        wait_for(lambda: lock.exists() and lock.read_text().strip() == str(first.pid), 30,
                 what="the first start holds the lock")
        second = subprocess.run([*preflight_exec, "true"], capture_output=True, text=True, timeout=30, env=env)
        assert second.returncode == 1, second.stderr
        assert f"another start of an app on :{port} (pid {first.pid})" in second.stderr
    finally:
        first.kill()
        first.wait()
    again = subprocess.run([*preflight_exec, "true"], capture_output=True, text=True, timeout=30, env=env)
    assert again.returncode == 0, again.stderr  # the lock went with the process that held it
