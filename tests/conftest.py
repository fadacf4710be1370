"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from app.demo.build import ensure_demo

REPO_ROOT = Path(__file__).resolve().parent.parent

# One torch CPU thread, here and in the processes the tests start (engine processes, tensor-parallel workers): the
# suite runs many processes at once on a few cores, where a second thread on these tiny models costs more CPU than
# it saves. (Ray gives its workers one thread per CPU they hold.)
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The tiny demo (base, tokenizer, adapters), built once and reused across runs.

    Set LORA_DEMO_DIR to keep it elsewhere, e.g. in a CI cache.
    """
    return ensure_demo(Path(os.environ.get("LORA_DEMO_DIR", REPO_ROOT / "demo" / "tiny")))
