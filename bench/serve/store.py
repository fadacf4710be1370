"""An emulated remote object store for the serve benchmarks: moto's S3 server on localhost, behind a proxy that
adds a first-byte delay to every request and caps every connection's bandwidth, holding the bench's adapters.

    python -m bench.serve.store --objects 4        # start it, upload 4 random 84 MB objects, print its figures
    python -m bench.serve.store proxy --upstream-port 9000 --latency-ms 100 --mbps 150   # the proxy alone

The app reads through the proxy (`env()`: AWS_ENDPOINT_URL and dummy keys); uploads go to moto directly. The
proxy runs in its own process, so that the bytes it paces share no GIL with the benchmark's HTTP client.
moto keeps each object in memory up to MOTO_S3_DEFAULT_KEY_BUFFER_SIZE and spills larger ones to temporary
files; the server here raises that bound to 1 GiB, so the objects stay in its memory (the device's disk holds the
base model and the node cache).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import httpx

BUCKET = "bench-adapters"
PREFIX = "adapters"
REGION = "us-west-2"  # not us-east-1: s3fs names the region as a location constraint, which us-east-1 refuses
KEY = "bench-key"  # moto accepts any key pair
CHUNK = 256 * 1024  # bytes the proxy moves at once; also the token bucket's burst
UPLOADS_AT_ONCE = 16
MOTO_BUFFER_BYTES = 1 << 30  # objects up to this stay in moto's memory instead of temporary files


@dataclass(frozen=True)
class StoreConfig:
    latency_ms: float = 100.0  # first-byte delay of every request
    mbps: float = 150.0  # per-connection bandwidth cap, MB/s (10^6 bytes)

    def __post_init__(self):
        if self.latency_ms < 0 or self.mbps <= 0:
            raise ValueError(f"latency_ms ({self.latency_ms}) must be >= 0 and mbps ({self.mbps}) > 0")


# --- the proxy -------------------------------------------------------------------------------------------
# Written by hand: no maintained Python library emulates a slow link (toxiproxy, which does, is a Go binary that
# the package registries do not carry).

class TokenBucket:
    """At most `rate` bytes/s on average, in bursts of at most `burst` bytes; a take beyond the tokens waits."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = float(burst), time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        if self.tokens < 0:  # the debt is repaid while sleeping; the next take refills from `stamp`
            await asyncio.sleep(-self.tokens / self.rate)


