"""A local Ray cluster with the app deployed from a config, once per test module."""

import socket
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve
from ray.serve._private.api import serve_start
from ray.serve.schema import ServeDeploySchema

from deploy import haproxy
from engine_helpers import TEST_HOST_CACHE_BYTES
from ray_nodes import INGRESS_DRAINING_S, free_ports


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_config(demo_dir: Path, replicas: int = 2, **args) -> ServeDeploySchema:
    base_args = {
        "base_model": str(demo_dir / "base"), "adapter_roots": [str(demo_dir / "adapters")], "build_demo": False,
        "device": "cpu", "num_slots": 6, "max_batch_size": 4, "max_input_tokens": 256, "max_total_tokens": 4096,
        "default_max_tokens": 16, "max_body_bytes": 65536, "max_pending_requests": 48, "spread_after_s": 0.2,
        "host_cache_bytes": TEST_HOST_CACHE_BYTES,
    }
    return ServeDeploySchema.model_validate({"applications": [{
        "name": "lora", "route_prefix": "/", "import_path": "deploy.app:build_app", "args": {**base_args, **args},
        "deployments": [{"name": "LoRAReplica", "num_replicas": replicas}, {"name": "Ingress", "num_replicas": 1}],
    }]})


class Cluster:
    def __init__(self, demo_dir: Path):
        self.demo_dir = demo_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = serve_start(http_options={"host": "127.0.0.1", "port": self.port})

    def deploy(self, replicas: int = 2, wait_replicas: bool = True, blocking: bool = True, **args) -> None:
        """blocking: wait until Serve calls the application running (False for one that never will be)."""
        self.client.deploy_apps(app_config(self.demo_dir, replicas, **args), _blocking=blocking)
        if wait_replicas:
            self.wait_for_replicas(replicas)

    def replicas(self) -> dict:
        response = httpx.get(f"{self.url}/v1/debug/replicas", timeout=10)
        return response.json()["replicas"] if response.status_code == 200 else {}

    def wait_for_replicas(self, count: int, timeout_s: float = 120) -> dict:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                view = self.replicas()
                if len(view) == count:
                    return view
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{count} replicas did not report within {timeout_s}s")


@pytest.fixture(scope="module")
def cluster(request, demo_dir, monkeypatch_module):
    """The app on 2 replicas, with the test module's CLUSTER_ARGS where it has them (None: the module deploys)."""
    # HTTP through HAProxy straight to the ingress, as `make serve` runs it (the controller reads the flag where
    # Ray starts); test_two_nodes keeps Serve's proxy, as a bare `ray start` has it.
    for name, value in haproxy.environment().items():
        monkeypatch_module.setenv(name, value)
    stats, metrics = free_ports(2)  # HAProxy's own ports, free whatever else runs on this machine
    monkeypatch_module.setenv("RAY_SERVE_HAPROXY_STATS_PORT", str(stats))
    monkeypatch_module.setenv("RAY_SERVE_HAPROXY_METRICS_PORT", str(metrics))
    monkeypatch_module.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", INGRESS_DRAINING_S)
    ray.init(num_cpus=8, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        cluster = Cluster(Path(demo_dir))
        args = getattr(request.module, "CLUSTER_ARGS", {})
        if args is not None:
            cluster.deploy(replicas=2, **args)
        yield cluster
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch
