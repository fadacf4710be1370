"""Seeded request traces for the engine benchmark: when each request arrives, which adapter it
names, and how long its prompt and output are. Pure numpy; no engine, no torch.

Adapter choice:
  uniform      every adapter equally likely
  zipf         P(k) ∝ k^-α over N adapters, α = 1.5 (Punica / SGLang benchmarks)
  power-<α>    S-LoRA's trace: index = floor(N · X), X ~ np.random.power(α); small α is skewed
  bursty-cv<c> a hot set of K adapters, uniform inside it, that moves on every T seconds;
               arrivals are Gamma with coefficient of variation c
  distinct     request i names adapter i: nothing repeats (needs N >= requests)
  sequential   the seed review's sequential bursts: the first third of the requests over adapters
               [0, N/5), the next third over [N/5, 3N/5), the rest over [3N/5, N), uniform inside a
               phase; with 300 requests over N = 50, requests 1-100 use adapters 1-10, the next 100
               adapters 11-30, the last 100 adapters 31-50
Arrivals are Gamma with mean 1/rate and CV 1 (Poisson) unless the workload says otherwise.
Lengths: "slora" draws input and output from U[8, 512) as S-LoRA does; "fixed" is 512 in / 128
out. `length_scale` shrinks both (at least 1 token) so a CPU run fits in minutes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

ZIPF_ALPHA = 1.5
SLORA_RANGE = (8, 512)  # [low, high) for both input and output, as S-LoRA's synthetic trace
FIXED_LENGTHS = (512, 128)
LENGTH_MODES = ("slora", "fixed")


@dataclass(frozen=True)
class Arrival:
    t_s: float  # seconds after the trace starts
    adapter: int | None  # index into the benchmark's adapters; None: the base model
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    """How one trace is drawn; `make` turns it into arrivals for a given N, count and rate."""

    name: str
    kind: str  # uniform | zipf | power | bursty | distinct | phases
    alpha: float = 0.0  # zipf and power
    cv: float = 1.0  # inter-arrival coefficient of variation
    hot_set: int | None = None  # bursty: adapters in the hot set (None: the benchmark's capacity K)
    rotate_s: float = 2.0  # bursty: the hot set moves on every rotate_s seconds
    # phases: (first, last) fractions of N; the requests split into len(phases) equal runs, in order
    phases: tuple[tuple[float, float], ...] = ()


WORKLOADS = {w.name: w for w in (
    Workload("uniform", "uniform"),
    Workload("zipf", "zipf", alpha=ZIPF_ALPHA),
    Workload("power-0.1", "power", alpha=0.1),
    Workload("power-0.3", "power", alpha=0.3),
    Workload("power-1", "power", alpha=1.0),
    Workload("bursty-cv1", "bursty", cv=1.0),
    Workload("bursty-cv4", "bursty", cv=4.0),
    Workload("distinct", "distinct"),
    Workload("sequential", "phases", phases=((0.0, 0.2), (0.2, 0.6), (0.6, 1.0))),
)}
SEQUENTIAL_ADAPTERS = 50  # the seed review's N for the sequential bursts
SEQUENTIAL_REQUESTS = 300


def arrival_times(count: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """Cumulative Gamma inter-arrivals with mean 1/rate and the given CV (CV 1: Poisson)."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"rate ({rate}) and cv ({cv}) must be > 0")
    shape = 1.0 / (cv * cv)
    return np.cumsum(rng.gamma(shape, 1.0 / (rate * shape), count))


