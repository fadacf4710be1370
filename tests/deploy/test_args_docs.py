"""docs/configuration.md lists every arg of `build_app` once, with the default the code has."""

import re
from pathlib import Path

from deploy.args import AppArgs, ENGINE_FIELDS
from app.engine.config import EngineConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def documented_args() -> list[str]:
    section = DOC.read_text().split("## Application arguments", 1)[1].split("## Deployment options", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)


def test_every_arg_is_documented_once():
    names = documented_args()
    assert sorted(names) == sorted(AppArgs.model_fields), set(names) ^ set(AppArgs.model_fields)
    assert len(names) == len(set(names))


def test_the_engine_settings_are_the_args_with_the_same_defaults():
    engine = EngineConfig(base_model="m")
    args = AppArgs(base_model="m", adapter_roots=[])
    assert set(ENGINE_FIELDS) <= set(AppArgs.model_fields)
    for name in ENGINE_FIELDS:
        if name not in ("base_model", "adapter_roots"):
            assert getattr(args, name) == getattr(engine, name) or name in ("max_prefill_tokens_per_step", "overlap_steps"), name
    assert args.engine_config() == engine
