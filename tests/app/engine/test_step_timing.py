"""StepTiming's summary: the recent steps' percentiles are recomputed at most every PERCENTILES_EVERY_S (the router
asks many times a second, on the engine thread); the totals are current at every call."""

from __future__ import annotations

from app.engine import step_timing
from app.engine.step_timing import StepTiming


def test_percentiles_are_reused_within_their_period_and_totals_are_always_current(monkeypatch):
    monkeypatch.setattr(step_timing, "PERCENTILES_EVERY_S", 3600.0)
    timing = StepTiming()
    timing.observe(0.001, 0.002, 0.008, 0.001, True, rows=4)
    first = timing.summary()
    assert first["decode"]["steps"] == 1 and first["totals"]["decode"]["rows"] == 4
    timing.observe(0.001, 0.020, 0.008, 0.001, True, rows=2)
    second = timing.summary()
    assert second["decode"] == first["decode"]  # the same percentiles, within the period
    assert second["totals"]["decode"]["rows"] == 6 and second["totals"]["decode"]["steps"] == 2
    monkeypatch.setattr(step_timing, "PERCENTILES_EVERY_S", 0.0)
    assert timing.summary()["decode"]["steps"] == 2