def draw_lengths(count: int, mode: str, scale: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if mode not in LENGTH_MODES:
        raise ValueError(f"lengths must be one of {LENGTH_MODES}, got {mode!r}")
    if not 0 < scale <= 1:
        raise ValueError(f"length_scale must be in (0, 1], got {scale}")
    if mode == "slora":
        prompt = rng.integers(*SLORA_RANGE, count)
        output = rng.integers(*SLORA_RANGE, count)
    else:
        prompt, output = np.full(count, FIXED_LENGTHS[0]), np.full(count, FIXED_LENGTHS[1])
    return np.maximum(1, np.round(prompt * scale)).astype(int), np.maximum(1, np.round(output * scale)).astype(int)


def zipf_probabilities(num_adapters: int, alpha: float) -> np.ndarray:
    weights = np.arange(1, num_adapters + 1, dtype=float) ** -alpha
    return weights / weights.sum()


def choose_adapters(workload: Workload, num_adapters: int, times: np.ndarray, default_hot_set: int,
                    rng: np.random.Generator) -> np.ndarray:
    count = len(times)
    if workload.kind == "uniform":
        return rng.integers(0, num_adapters, count)
    if workload.kind == "zipf":
        return rng.choice(num_adapters, count, p=zipf_probabilities(num_adapters, workload.alpha))
    if workload.kind == "power":
        return np.minimum((rng.power(workload.alpha, count) * num_adapters).astype(int), num_adapters - 1)
    if workload.kind == "bursty":
        return _bursty_adapters(num_adapters, times, workload.hot_set or default_hot_set, workload.rotate_s, rng)
    if workload.kind == "distinct":
        if num_adapters < count:
            raise ValueError(f"distinct needs one adapter per request: {num_adapters} adapters < {count} requests")
        return rng.permutation(num_adapters)[:count]
    if workload.kind == "phases":
        return _phase_adapters(num_adapters, count, workload.phases, rng)
    raise ValueError(f"unknown workload kind {workload.kind!r}")


def _bursty_adapters(num_adapters: int, times: np.ndarray, hot_set: int, rotate_s: float,
                     rng: np.random.Generator) -> np.ndarray:
    """Window w = floor(t / rotate_s) draws uniformly from its own hot set of `hot_set` adapters."""
    hot_set = min(hot_set, num_adapters)
    windows = (times // rotate_s).astype(int)
    order = rng.permutation(num_adapters)
    # Consecutive windows take consecutive blocks of a shuffled ring, so the hot set moves on
    # completely each window whenever N >= 2 * hot_set.
    starts = (windows * hot_set) % num_adapters
    picks = rng.integers(0, hot_set, len(times))
    return order[(starts + picks) % num_adapters]


def _phase_adapters(num_adapters: int, count: int, phases, rng: np.random.Generator) -> np.ndarray:
    """Request i is in phase i * len(phases) // count, uniform over that phase's adapters (at least one)."""
    phase = np.arange(count) * len(phases) // count
    bounds = [(round(lo * num_adapters), max(round(hi * num_adapters), round(lo * num_adapters) + 1))
              for lo, hi in phases]
    low = np.array([bounds[p][0] for p in phase])
    high = np.array([min(bounds[p][1], num_adapters) for p in phase])
    return np.minimum(low + (rng.random(count) * (high - low)).astype(int), num_adapters - 1)


def hot_sets(arrivals: list[Arrival], rotate_s: float) -> list[set[int]]:
    """The adapters used in each rotate_s window (tests and reports)."""
    last = int(arrivals[-1].t_s // rotate_s) if arrivals else -1
    sets: list[set[int]] = [set() for _ in range(last + 1)]
    for a in arrivals:
        sets[int(a.t_s // rotate_s)].add(a.adapter)
    return sets


def make(workload: Workload | str, num_adapters: int, count: int, rate: float, seed: int, lengths: str = "slora",
         length_scale: float = 1.0, default_hot_set: int = 4, rotate_s: float | None = None) -> list[Arrival]:
    """`count` arrivals at `rate` per second over `num_adapters` adapters, the same for the same seed."""
    workload = WORKLOADS[workload] if isinstance(workload, str) else workload
    if rotate_s is not None:
        workload = replace(workload, rotate_s=rotate_s)
    if num_adapters < 1 or count < 1:
        raise ValueError(f"num_adapters ({num_adapters}) and count ({count}) must be >= 1")
    # Separate streams: changing the adapter law leaves arrival times and lengths as they were.
    times_rng, lengths_rng, adapters_rng = (np.random.default_rng([seed, i]) for i in range(3))
    times = arrival_times(count, rate, workload.cv, times_rng)
    prompt, output = draw_lengths(count, lengths, length_scale, lengths_rng)
    adapters = choose_adapters(workload, num_adapters, times, default_hot_set, adapters_rng)
    return [Arrival(float(t), int(a), int(p), int(o)) for t, a, p, o in zip(times, adapters, prompt, output)]


def without_adapters(arrivals: list[Arrival]) -> list[Arrival]:
    """The same trace on the base model (arm E)."""
    return [Arrival(a.t_s, None, a.prompt_len, a.output_len) for a in arrivals]


def random_prompt(length: int, vocab_ids: np.ndarray, rng: np.random.Generator) -> list[int]:
    """Token ids drawn uniformly from `vocab_ids` (the tokenizer's vocab minus special tokens)."""
    return rng.choice(vocab_ids, length).tolist()
