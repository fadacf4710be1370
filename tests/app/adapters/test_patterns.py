"""app/adapters/patterns.py decides target modules, rank and alpha exactly as PEFT does, on ordinary configs."""

from __future__ import annotations

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from adapter_helpers import llama_config
from app.adapters.patterns import pattern_value, selects
from app.adapters.targets import target_shapes

MODULES = sorted(target_shapes(llama_config(layers=4)))

CONFIGS = [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"]),
    dict(target_modules=r".*\.(q|k|v|o)_proj"),
    dict(target_modules=r"model\.layers\.[02]\.mlp\..*"),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[1, 3]),
    dict(target_modules=["q_proj"], layers_to_transform=2, layers_pattern="layers"),
    dict(target_modules=["q_proj"], layers_to_transform=[0], layers_pattern=["blocks", "layers"]),
    dict(target_modules=["self_attn.q_proj", "mlp.up_proj"]),
    dict(target_modules=["q_proj", "v_proj", "o_proj"], exclude_modules=["model.layers.1.self_attn.o_proj"]),
    dict(target_modules=["q_proj", "v_proj"], exclude_modules=r".*layers\.3\..*"),
]


@pytest.mark.parametrize("kwargs", CONFIGS, ids=lambda k: str(sorted(k.items())))
def test_target_selection_equals_peft(kwargs):
    config = LoraConfig(**kwargs)
    for module in MODULES:
        assert selects("a", config, module) == bool(check_target_module_exists(config, module)), module


def test_rank_and_alpha_patterns_equal_peft():
    patterns = {"v_proj": 2, r"layers\.1\.self_attn\.o_proj": 4, "mlp.down_proj": 6, r"layers\.[23]\..*_proj": 3}
    for module in MODULES:
        expected = patterns.get(get_pattern_key(patterns.keys(), module), 8)
        assert pattern_value("a", "rank_pattern", patterns, module, 8) == expected, module
