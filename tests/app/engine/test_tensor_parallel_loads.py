"""Adapter loads on a tensor-parallel engine (two gloo workers on CPU): each worker reads its shard on a thread from
the step that brings the load, as rank 0 reads its own, and writes it into the slot before the first step that uses
it; a remote adapter reaches the workers through the node cache. (A module of its own: a process holds one
tensor-parallel engine, and test_tensor_parallel_engine.py keeps one for the whole module.)"""

import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import store_helpers
from app.adapters.safetensors_file import WEIGHTS_NAME
from app.engine.workers import Load, ShardLoads
from engine_helpers import greedy, jobs, run_all

MAX_NEW = 12
file_server = store_helpers.file_server  # the fixture, under its name


def serve(engine, work) -> list[list[int]]:
    requests = [engine.add_request(p, a, greedy(MAX_NEW, ignore_eos=True)) for p, a in work]
    tokens = run_all(engine, check=True)
    return [tokens[r.request_id] for r in requests]


def test_adapters_churning_through_two_slots_serve_the_tokens_of_one_process(make_engine, manifest, adapter_names):
    """More adapters than slots: each worker starts reading its shard when rank 0 begins a load, a later load
    replaces an unwritten one in the same slot, and a slot is written before the first step that uses it."""
    work = jobs(manifest, adapter_names, 12)
    alone = serve(make_engine(num_slots=2), work)
    sharded = make_engine(num_slots=2, tensor_parallel_size=2, overlap_steps=True)
    assert serve(sharded, work) == alone
    assert sharded.metrics()["evictions"] >= len({a for _, a in work if a is not None}) - 2  # all came through


def test_adapters_from_a_remote_store_reach_the_workers_through_the_node_cache(make_engine, file_server, tmp_path,
                                                                              demo_dir, manifest, adapter_names):
    """Each worker reads its shard of a remote adapter from the node cache that rank 0's download filled: the
    tokens are those of local adapters, and each adapter's weights leave the store once."""
    shutil.copytree(Path(demo_dir) / "adapters", tmp_path / "www" / "adapters")
    root = f"{file_server.url}/adapters"
    work = jobs(manifest, adapter_names, 6)
    names = sorted({a for _, a in work if a is not None})
    alone = serve(make_engine(), work)
    sharded = make_engine(register=False, tensor_parallel_size=2, adapter_roots=(root,),
                          adapter_cache_dir=str(tmp_path / "cache"))
    for name in names:
        sharded.register_adapter(name, f"{root}/{name}")
    registered = {name: file_server.gets[f"/adapters/{name}/{WEIGHTS_NAME}"] for name in names}
    assert serve(sharded, work) == alone
    assert {name: file_server.gets[f"/adapters/{name}/{WEIGHTS_NAME}"] - registered[name] for name in names} == \
        {name: 1 for name in names}


class Loads(ShardLoads):
    """ShardLoads whose reads wait for the test's word (each load's adapter id names its gate)."""

    def __init__(self):
        super().__init__(plan=None, layout=None, lora=self, device=torch.device("cpu"), dtype=torch.float32)
        self.gates: dict[str, threading.Event] = {}
        self.written: list[tuple[int, str]] = []

    def _read(self, load):
        if not self.gates[load.spec.adapter_id].wait(timeout=10):
            raise TimeoutError(load.spec.adapter_id)
        if load.spec.adapter_id.startswith("broken"):
            raise OSError(f"cannot read {load.spec.adapter_id}")
        return [], torch.zeros(1)

    def write_slot(self, slot, pages, host_pages, scales, rank):  # the worker's LoRASlots
        self.written.append((slot, self.adapter_in[slot]))

    def begin_load(self, slot: int, pages: tuple[int, ...], adapter_id: str, done: bool = True) -> None:
        self.gates[adapter_id] = threading.Event()
        if done:
            self.gates[adapter_id].set()
        self.adapter_in = {**getattr(self, "adapter_in", {}), slot: adapter_id}
        self.begin(Load(slot, pages, SimpleNamespace(adapter_id=adapter_id, rank=4)))


def test_a_load_waits_for_its_read_only_when_a_step_needs_its_slot_and_a_newer_load_voids_an_unwritten_one():
    loads = Loads()
    loads.begin_load(1, (3, 4), "slow", done=False)
    loads.write(needed=set())  # nothing needs slot 1 yet: the step goes on without waiting
    assert loads.written == []
    loads.begin_load(2, (3, 4), "fresh")  # rank 0 evicted slot 1 and gave its pages to slot 2
    loads.write(needed={2})
    loads.gates["slow"].set()
    time.sleep(0.05)
    loads.write(needed=set())
    assert loads.written == [(2, "fresh")]  # the void load never overwrites pages 3 and 4

    loads.begin_load(5, (7,), "late", done=False)
    threading.Timer(0.2, loads.gates["late"].set).start()
    loads.write(needed={5})  # the step that uses slot 5 waits for its read
    assert loads.written[-1] == (5, "late")

    loads.begin_load(6, (8,), "broken")
    loads.write(needed=set())  # a failed read that no step needs fails nothing
    with pytest.raises(RuntimeError, match="slot 6: this worker could not read its shard"):
        loads.write(needed={6})
