"""A local Ray cluster with the app deployed from a config, once per test module.

The modules that use the `cluster` fixture share one Ray runtime and Serve instance: they run one after another
(pytest_collection_modifyitems), each deploys its app on it and deletes every app when it ends, and the runtime
stops once the last of them has run, before any module that starts Ray nodes of its own.
"""

import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve
from ray.serve._private import client as serve_client
from ray.serve._private.api import serve_start
from ray.serve.schema import ApplicationStatus, ServeDeploySchema

from deploy import haproxy
from engine_helpers import TEST_HOST_CACHE_BYTES
from ray_nodes import free_ports
from web import HTTP


# Serve's handles and replicas push autoscaling metrics every 10 s by default; test_autoscaling wants seconds.
# Only deployments with an autoscaling_config push them.
FAST_METRICS = {"RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5"}


def application(demo_dir: Path, name: str = "lora", route_prefix: str = "/", replicas: int = 2,
                env: dict | None = None, **args) -> dict:
    """One application of a serve config. env: environment variables of its processes (the runtime started before
    the module set them)."""
    base_args = {
        "base_model": str(demo_dir / "base"), "adapter_roots": [str(demo_dir / "adapters")], "build_demo": False,
        "device": "cpu", "num_slots": 6, "max_batch_size": 4, "max_input_tokens": 256, "max_total_tokens": 4096,
        "default_max_tokens": 16, "max_body_bytes": 65536, "max_pending_requests": 48, "spread_after_s": 0.2,
        "host_cache_bytes": TEST_HOST_CACHE_BYTES,
    }
    return {"name": name, "route_prefix": route_prefix, "import_path": "deploy.app:build_app",
            "args": {**base_args, **args}, **({"runtime_env": {"env_vars": env}} if env else {}),
            "deployments": [{"name": "LoRAReplica", "num_replicas": replicas}, {"name": "Ingress", "num_replicas": 1}]}


def app_config(demo_dir: Path, replicas: int = 2, env: dict | None = None, **args) -> ServeDeploySchema:
    return ServeDeploySchema.model_validate({"applications": [application(demo_dir, replicas=replicas, env=env,
                                                                          **args)]})


class Cluster:
    def __init__(self, demo_dir: Path):
        self.demo_dir = demo_dir
        [self.port] = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = serve_start(http_options={"host": "127.0.0.1", "port": self.port})

    def application(self, name: str, route_prefix: str, replicas: int = 2, **args) -> dict:
        """One application of the demo, for a config of several (client.deploy_apps deletes the apps it omits)."""
        return application(self.demo_dir, name, route_prefix, replicas, **args)

    def deploy(self, replicas: int = 2, wait_replicas: bool = True, blocking: bool = True, env: dict | None = None,
               **args) -> None:
        """blocking: wait until Serve calls the application running (False for one that never will be)."""
        self.client.deploy_apps(app_config(self.demo_dir, replicas, env, **args), _blocking=blocking)
        if wait_replicas:
            self.wait_for_replicas(replicas)

    def replicas(self, headers: dict | None = None) -> dict:
        response = HTTP.get(f"{self.url}/v1/debug/replicas", headers=headers, timeout=10)
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
            time.sleep(0.2)
        raise TimeoutError(f"{count} replicas did not report within {timeout_s}s")


class SharedRuntime:
    """The Ray runtime and Serve instance of the modules that use `cluster`: started by the first of them."""

    cluster: Cluster | None = None
    _env: pytest.MonkeyPatch | None = None

    @classmethod
    def get(cls, demo_dir: Path) -> Cluster:
        if cls.cluster is None:
            # HTTP through HAProxy straight to the ingress, as `make serve` runs it (the controller reads the flag
            # where Ray starts); test_two_nodes keeps Serve's proxy, as a bare `ray start` has it.
            cls._env = pytest.MonkeyPatch()
            for name, value in {**haproxy.environment(), **FAST_METRICS}.items():
                cls._env.setenv(name, value)
            stats, metrics = free_ports(2)  # HAProxy's own ports, free whatever else runs on this machine
            cls._env.setenv("RAY_SERVE_HAPROXY_STATS_PORT", str(stats))
            cls._env.setenv("RAY_SERVE_HAPROXY_METRICS_PORT", str(metrics))
            # Serve's client checks once a second whether an app it waits for is running; ten times here.
            cls._env.setattr(serve_client, "CLIENT_POLLING_INTERVAL_S", 0.1)
            ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="warning", log_to_driver=False)
            cls.cluster = Cluster(demo_dir)
        return cls.cluster

    @classmethod
    def delete_apps(cls, timeout_s: float = 60) -> None:
        """Every app deleted at once; their replicas stop side by side. (serve.delete waits for each app in turn
        and checks once a second.)"""
        if cls.cluster is None:
            return
        names = list(serve.status().applications)
        for name in names:
            serve.delete(name, _blocking=False)
        deadline = time.monotonic() + timeout_s
        while left := [name for name, app in serve.status().applications.items()
                       if app.status != ApplicationStatus.NOT_STARTED]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"apps {left} were not deleted within {timeout_s}s")
            time.sleep(0.1)

    @classmethod
    def stop(cls) -> None:
        if cls.cluster is not None:
            cls.cluster = None
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
                cls._env.undo()


def _uses_cluster(item: pytest.Item) -> bool:
    return "cluster" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that share the runtime run one after another, where the first of them would run."""
    shared = [item for item in items if _uses_cluster(item)]
    if shared:
        first = items.index(shared[0])
        rest = [item for item in items if not _uses_cluster(item)]
        items[:] = rest[:first] + shared + rest[first:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the module fixtures of the last module that shares the runtime are torn down, the runtime stops."""
    if _uses_cluster(item) and (nextitem is None or not _uses_cluster(nextitem)):
        SharedRuntime.stop()


@pytest.fixture(scope="module")
def cluster(request, demo_dir):
    """The app on 2 replicas, with the test module's CLUSTER_ARGS where it has them (None: the module deploys),
    on the shared runtime; every app is deleted when the module ends."""
    cluster = SharedRuntime.get(Path(demo_dir))
    try:
        args = getattr(request.module, "CLUSTER_ARGS", {})
        if args is not None:
            cluster.deploy(replicas=getattr(request.module, "CLUSTER_REPLICAS", 2), **args)
        yield cluster
    finally:
        SharedRuntime.delete_apps()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch
