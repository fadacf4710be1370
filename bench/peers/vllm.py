"""Offline throughput through vLLM's `LLM` API: the workload of bench/engine/throughput.py, driven as it drives ours.

    python -m bench.peers.vllm --size llama3-8b-shape --adapters 32 --max-batch-size 32 --dtype bfloat16   # GPU
    python -m bench.peers.vllm --size llama3-8b-shape --adapters 0 --max-batch-size 128 --dtype bfloat16   # base

The same base model and adapter folders (bench/adapter_pool.py), the same seeded requests as token ids, the same
warm-up (every adapter serves one short request, the base model one when there are none), and the same clock: from
submitting every request, in one `LLM.generate` call, to the last token. Greedy, EOS ignored, as ours.
Flags map onto LLM(...): --max-batch-size is max_num_seqs, --slots max_loras, --dtype dtype; --engine-arg passes
any further keyword. The result records vLLM's version, every keyword LLM(...) got, the VLLM_* environment and
the config vLLM resolved from them.

vLLM is never installed with the project (bench/device/vllm_compare.sh installs it on the GPU machine). Run this
as a module: its own name is vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import transformers

from bench.common import RESULTS, write_result
from bench.engine.offline_workload import (Tally, Workload, add_workload_args, check_workload_args,
                                           prepare_workload, run_fields, warm_up)

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM's LoRAConfig accepts
INSTALL_HINT = ("on the GPU machine: bash .vstage/install.sh && export PYTHONPATH=/tmp/vsite:$PYTHONPATH "
                "VLLM_USE_FLASHINFER_SAMPLER=0 (../shared/peers/vllm/README.md, bench/device/vllm_compare.sh)")


def require_vllm() -> str:
    """vLLM's version, or exit with how to install it: the project never does."""
    try:
        import vllm
    except ImportError as e:
        raise SystemExit(f"bench.peers.vllm needs vLLM, which the project does not install ({e}); "
                         f"{INSTALL_HINT}") from e
    return vllm.__version__


def max_lora_rank(adapter_dir: Path, names: list[str]) -> int:
    """The highest rank among the adapters, raised to the next rank vLLM accepts."""
    from peft import LoraConfig

    rank = max(LoraConfig.from_pretrained(str(adapter_dir / name)).r for name in names)
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise SystemExit(f"adapter rank {rank} exceeds vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")
    return fits[0]


def parse_engine_args(items: list[str]) -> dict:
    """KEY=VALUE pairs; a VALUE that parses as JSON is that value (8192, true, {"level": 0}), else a string."""
    parsed = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            parsed[key] = json.loads(text)
        except ValueError:
            parsed[key] = text
    return parsed


def engine_args(args, base: Path, adapter_dir: Path, names: list[str]) -> dict:
    """Every keyword LLM(...) gets: ours' settings under vLLM's names, LoRA when there are adapters, then
    --engine-arg, which may override any of them."""
    kwargs = {"model": str(base), "dtype": args.dtype, "seed": args.seed, "max_num_seqs": args.max_batch_size,
              "gpu_memory_utilization": args.gpu_memory_utilization}
    if names:
        kwargs |= {"enable_lora": True, "max_loras": args.slots, "max_cpu_loras": max(args.slots, len(names)),
                   "max_lora_rank": max_lora_rank(adapter_dir, names)}
    return kwargs | parse_engine_args(args.engine_arg)


def lora_requests(adapter_dir: Path, names: list[str]) -> dict:
    """adapter name -> its LoRARequest; vLLM's integer ids start at 1."""
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(lora_name=name, lora_int_id=i + 1, lora_path=str(adapter_dir / name))
            for i, name in enumerate(names)}


def generate(llm, work: Workload, name_to_lora: dict, tally: Tally) -> int:
    """Submit every request of `work` in one call and count its tokens into `tally`; returns how many requests
    produced other than their max_tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in work.prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in work.max_tokens]
    loras = None if all(a is None for a in work.adapters) else [name_to_lora[a] for a in work.adapters]
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    mismatches = 0
    for out, max_tokens in zip(outputs, work.max_tokens):
        produced = len(out.outputs[0].token_ids)
        tally.output_tokens += min(produced, max_tokens)
        tally.finished += out.finished
        tally.finished_tokens += min(produced, max_tokens) if out.finished else 0
        mismatches += produced != max_tokens
    return mismatches


def resolved_config(llm) -> str | None:
    """vLLM's whole resolved config as it prints it (its defaults included), where this version exposes it."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return None if config is None else str(config)


def run(args, base: Path, adapter_dir: Path, names: list[str], work: Workload) -> dict:
    from vllm import LLM

    kwargs = engine_args(args, base, adapter_dir, names)
    built = time.perf_counter()
    llm = LLM(**kwargs)
    build_s = time.perf_counter() - built
    name_to_lora = lora_requests(adapter_dir, names)
    warm = time.perf_counter()
    generate(llm, warm_up(work, names), name_to_lora, Tally(None))
    warm_up_s = time.perf_counter() - warm
    tally = Tally(None)
    mismatches = generate(llm, work, name_to_lora, tally)
    result = {**tally.as_dict(work), "length_mismatches": mismatches}
    return {"engine_args": kwargs, "vllm_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")},
            "vllm_config": resolved_config(llm), "build_s": build_s, "warm_up_s": warm_up_s, "result": result}


def release_cuda_cache() -> None:
    """A base or adapters built here on the GPU leave blocks in torch's cache, which vLLM's memory check would see
    as taken."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p)
    p.add_argument("--slots", type=int, default=32, help="max_loras: adapters on the GPU at once")
    p.add_argument("--max-batch-size", type=int, default=32, help="max_num_seqs: sequences running at once")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any further LLM(...) keyword, e.g. enforce_eager=true; VALUE is JSON or a string; repeatable")
    p.add_argument("--note", default="", help="free text kept in the result")
    p.add_argument("--name", default=None, help="the result's name after the device prefix "
                                                "(default throughput-vllm-<size>)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    check_workload_args(p, args)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    version = require_vllm()  # before building a 16 GB base for nothing
    # torch.cuda.is_available() (prepare asks it) through NVML, not the CUDA runtime: vLLM forks its engine core,
    # and a process forked after the runtime started cannot use CUDA.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    base, adapter_dir, names, work = prepare_workload(args)
    release_cuda_cache()
    payload = {"benchmark": "throughput", "transformers": transformers.__version__, "vllm_version": version,
               **run_fields("vllm", args, work), **run(args, base, adapter_dir, names, work)}
    path = write_result(args.name or f"throughput-vllm-{args.size}", payload, args.out_dir)
    r = payload["result"]
    print(f"vllm {version}: {r['output_tokens_per_s']:.1f} output tok/s, {r['requests_finished']}/"
          f"{r['requests_total']} requests, {r['output_tokens']} tokens in {r['wall_s']:.1f} s\nwrote {path}",
          flush=True)
    return payload


if __name__ == "__main__":
    main()
