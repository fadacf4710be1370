"""Token choice for every row of a batch in one pass on the device, with per-row seeds.

`sample_rows` replaces this loop (app/sampling/params.py) without host syncs or per-row launches:

    for b in rows: token[b] = argmax(logits[b]) if greedy[b] else sample(logits[b], params[b], generator[b])

It draws from the same distribution as `sample()`, except that ties at the top-k or top-p boundary
are all kept (the kept set is every token whose logit reaches a per-row threshold), so the support
does not depend on how the sort orders equal values. Shapes never depend on the data, so a CUDA
graph can capture it; on CPU it runs eagerly.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from app.sampling.logprobs import EchoRows, TokenLogprob, pack, unpack
from app.sampling.penalties import apply_penalties
from app.sampling.params import GREEDY_TEMPERATURE, MAX_LOGPROBS, SamplingParams
from app.sampling.structured import apply_grammars


def _int64(x: int) -> int:
    """x wrapped into the signed 64-bit range, as the hash's int64 tensors hold it."""
    return (x + 2**63) % 2**64 - 2**63


def random_seed() -> int:
    """A seed for a request that gave none; the engine draws it once, at admission."""
    return _int64(secrets.randbits(64))


def seed_for(params: SamplingParams) -> int:
    """The request's own seed (wrapped to int64), or a fresh random one."""
    return random_seed() if params.seed is None else _int64(params.seed)


_INT32_MAX = 2**31 - 1


@dataclass
class RowParams:
    """Per-row sampling parameters as device tensors, one row per batch row.

    The two host flags let `sample_rows` skip work that no row needs; they are computed from the
    host-side SamplingParams, so setting them costs no sync.
    """

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int32, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    seed: torch.Tensor  # [B] int64
    counter: torch.Tensor  # [B] int64, the row's output position
    is_all_greedy: bool = False  # no row samples: skip the noise
    is_filtered: bool = True  # some row uses top-k or top-p: do the sort

    @classmethod
    def empty(cls, batch_size: int, device: torch.device | str) -> RowParams:
        """Static buffers for `fill_` (e.g. in a CUDA graph's memory), every row greedy."""
        return cls(temperature=torch.zeros(batch_size, dtype=torch.float32, device=device),
                   top_k=torch.zeros(batch_size, dtype=torch.int32, device=device),
                   top_p=torch.ones(batch_size, dtype=torch.float32, device=device),
                   seed=torch.zeros(batch_size, dtype=torch.int64, device=device),
                   counter=torch.zeros(batch_size, dtype=torch.int64, device=device),
                   is_all_greedy=True, is_filtered=False)

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int],
                    device: torch.device | str) -> RowParams:
        rows = cls.empty(len(params), device)
        rows.fill_(params, seeds, counters)
        return rows

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    def fill_(self, params: Sequence[SamplingParams], seeds: Sequence[int], counters: Sequence[int]) -> None:
        """Write the first len(params) rows in place; the remaining rows become greedy padding."""
        if not len(params) == len(seeds) == len(counters):
            raise ValueError(f"need one seed and one counter per row: {len(params)} params, "
                             f"{len(seeds)} seeds, {len(counters)} counters")
        if len(params) > self.batch_size:
            raise ValueError(f"batch of {len(params)} rows exceeds the buffers' {self.batch_size} rows")
        pad = self.batch_size - len(params)
        greedy = [p.is_greedy for p in params] + [True] * pad
        host = {
            "temperature": ([0.0 if g else p.temperature for g, p in zip(greedy, params)] + [0.0] * pad,
                            torch.float32),
            # A top_k past the vocabulary keeps everything; clamp it so any client value fits int32.
            "top_k": ([min(p.top_k, _INT32_MAX) for p in params] + [0] * pad, torch.int32),
            "top_p": ([p.top_p for p in params] + [1.0] * pad, torch.float32),
            "seed": ([_int64(s) for s in seeds] + [0] * pad, torch.int64),
            "counter": (list(counters) + [0] * pad, torch.int64),
        }
        for name, (values, dtype) in host.items():
            getattr(self, name).copy_(torch.tensor(values, dtype=dtype), non_blocking=True)
        self.is_all_greedy = all(greedy)
        self.is_filtered = any(not g and (p.top_k > 0 or p.top_p < 1.0) for g, p in zip(greedy, params))


