"""Each bad adapter is refused with its own error and message, and the engine keeps serving."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from app import errors
from engine_helpers import greedy, run_all

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def rewrite(folder: Path, fn):
    tensors = load_file(folder / WEIGHTS)
    save_file({k: v.contiguous() for k, v in fn(tensors).items()}, folder / WEIGHTS)


def corrupt(folder):
    (folder / WEIGHTS).write_bytes(b"\x00garbage" * 10)


def rank_too_high(folder):
    pass  # the engine below uses max_rank 4; this adapter has a larger rank


def unknown_target(folder):
    rewrite(folder, lambda t: {k.replace("q_proj", "lm_head"): v for k, v in t.items()})
    config = json.loads((folder / CONFIG).read_text())
    config["target_modules"] = ["lm_head" if m == "q_proj" else m for m in config["target_modules"]]
    (folder / CONFIG).write_text(json.dumps(config))


def shape_mismatch(folder):
    rewrite(folder, lambda t: {k: (v[:, :-1] if "lora_A" in k else v) for k, v in t.items()})


def nan_values(folder):
    rewrite(folder, lambda t: {k: (v.fill_(float("nan")) if "lora_B" in k else v) for k, v in t.items()})


def pickle_only(folder):
    torch.save(load_file(folder / WEIGHTS), folder / "adapter_model.bin")
    (folder / WEIGHTS).unlink()


CASES = {
    "corrupt": (corrupt, errors.AdapterFormatError, "safetensors"),
    "rank": (rank_too_high, errors.AdapterRankTooHigh, "max_rank"),
    "target": (unknown_target, errors.AdapterTargetUnsupported, "lm_head"),
    "shape": (shape_mismatch, errors.AdapterShapeMismatch, "shape"),
    "nan": (nan_values, errors.AdapterNonFinite, "NaN"),
    "pickle": (pickle_only, errors.AdapterFormatError, "pickle"),
}


def test_each_bad_adapter_refused_and_serving_continues(make_engine, demo_dir, manifest, tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    too_high = next(a for a in manifest["adapters"] if a["rank"] > 4)
    fits = next(a for a in manifest["adapters"] if a["rank"] <= 4)
    engine = make_engine(register=False, adapter_roots=(str(root),), max_rank=4)
    for name, (damage, error, phrase) in CASES.items():
        folder = root / name
        # Registration checks the header before it reads the values: the NaN case needs a rank that fits.
        source = fits if name == "nan" else too_high
        shutil.copytree(Path(demo_dir) / source["path"], folder)
        damage(folder)
        with pytest.raises(error, match=phrase):
            engine.register_adapter(name, str(folder))
    outside = tmp_path / "outside"
    shutil.copytree(Path(demo_dir) / too_high["path"], outside)
    os.symlink(outside, root / "escape")
    for path in (str(outside), str(root / ".." / "outside"), str(root / "escape")):
        with pytest.raises(errors.AdapterPathOutsideRoots):
            engine.register_adapter("outside", path)
    messages = set()
    for name, (damage, error, _) in CASES.items():
        try:
            engine.register_adapter(name, str(root / name))
        except error as e:
            messages.add(str(e))
    assert len(messages) == len(CASES), "each refusal has its own message"
    assert len(engine.registry) == 0
    request = engine.add_request(manifest["prompts"][0], None, greedy(4))
    assert len(run_all(engine, check=True)[request.request_id]) >= 1
