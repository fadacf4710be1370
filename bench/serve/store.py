"""An emulated remote object store for the serve benchmarks: moto's S3 server on localhost, behind a proxy that
adds a first-byte delay to every request and caps every connection's bandwidth, holding the bench's adapters.

    python -m bench.serve.store --objects 8        # start it, upload 8 random 84 MB objects, print its figures
    python -m bench.serve.store register --adapters 64   # time the app registering 64 demo adapters from it

A real object store's throughput grows with the connections a client opens, even on one object, whose byte ranges
each come at a connection's rate; one moto process's does not: it serves from one Python process (185-200 MB/s
at 1, 4 and 8 connections on 2 CPU cores; 253 MB/s over 8 connections on the H100's host). So the store runs as
`shards` moto processes (StoreConfig). Every shard holds the bytes of each distinct weights file once, under
`sources/`; an adapter's weights key is an alias of its source, and the proxies send each ranged GET of it to the
shard that its key and first byte hash to, so that one adapter's ranges are served by several processes at once.
Every other object (configs) lives in shard 0, where listings go too. `proxies` proxy processes
(bench/serve/store_proxy.py) share one port; they start once the upload has written the aliases. The app reads
through the proxies (`env()`: AWS_ENDPOINT_URL and dummy keys); uploads go to the shards directly. The proxies
run in processes of their own, so that the bytes they pace share no GIL with the benchmark's HTTP client.
moto keeps each object in memory up to MOTO_S3_DEFAULT_KEY_BUFFER_SIZE and spills larger ones to temporary
files; the shards here raise that bound to 1 GiB, so the objects stay in memory (the device's disk holds the
base model and the node cache).
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import httpx

from bench.ports import free_ports
from bench.serve.store_proxy import WEIGHTS_NAME

BUCKET = "bench-adapters"
PREFIX = "adapters"
SOURCES = "sources"  # where each shard holds the distinct weights files that adapters' weights keys alias
REGION = "us-west-2"  # not us-east-1: s3fs names the region as a location constraint, which us-east-1 refuses
KEY = "bench-key"  # moto accepts any key pair
UPLOADS_AT_ONCE = 16
MOTO_BUFFER_BYTES = 1 << 30  # objects up to this stay in moto's memory instead of temporary files


@dataclass(frozen=True)
class StoreConfig:
    latency_ms: float = 100.0  # first-byte delay of every request
    mbps: float = 150.0  # per-connection bandwidth cap, MB/s (10^6 bytes)
    shards: int = 4  # moto processes, each holding every distinct weights file; shard 0 also every small object
    proxies: int = 2  # proxy processes on the one port
    cores: int = 0  # host cores the store's processes run on alone (the last of this process's); 0: any core

    def __post_init__(self):
        if self.latency_ms < 0 or self.mbps <= 0:
            raise ValueError(f"latency_ms ({self.latency_ms}) must be >= 0 and mbps ({self.mbps}) > 0")
        if self.shards < 1 or self.proxies < 1:
            raise ValueError(f"shards ({self.shards}) and proxies ({self.proxies}) must be >= 1")
        if not 0 <= self.cores < len(os.sched_getaffinity(0)):
            raise ValueError(f"cores ({self.cores}) must leave at least one of this process's "
                             f"{len(os.sched_getaffinity(0))} cores to the rest")

    def core_split(self) -> tuple[set[int], set[int]]:
        """(the store's cores, everything else's): the last `cores` of this process's, and the others; both all
        of them when `cores` is 0."""
        mine = sorted(os.sched_getaffinity(0))
        if not self.cores:
            return set(mine), set(mine)
        return set(mine[-self.cores:]), set(mine[:-self.cores])


def _child_setup(cores: set[int]) -> Callable[[], None]:
    """What a child runs before exec: get SIGTERM when the benchmark's process ends, however it ends, and run on
    `cores` only (Linux)."""
    def setup() -> None:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        os.sched_setaffinity(0, cores)

    return setup


class EmulatedStore:
    """The moto shards and the proxies as child processes; `close()` (or the `with` block's end) stops them. The
    proxies start at the end of `upload`, which must come first."""

    def __init__(self, config: StoreConfig = StoreConfig()):
        self.config = config
        self.cores, self.other_cores = config.core_split()
        self.moto_ports = free_ports(config.shards)
        [self.proxy_port] = free_ports(1)
        env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(MOTO_BUFFER_BYTES)}
        self._moto = [subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                       env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       preexec_fn=_child_setup(self.cores)) for port in self.moto_ports]
        self._proxies: list[subprocess.Popen] = []
        self._scratch = tempfile.mkdtemp(prefix="store-proxy-")
        try:
            for process, port in zip(self._moto, self.moto_ports):
                self._wait_for(process, f"http://127.0.0.1:{port}/moto-api/", "moto's server (is moto[server] "
                               "installed?)")
        except BaseException:
            self.close()
            raise
        self.root = f"s3://{BUCKET}/{PREFIX}"

    def _start_proxies(self, sources: dict[str, str]) -> None:
        (aliases := Path(self._scratch) / "sources.json").write_text(json.dumps(sources))
        proxy = [sys.executable, "-m", "bench.serve.store_proxy", "--port", str(self.proxy_port),
                 "--upstream-ports", *map(str, self.moto_ports), "--sources", str(aliases),
                 "--latency-ms", str(self.config.latency_ms), "--mbps", str(self.config.mbps)]
        self._proxies = [subprocess.Popen(proxy, cwd=Path(__file__).resolve().parents[2],
                                          preexec_fn=_child_setup(self.cores)) for _ in range(self.config.proxies)]
        for process in self._proxies:  # each answers for itself only once the port has them all
            self._wait_for(process, None, "the proxy")

    def _wait_for(self, process: subprocess.Popen, url: str | None, what: str, timeout_s: float = 60.0) -> None:
        """Until `url` answers (None: until the proxy port accepts a connection), or the process exits."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"{what} exited with {process.returncode}")
            try:
                if url is not None:
                    httpx.get(url, timeout=2)
                else:
                    socket.create_connection(("127.0.0.1", self.proxy_port), timeout=2).close()
                return
            except (httpx.HTTPError, OSError):
                time.sleep(0.2)
        raise TimeoutError(f"{what} did not answer within {timeout_s:.0f} s")

    def pids(self) -> list[int]:
        """The store's processes: its moto shards and its proxies."""
        return [process.pid for process in [*self._moto, *self._proxies]]

    def http_root(self) -> str:
        """The root as an http:// URL through the proxies: the weights are uploaded public-read, so moto serves
        them to plain GETs and HEADs."""
        return f"http://127.0.0.1:{self.proxy_port}/{BUCKET}/{PREFIX}"

    def env(self) -> dict[str, str]:
        """What a client of the emulated store needs: the proxy's endpoint, dummy keys, a region."""
        return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy_port}", "AWS_ACCESS_KEY_ID": KEY,
                "AWS_SECRET_ACCESS_KEY": KEY, "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION}

    def filesystem(self, direct: bool, shard: int = 0):
        """An s3fs filesystem on one moto shard itself (direct) or through the proxies, fresh (no cached
        connections)."""
        import s3fs

        port = self.moto_ports[shard] if direct else self.proxy_port
        return s3fs.S3FileSystem(key=KEY, secret=KEY, endpoint_url=f"http://127.0.0.1:{port}",
                                 client_kwargs={"region_name": REGION}, skip_instance_cache=True)

    def upload(self, folders: list[Path], names: list[str]) -> dict:
        """Adapter folder i as `names[i]` under the root, then start the proxies. Folders may repeat. Each distinct
        weights file is uploaded to every shard once, under SOURCES, and the adapters' weights keys are aliases of
        it (their names differ, their bytes repeat); every other file goes to shard 0, uploaded where its folder
        first appears and copied inside the shard where it repeats. UPLOADS_AT_ONCE files at once per shard, the
        shards at once."""
        if self._proxies:
            raise RuntimeError("the store's adapters are uploaded once")
        started, shards = time.perf_counter(), range(self.config.shards)
        distinct = list(dict.fromkeys(folders))
        sources = {f"{BUCKET}/{PREFIX}/{name}/{WEIGHTS_NAME}": f"{BUCKET}/{SOURCES}/{distinct.index(folder)}/"
                   f"{WEIGHTS_NAME}" for folder, name in zip(folders, names) if (folder / WEIGHTS_NAME).is_file()}
        weights = [[str(folder / WEIGHTS_NAME) for folder in distinct if (folder / WEIGHTS_NAME).is_file()],
                   [f"{BUCKET}/{SOURCES}/{i}/{WEIGHTS_NAME}" for i, folder in enumerate(distinct)
                    if (folder / WEIGHTS_NAME).is_file()]]
        puts, copies = ([], []), ([], [])
        first: dict[Path, str] = {}  # local file -> its first key in shard 0
        for folder, name in zip(folders, names):
            for file in sorted(f for f in folder.iterdir() if f.is_file() and f.name != WEIGHTS_NAME):
                key = f"{BUCKET}/{PREFIX}/{name}/{file.name}"
                source = first.setdefault(file, key)
                pairs = puts if source == key else copies
                pairs[0].append(str(file) if source == key else source)
                pairs[1].append(key)

        def fill(shard: int) -> None:
            fs = self.filesystem(direct=True, shard=shard)
            if not fs.exists(BUCKET):
                fs.mkdir(BUCKET)
            if weights[0]:
                fs.put(*weights, batch_size=UPLOADS_AT_ONCE, ACL="public-read")  # for http_root()
            if shard == 0 and puts[0]:
                fs.put(*puts, batch_size=UPLOADS_AT_ONCE)
            if shard == 0 and copies[0]:
                fs.copy(*copies, batch_size=UPLOADS_AT_ONCE)

        with ThreadPoolExecutor(self.config.shards) as pool:
            list(pool.map(fill, shards))
        self._start_proxies(sources)
        sizes = [os.path.getsize(p) for p in [*weights[0] * self.config.shards, *puts[0]]]
        elapsed = time.perf_counter() - started
        return {"adapters": len(names), "distinct": len(distinct), "shards": self.config.shards,
                "uploaded_objects": len(sizes), "uploaded_bytes": sum(sizes),
                "upload_mb_per_s": sum(sizes) / elapsed / 1e6, "copied_in_store": len(copies[0]),
                "aliases": len(sources), "total_s": elapsed}

    def measure(self, uris: list[str], repeats: int = 5, connections: int = 8) -> dict:
        """The store's figures as a client through the proxies sees them (the floor under any fetch), on the
        first of `uris`: time to first byte of a 1 KiB ranged GET (median over `repeats`, on a warm connection);
        one GET of the whole object on one connection; the app's own download of it (RemoteStore.download) alone.
        Over all of `uris`: `connections` ranged GETs of the app's part size at once,
        twice over, one object after another (what the shards and the proxies deliver together)."""
        from app.adapters.remote import PART_BYTES

        fs = self.filesystem(direct=False)
        uri, path = uris[0], uris[0].removeprefix("s3://")
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
        paths = [u.removeprefix("s3://") for u in uris]
        reads = [(paths[i % len(paths)], (i * PART_BYTES) % max(size - PART_BYTES, 1)) for i in range(2 * connections)]
        t = time.perf_counter()
        with ThreadPoolExecutor(connections) as pool:
            parallel = sum(pool.map(lambda read: len(fs.cat_file(read[0], start=read[1], end=read[1] + PART_BYTES)),
                                    reads))
        parallel_s = time.perf_counter() - t
        first_byte_s = statistics.median(ttfb)
        return {"object_bytes": size, "ttfb_ms_p50": 1e3 * first_byte_s, "ttfb_ms_max": 1e3 * max(ttfb),
                "get_whole_s": whole_s, "single_connection_mb_per_s": size / whole_s / 1e6,
                "single_connection_mb_per_s_after_first_byte": size / max(whole_s - first_byte_s, 1e-9) / 1e6,
                "connections": connections, "parallel_objects": len(uris),
                "parallel_mb_per_s": parallel / parallel_s / 1e6,
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
        shutil.rmtree(self._scratch, ignore_errors=True)
        for process in [*self._proxies, *self._moto]:
            if process.poll() is None:
                process.terminate()
        for process in [*self._proxies, *self._moto]:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The emulated store's options, as every store benchmark takes them (`store_config` reads them back)."""
    parser.add_argument("--latency-ms", type=float, default=StoreConfig.latency_ms)
    parser.add_argument("--mbps", type=float, default=StoreConfig.mbps)
    parser.add_argument("--shards", type=int, default=StoreConfig.shards)
    parser.add_argument("--proxies", type=int, default=StoreConfig.proxies)
    parser.add_argument("--cores", type=int, default=StoreConfig.cores,
                        help="host cores the store runs on alone, the last of this process's (0: any)")


def store_config(args: argparse.Namespace) -> StoreConfig:
    return StoreConfig(args.latency_ms, args.mbps, args.shards, args.proxies, args.cores)


def random_objects(scratch: Path, count: int, object_mb: float, prefix: str = "object") -> list[Path]:
    """`count` folders under `scratch`, each holding one weights file of `object_mb` random MB."""
    folders = []
    for i in range(count):
        (folder := scratch / f"{prefix}-{i}").mkdir()
        (folder / WEIGHTS_NAME).write_bytes(os.urandom(int(object_mb * 1e6)))
        folders.append(folder)
    return folders


def describe(config: StoreConfig) -> dict:
    return {"kind": "moto's S3 server behind a first-byte-delay and bandwidth-cap proxy (bench/serve/store.py)",
            "layout": "every shard holds each distinct weights file; one object's ranges spread over the shards",
            **asdict(config)}


def time_registrations(config: StoreConfig, count: int) -> dict:
    """The app's registry registering `count` adapters (the tiny demo's, repeated) from the store, one at a time and
    VALIDATIONS_AT_ONCE at a time, as a replica does when it starts."""
    from transformers import AutoConfig

    from app.adapters.registry import VALIDATIONS_AT_ONCE, AdapterRegistry
    from app.demo.build import ensure_demo
    from bench.common import REPO_DEMO

    demo = ensure_demo(REPO_DEMO / "tiny")
    folders = sorted(f for f in (demo / "adapters").iterdir() if f.is_dir())
    names = [f"adapter-{i}" for i in range(count)]
    out = {"adapters": count}
    with EmulatedStore(config) as store, mock.patch.dict(os.environ, store.env()):
        store.upload([folders[i % len(folders)] for i in range(count)], names)
        for at_once in (1, VALIDATIONS_AT_ONCE):
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches filesystems by arguments, not by environment
            registry = AdapterRegistry([store.root], AutoConfig.from_pretrained(demo / "base"), 64)
            try:
                started = time.perf_counter()
                with ThreadPoolExecutor(at_once) as pool:
                    list(pool.map(lambda name: registry.register(name, f"{store.root}/{name}"), names))
                out[f"seconds_{at_once}_at_once"] = time.perf_counter() - started
            finally:
                registry.shutdown()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", default="demo", choices=["demo", "register"])
    add_store_arguments(parser)
    parser.add_argument("--objects", type=int, default=8, help="demo: random objects of --object-mb to upload")
    parser.add_argument("--object-mb", type=float, default=83.9)
    parser.add_argument("--adapters", type=int, default=64, help="register: copies of the tiny demo's adapters")
    args = parser.parse_args(argv)
    config = store_config(args)
    if args.role == "register":
        print(json.dumps({"store": describe(config), **time_registrations(config, args.adapters)}, indent=1))
        return
    scratch = Path(tempfile.mkdtemp(prefix="store-demo-"))
    try:
        folders = random_objects(scratch, args.objects, args.object_mb)
        with EmulatedStore(config) as store:
            upload = store.upload(folders, [f.name for f in folders])
            floor = store.measure([f"{store.root}/{f.name}/{WEIGHTS_NAME}" for f in folders])
            print(json.dumps({"store": describe(config), "upload": upload, "floor": floor}, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