def sample_rows(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """Token ids [B] int64 on the logits' device, from logits [B, V] of any float dtype."""
    assert logits.dim() == 2 and logits.shape[0] == rows.batch_size, (tuple(logits.shape), rows.batch_size)
    greedy_tokens = logits.argmax(-1)  # ties: the lowest index
    if rows.is_all_greedy:
        return greedy_tokens
    # Gumbel-max: argmax(x + g) with g = -log(-log u) is a draw from softmax(x), filtered tokens (-inf) never win.
    scores = masked_logits(logits, rows) + _gumbel_noise(rows.seed, rows.counter, logits.shape[1])
    return torch.where(rows.temperature < GREEDY_TEMPERATURE, greedy_tokens, scores.argmax(-1))


def sample_batch(logits: torch.Tensor, requests: Sequence, eos_ids: Sequence[int], echo: EchoRows | None = None,
                 echo_logits: torch.Tensor | None = None) -> tuple[list[tuple[int, TokenLogprob | None]], list]:
    """Every request's next token (and its logprobs where asked), and the echo rows' prompt logprobs: launch_sampling,
    then its read()."""
    return launch_sampling(logits, requests, eos_ids, echo, echo_logits).read()


@dataclass
class SampledRows:
    """A step's token choice, launched on the device: `tokens` stay there (a next step launched before this one is
    read takes its decode rows' inputs from them), and one copy of everything the host needs is under way."""

    tokens: torch.Tensor  # [B] int64, on the logits' device
    host: torch.Tensor  # float64: the tokens, then each row's packed logprobs (pack), then the echo rows'
    ready: torch.cuda.Event | None  # when the copy into `host` is done (None: it is done)
    ks: list[int | None]
    k: int | None
    echo: EchoRows | None

    def read(self) -> tuple[list[tuple[int, TokenLogprob | None]], list]:
        """(token, its logprobs or None) per row, and the echo rows' prompt logprobs: waits for the copy, the
        step's one sync."""
        if self.ready is not None:
            self.ready.synchronize()
        host = self.host.tolist()
        n = len(self.ks)
        chosen = [int(t) for t in host[:n]]
        width = 1 + 2 * self.k if self.k is not None else 0
        sampled = unpack(host[n:n + n * width], chosen, width, self.ks) if self.k is not None else [None] * n
        prompt = []
        if self.echo is not None and self.echo.rows:
            prompt = unpack(host[n + n * width:], self.echo.targets, 1 + 2 * self.echo.k,
                            [r.params.prompt_logprobs for r in self.echo.owners])
        return list(zip(chosen, sampled)), prompt


class ReadbackBuffers:
    """Pinned host memory for launch_sampling's copies, allocated once, before serving: two buffers used in turn,
    as at most two steps' copies are alive (the step launched, and the one before it until it is read).

    Pinning memory while serving would stall the engine: the CUDA driver waits for the work of the device and of
    its peers to finish. With tensor parallelism that work includes a collective waiting for this process's next
    launch, so the wait never ends."""

    def __init__(self, max_rows: int):
        numel = max_rows * (2 + 2 * MAX_LOGPROBS)  # a token and packed logprobs (pack) per row, at most
        self.buffers = [torch.empty(numel, dtype=torch.float64, pin_memory=True) for _ in range(2)]
        self.turn = 0

    def take(self, numel: int) -> torch.Tensor | None:
        """The next buffer's first `numel` values; None where they do not fit (echo's prompt rows, for one)."""
        if numel > self.buffers[0].numel():
            return None
        buffer, self.turn = self.buffers[self.turn], self.turn ^ 1
        return buffer[:numel]


def launch_sampling(logits: torch.Tensor, requests: Sequence, eos_ids: Sequence[int], echo: EchoRows | None = None,
                    echo_logits: torch.Tensor | None = None, buffers: ReadbackBuffers | None = None) -> SampledRows:
    """Every request's next token, chosen on the device without waiting for it.

    logits [len(requests), V] are the raw logits; penalties (app/sampling/penalties.py), then each constrained
    row's grammar mask (app/sampling/structured.py) apply before the choice; logprobs read the raw values.
    Everything the host needs comes back in one device-to-host copy: on CUDA into one of `buffers`, without
    waiting; where none is given or the values do not fit, into pageable memory, waiting for it.
    """
    params = [r.params for r in requests]
    chosen_from = apply_grammars(apply_penalties(logits, requests, eos_ids), requests)
    if all(p.is_greedy for p in params):  # sample_rows' choice for greedy rows, without its per-row device tensors
        tokens = chosen_from.argmax(-1)  # [B]
    else:
        rows = RowParams.from_params(params, [r.seed for r in requests], [r.num_output_tokens for r in requests],
                                     logits.device)
        tokens = sample_rows(chosen_from, rows)  # [B]
    ks = [r.params.logprobs for r in requests]
    k = max((k for k in ks if k is not None), default=None)
    parts = [tokens.double()]
    if k is not None:
        parts.append(pack(logits, tokens, k).flatten())
    if echo is not None and echo.rows:
        targets = torch.tensor(echo.targets, dtype=torch.long).to(logits.device, non_blocking=True)
        parts.append(pack(echo_logits, targets, echo.k).flatten())
    values = torch.cat(parts) if len(parts) > 1 else parts[0]
    host = buffers.take(values.numel()) if buffers is not None and values.device.type == "cuda" else None
    if host is None:
        return SampledRows(tokens, values.cpu(), None, ks, k, echo)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return SampledRows(tokens, host, ready, ks, k, echo)


def masked_logits(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """[B, V] float32: logits / temperature, with tokens outside top-k and top-p at -inf.

    Greedy rows come back unscaled; `sample_rows` takes their argmax from the raw logits anyway.
    """
    is_greedy = rows.temperature < GREEDY_TEMPERATURE
    x = logits.float() / torch.where(is_greedy, 1.0, rows.temperature)[:, None]
    if not rows.is_filtered:
        return x
    return x.masked_fill(x < _keep_threshold(x, rows.top_k, rows.top_p), float("-inf"))


def _keep_threshold(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the smallest logit each row keeps after top-k, then top-p (one sort for both)."""
    vocab = x.shape[1]
    ordered = x.sort(dim=-1, descending=True).values  # [B, V]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).long()
    kth = ordered.gather(1, (k - 1)[:, None])  # [B, 1]
    in_top_k = ordered >= kth
    probs = ordered.masked_fill(~in_top_k, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the likelier tokens; the first is exactly 0, so it stays
    in_top_p = (before < top_p[:, None]) | (top_p >= 1.0)[:, None]  # top_p = 1 keeps even the float-rounded tail
    kept = (in_top_k & in_top_p).sum(-1, keepdim=True).clamp(min=1)  # both are prefixes of the order
    return ordered.gather(1, kept - 1)


# Counter-based noise, hand-written because torch has no batched RNG with a seed per row: a
# torch.Generator per row means B launches, and one shared generator makes a row's draws depend on
# its batch. Here u[b, v] = hash(seed[b], counter[b], v) (splitmix64 in int64 ops), so a seeded
# request draws the same tokens whatever batch it is in and wherever its row sits.
_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic, so mask off the copied sign bits)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer; int64 multiplication wraps mod 2**64 as the unsigned one does."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def _gumbel_noise(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] float32 Gumbel noise, a pure function of (seed[b], counter[b], v)."""
    row_key = _mix64(_mix64(seed) + counter * _GOLDEN)  # [B]
    column = torch.arange(1, vocab + 1, dtype=torch.int64, device=seed.device) * _GOLDEN  # [V]
    bits = _shr(_mix64(row_key[:, None] + column), 12)  # [B, V], 52 random bits
    u = (bits.double() + 0.5) * 2.0**-52  # in (0, 1): never log(0), never log(1)
    return -torch.log(-torch.log(u)).float()  # float64 keeps -log(u) exact near u = 1
