"""Helpers shared by the engine tests."""

from pathlib import Path

from app.config import EngineConfig
from app.sampling import SamplingParams


def engine_config(demo_dir, **overrides) -> EngineConfig:
    fields = dict(base_model=str(Path(demo_dir) / "base"), adapter_roots=(str(Path(demo_dir) / "adapters"),),
                  num_slots=4, max_rank=16, device="cpu", dtype="float32")
    fields.update(overrides)
    return EngineConfig(**fields)


def run_all(engine, check=False, on_step=None) -> dict[str, list[int]]:
    """Step until idle; returns request_id -> generated token ids."""
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for output in engine.step():
            assert output.error is None, output.error
            tokens.setdefault(output.request_id, []).extend(output.token_ids)
        if check:
            engine.check_invariants()
        if on_step:
            on_step(engine)
    return tokens


def greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def tokens_alone(engine, prompt, adapters, max_tokens=12) -> dict:
    """adapter -> greedy tokens of `prompt` run alone on a synchronous engine (the streaming tests' reference)."""
    expected = {}
    for adapter in adapters:
        request = engine.add_request(prompt, adapter, greedy(max_tokens))
        expected[adapter] = run_all(engine)[request.request_id]
    return expected
