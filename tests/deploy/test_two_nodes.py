"""Two real Ray nodes on this machine (`ray start --head`, then `ray start --address`), one replica pinned
to each by a custom resource, the app deployed with `serve deploy`: the router's hints reach the
replica on the other node ahead of its requests, and when that node's raylet is killed under load,
its in-flight requests end as docs/reliability.md promises and later requests succeed on
the node that remains. Every wait has a deadline; the nodes are stopped in finalizers."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import ray
from ray.util.state import list_actors

from deploy.app import SINGLE_LOOP_ENV
from ray_nodes import RayNode, connect_driver, disconnect_driver, free_ports, serve_cli, write_serve_config
from traffic import PROMPT, Traffic, demo_adapters, expected_texts, replica_view, wait_for
from web import HTTP

BATCH = 4
# The GCS declares a node dead after health_check_failure_threshold (5) failed checks, health_check_period_ms
# (3000) apart: 15 s by default. The test waits for that (actors on the node are only then declared dead).
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "3"}
LONG_TOKENS = 1200  # runs for many seconds on CPU, so it is still streaming when its node is killed (2048 positions)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    logs = tmp_path_factory.mktemp("two_nodes")
    head = RayNode(logs / "head.log", num_cpus=3, resources={"lora_slot": 1, "lora_head": 1}, dashboard=True,
                   env=FAST_NODE_DEATH)
    worker = None
    try:
        head.wait_started()
        worker = RayNode(logs / "worker.log", head_address=head.address, num_cpus=2, resources={"lora_slot": 1},
                         temp_dir=head.temp_dir)
        worker.wait_started()
        connect_driver(head.address)
        yield head, worker
    finally:
        disconnect_driver()
        if worker is not None:
            worker.stop()
        head.stop()


@pytest.fixture(scope="module")
def app(nodes, demo_dir, tmp_path_factory):
    """The app on both nodes; yields (url, {node: replica uid})."""
    head, worker = nodes
    (port,) = free_ports(1)
    args = {"base_model": f"{demo_dir}/base", "adapter_roots": [f"{demo_dir}/adapters"], "build_demo": False,
            "device": "cpu", "num_slots": 6, "max_batch_size": BATCH, "max_ongoing_requests": BATCH,
            "max_input_tokens": 256, "max_total_tokens": 4096, "spread_after_s": 0.2}
    runtime_env = {"env_vars": SINGLE_LOOP_ENV}
    # ray_actor_options in the config replace the code's: name CPUs and the runtime_env again.
    deployments = [
        {"name": "LoRAReplica", "num_replicas": 2,
         "ray_actor_options": {"num_cpus": 0.5, "resources": {"lora_slot": 1}, "runtime_env": runtime_env}},
        {"name": "Ingress", "num_replicas": 1,
         "ray_actor_options": {"num_cpus": 0.25, "resources": {"lora_head": 0.01}, "runtime_env": runtime_env}}]
    config = write_serve_config(tmp_path_factory.mktemp("config") / "two_nodes.yaml", port, args, deployments)
    done = serve_cli("deploy", str(config), "-a", head.dashboard_url, env={})
    assert done.returncode == 0, done.stdout + done.stderr
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: len(replica_view(url)) == 2, 120, what="two replicas reporting")
    head_node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and "lora_head" in n["Resources"])
    on_node = {}
    for actor in list_actors(address=head.dashboard_url, filters=[("state", "=", "ALIVE")], limit=1000):
        if actor.class_name.endswith("LoRAReplica") and actor.name:
            on_node["head" if actor.node_id == head_node else "worker"] = actor.name.rsplit("#", 1)[-1]
        elif actor.name and actor.name.endswith("::router_state"):
            print("router actor on the", "head" if actor.node_id == head_node else "worker", "node")
    assert set(on_node) == {"head", "worker"}, on_node
    assert set(on_node.values()) == set(replica_view(url))
    return url, on_node


def test_hints_reach_the_replica_on_the_other_node(app, demo_dir):
    url, on_node = app
    expected = expected_texts(demo_dir, demo_adapters(demo_dir))
    remote = on_node["worker"]

    def hinted_ahead() -> bool:
        lead = replica_view(url)[remote]["hint_lead_seconds"]
        return lead["count"] > 0 and lead["sum"] > 0

    with Traffic(url, expected, clients=12) as traffic:  # 12 clients, 2 x 4 slots: requests wait in the router
        wait_for(hinted_ahead, 60, what="a hint arriving at the worker node's replica before its request")
    failed = [o for o in traffic.results if not o.ok]
    assert not failed, [(o.model, o.stream, o.status, o.detail) for o in failed[:5]]
    assert {o.replica for o in traffic.results} == set(on_node.values())
    stats = replica_view(url)[remote]
    print(f"worker-node replica: {stats['arrivals']}, hint lead {stats['hint_lead_seconds']}")


def long_stream(url: str, model: str, outcomes: list, landed: dict, timeout_s: float = 60) -> None:
    """One long stream; records (replica, finish): "done", "error:<code>", or the client exception."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": LONG_TOKENS, "ignore_eos": True, "stream": True}
    replica, finish, events = None, "no [DONE]", []
    try:
        with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as response:
            replica = response.headers.get("x-replica-id")
            landed[model] = replica
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        if events and events[-1] == "[DONE]":
            last = json.loads(events[-2]) if len(events) > 1 else {}
            finish = f"error:{last['error']['code']}" if "error" in last else "done"
    except httpx.HTTPError as e:
        finish = type(e).__name__
    outcomes.append((model, replica, finish))


