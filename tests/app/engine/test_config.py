"""EngineConfig's derived defaults."""

from app.engine.config import EngineConfig


def budget(**fields) -> int:
    return EngineConfig(base_model="base", **fields).max_prefill_tokens_per_step


def test_the_prefill_budget_is_the_graph_room_unless_that_fills_a_large_batch_too_slowly():
    assert budget(max_batch_size=32) == 480  # steps that prefill replay the 512-token graph
    assert budget(max_batch_size=128) == 384
    assert budget(max_batch_size=256) == 4096  # 256 tokens a step: eager steps of 4096 instead
    assert budget(max_batch_size=32, max_graph_tokens=0) == 4096
    assert budget(max_batch_size=256, max_prefill_tokens_per_step=100) == 100


def test_steps_overlap_by_default_on_one_device_only():
    assert EngineConfig(base_model="base").overlap_steps
    assert not EngineConfig(base_model="base", tensor_parallel_size=2).overlap_steps
    assert EngineConfig(base_model="base", tensor_parallel_size=2, overlap_steps=True).overlap_steps
