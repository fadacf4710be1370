"""Adapter registry: good adapters give the spec PEFT would build; each bad one is refused with its own error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from peft.tuners.lora import LoraLayer

from adapter_helpers import (  # noqa: F401 (root, registry and good are fixtures)
    ATTN, BASE, edit_config, edit_tensors, good, llama_config, make_adapter, registry, root,
)
from app.errors import (
    AdapterAlreadyExists,
    AdapterConfigMismatch,
    AdapterFormatError,
    AdapterInvalid,
    AdapterNonFinite,
    AdapterNotFound,
    AdapterPathOutsideRoots,
    AdapterRankTooHigh,
    AdapterShapeMismatch,
    AdapterTargetUnsupported,
    AdapterTooLarge,
)
from app.adapters.registry import CONFIG_NAME, WEIGHTS_NAME, AdapterRegistry, validate_adapter_id
from app.adapters.targets import SUPPORTED_TARGETS


def peft_scales(model) -> dict[str, float]:
    prefix = "base_model.model."
    return {
        name.removeprefix(prefix): module.scaling["default"]
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


# --- good adapters --------------------------------------------------------------------------------


def test_attention_adapter_spec(registry, good, root):
    spec = registry.register("good", "good")  # relative to the root
    assert spec.path == good.resolve()
    assert spec.weights_file == (good / WEIGHTS_NAME).resolve()
    assert spec.rank == 8
    assert spec.target_modules == {"q_proj", "v_proj"}
    assert set(spec.module_ranks) == {f"model.layers.{i}.self_attn.{t}" for i in (0, 1) for t in ("q_proj", "v_proj")}
    assert set(spec.module_ranks.values()) == {8}
    assert set(spec.module_scales.values()) == {2.0}
    assert spec.module_shapes["model.layers.0.self_attn.v_proj"] == (64, 32)  # 2 kv heads * head_dim 16
    assert spec.nbytes == (good / WEIGHTS_NAME).stat().st_size
    assert registry.get("good") is spec and "good" in registry and len(registry) == 1


def test_all_linear_rslora_adapter(registry, root):
    model = make_adapter(root / "all", r=4, lora_alpha=8, target_modules="all-linear", use_rslora=True)
    spec = registry.register("all", root / "all")
    assert spec.target_modules == set(SUPPORTED_TARGETS)
    assert len(spec.module_ranks) == 2 * len(SUPPORTED_TARGETS)
    assert set(spec.module_scales.values()) == {8 / math.sqrt(4)}
    assert dict(spec.module_scales) == peft_scales(model)


def test_rank_and_alpha_patterns_scale_like_peft(registry, root):
    model = make_adapter(
        root / "pat",
        r=8,
        lora_alpha=16,
        target_modules=ATTN,
        rank_pattern={"v_proj": 2, r"layers\.1\.self_attn\.o_proj": 4},
        alpha_pattern={"q_proj": 32},
    )
    spec = registry.register("pat", root / "pat")
    assert spec.module_ranks["model.layers.0.self_attn.v_proj"] == 2
    assert spec.module_ranks["model.layers.1.self_attn.o_proj"] == 4
    assert spec.module_ranks["model.layers.0.self_attn.o_proj"] == 8
    assert spec.module_scales["model.layers.0.self_attn.q_proj"] == 4.0
    assert spec.module_scales["model.layers.0.self_attn.v_proj"] == 8.0
    assert dict(spec.module_scales) == peft_scales(model)
    assert spec.rank == 8


def test_validate_changes_nothing_and_list_is_sorted(registry, root):
    for name in ("b", "a"):
        make_adapter(root / name, r=2)
    registry.validate("b", "b")
    assert len(registry) == 0
    registry.register("b", "b")
    registry.register("a", "a")
    assert [spec.adapter_id for spec in registry.list()] == ["a", "b"]


def test_symlink_inside_roots_is_fine(registry, good, root):
    (root / "alias").symlink_to(good)
    assert registry.register("alias", "alias").path == good.resolve()


# --- refusals -------------------------------------------------------------------------------------


def test_corrupt_safetensors(registry, good):
    (good / WEIGHTS_NAME).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(AdapterFormatError, match="not readable safetensors"):
        registry.register("bad", good)


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size :])


def _first_tensor(header: dict) -> dict:
    return header[min(k for k in header if k != "__metadata__")]


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda h: _first_tensor(h).__setitem__("dtype", "Q4"), "malformed header entry"),
        (lambda h: _first_tensor(h).__setitem__("shape", [3, -1]), "malformed header entry"),
        (lambda h: _first_tensor(h).__setitem__("shape", [1]), "bytes for shape"),
        (lambda h: _first_tensor(h)["data_offsets"].__setitem__(0, 4), "bytes for shape"),
        (lambda h: h.pop(max(k for k in h if k != "__metadata__")), "overlaps or leaves gaps|cover"),
        (lambda h: h.__setitem__("extra", {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}), "overlaps"),
    ],
)
def test_malformed_safetensors_header(registry, good, edit, why):
    _rewrite_header(good / WEIGHTS_NAME, edit)
    with pytest.raises(AdapterFormatError, match=f"not readable safetensors: .*({why})"):
        registry.register("bad", good)


def test_truncated_safetensors(registry, good):
    data = (good / WEIGHTS_NAME).read_bytes()
    (good / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterFormatError, match="not readable safetensors"):
        registry.register("bad", good)


def test_rank_too_high(registry, root):
    make_adapter(root / "big", r=32)
    with pytest.raises(AdapterRankTooHigh, match=r"rank 32 > max_rank 16 \(set max_rank >= 32\)"):
        registry.register("big", "big")


@pytest.mark.parametrize(
    "targets, module",
    [
        (["q_proj", "lm_head"], "lm_head"),
        (["q_proj", "embed_tokens"], "model.embed_tokens"),  # PEFT also saves the embedding's base_layer
        (r".*\.(q_proj|embed_tokens)", "model.embed_tokens"),  # a regex: only the tensors tell
    ],
)
def test_unsupported_target(registry, root, targets, module):
    make_adapter(root / "x", r=4, target_modules=targets)
    with pytest.raises(AdapterTargetUnsupported, match=f"targets {module}; supported targets are \\['down_proj'"):
        registry.register("x", "x")


def test_target_outside_registry_supported_set(root):
    registry = AdapterRegistry([root], BASE, max_rank=16, supported_targets=ATTN)
    make_adapter(root / "mlp", r=4, target_modules=["gate_proj"])
    with pytest.raises(AdapterTargetUnsupported, match="gate_proj"):
        registry.register("mlp", "mlp")


def test_shape_mismatch_other_hidden_size(registry, root):
    make_adapter(root / "other", base=llama_config(hidden=32), r=4)
    with pytest.raises(AdapterShapeMismatch, match=r"expects lora_A \[r, 64\].*got \[4, 32\]"):
        registry.register("other", "other")


def test_layer_out_of_range(registry, root):
    make_adapter(root / "deep", base=llama_config(layers=3), r=4)
    with pytest.raises(AdapterShapeMismatch, match=r"no module model.layers.2.self_attn.q_proj \(it has 2 layers\)"):
        registry.register("deep", "deep")


def test_missing_lora_b(registry, good):
    edit_tensors(good, lambda t: t.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"))
    with pytest.raises(AdapterFormatError, match="layers.0.self_attn.q_proj has no lora_B.weight"):
        registry.register("half", good)


def test_nan(registry, good):
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    edit_tensors(good, lambda t: t[key].view(-1).__setitem__(3, float("nan")))
    with pytest.raises(AdapterNonFinite, match=rf"{key}' has 1 NaN/Inf"):
        registry.register("nan", good)


def test_pickle_only_adapter(registry, root):
    make_adapter(root / "pickled", r=4, safe=False)
    with pytest.raises(AdapterFormatError, match=r"pickle weights \['adapter_model.bin'\].*safe_serialization=True"):
        registry.register("pickled", "pickled")


def test_missing_config(registry, good):
    (good / CONFIG_NAME).unlink()
    with pytest.raises(AdapterFormatError, match="has no adapter_config.json"):
        registry.register("x", good)


def test_unparseable_config(registry, good):
    (good / CONFIG_NAME).write_text("{r: 8,")
    with pytest.raises(AdapterFormatError, match="not a valid LoRA config"):
        registry.register("x", good)


def test_missing_folder(registry):
    with pytest.raises(AdapterFormatError, match="no such directory 'nope'"):
        registry.register("x", "nope")
    with pytest.raises(AdapterFormatError, match="cannot read its files: embedded null byte"):
        registry.register("x", "no\x00pe")


def test_not_lora(registry, good):
    edit_config(good, peft_type="IA3")
    with pytest.raises(AdapterInvalid, match="peft_type is 'IA3'; only 'LORA'"):
        registry.register("x", good)


@pytest.mark.parametrize(
    "changes, error, phrase",
    [
        ({"use_dora": True}, AdapterInvalid, "DoRA"),
        ({"fan_in_fan_out": True}, AdapterInvalid, "fan_in_fan_out"),
        ({"lora_bias": True}, AdapterInvalid, "lora_bias"),
        ({"modules_to_save": ["lm_head"]}, AdapterTargetUnsupported, "modules_to_save"),
        ({"init_lora_weights": "pissa"}, AdapterInvalid, "modifies the base weights"),
    ],
)
def test_unserved_features(registry, good, changes, error, phrase):
    edit_config(good, **changes)
    with pytest.raises(error, match=phrase):
        registry.register("x", good)


def test_path_outside_roots_via_dotdot(registry, root, tmp_path):
    make_adapter(tmp_path / "outside" / "a", r=4)
    for path in ("../outside/a", root / ".." / "outside" / "a", tmp_path / "outside" / "a"):
        with pytest.raises(AdapterPathOutsideRoots, match="outside the adapter roots"):
            registry.register("x", path)


def test_folder_symlink_escaping_roots(registry, root, tmp_path):
    make_adapter(tmp_path / "outside" / "a", r=4)
    (root / "link").symlink_to(tmp_path / "outside" / "a")
    with pytest.raises(AdapterPathOutsideRoots, match="folder resolves to .*outside"):
        registry.register("x", "link")


@pytest.mark.parametrize("name", [WEIGHTS_NAME, CONFIG_NAME])
def test_file_symlink_escaping_roots(registry, good, tmp_path, name):
    secret = tmp_path / name
    (good / name).rename(secret)
    (good / name).symlink_to(secret)
    with pytest.raises(AdapterPathOutsideRoots, match=f"{name} resolves to {secret}"):
        registry.register("x", good)


def test_too_large(root, good):
    registry = AdapterRegistry([root], BASE, max_rank=16, max_adapter_bytes=1000)
    nbytes = (good / WEIGHTS_NAME).stat().st_size
    with pytest.raises(AdapterTooLarge, match=f"is {nbytes} bytes > max_adapter_bytes 1000"):
        registry.register("x", good)


def test_config_lies_about_rank(registry, good):
    edit_config(good, r=4)
    with pytest.raises(AdapterConfigMismatch, match="has rank 8 in its tensors but 4 in adapter_config.json"):
        registry.register("x", good)


def test_config_claims_targets_without_tensors(registry, good):
    edit_config(good, target_modules=["q_proj", "v_proj", "o_proj"])
    with pytest.raises(AdapterConfigMismatch, match="selects 2 modules of the base model that have no tensors"):
        registry.register("x", good)


def test_config_omits_targets_with_tensors(registry, good):
    edit_config(good, target_modules=["q_proj"])
    with pytest.raises(AdapterConfigMismatch, match="2 modules have tensors but target_modules=.*does not select"):
        registry.register("x", good)


# --- registry state -------------------------------------------------------------------------------


def test_duplicate_register(registry, good):
    registry.register("good", good)
    with pytest.raises(AdapterAlreadyExists, match="'good' is already registered"):
        registry.register("good", good)


def test_unregister_and_get_unknown(registry, good):
    registry.register("good", good)
    with pytest.raises(AdapterNotFound, match=r"'nope' is not registered \(1 adapters are\)"):
        registry.get("nope")
    with pytest.raises(AdapterNotFound, match="'nope' is not registered"):
        registry.unregister("nope")
    assert registry.unregister("good").adapter_id == "good"
    assert "good" not in registry and len(registry) == 0


@pytest.mark.parametrize("adapter_id", ["a/b", "..", "x\x00y", "", "a..b", "-x", "ok\n", "x" * 129, None])
def test_invalid_ids(registry, good, adapter_id):
    with pytest.raises(AdapterInvalid, match="invalid adapter id"):
        registry.register(adapter_id, good)


def test_valid_ids():
    for adapter_id in ("a", "llama-3.1_sql", "X" * 128):
        assert validate_adapter_id(adapter_id) == adapter_id