async def _relay(client_reader, client_writer, upstream: tuple[str, int], latency_s: float, rate: float) -> None:
    """One client connection: its requests go upstream as they come; each response's first bytes wait until
    `latency_s` after its request's first bytes, and every response byte passes one token bucket. HTTP/1.1 sends a
    connection's requests one after another, so 'the client wrote while no request awaited its response' marks a
    new request (reads carry no body that could overlap their response)."""
    try:
        up_reader, up_writer = await asyncio.open_connection(*upstream)
    except OSError:
        client_writer.close()
        return
    loop, bucket = asyncio.get_running_loop(), TokenBucket(rate, CHUNK)
    sent_at: list[float] = []  # the awaiting request's first-byte time, if one awaits its response

    async def requests():
        while data := await client_reader.read(CHUNK):
            if not sent_at:
                sent_at.append(loop.time())
            up_writer.write(data)
            await up_writer.drain()

    async def responses():
        while data := await up_reader.read(CHUNK):
            if sent_at:
                await asyncio.sleep(sent_at.pop() + latency_s - loop.time())
            await bucket.take(len(data))
            client_writer.write(data)
            await client_writer.drain()

    tasks = [asyncio.create_task(requests()), asyncio.create_task(responses())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    except (ConnectionError, OSError):
        pass
    finally:
        for task in tasks:
            task.cancel()
        for writer in (up_writer, client_writer):
            writer.close()


async def serve_proxy(upstream_port: int, config: StoreConfig) -> None:
    """Listen on a free localhost port, print it, relay to `upstream_port` until killed."""
    upstream, latency_s, rate = ("127.0.0.1", upstream_port), config.latency_ms / 1e3, config.mbps * 1e6

    async def handle(reader, writer):
        try:
            await _relay(reader, writer, upstream, latency_s, rate)
        except (ConnectionError, OSError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, limit=CHUNK)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


# --- the store: moto + the proxy + the uploads ------------------------------------------------------------

def _die_with_parent() -> None:
    """In a child, before exec: get SIGTERM when the benchmark's process ends, however it ends (Linux)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmulatedStore:
    """moto's S3 server and the proxy as child processes; `close()` (or the `with` block's end) stops them."""

    def __init__(self, config: StoreConfig = StoreConfig()):
        self.config = config
        self.moto_port = _free_port()
        env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(MOTO_BUFFER_BYTES)}
        self._moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                       str(self.moto_port)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self._proxy = subprocess.Popen([sys.executable, "-m", "bench.serve.store", "proxy", "--upstream-port",
                                        str(self.moto_port), "--latency-ms", str(config.latency_ms), "--mbps",
                                        str(config.mbps)], stdout=subprocess.PIPE, text=True,
                                       cwd=Path(__file__).resolve().parents[2], preexec_fn=_die_with_parent)
        try:
            self.proxy_port = int(self._proxy.stdout.readline())
            self._wait_for_moto()
        except BaseException:
            self.close()
            raise
        self.root = f"s3://{BUCKET}/{PREFIX}"

    def _wait_for_moto(self, timeout_s: float = 60.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self._moto.poll() is not None:
                raise RuntimeError(f"moto's server exited with {self._moto.returncode} (is moto[server] installed?)")
            try:
                httpx.get(f"http://127.0.0.1:{self.moto_port}/moto-api/", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise TimeoutError(f"moto's server did not answer on port {self.moto_port} within {timeout_s:.0f} s")

    def env(self) -> dict[str, str]:
        """What a client of the emulated store needs: the proxy's endpoint, dummy keys, a region."""
        return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy_port}", "AWS_ACCESS_KEY_ID": KEY,
                "AWS_SECRET_ACCESS_KEY": KEY, "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION}

    def filesystem(self, direct: bool):
        """An s3fs filesystem on moto itself (direct) or through the proxy, fresh (no cached connections)."""
        import s3fs

        port = self.moto_port if direct else self.proxy_port
        return s3fs.S3FileSystem(key=KEY, secret=KEY, endpoint_url=f"http://127.0.0.1:{port}",
                                 client_kwargs={"region_name": REGION}, skip_instance_cache=True)

    def upload(self, folders: list[Path], names: list[str]) -> dict:
        """Adapter folder i as `names[i]` under the root: each distinct folder's files uploaded to moto directly,
        UPLOADS_AT_ONCE files at once; a folder that appears again is copied inside the store (its name differs,
        its bytes repeat)."""
        fs, started = self.filesystem(direct=True), time.perf_counter()
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        first: dict[Path, str] = {}
        puts, copies = ([], []), ([], [])
        for folder, name in zip(folders, names):
            pairs = puts if folder not in first else copies
            source = str(folder) if folder not in first else first[folder]
            first.setdefault(folder, f"{BUCKET}/{PREFIX}/{name}")
            for file in sorted(f.name for f in folder.iterdir() if f.is_file()):
                pairs[0].append(f"{source}/{file}")
                pairs[1].append(f"{BUCKET}/{PREFIX}/{name}/{file}")
        fs.put(*puts, batch_size=UPLOADS_AT_ONCE)
        uploaded_s = time.perf_counter() - started
        if copies[0]:
            fs.copy(*copies, batch_size=UPLOADS_AT_ONCE)
        sizes = [os.path.getsize(p) for p in puts[0]]
        return {"adapters": len(names), "distinct": len(first), "uploaded_bytes": sum(sizes),
                "upload_s": uploaded_s, "upload_mb_per_s": sum(sizes) / uploaded_s / 1e6,
                "copied_in_store": len(copies[0]) // 2, "total_s": time.perf_counter() - started}

    def measure(self, uri: str, repeats: int = 5, connections: int = 8) -> dict:
        """The store's figures as a client through the proxy sees them (the floor under any fetch): time to first
        byte of a 1 KiB ranged GET (median over `repeats`, on a warm connection); one GET of the whole object on
        one connection; `connections` ranged GETs of the app's part size at once, twice over (what the store and
        the proxy deliver together); and the app's own download of the object (RemoteStore.download) alone."""
        from app.adapters.remote import PART_BYTES

        fs = self.filesystem(direct=False)
        path = uri.removeprefix("s3://")
        size = fs.info(path)["size"]  # also opens the connection
        ttfb = []
        for _ in range(repeats):
            t = time.perf_counter()
            fs.cat_file(path, start=0, end=1024)
            ttfb.append(time.perf_counter() - t)
        t = time.perf_counter()
        whole = len(fs.cat_file(path))
        whole_s = time.perf_counter() - t
        assert whole == size, f"read {whole} of {size} bytes"
        starts = [(i * PART_BYTES) % max(size - PART_BYTES, 1) for i in range(2 * connections)]
        t = time.perf_counter()
        with ThreadPoolExecutor(connections) as pool:
            parallel = sum(pool.map(lambda start: len(fs.cat_file(path, start=start, end=start + PART_BYTES)),
                                    starts))
        parallel_s = time.perf_counter() - t
        first_byte_s = statistics.median(ttfb)
        return {"object_bytes": size, "ttfb_ms_p50": 1e3 * first_byte_s, "ttfb_ms_max": 1e3 * max(ttfb),
                "get_whole_s": whole_s, "single_connection_mb_per_s": size / whole_s / 1e6,
                "single_connection_mb_per_s_after_first_byte": size / max(whole_s - first_byte_s, 1e-9) / 1e6,
                "connections": connections, "parallel_mb_per_s": parallel / parallel_s / 1e6,
                "app_download_s": self._app_download_s(uri)}

    def _app_download_s(self, uri: str) -> float:
        """One object through the app's RemoteStore.download (its ranged parts at once), as a replica fetches."""
        import s3fs

        from app.adapters.remote import RemoteStore

        with mock.patch.dict(os.environ, self.env()):
            s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches filesystems by arguments, not by environment
            store = RemoteStore([uri.rsplit("/", 1)[0]])
            try:
                obj = store.stat(uri)
                with tempfile.TemporaryDirectory() as scratch:
                    t = time.perf_counter()
                    store.download(obj, Path(scratch) / "object")
                    return time.perf_counter() - t
            finally:
                store.shutdown()
                s3fs.S3FileSystem.clear_instance_cache()

    def close(self) -> None:
        for process in (self._proxy, self._moto):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
        if self._proxy.stdout:
            self._proxy.stdout.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RemoteAdapters:
    """The claim bench's adapters in an emulated store, and a fresh, empty node cache for each arm.

    Uploads `folders[i]` as `names[i]` (folders may repeat: the store holds len(names) distinct objects whose
    bytes may repeat), sets this process's environment to the store's before Ray starts (so that every Ray worker
    inherits it), and measures the store's floor on the first adapter."""

    def __init__(self, config: StoreConfig, folders: list[Path], names: list[str], cache_adapters: float | None,
                 cache_root: str | None = None):
        self.config, self.store = config, EmulatedStore(config)
        try:
            os.environ.update(self.store.env())
            self.upload = self.store.upload(folders, names)
            weights = max((f for f in folders[0].iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
            self.floor = self.store.measure(f"{self.store.root}/{names[0]}/{weights.name}")
        except BaseException:
            self.store.close()
            raise
        # A node cache entry is the adapter's files; the budget is counted in the largest, as --capacity is.
        self.entry_bytes = max(sum(f.stat().st_size for f in d.iterdir() if f.is_file()) for d in set(folders))
        self.cache_adapters = len(names) if cache_adapters is None else cache_adapters
        self.cache_bytes = max(1, int(self.cache_adapters * self.entry_bytes))
        self.cache_root, self.cache_dir = cache_root, None
        self.root = self.store.root

    def fresh_cache(self) -> dict:
        """AppArgs fields for the next arm: an empty node cache folder of the same budget as every arm's."""
        self.drop_cache()
        self.cache_dir = tempfile.mkdtemp(prefix="node-cache-", dir=self.cache_root)
        return {"adapter_cache_dir": self.cache_dir, "adapter_cache_bytes": self.cache_bytes}

    def drop_cache(self) -> None:
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)
            self.cache_dir = None

    def record(self) -> dict:
        return {**describe(self.config), "root": self.root, "floor": self.floor, "upload": self.upload,
                "node_cache_adapters": self.cache_adapters, "node_cache_bytes": self.cache_bytes,
                "node_cache_entry_bytes": self.entry_bytes}

    def close(self) -> None:
        self.drop_cache()
        self.store.close()


def describe(config: StoreConfig) -> dict:
    return {"kind": "moto's S3 server behind a first-byte-delay and bandwidth-cap proxy (bench/serve/store.py)",
            **asdict(config)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="demo", choices=["demo", "proxy"])
    parser.add_argument("--upstream-port", type=int)
    parser.add_argument("--latency-ms", type=float, default=StoreConfig.latency_ms)
    parser.add_argument("--mbps", type=float, default=StoreConfig.mbps)
    parser.add_argument("--objects", type=int, default=4, help="demo: random objects of --object-mb to upload")
    parser.add_argument("--object-mb", type=float, default=83.9)
    args = parser.parse_args(argv)
    config = StoreConfig(args.latency_ms, args.mbps)
    if args.role == "proxy":
        asyncio.run(serve_proxy(args.upstream_port, config))
        return
    scratch = Path(tempfile.mkdtemp(prefix="store-demo-"))
    try:
        folders = []
        for i in range(args.objects):
            folder = scratch / f"object-{i}"
            folder.mkdir()
            (folder / "object.bin").write_bytes(os.urandom(int(args.object_mb * 1e6)))
            folders.append(folder)
        with EmulatedStore(config) as store:
            upload = store.upload(folders, [f.name for f in folders])
            floor = store.measure(f"{store.root}/{folders[0].name}/object.bin")
            print(json.dumps({"store": describe(config), "upload": upload, "floor": floor}, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
