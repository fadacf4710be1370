"""Slowloris against `make serve`'s HAProxy: clients that send part of their headers and stall fill every
connection slot, and are dropped after the client timeout (deploy/haproxy.py), so a normal request goes
through within it instead of waiting for an hour. The same timeout does not cut a long completion: it applies
only while HAProxy waits for the client. The test shrinks HAProxy's slots and the timeout to run quickly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from deploy import haproxy, preflight
from ray_nodes import INGRESS_DRAINING_S, RAY_ENV, SERVE, free_ports, stop_serve_run, write_serve_config
from traffic import wait_for

pytestmark = pytest.mark.skipif(not haproxy.available(), reason="no HAProxy binary on this machine")
SLOTS, CLIENT_TIMEOUT_S = 40, 1


@pytest.fixture(scope="module")
def served(tmp_path_factory, demo_dir):
    tmp = tmp_path_factory.mktemp("slowloris")
    http, stats, metrics = free_ports(3)
    config = write_serve_config(tmp / "serve_config.yaml", http,
                                {"base_model": str(demo_dir / "base"), "adapter_roots": [str(demo_dir / "adapters")],
                                 "adapters": {"pirate": "pirate"}, "num_slots": 2, "device": "cpu"},
                                [{"name": "LoRAReplica", "num_replicas": 1}, {"name": "Ingress", "num_replicas": 1}])
    env = {**os.environ, **RAY_ENV, **haproxy.environment(), "RAY_ADDRESS": "local",
           "RAY_SERVE_HAPROXY_STATS_PORT": str(stats), "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
           "RAY_SERVE_HAPROXY_MAXCONN": str(SLOTS), "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(CLIENT_TIMEOUT_S),
           "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": INGRESS_DRAINING_S}
    with open(tmp / "serve.log", "ab") as log:
        process = subprocess.Popen([SERVE, "run", str(config)], env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{http}/v1/models", timeout=5).status_code == 200, 240,
                 what="the app answers")
        yield f"http://127.0.0.1:{http}"
    finally:
        stop_serve_run(process)
        for port in (http, stats, metrics):
            for holder in preflight.holders(port):
                if holder.is_orphaned_serve_haproxy:
                    os.kill(holder.pid, signal.SIGKILL)


def test_stalled_headers_are_dropped_and_normal_requests_go_through(served):
    host, port = served.removeprefix("http://").split(":")
    stalled = []
    for _ in range(SLOTS + 10):
        s = socket.create_connection((host, int(port)), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: app")  # and never the rest
        stalled.append(s)
    try:
        time.sleep(0.1)
        start = time.monotonic()
        response = httpx.post(f"{served}/v1/completions", timeout=8 * CLIENT_TIMEOUT_S,
                              json={"model": "pirate", "prompt": "Hello!", "max_tokens": 4})
        waited = time.monotonic() - start
        assert response.status_code == 200, response.text
        print(f"\na normal request behind {len(stalled)} stalled clients took {waited:.1f} s")
        # With Ray's 3600 s it waited 6.5 s here, until a reload of HAProxy took new connections, and without one as
        # long as the stalled clients hold their connections.
        assert waited < 4 * CLIENT_TIMEOUT_S, f"a normal request waited {waited:.1f} s behind stalled clients"
    finally:
        for s in stalled:
            s.close()


@pytest.fixture(scope="module")
def long_tokens(served) -> int:
    """max_tokens that keep 12 choices generating for about three client timeouts on this machine, however fast."""
    body = {"model": "pirate", "prompt": "Hello!", "max_tokens": 64, "ignore_eos": True, "n": 12}
    start = time.monotonic()
    assert httpx.post(f"{served}/v1/completions", json=body, timeout=120).status_code == 200
    per_token_s = (time.monotonic() - start) / 64
    return min(4000, max(480, round(3 * CLIENT_TIMEOUT_S / per_token_s)))


@pytest.mark.parametrize("stream", [False, True])
def test_a_completion_longer_than_the_client_timeout_is_not_cut(served, long_tokens, stream):
    body = {"model": "pirate", "prompt": "Hello!", "max_tokens": long_tokens, "ignore_eos": True, "n": 12,
            "stream": stream}
    start = time.monotonic()
    with httpx.stream("POST", f"{served}/v1/completions", json=body, timeout=120) as response:
        text = "".join(response.iter_text())
    elapsed = time.monotonic() - start
    assert response.status_code == 200, text
    assert elapsed > CLIENT_TIMEOUT_S, f"{long_tokens} tokens took {elapsed:.1f} s: the timeout was never tested"
    assert text.count('"index"') >= 12 if not stream else text.rstrip().endswith("data: [DONE]")
