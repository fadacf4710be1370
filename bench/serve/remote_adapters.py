"""The claim bench's adapters in the emulated remote store (bench/serve/store.py), and a fresh, empty node cache
for each arm: what `--adapter-store s3` of bench.serve.load sets up before Ray starts."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from bench.serve.store import EmulatedStore, StoreConfig, describe


def _run_on(cores: set[int]) -> None:
    """Every thread of this process on `cores` only (a thread's affinity is its own; new ones inherit it)."""
    for thread in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(thread), cores)


class RemoteAdapters:
    """The claim bench's adapters in an emulated store, and a fresh, empty node cache for each arm.

    Uploads `folders[i]` as `names[i]` (folders may repeat: the store holds len(names) distinct objects whose
    bytes may repeat), sets this process's environment to the store's and moves it off the store's cores
    (`StoreConfig.cores`) before Ray starts (so that every Ray worker inherits both), and measures the store's
    floor on the first adapter."""

    def __init__(self, config: StoreConfig, folders: list[Path], names: list[str], cache_adapters: float | None,
                 cache_root: str | None = None):
        self.config, self.store = config, EmulatedStore(config)
        try:
            os.environ.update(self.store.env())
            if config.cores:
                _run_on(self.store.other_cores)
            self.upload = self.store.upload(folders, names)
            weights = max((f for f in folders[0].iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
            self.floor = self.store.measure([f"{self.store.root}/{name}/{weights.name}" for name in names[:8]])
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
