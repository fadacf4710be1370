"""Offline throughput: N requests with S-LoRA lengths (prompt and output U[8, max_len)) over A adapters
(0: the base model), all submitted at once, in output tokens/s, for our engine or PEFT's own mixed-adapter
`generate`. The workload is bench/engine/offline_workload.py's, which bench/peers/vllm.py runs through vLLM.

    python -m bench.engine.throughput --size llama3-8b-shape --slots 32 --max-batch-size 32         # GPU
    python -m bench.engine.throughput --size llama3-8b-shape --engine peft --time-budget-s 120      # baseline
    python -m bench.engine.throughput --size tiny --requests 8 --max-len 32 --slots 4               # CPU

Our engine is driven only through its public interface (EngineConfig, register_adapter, add_request,
step, has_work, metrics), and only EngineConfig fields that exist are passed, so the same script runs
before and after engine rewrites. Every adapter serves one short request before the clock starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import deque
from pathlib import Path

import torch
import transformers

from bench.common import RESULTS, device_name, device_slug, git_commit
from bench.engine.offline_workload import (MIN_LEN, Tally, Workload, add_workload_args, check_workload_args,
                                           prepare_workload, run_fields, warm_up)

PROGRESS_EVERY_S = 15.0


# --- our engine --------------------------------------------------------------------------------------


def engine_config(args, base: Path, adapter_dir: Path):
    """An EngineConfig from the fields this engine has; the rest are reported as skipped."""
    from app.engine.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    defaults = EngineConfig(base_model=str(base))
    wanted = {"base_model": str(base), "adapter_roots": (str(adapter_dir),), "num_slots": args.slots,
              "max_batch_size": args.max_batch_size, "dtype": args.dtype,
              "host_cache_bytes": int(args.host_cache_gib * (1 << 30)),
              "max_queue": max(args.requests + args.adapters, getattr(defaults, "max_queue", 0)),
              "max_total_tokens": max(2 * args.max_len * args.max_batch_size,
                                      getattr(defaults, "max_total_tokens", 0))}
    for item in args.engine_arg:
        key, _, text = item.partition("=")
        if key not in fields:
            raise SystemExit(f"--engine-arg {key}: EngineConfig has no such field; it has {sorted(fields)}")
        default = getattr(defaults, key)
        if isinstance(default, bool):
            wanted[key] = text.lower() in ("1", "true", "yes")
        elif default is None:  # an int (kv_cache_bytes, max_prefill_tokens_per_step, ...) or a name (quantization)
            wanted[key] = int(text) if text.isdigit() else text
        else:
            wanted[key] = type(default)(text)
    skipped = sorted(k for k in wanted if k not in fields)
    return EngineConfig(**{k: v for k, v in wanted.items() if k in fields}), skipped


def timed_budget(args) -> float | None:
    """--time-budget-s, shortened so that the timed run ends by --stop-by (a lease's hard limit)."""
    budgets = [b for b in (args.time_budget_s, args.stop_by and args.stop_by - time.time()) if b is not None]
    return max(0.0, min(budgets)) if budgets else None


def run_engine(args, base: Path, adapter_dir: Path, names: list[str], work: Workload) -> dict:
    from app.engine.engine import LLMEngine
    from app.sampling.params import SamplingParams

    config, skipped = engine_config(args, base, adapter_dir)
    built = time.perf_counter()
    engine = LLMEngine(config)
    for name in names:
        engine.register_adapter(name, str(adapter_dir / name))
    build_s = time.perf_counter() - built
    warm = time.perf_counter()
    first = warm_up(work, names)
    _drive(engine, first.prompts, first.max_tokens, first.adapters, SamplingParams, Tally(None))
    warm_up_s = time.perf_counter() - warm
    tally = Tally(timed_budget(args))
    steps = _drive(engine, work.prompts, work.max_tokens, work.adapters, SamplingParams, tally)
    metrics = engine.metrics()
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    return {"engine_config": dataclasses.asdict(config), "config_fields_skipped": skipped, "build_s": build_s,
            "warm_up_s": warm_up_s, "result": {**tally.as_dict(work), **steps},
            "engine_metrics": json.loads(json.dumps(metrics, default=str))}


def _drive(engine, prompts, max_tokens, adapters, sampling_params, tally: Tally) -> dict:
    """Submit every request (again after a step when the queue is full), step until all finish or the budget ends.

    A step that streams a request's first token counts as a prefill step: the split is what the public
    interface shows, not the engine's own accounting.
    """
    pending = deque(range(len(prompts)))
    index_of, produced = {}, {}
    split = {"steps": 0, "prefill_steps": 0, "prefill_step_s": 0.0, "decode_steps": 0, "decode_step_s": 0.0,
             "decode_step_tokens": 0, "length_mismatches": 0}
    last_report = time.perf_counter()
    while (pending or engine.has_work()) and not tally.over_budget():
        while pending:
            i = pending[0]
            params = sampling_params(max_tokens=max_tokens[i], temperature=0.0, ignore_eos=True)
            try:
                request = engine.add_request(prompts[i], adapters[i], params)
            except Exception as e:
                if type(e).__name__ != "CapacityExceeded":
                    raise
                break  # the queue is full: step first
            index_of[getattr(request, "request_id", request)] = pending.popleft()
        start = time.perf_counter()
        outputs = engine.step()
        step_s = time.perf_counter() - start
        first_tokens = tokens = 0
        for out in outputs:
            if getattr(out, "error", None) is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            i = index_of[out.request_id]
            before = produced.get(i, 0)
            produced[i] = before + len(out.token_ids)
            tally.output_tokens += min(produced[i], max_tokens[i]) - min(before, max_tokens[i])
            first_tokens += before == 0 and produced[i] > 0
            tokens += len(out.token_ids)
            if out.finished:
                tally.finished += 1
                tally.finished_tokens += min(produced[i], max_tokens[i])
                split["length_mismatches"] += produced[i] != max_tokens[i]
        kind = "prefill" if first_tokens else "decode"
        split["steps"] += 1
        split[f"{kind}_steps"] += 1
        split[f"{kind}_step_s"] += step_s
        if not first_tokens:
            split["decode_step_tokens"] += tokens
        if time.perf_counter() - last_report > PROGRESS_EVERY_S and tally.budget_s is not None:
            last_report = time.perf_counter()
            print(f"  {last_report - tally.started:6.1f} s: {tally.finished} finished, {tally.output_tokens} tokens, "
                  f"{split['steps']} steps", flush=True)
    split["mean_tokens_per_step"] = tally.output_tokens / max(1, split["steps"])
    split["mean_decode_batch"] = split["decode_step_tokens"] / max(1, split["decode_steps"])
    split["decode_step_tokens_per_s"] = split["decode_step_tokens"] / max(1e-9, split["decode_step_s"])
    return split


# --- PEFT's mixed-adapter generate -------------------------------------------------------------------


class _Deadline(transformers.StoppingCriteria):
    def __init__(self, tally: Tally):
        self.tally = tally

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.tally.over_budget(), dtype=torch.bool, device=input_ids.device)


