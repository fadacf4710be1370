"""Adapter loads on a tensor-parallel engine (two gloo workers on CPU): each worker reads its shard on a thread from
the step that brings the load, as rank 0 reads its own, and writes it into the slot before the first step that uses
it. (A module of its own: a process holds one tensor-parallel engine, and test_tensor_parallel_engine.py keeps one
for the whole module.)"""

from engine_helpers import greedy, jobs, run_all

MAX_NEW = 12


def test_adapters_churning_through_two_slots_serve_the_tokens_of_one_process(make_engine, manifest, adapter_names):
    """More adapters than slots: each worker starts reading its shard when rank 0 begins a load, a later load
    replaces an unwritten one in the same slot, and a slot is written before the first step that uses it."""
    work = jobs(manifest, adapter_names, 12)

    def serve(engine):
        requests = [engine.add_request(p, a, greedy(MAX_NEW, ignore_eos=True)) for p, a in work]
        tokens = run_all(engine, check=True)
        return [tokens[r.request_id] for r in requests]

    alone = serve(make_engine(num_slots=2))
    sharded = make_engine(num_slots=2, tensor_parallel_size=2, overlap_steps=True)
    assert serve(sharded) == alone
    assert sharded.metrics()["evictions"] >= len(adapter_names)
