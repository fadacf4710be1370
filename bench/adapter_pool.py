"""The benchmark's base model and its many distinct adapters, made cheaply.

Demo sizes: scaled copies of the demo's trained adapters (lora_B times a distinct factor), so
each copy is a different adapter of the same shape, as tests/app/conftest.py's churn_root does.
llama3-8b-shape: random rank-16 all-linear adapters written straight to safetensors with PEFT's
key names; training or PEFT-wrapping an 8B model per adapter would take far too long.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from app.demo.build import ensure_demo
from app.adapters.targets import SUPPORTED_TARGETS, target_shapes
from bench.common import REPO_DEMO

GPU_SIZE = "llama3-8b-shape"

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"


def prepare(size: str, count: int, seed: int = 0, demo_dir: Path | None = None,
            base: Path | None = None) -> tuple[Path, Path, list[str]]:
    """(base model folder, adapter folder, `count` adapter names) for a demo size, building what is missing.

    llama3-8b-shape: a random 16 GB base saved once under demo/ (or `base`), built on the GPU when
    there is one, and random adapters. Other sizes: the demo (or `demo_dir`) and scaled copies.
    """
    if size == GPU_SIZE:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        base = base or ensure_demo(REPO_DEMO / f"{GPU_SIZE}-base", size=GPU_SIZE, adapters=0, device=device) / "base"
        adapter_dir = REPO_DEMO / f"{GPU_SIZE}-bench-adapters"
        return base, adapter_dir, random_adapters(base, count, adapter_dir, rank=16, seed=seed, device=device)
    demo = demo_dir or ensure_demo(REPO_DEMO / size, size=size)
    adapter_dir = demo.parent / f"{demo.name}-bench-adapters"
    return demo / "base", adapter_dir, scaled_copies(demo, count, adapter_dir)


def adapter_name(i: int) -> str:
    return f"bench-{i:04d}"


def _fresh_dir(out_dir: Path, source: dict) -> None:
    """Wipe `out_dir` when it was made from another source (a rebuilt demo, another seed)."""
    stamp = out_dir / "source.json"
    text = json.dumps(source, sort_keys=True, default=str)
    if stamp.is_file() and stamp.read_text() == text:
        return
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    stamp.write_text(text)


def _is_complete(folder: Path) -> bool:
    return (folder / WEIGHTS_NAME).is_file() and (folder / CONFIG_NAME).is_file()


def scaled_copies(demo_dir: Path, count: int, out_dir: Path) -> list[str]:
    """`count` adapters: demo adapter i % k with lora_B scaled by 1 + 0.05 * (i // k). Reuses earlier copies."""
    manifest = json.loads((demo_dir / "demo.json").read_text())
    sources = [demo_dir / a["path"] for a in manifest["adapters"]]
    if not sources:
        raise ValueError(f"the demo in {demo_dir} has no adapters to copy")
    digest = hashlib.sha256()
    for src in sources:
        digest.update((src / WEIGHTS_NAME).read_bytes())
    _fresh_dir(out_dir, {"demo_adapters_sha256": digest.hexdigest()})
    names = []
    for i in range(count):
        name, src = adapter_name(i), sources[i % len(sources)]
        dst = out_dir / name
        if not _is_complete(dst):
            factor = 1.0 + 0.05 * (i // len(sources))
            tensors = {k: (v * factor if "lora_B" in k else v).contiguous()
                       for k, v in load_file(src / WEIGHTS_NAME).items()}
            config_text = (src / CONFIG_NAME).read_text()
            _write(dst, tensors, lambda folder: (folder / CONFIG_NAME).write_text(config_text))
        names.append(name)
    return names


def random_adapters(base_dir: Path, count: int, out_dir: Path, rank: int = 16, seed: int = 0,
                    device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """`count` random LoRA adapters of `rank` on all seven linear targets of the base in `base_dir`.

    lora_A [r, in] and lora_B [out, r] are normal(0, 0.02), so every adapter changes the output.
    """
    config = AutoConfig.from_pretrained(base_dir)
    shapes = target_shapes(config)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(SUPPORTED_TARGETS),
                      task_type="CAUSAL_LM", base_model_name_or_path=str(base_dir))
    _fresh_dir(out_dir, {"config": config.to_dict(), "rank": rank, "seed": seed, "device": str(device),
                         "dtype": str(dtype)})
    names = []
    for i in range(count):
        name = adapter_name(i)
        dst = out_dir / name
        if not _is_complete(dst):
            gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + i)
            tensors = {}
            for module, (fan_in, fan_out) in shapes.items():
                key = f"base_model.model.{module}"
                tensors[f"{key}.lora_A.weight"] = _normal((rank, fan_in), gen, device, dtype)
                tensors[f"{key}.lora_B.weight"] = _normal((fan_out, rank), gen, device, dtype)
            _write(dst, tensors, lora.save_pretrained)
        names.append(name)
    return names


def _normal(shape, gen, device, dtype) -> torch.Tensor:
    return torch.empty(shape, device=device, dtype=torch.float32).normal_(0.0, 0.02, generator=gen).to(dtype).cpu()


def _write(dst: Path, tensors: dict, write_config) -> None:
    """Write into a temporary folder and rename, so an interrupted run leaves no half adapter."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, tmp / WEIGHTS_NAME)
    write_config(tmp)
    if dst.exists():
        for f in dst.iterdir():
            f.unlink()
        dst.rmdir()
    tmp.rename(dst)

