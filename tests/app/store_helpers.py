"""Real remote stores for the remote-adapter tests, each on a free localhost port: moto's S3 server (a process
per test session, and spare ones that a test may stop), HTTP file servers (threads) and a server that accepts
connections and never answers; and registries over them."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from adapter_helpers import BASE
from app.adapters.registry import AdapterRegistry
from bench.ports import free_ports

# The GPU machine's image runs `pytest -m gpu` over tests/app without the test extra: skip, do not fail, there.
boto3 = pytest.importorskip("boto3")
s3fs = pytest.importorskip("s3fs")

REGION = "us-east-1"
S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")  # use_s3_endpoint's
_buckets = itertools.count()


def _moto_command(port: int) -> list[str]:
    script = Path(sys.executable).parent / "moto_server"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "moto.server"]
    return [*command, "-H", "127.0.0.1", "-p", str(port)]


def use_s3_endpoint(monkeypatch, endpoint: str, key_id: str = "testing", secret: str = "testing") -> None:
    """Point this process's environment (and so s3fs, and any child process) at an S3 endpoint."""
    for name, value in zip(S3_ENV, (endpoint, key_id, secret, REGION)):
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec shares instances, each keeping the endpoint it was made with


class MotoServer:
    """moto's standalone S3 (and IAM) server in its own process. It accepts any credentials until
    `enforce_auth`."""

    def __init__(self, start_timeout_s: float = 30.0):
        [port] = free_ports(1)
        self.endpoint = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(_moto_command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.key_id, self.secret = "testing", "testing"
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on {self.endpoint}") from None
                time.sleep(0.05)

    def client(self, service: str = "s3"):
        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id=self.key_id, aws_secret_access_key=self.secret)

    def enforce_auth(self) -> None:
        """From now on only the key of an IAM user allowed everything passes (moto's INITIAL_NO_AUTH_ACTION_COUNT,
        set through its API); that key becomes this server's credentials."""
        iam = self.client("iam")
        iam.create_user(UserName="node")
        iam.put_user_policy(UserName="node", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="node")["AccessKey"]
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=10).close()
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]

    def use(self, monkeypatch, key_id: str | None = None, secret: str | None = None) -> None:
        use_s3_endpoint(monkeypatch, self.endpoint, key_id or self.key_id, secret or self.secret)

    def bucket(self) -> S3Bucket:
        name = f"adapters-{next(_buckets)}"
        client = self.client()
        client.create_bucket(Bucket=name)
        return S3Bucket(client, name)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@dataclass
class S3Bucket:
    client: object  # boto3's S3 client
    name: str

    def uri(self, *parts: str) -> str:
        return "/".join([f"s3://{self.name}", *parts])

    def put_folder(self, folder: Path, prefix: str) -> str:
        """Upload the files of `folder` under `prefix` (single-part uploads: their ETags are MD5s); its URI."""
        for file in sorted(folder.iterdir()):
            if file.is_file():
                self.client.put_object(Bucket=self.name, Key=f"{prefix}/{file.name}", Body=file.read_bytes())
        return self.uri(prefix)


class FileServer:
    """http.server's file server over a folder, in a thread, as `python -m http.server` serves one: directory
    listings in HTML, Last-Modified but no ETag, and Range ignored (a ranged GET gets the whole file). Counts GETs
    and HEADs per path. Misbehaves where a test says: answers 403 under `forbidden`; answers 302 to
    `redirects[path]`; holds each file's GET until `hold` is set; waits `delay_s` before each file it sends; sends
    `short_by` bytes fewer than each file's Content-Length announces, then closes the connection."""

    def __init__(self, directory: Path):
        self.gets: Counter[str] = Counter()
        self.heads: Counter[str] = Counter()
        self.forbidden: tuple[str, ...] = ()
        self.redirects: dict[str, str] = {}
        self.hold: threading.Event | None = None
        self.delay_s = 0.0
        self.short_by = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, self, directory=str(directory)))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="file-server", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()


class _Handler(SimpleHTTPRequestHandler):
    def __init__(self, files: FileServer, *args, **kwargs):
        self.files = files
        super().__init__(*args, **kwargs)

    def do_GET(self):
        if not self._refused() and not self._redirected():
            with self.files._lock:
                self.files.gets[self.path] += 1
            if not self.path.endswith("/"):
                if self.files.hold is not None:
                    self.files.hold.wait(30)
                time.sleep(self.files.delay_s)
            super().do_GET()

    def do_HEAD(self):
        if not self._refused() and not self._redirected():
            super().do_HEAD()
            with self.files._lock:  # counted once answered
                self.files.heads[self.path] += 1

    def copyfile(self, source, outputfile):
        if not self.files.short_by:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(max(0, os.fstat(source.fileno()).st_size - self.files.short_by)))

    def _refused(self) -> bool:
        if self.files.forbidden and self.path.startswith(self.files.forbidden):
            self.send_error(403)
            return True
        return False

    def _redirected(self) -> bool:
        location = self.files.redirects.get(self.path)
        if location is None:
            return False
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()
        return True

    def log_message(self, *args):
        pass


@contextmanager
def silent_server():
    """The URL of a server that accepts connections and never answers: a store that hangs."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    held, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, name="silent-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for connection in held:
            connection.close()
        server.close()


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def moto_server():
    """One moto server for the session (tests each take their own bucket)."""
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def s3(moto_server, monkeypatch) -> S3Bucket:
    """A new bucket on the session's moto server, with this process's environment pointed at it."""
    moto_server.use(monkeypatch)
    yield moto_server.bucket()
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def spare_moto():
    """A moto server of this test's own, which it may stop or lock with credentials."""
    server = MotoServer()
    yield server
    server.stop()
    s3fs.S3FileSystem.clear_instance_cache()


def _serving(folder: Path):
    folder.mkdir()
    server = FileServer(folder)
    yield server
    server.stop()


@pytest.fixture
def file_server(tmp_path):
    """An HTTP file server over tmp_path / "www"."""
    yield from _serving(tmp_path / "www")


@pytest.fixture
def foreign_server(tmp_path):
    """A second HTTP file server, over tmp_path / "foreign": a host outside the adapter roots."""
    yield from _serving(tmp_path / "foreign")


@pytest.fixture
def registries():
    """Makes registries (max_rank 16 over BASE unless told), and shuts their fetch threads down after the test."""
    made = []

    def make(roots, base=BASE, **kwargs) -> AdapterRegistry:
        made.append(AdapterRegistry(roots, base, max_rank=16, **kwargs))
        return made[-1]

    yield make
    for registry in made:
        registry.shutdown()


def wait_for_fetches(registry: AdapterRegistry, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while registry.node_snapshot()["fetches_running"]:
        assert time.monotonic() < deadline, "fetches ahead did not finish"
        time.sleep(0.01)


def assert_same_bytes(got, expected) -> None:
    """Two StoredAdapters hold the same modules, ranks, scales and tensor bytes."""
    got, expected = got.flat_parts(), expected.flat_parts()
    assert got.keys() == expected.keys()
    for module, (a, b, rank, scale) in expected.items():
        got_a, got_b, got_rank, got_scale = got[module]
        assert (got_rank, got_scale, got_a.dtype) == (rank, scale, a.dtype)
        assert torch.equal(got_a.view(torch.uint8), a.view(torch.uint8))
        assert torch.equal(got_b.view(torch.uint8), b.view(torch.uint8))
