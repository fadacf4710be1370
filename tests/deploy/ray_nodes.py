"""Real Ray nodes on this machine, started with `ray start --block` as an operator would start them.

Each node is one `ray start --block` process in a session of its own. Its GCS, raylet and agents are
its children (Ray fate-shares them with it), and the workers it runs exit when their raylet goes.
`stop()` ends that process by its id (SIGTERM, then SIGKILL for its process group), never by name:
other Ray clusters on this machine are left alone. Every port is chosen free, so several clusters
can run side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
import yaml
from ray._raylet import Config
from ray.serve.context import _set_global_client

from bench.ports import free_ports  # noqa: F401 - the tests import it from here

RAY = str(Path(sys.executable).with_name("ray"))
SERVE = str(Path(sys.executable).with_name("serve"))
# Ray >= 2.60 puts new local clusters under token auth; the CLI and drivers must say so to send the token.
RAY_ENV = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}


class RayNode:
    """One `ray start --block` node. Use as a context manager, or call stop() in a finalizer."""

    def __init__(self, log_path: Path, *, head_address: str | None = None, num_cpus: float = 2,
                 resources: dict | None = None, dashboard: bool = False, temp_dir: str | None = None,
                 env: dict | None = None):
        self.log_path = log_path
        gcs, client, dash, agent_http, agent_grpc, runtime_env, metrics, node_manager, object_manager = free_ports(9)
        args = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}",
                f"--resources={json.dumps(resources or {})}", f"--dashboard-agent-listen-port={agent_http}",
                f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={runtime_env}",
                f"--metrics-export-port={metrics}", f"--node-manager-port={node_manager}",
                f"--object-manager-port={object_manager}", "--object-store-memory=200000000",
                "--disable-usage-stats"]
        if head_address is None:
            self._own_temp_dir = temp_dir is None
            self.temp_dir = temp_dir or tempfile.mkdtemp(prefix="lrs", dir="/tmp")  # unix sockets: short paths
            args += ["--head", f"--port={gcs}", f"--ray-client-server-port={client}",
                     f"--include-dashboard={str(dashboard).lower()}", f"--temp-dir={self.temp_dir}"]
            if dashboard:
                args += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dash}"]
            self.address = f"127.0.0.1:{gcs}"
        else:
            self.temp_dir, self._own_temp_dir = temp_dir, False
            args += [f"--address={head_address}"] + ([f"--temp-dir={temp_dir}"] if temp_dir else [])
            self.address = head_address
        self.dashboard_url = f"http://127.0.0.1:{dash}" if dashboard else None
        self.env = {**os.environ, **RAY_ENV, **(env or {})}
        if head_address is None:  # `ray start --head` under token auth wants a token: make one if none exists
            subprocess.run([RAY, "get-auth-token", "--generate"], env=self.env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60, check=True)
        self._log = open(log_path, "ab")
        self.process = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                        start_new_session=True)

    def wait_started(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.process.returncode}: {self.log_tail()}")
            if b"Ray runtime started" in self.log_path.read_bytes():
                return
            time.sleep(0.2)
        raise TimeoutError(f"ray start did not come up within {timeout_s}s: {self.log_tail()}")

    def child_pid(self, name: str) -> int:
        """The pid of this node's process called `name` (raylet, gcs_server), a child of `ray start`."""
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            comm, ppid = stat[stat.index("(") + 1:stat.rindex(")")], int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == self.process.pid and comm == name:
                return int(proc.name)
        raise LookupError(f"no {name} under ray start (pid {self.process.pid})")

    def kill_raylet(self) -> int:
        """The node dies as a machine would: its raylet killed, its workers then exit with it."""
        pid = self.child_pid("raylet")
        os.kill(pid, signal.SIGKILL)
        return pid

    def log_tail(self, chars: int = 2000) -> str:
        return self.log_path.read_bytes()[-chars:].decode(errors="replace")

    def stop(self) -> None:
        """Kill the node at once (a test cluster needs no drain): its process group, then its children,
        which Ray ties to the `ray start` process, go with it; its workers exit when their raylet does."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.wait(10)
        self._log.close()
        if self._own_temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def connect_driver(address: str) -> None:
    """ray.init from this process against a cluster under token auth. Ray caches the auth mode it read
    from the environment, so name the mode and refresh that cache first."""
    os.environ.update(RAY_ENV)
    Config.initialize("")
    ray.init(address=address, logging_level="warning", log_to_driver=False)


def disconnect_driver() -> None:
    """ray.shutdown, and forget Serve's client of this cluster: a later cluster's tests must not reuse it."""
    ray.shutdown()
    _set_global_client(None)


def write_serve_config(path: Path, port: int, args: dict, deployments: list[dict]) -> Path:
    """A serve_config.yaml like the repository's, for `serve deploy`."""
    config = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
              "applications": [{"name": "lora", "route_prefix": "/", "import_path": "deploy.app:build_app",
                                "args": args, "deployments": deployments}]}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def serve_cli(*args: str, env: dict, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`serve ...` as an operator runs it (token auth named, as README says)."""
    return subprocess.run([SERVE, *args], env={**os.environ, **RAY_ENV, **env}, capture_output=True, text=True,
                          timeout=timeout_s)


def stop_serve_run(process: subprocess.Popen) -> None:
    """serve run's graceful shutdown (seconds when idle; given 30 s), then its whole process group: a cluster left
    running would be the one a later test's ray.init() connects to."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # started with start_new_session: the group is serve run's
    except ProcessLookupError:
        pass
    process.wait()
