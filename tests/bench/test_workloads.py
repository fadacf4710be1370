"""Trace generators are seeded and have the shapes they claim (the bench itself: test_claim_bench.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from bench.workloads import WORKLOADS, hot_sets, make, zipf_probabilities


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_trace(name):
    kw = dict(num_adapters=64, count=50, rate=5.0, lengths="slora", length_scale=0.5)
    assert make(name, seed=1, **kw) == make(name, seed=1, **kw)
    assert make(name, seed=1, **kw) != make(name, seed=2, **kw)


def test_arrivals_and_lengths_follow_the_spec():
    trace = make("uniform", 8, 4000, rate=20.0, seed=0, lengths="slora")
    gaps = np.diff([0.0] + [a.t_s for a in trace])
    assert abs(gaps.mean() - 1 / 20) < 0.005 and abs(gaps.std() / gaps.mean() - 1) < 0.1  # Poisson: CV 1
    prompts, outputs = [a.prompt_len for a in trace], [a.output_len for a in trace]
    assert min(prompts) >= 8 and max(prompts) < 512 and min(outputs) >= 8 and max(outputs) < 512
    fixed = make("uniform", 8, 10, rate=1.0, seed=0, lengths="fixed", length_scale=0.25)
    assert {(a.prompt_len, a.output_len) for a in fixed} == {(128, 32)}
    bursty = make("bursty-cv4", 8, 4000, rate=20.0, seed=0)
    bursty_gaps = np.diff([a.t_s for a in bursty])
    assert bursty_gaps.std() / bursty_gaps.mean() > 3


def test_zipf_is_skewed_as_p_k_proportional_to_k_to_the_minus_alpha():
    n, count = 16, 20000
    counts = Counter(a.adapter for a in make("zipf", n, count, rate=100.0, seed=0))
    expected = zipf_probabilities(n, 1.5)
    assert abs(counts[0] / count - expected[0]) < 0.02  # P(1) = 1 / H(16, 1.5) ~ 0.43
    assert counts[0] > 2.5 * counts[1] > counts[3]
    uniform = Counter(a.adapter for a in make("uniform", n, count, rate=100.0, seed=0))
    assert max(uniform.values()) < 1.2 * count / n


def test_power_law_small_alpha_is_more_skewed():
    def top_share(name):
        counts = Counter(a.adapter for a in make(name, 100, 5000, rate=100.0, seed=0))
        return counts[0] / 5000

    assert top_share("power-0.1") > top_share("power-0.3") > top_share("power-1")


def test_distinct_never_repeats():
    trace = make("distinct", 200, 200, rate=10.0, seed=0)
    assert len({a.adapter for a in trace}) == 200
    with pytest.raises(ValueError, match="100 adapters < 101 requests"):
        make("distinct", 100, 101, rate=10.0, seed=0)


def test_bursty_hot_set_rotates():
    trace = make("bursty-cv1", 32, 2000, rate=50.0, seed=0, default_hot_set=4, rotate_s=2.0)
    windows = [s for s in hot_sets(trace, 2.0) if s]
    assert len(windows) > 10
    assert all(len(s) <= 4 for s in windows)
    assert all(a != b for a, b in zip(windows, windows[1:]))  # the hot set moves each window
    assert len(set().union(*windows)) == 32  # and over time covers every adapter


def test_sequential_bursts_move_through_three_adapter_ranges():
    trace = make("sequential", 50, 300, rate=5.0, seed=0)
    phases = [{a.adapter for a in trace[i:i + 100]} for i in (0, 100, 200)]
    assert phases[0] <= set(range(10)) and phases[1] <= set(range(10, 30)) and phases[2] <= set(range(30, 50))
    assert [len(p) for p in phases] >= [9, 18, 18]  # nearly every adapter of each range is used