def run_peft(args, base: Path, adapter_dir: Path, names: list[str], work: Workload) -> dict:
    """Static batches in submission order, left-padded, each generating its longest request's max_tokens."""
    from peft import PeftModel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16, "float32": torch.float32}[args.dtype]
    built = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to max_new_tokens
    model = PeftModel.from_pretrained(model, adapter_dir / names[0], adapter_name=names[0], low_cpu_mem_usage=True)
    for name in names[1:]:
        model.load_adapter(adapter_dir / name, adapter_name=name, low_cpu_mem_usage=True)
    model.eval()
    build_s = time.perf_counter() - built
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    _generate(model, [work.prompts[0][:MIN_LEN]] * 2, [2, 2], names[:2], pad, device, Tally(None))  # warm-up
    tally = Tally(timed_budget(args))
    batches = generated_steps = 0
    for start in range(0, len(work.prompts), args.max_batch_size):
        if tally.over_budget():
            break
        rows = slice(start, start + args.max_batch_size)
        generated_steps += _generate(model, work.prompts[rows], work.max_tokens[rows], work.adapters[rows], pad,
                                     device, tally)
        batches += 1
    return {"build_s": build_s, "dtype": str(dtype),
            "result": {**tally.as_dict(work), "batches": batches, "generate_steps": generated_steps}}


def _generate(model, prompts, max_tokens, adapters, pad: int, device, tally: Tally) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, adapter_names=list(adapters),
                             max_new_tokens=max(max_tokens), do_sample=False, pad_token_id=pad,
                             stopping_criteria=transformers.StoppingCriteriaList([_Deadline(tally)]))
    steps = out.shape[1] - width
    for n in max_tokens:
        tally.output_tokens += min(steps, n)
        if steps >= n:
            tally.finished += 1
            tally.finished_tokens += n
    return steps


# --- the command -------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="ours", choices=["ours", "peft"])
    add_workload_args(p)
    p.add_argument("--slots", type=int, default=32, help="EngineConfig.num_slots, where the engine has it")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--host-cache-gib", type=float, default=4.0)
    p.add_argument("--engine-arg", action="append", default=[], metavar="FIELD=VALUE",
                   help="any further EngineConfig field, e.g. kv_cache_bytes=...; repeatable")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop after this long (the timed run only) and report what finished, flagged partial")
    p.add_argument("--stop-by", type=float, default=None, metavar="UNIX_TIME",
                   help="end the timed run by this wall-clock time whatever the build took (flagged partial)")
    p.add_argument("--note", default="", help="free text kept in the result")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    check_workload_args(p, args)
    if args.engine == "peft" and args.adapters < 1:
        p.error("--engine peft runs PEFT's mixed-adapter generate: it needs --adapters >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    base, adapter_dir, names, work = prepare_workload(args)
    payload = (run_peft if args.engine == "peft" else run_engine)(args, base, adapter_dir, names, work)
    import peft

    record = {"benchmark": "throughput", "command": " ".join(sys.orig_argv), "git_commit": git_commit(),
              "device": device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
              "peft": peft.__version__, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              **run_fields(args.engine, args, work), **payload}
    out = args.out or RESULTS / f"{device_slug()}-throughput-{args.engine}-{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    r = record["result"]
    print(f"{args.engine}: {r['output_tokens_per_s']:.1f} output tok/s, {r['requests_finished']}/{r['requests_total']} "
          f"requests, {r['output_tokens']} tokens in {r['wall_s']:.1f} s{' (PARTIAL: time budget)' if r['partial'] else ''}"
          f"\nwrote {out}", flush=True)
    return record


if __name__ == "__main__":
    main()
