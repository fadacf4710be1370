"""The offline throughput workload, one definition for every engine that runs it (bench/engine/throughput.py,
bench/peers/vllm.py): N requests with S-LoRA lengths (prompt and output U[8, max_len)) over A adapters (none: the
base model), the base model and adapter folders they run on, the warm-up before the clock, and what a timed run
reports.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import AutoConfig

from bench.adapter_pool import prepare

MIN_LEN = 8  # S-LoRA's lower bound for prompt and output lengths
FIRST_TOKEN_ID = 16  # prompts skip the lowest ids, where the demo tokenizer keeps its special tokens
WARM_UP_TOKENS = 2


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    adapters: list[str | None]  # None: the base model

    def summary(self) -> dict:
        prompt_lens = [len(p) for p in self.prompts]
        return {"requests": len(self.prompts), "prompt_tokens": sum(prompt_lens), "output_tokens": sum(self.max_tokens),
                "distinct_adapters": len({a for a in self.adapters if a is not None})}


def make_workload(requests: int, names: list[str], max_len: int, vocab: int, seed: int) -> Workload:
    """Seeded requests over `names`, or all on the base model when there are none."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(MIN_LEN, max_len, requests)
    output_lens = rng.integers(MIN_LEN, max_len, requests)
    adapters = rng.integers(0, max(1, len(names)), requests)
    prompts = [rng.integers(FIRST_TOKEN_ID, vocab, n).tolist() for n in prompt_lens]
    return Workload(prompts, [int(n) for n in output_lens], [names[i] if names else None for i in adapters])


def warm_up(work: Workload, names: list[str]) -> Workload:
    """One short request per adapter (one on the base model when there are none), served before the clock starts,
    so that every adapter is resident and the engine has run its first steps."""
    adapters: list[str | None] = list(names) or [None]
    return Workload([work.prompts[0][:MIN_LEN]] * len(adapters), [WARM_UP_TOKENS] * len(adapters), adapters)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="tiny", help="demo size: tiny | small | llama3-8b-shape (app/demo/build.py)")
    p.add_argument("--demo-dir", type=Path, default=None, help="a built demo to use for demo sizes")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--adapters", type=int, default=32, help="distinct adapters the requests use; 0: the base model")
    p.add_argument("--max-len", type=int, default=512, help="prompt and output lengths are U[8, max_len)")
    p.add_argument("--seed", type=int, default=0)


def check_workload_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.max_len <= MIN_LEN:
        p.error(f"--max-len must exceed {MIN_LEN}, got {args.max_len}")
    if args.adapters < 0 or args.requests < 1:
        p.error(f"--adapters must be >= 0 and --requests >= 1, got {args.adapters} and {args.requests}")


def prepare_workload(args: argparse.Namespace) -> tuple[Path, Path, list[str], Workload]:
    """(base model folder, adapter folder, adapter names, requests), building the folders that are missing."""
    base, adapter_dir, names = prepare(args.size, args.adapters, demo_dir=args.demo_dir)
    vocab = AutoConfig.from_pretrained(base).vocab_size
    return base, adapter_dir, names, make_workload(args.requests, names, args.max_len, vocab, args.seed)


def run_fields(engine: str, args: argparse.Namespace, work: Workload) -> dict:
    """What every throughput result records about its run, whichever engine ran it."""
    return {"engine": engine, "size": args.size, "note": args.note,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "workload": {"lengths": f"U[{MIN_LEN}, {args.max_len})", "seed": args.seed, **work.summary()}}


@dataclass
class Tally:
    """What a timed run produced; tokens past a request's max_tokens are never counted.

    The clock starts when the Tally is made, just before the first request is submitted.
    """

    budget_s: float | None
    started: float = dataclasses.field(default_factory=time.perf_counter)
    output_tokens: int = 0
    finished: int = 0
    finished_tokens: int = 0
    is_partial: bool = False

    def over_budget(self) -> bool:
        self.is_partial = self.budget_s is not None and time.perf_counter() - self.started > self.budget_s
        return self.is_partial

    def as_dict(self, work: Workload) -> dict:
        wall = time.perf_counter() - self.started
        return {"partial": self.is_partial, "time_budget_s": self.budget_s, "wall_s": wall,
                "requests_finished": self.finished, "requests_total": len(work.prompts),
                "output_tokens": self.output_tokens, "output_tokens_per_s": self.output_tokens / wall,
                "finished_output_tokens": self.finished_tokens, "requests_per_s": self.finished / wall}
