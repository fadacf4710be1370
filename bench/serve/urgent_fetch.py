"""How long a download that a request waits for takes while fetches ahead hold a replica's store connections.

A replica's downloads share `adapter_fetch_workers` connections, and the ranges of a download that a request at the
replica waits for go first (app/adapters/part_pool.py). This starts `--ahead` downloads at once through the app's
RemoteStore as fetches ahead, waits `--after-s`, then starts one more download and times it: waited for, as a
replica's read is (urgent), and not, served in the order its ranges came (in order). Each object is downloaded
alone first, for the floor. The phases alternate `--repeats` times, each on objects not read before.

    python -m bench.serve.urgent_fetch                      # 8 fetches ahead of 84 MB, 4 shards, 2 proxies
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

from bench.common import RESULTS, write_result
from bench.serve.store import EmulatedStore, add_store_arguments, describe, random_objects, store_config
from bench.serve.store_proxy import WEIGHTS_NAME


def waited_download_s(store, objects, scratch: Path, urgent: bool | None, after_s: float) -> float:
    """Seconds to download objects[-1] after objects[:-1] started downloading as fetches ahead `after_s` before
    (urgent None: objects[-1] alone)."""
    ahead, waited = ([] if urgent is None else objects[:-1]), objects[-1]
    with ThreadPoolExecutor(max(1, len(ahead))) as pool:
        futures = [pool.submit(store.download_all, [(obj, scratch / f"ahead-{i}")]) for i, obj in enumerate(ahead)]
        time.sleep(after_s if ahead else 0)
        start = time.perf_counter()
        with store.parts.waited_for(waited.uri) if urgent is not False else nullcontext():
            store.download_all([(waited, scratch / "waited")])
        took = time.perf_counter() - start
        for future in futures:
            future.result()
    return took


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ahead", type=int, default=8, help="fetches ahead under way (fetch workers)")
    parser.add_argument("--workers", type=int, default=8, help="the replica's adapter_fetch_workers")
    parser.add_argument("--after-s", type=float, default=0.3, help="when the waited-for download starts")
    parser.add_argument("--object-mb", type=float, default=83.9)
    parser.add_argument("--repeats", type=int, default=3)
    add_store_arguments(parser)
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    config = store_config(args)
    phases = {"alone": [], "urgent": [], "in order": []}
    per_round = args.ahead + 1
    scratch = Path(tempfile.mkdtemp(prefix="urgent-fetch-"))
    try:
        # Every download is of an object of its own name; the names share the bytes of one round's objects, which
        # every shard holds once.
        distinct = random_objects(scratch, per_round, args.object_mb, "object")
        names = [f"object-{i}" for i in range(per_round * args.repeats * 2)]
        with EmulatedStore(config) as store, mock.patch.dict(os.environ, store.env()):
            store.upload([distinct[i % per_round] for i in range(len(names))], names)
            import s3fs

            from app.adapters.remote import RemoteStore

            s3fs.S3FileSystem.clear_instance_cache()  # fsspec caches filesystems by arguments, not by environment
            remote = RemoteStore([store.root], workers=args.workers)
            try:
                objects = [remote.stat(f"{store.root}/{name}/{WEIGHTS_NAME}") for name in names]
                for i in range(args.repeats * 2):
                    batch = objects[i * per_round:(i + 1) * per_round]
                    phases["alone"].append(waited_download_s(remote, batch[-1:], scratch, None, 0))
                    urgent = i % 2 == 0
                    took = waited_download_s(remote, batch, scratch, urgent, args.after_s)
                    phases["urgent" if urgent else "in order"].append(took)
                    print(f"{'urgent' if urgent else 'in order':8s} {took:.2f} s (alone {phases['alone'][-1]:.2f} s)",
                          flush=True)
            finally:
                remote.shutdown()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = {name: {"median_s": statistics.median(times), "runs_s": times} for name, times in phases.items()}
    print(" ".join(f"{name}: {s['median_s']:.2f} s" for name, s in summary.items()))
    path = write_result("urgent-fetch", {"benchmark": "urgent-fetch", "store": describe(config),
                                         "cpus": os.cpu_count(), "args": {**vars(args), "results_dir": None},
                                         "waited_download": summary}, args.results_dir)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
