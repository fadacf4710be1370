"""What downloads from a remote store cost a replica's engine loop when they run in its process.

A replica's engine steps on a thread: some Python to schedule and launch the step, then a wait on the GPU
(which frees the GIL). Fetches of remote adapters run on worker threads of the same process: their ranged reads
go through obstore for s3:// and urllib3 for http(s)://, both waiting and reading with the GIL released. This
times a stand-in for the engine loop (`--step-python-ms` of Python, `--step-ops` torch calls, each of which lets
go of the GIL and takes it back as a step's launches do, then `--step-wait-ms` asleep), under an engine
process's GIL switch interval (`--switch-interval-s`), while `--downloads` adapters download at once from the
emulated store (bench/serve/store.py) through the app's own RemoteStore.download: in the loop's process, as a
replica downloads, and in a child process; in turn `--repeats` times, with an idle phase first. `--scheme http`
reads the same objects from the same store as an http:// root (plain GETs of public-read objects):

    python -m bench.serve.fetch_contention                    # 8 downloads of 84 MB at once, 4 shards, 2 proxies
    bash bench/device/fetch_contention.sh                     # the same on the GPU machine's host

Each phase reports the loop's step time (p50 / p90 / p99, ms), how late a thread that sleeps 2 ms at a time
wakes (`gil_wait_ms`: its wait for the GIL, and for a core), and the downloads' MB/s. A child process shares
no GIL with the loop: where a phase differs from it beyond noise, the difference is the GIL's.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import torch

from app.engine.async_engine import SWITCH_INTERVAL_S
from app.engine.stall_sampler import StallSampler
from bench.common import RESULTS, write_result
from bench.serve.store import EmulatedStore, add_store_arguments, describe, random_objects, store_config
from bench.serve.store_proxy import WEIGHTS_NAME


def stand_in_step(python_ms: float, wait_ms: float, loops_per_ms: int, ops: int = 0, tensor=None) -> None:
    x = 0
    for i in range(int(python_ms * loops_per_ms)):
        x += i * i
    for _ in range(ops):  # each torch call lets go of the GIL and takes it back, as an engine step's launches do
        tensor.add_(1)
    time.sleep(wait_ms / 1e3)


def loops_per_ms() -> int:
    """How many iterations of the stand-in's Python loop take a millisecond here, alone."""
    n, x, start = 500_000, 0, time.perf_counter()
    for i in range(n):
        x += i * i
    return max(1, int(n / (1e3 * (time.perf_counter() - start))))


def download(env: dict, uris: list[str], rounds: int) -> tuple[float, int]:
    """Each of `uris` `rounds` times, all at once on len(uris) threads, through the app's RemoteStore: (seconds,
    bytes)."""
    with mock.patch.dict(os.environ, env):
        import s3fs

        from app.adapters.remote import RemoteStore

        s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches filesystems by arguments, not by environment
        store = RemoteStore([uris[0].rsplit("/", 2)[0]])
        scratch = Path(tempfile.mkdtemp(prefix="fetch-contention-"))
        try:
            objects = [store.stat(uri) for uri in uris] * rounds
            start = time.perf_counter()
            with ThreadPoolExecutor(len(uris)) as pool:
                list(pool.map(lambda i: store.download(objects[i], scratch / f"object-{i}"), range(len(objects))))
            return time.perf_counter() - start, sum(obj.size for obj in objects)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            store.shutdown()


