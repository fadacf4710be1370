"""A rolling update by `serve deploy` with changed args, while traffic flows, on a real `ray start` node.

Changed `args` change the application's code version (Serve hashes import_path, runtime_env and args),
so Serve rebuilds the app and replaces every replica, a few at a time, and starts a new router actor
for the new version, seeded from the new args' `adapters`. Adapters registered at run time lived in
the old actor's registry: they are not carried over (docs/cluster.md), which the
last assertions pin.
"""

from __future__ import annotations

import shutil
import time

import httpx
import pytest
from ray.serve.context import _get_global_client

from ray_nodes import RayNode, connect_driver, disconnect_driver, free_ports, serve_cli, write_serve_config
from traffic import Traffic, demo_adapters, expected_texts, replica_view, request_once, wait_for
from web import HTTP

REPLICAS = 2


def app_args(demo_dir, root, max_batch_size: int) -> dict:
    return {"base_model": f"{demo_dir}/base", "adapter_roots": [str(root)], "build_demo": False, "device": "cpu",
            "num_slots": 6, "max_batch_size": max_batch_size, "max_input_tokens": 256, "max_total_tokens": 4096,
            "spread_after_s": 0.2}


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    node = RayNode(tmp_path_factory.mktemp("rolling") / "head.log", num_cpus=4, dashboard=True)
    try:
        node.wait_started()
        connect_driver(node.address)
        yield node
    finally:
        disconnect_driver()
        node.stop()


def deploy(head, config) -> None:
    done = serve_cli("deploy", str(config), "-a", head.dashboard_url, env={})
    assert done.returncode == 0, done.stdout + done.stderr


def test_serve_deploy_with_new_args_rolls_replicas_under_traffic(head, demo_dir, tmp_path):
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    deployments = [{"name": "LoRAReplica", "num_replicas": REPLICAS}, {"name": "Ingress", "num_replicas": 1}]
    # v2 serves the same adapters from a new root, plus one that only the new root holds.
    new_root = tmp_path / "adapters-v2"
    shutil.copytree(f"{demo_dir}/adapters", new_root)
    shutil.copytree(new_root / "pirate", new_root / "stowaway")
    v1 = write_serve_config(tmp_path / "v1.yaml", port, app_args(demo_dir, f"{demo_dir}/adapters", 4), deployments)
    v2 = write_serve_config(tmp_path / "v2.yaml", port, app_args(demo_dir, new_root, 6), deployments)
    expected = expected_texts(demo_dir, demo_adapters(demo_dir))

    deploy(head, v1)
    old = set(wait_for(lambda: len(view := replica_view(url)) == REPLICAS and view, 120, what="v1 replicas"))
    registered = HTTP.post(f"{url}/v1/adapters", timeout=30,
                            json={"name": "runtime-pirate", "path": f"{demo_dir}/adapters/pirate"})
    assert registered.status_code == 201, registered.text

    with Traffic(url, expected, clients=4) as traffic:
        wait_for(lambda: len(traffic.results) >= 20, 60, what="traffic before the update")
        updated_at = time.monotonic()
        deploy(head, v2)
        new = wait_for(lambda: len(view := replica_view(url)) == REPLICAS and not set(view) & old and set(view),
                       180, what="every replica replaced")
        replaced_at = time.monotonic()
        wait_for(lambda: sum(o.started > replaced_at and o.replica in new for o in traffic.results) >= 10,
                 60, what="traffic on the new replicas")
        rolled_in = time.monotonic() - updated_at
    results = traffic.results
    failed = [o for o in results if not o.ok]
    print(f"rolled {REPLICAS} replicas in {rolled_in:.1f}s under traffic: {len(results)} requests, "
          f"{len(failed)} failed")
    assert not failed, [(o.model, o.stream, o.status, o.detail) for o in failed[:5]]
    assert {o.replica for o in results} & old and {o.replica for o in results} & new

    # The new args are in force: max_batch_size 6 (max_ongoing_requests 2 x 6), adapters from the new root.
    details = _get_global_client().get_serve_details()["applications"]["lora"]["deployments"]["LoRAReplica"]
    assert details["deployment_config"]["max_ongoing_requests"] == 12
    models = {m["id"]: m for m in HTTP.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert all(m["root"].startswith(str(new_root)) for m in models.values() if m["parent"])
    with httpx.Client(base_url=url, timeout=60) as client:
        assert request_once(client, "stowaway", False, expected["pirate"], 12).ok
        # A registration made at run time lived in the old version's router actor: gone, as docs/cluster.md says.
        assert "runtime-pirate" not in models
        assert request_once(client, "runtime-pirate", False, expected["pirate"], 12).status == "404"
        again = client.post("/v1/adapters", json={"name": "runtime-pirate", "path": str(new_root / "pirate")})
        assert again.status_code == 201, again.text
        assert request_once(client, "runtime-pirate", True, expected["pirate"], 12).ok
