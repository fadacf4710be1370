import random

import pytest
import torch

from app.sampling.sampler import RowParams, masked_logits, random_seed, sample_rows, seed_for
from app.sampling.params import SamplingParams

CPU = torch.device("cpu")


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row, the straightforward way in float64: softmax, sort, top-k, top-p (ties at a cut all kept)."""
    probs = (logits.double() / params.temperature).softmax(-1)
    ordered = probs.sort(descending=True).values
    if 0 < params.top_k < len(probs):
        probs = torch.where(probs >= ordered[params.top_k - 1], probs, 0.0)
        probs = probs / probs.sum()
        ordered = probs.sort(descending=True).values
    if params.top_p < 1.0:
        before = ordered.cumsum(0) - ordered
        last = ordered[before < params.top_p][-1]  # before[0] = 0, so the likeliest always stays
        probs = torch.where(probs >= last, probs, 0.0)
    return probs / probs.sum()


def random_params(rng: random.Random, vocab: int) -> SamplingParams:
    return SamplingParams(temperature=rng.choice([0.0, 0.3, 1.0, 1.7]),
                          top_k=rng.choice([0, 0, 1, rng.randint(1, vocab + 3)]),
                          top_p=rng.choice([1.0, 1.0, 1e-9, rng.uniform(0.05, 1.0)]))


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (32, 100), generator=gen).to(torch.bfloat16)  # many ties
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0, top_p=0.9)
              for i in range(32)]
    rows = RowParams.from_params(params, list(range(32)), [0] * 32, CPU)
    tokens = sample_rows(logits, rows)
    assert tokens.dtype == torch.int64 and tokens.shape == (32,)
    assert torch.equal(tokens[1::2], logits.argmax(-1)[1::2])
    all_greedy = RowParams.from_params([SamplingParams(temperature=0.0)] * 32, [0] * 32, [0] * 32, CPU)
    assert all_greedy.is_all_greedy and torch.equal(sample_rows(logits, all_greedy), logits.argmax(-1))


@pytest.mark.parametrize("ties", [False, True])
def test_support_matches_reference(ties):
    rng, gen, vocab = random.Random(ties), torch.Generator().manual_seed(1), 40
    for _ in range(50):
        logits = (torch.randint(-3, 3, (16, vocab), generator=gen).float() if ties
                  else 3 * torch.randn(16, vocab, generator=gen))
        params = [random_params(rng, vocab) for _ in range(16)]
        rows = RowParams.from_params(params, [random_seed() for _ in params], [0] * 16, CPU)
        support = masked_logits(logits, rows).isfinite()
        tokens = sample_rows(logits, rows)
        for b, p in enumerate(params):
            if p.is_greedy:
                continue
            expected = reference_probs(logits[b], p) > 0
            assert torch.equal(support[b], expected), (p, logits[b])
            assert expected[tokens[b]]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.8),
                                    SamplingParams(temperature=1.0, top_k=8, top_p=0.9)])
def test_frequencies_match_reference(params):
    draws, logits = 20_000, torch.randn(12, generator=torch.Generator().manual_seed(2))
    rows = RowParams.from_params([params] * draws, [1234] * draws, list(range(draws)), CPU)
    tokens = sample_rows(logits.expand(draws, -1), rows)
    observed = torch.bincount(tokens, minlength=12).double() / draws
    assert 0.5 * (observed - reference_probs(logits, params)).abs().sum() < 0.02


def test_seeded_rows_are_reproducible_across_batches():
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(1000, generator=gen)
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    others = [SamplingParams(temperature=t, top_k=k) for t, k in [(0.0, 0), (0.5, 3), (1.2, 0), (1.0, 50)]]
    drawn = set()
    for position, batch_size in [(0, 1), (3, 5), (1, 4)]:
        batch = random.Random(position).choices(others, k=batch_size)
        batch[position] = mine
        logits = torch.randn(batch_size, 1000, generator=gen)
        logits[position] = row
        seeds = [seed_for(p) for p in batch]
        rows = RowParams.from_params(batch, seeds, [5] * batch_size, CPU)
        drawn.add(int(sample_rows(logits, rows)[position]))
    assert len(drawn) == 1
    flat = torch.zeros(100, 1000)  # uniform: every counter's draw is a fresh token
    by_counter = sample_rows(flat, RowParams.from_params([mine] * 100, [7] * 100, list(range(100)), CPU))
    by_seed = sample_rows(flat, RowParams.from_params([mine] * 100, list(range(100)), [0] * 100, CPU))
    assert len(set(by_counter.tolist())) > 90 and len(set(by_seed.tolist())) > 90


def test_static_buffers_refill_in_place():
    rng, gen = random.Random(4), torch.Generator().manual_seed(4)
    logits = 2 * torch.randn(8, 64, generator=gen)
    static = RowParams.empty(8, CPU)
    pointers = [t.data_ptr() for t in (static.temperature, static.top_k, static.top_p, static.seed, static.counter)]
    for step in range(5):
        params = [random_params(rng, 64) for _ in range(rng.randint(1, 8))]
        seeds, counters = [rng.randint(-2**63, 2**63 - 1) for _ in params], [step] * len(params)
        static.fill_(params, seeds, counters)
        fresh = RowParams.from_params(params, seeds, counters, CPU)
        n = len(params)
        assert torch.equal(sample_rows(logits, static)[:n], sample_rows(logits[:n], fresh))
        assert torch.equal(sample_rows(logits, static)[n:], logits[n:].argmax(-1))  # padding rows are greedy
    assert pointers == [t.data_ptr() for t in (static.temperature, static.top_k, static.top_p, static.seed,
                                               static.counter)]


def test_fill_refuses_too_many_rows():
    with pytest.raises(ValueError, match="3 rows exceeds the buffers' 2 rows"):
        RowParams.empty(2, CPU).fill_([SamplingParams()] * 3, [0] * 3, [0] * 3)


def test_top_k_beyond_int32_is_the_same_as_no_top_k():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)).expand(2, 50)
    huge = SamplingParams(temperature=1.0, top_k=10**30)
    off = SamplingParams(temperature=1.0)
    rows = RowParams.from_params([huge, off], [1, 1], [0, 0], "cpu")
    masked = masked_logits(logits, rows)
    assert torch.equal(masked[0], masked[1]) and masked.isfinite().all()
    drawn = sample_rows(logits, rows)
    assert drawn[0] == drawn[1]