def timed_phase(run, args, per_ms: int) -> dict:
    """The stand-in loop's step times while `run()` (which returns (seconds, bytes) or None) runs."""
    stop, steps = threading.Event(), []
    tensor = torch.zeros(16) if args.step_ops else None

    def loop() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            stand_in_step(args.step_python_ms, args.step_wait_ms, per_ms, args.step_ops, tensor)
            steps.append(1e3 * (time.perf_counter() - t))

    thread = threading.Thread(target=loop)
    waker = StallSampler(interval_s=0.002)  # marks nothing: it only times its own wake-ups, a wait for the GIL
    waker.mark(None)
    thread.start()
    try:
        moved = run()
    finally:
        stop.set()
        thread.join()
        waker.stop()
    ordered = sorted(steps[1:])
    q = lambda f: ordered[min(len(ordered) - 1, int(f * len(ordered)))]  # noqa: E731
    out = {"steps": len(ordered), "step_ms_p50": statistics.median(ordered), "step_ms_p90": q(0.9),
           "step_ms_p99": q(0.99), "gil_wait_ms": waker.summary()["wake_late_ms"]}
    if moved is not None:
        out.update(download_s=moved[0], download_mb_per_s=moved[1] / moved[0] / 1e6)
    return out


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--downloads", type=int, default=8, help="adapters downloading at once (fetch workers)")
    parser.add_argument("--rounds", type=int, default=3, help="times each phase downloads every adapter")
    parser.add_argument("--object-mb", type=float, default=83.9)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=5.0, help="the idle phase's length")
    parser.add_argument("--step-python-ms", type=float, default=2.0)
    parser.add_argument("--step-wait-ms", type=float, default=7.0, help="the GPU's share of a decode step")
    parser.add_argument("--switch-interval-s", type=float, default=SWITCH_INTERVAL_S,
                        help="the GIL's switch interval (an engine process's by default)")
    parser.add_argument("--step-ops", type=int, default=0,
                        help="torch calls per step besides the Python (each lets go of the GIL and takes it back)")
    parser.add_argument("--scheme", choices=("s3", "http"), default="s3", help="how the app reads the store")
    add_store_arguments(parser)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    sys.setswitchinterval(args.switch_interval_s)
    config = store_config(args)
    scratch = Path(tempfile.mkdtemp(prefix="fetch-contention-"))
    phases = []
    try:
        folders = random_objects(scratch, args.downloads, args.object_mb, "adapter")
        per_ms = loops_per_ms()
        with EmulatedStore(config) as store, \
                multiprocessing.get_context("spawn").Pool(1) as child:
            store.upload(folders, [f.name for f in folders])
            root = store.root if args.scheme == "s3" else store.http_root()
            uris, env = [f"{root}/{f.name}/{WEIGHTS_NAME}" for f in folders], store.env()
            child.apply(download, (env, uris[:1], 1))  # the child's imports and connections, before timing
            download(env, uris[:1], 1)
            phases.append({"phase": "idle", **timed_phase(lambda: time.sleep(args.idle_s), args, per_ms)})
            for _ in range(args.repeats):
                for where, run in (("in the loop's process", lambda: download(env, uris, args.rounds)),
                                   ("in a child process", lambda: child.apply(download, (env, uris, args.rounds)))):
                    phases.append({"phase": f"{args.downloads} downloads {where}", **timed_phase(run, args, per_ms)})
                    p = phases[-1]
                    print(f"{p['phase']:36s} step p50/p90/p99 {p['step_ms_p50']:.2f} / {p['step_ms_p90']:.2f} / "
                          f"{p['step_ms_p99']:.2f} ms, GIL wait mean/p99 {p['gil_wait_ms']['mean']:.2f} / "
                          f"{p['gil_wait_ms']['recent_p99']:.2f} ms, {p['download_mb_per_s']:.0f} MB/s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"idle: step p50/p90/p99 {phases[0]['step_ms_p50']:.2f} / {phases[0]['step_ms_p90']:.2f} / "
          f"{phases[0]['step_ms_p99']:.2f} ms")
    name = "fetch-contention" if args.scheme == "s3" else f"fetch-contention-{args.scheme}"
    path = write_result(name, {"benchmark": "fetch-contention", "store": describe(config), "cpus": os.cpu_count(),
                               "args": {**vars(args), "results_dir": None}, "phases": phases}, args.results_dir)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
