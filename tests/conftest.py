"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.demo.build import ensure_demo

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The tiny demo (base, tokenizer, adapters), built once and reused across runs.

    Set LORA_DEMO_DIR to keep it elsewhere, e.g. in a CI cache.
    """
    return ensure_demo(Path(os.environ.get("LORA_DEMO_DIR", REPO_ROOT / "demo" / "tiny")))