def test_node_lost_under_load_ends_its_requests_cleanly_and_the_other_node_serves(app, nodes, demo_dir):
    url, on_node = app
    _, worker = nodes
    expected = expected_texts(demo_dir, demo_adapters(demo_dir))
    remote, local = on_node["worker"], on_node["head"]
    outcomes, landed, streams = [], {}, []
    with Traffic(url, expected, clients=6) as during:
        # Long streams, until one runs on the worker node's replica: first the adapters it holds (affinity).
        resident = replica_view(url)[remote]["resident"]
        for model in [*resident, *sorted(set(expected) - set(resident) - {"base"})]:
            streams.append(threading.Thread(target=long_stream, args=(url, model, outcomes, landed), daemon=True))
            streams[-1].start()
            wait_for(lambda: model in landed, 30, poll_s=0.05, what=f"the {model} stream starting")
            if remote in landed.values():
                break
        assert remote in landed.values(), landed
        time.sleep(0.5)
        killed_at = time.monotonic()
        worker.kill_raylet()
        wait_for(lambda: set(replica_view(url)) == {local}, 60, what="the router's view dropping the lost replica")
        settled_at = time.monotonic()
        for t in streams:
            t.join(timeout=max(1.0, 90 - (time.monotonic() - killed_at)))
        assert not any(t.is_alive() for t in streams), "a stream never ended after its node died"
    with Traffic(url, expected, clients=4) as after:
        wait_for(lambda: len(after.results) >= 30, 60, what="requests after the node loss")

    print(f"view settled {settled_at - killed_at:.1f}s after the kill; long streams: {outcomes}; during: "
          f"{len(during.results)} requests, failures {[(o.stream, o.status) for o in during.failures()]}")
    for model, replica, finish in outcomes:
        # A stream cut by its replica's death ends with an engine_unavailable event and [DONE]; others finish.
        assert finish == ("error:engine_unavailable" if replica == remote else "done"), (model, replica, finish)
    for o in during.failures():
        # Requests that had sent nothing are retried (docs/reliability.md); a started stream ends with a clear error.
        assert o.status in ("stream:engine_unavailable", "503"), (o.model, o.stream, o.status, o.detail)
    failed = after.failures()
    assert not failed, [(o.model, o.stream, o.status, o.detail) for o in failed[:5]]
    assert {o.replica for o in after.results} == {local}
