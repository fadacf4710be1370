"""FP8 checkpoints as published (app/model/fp8_checkpoint.py), on CPU: compressed-tensors' float format, written
by the compressed-tensors package, loads its FP8 weights and scales as they are, into the model this engine's
own quantizer makes of the dense weights; every other quantization is refused by name; and an FP8 checkpoint on
a CPU engine is refused at start-up."""

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from app.engine.config import EngineConfig
from app.model.architectures import UnsupportedModel, check_supported
from app.model.fp8 import Fp8Linear, Fp8Unsupported, quantize_linears
from app.model.fp8_checkpoint import dense_config, fp8_scheme, load_fp8_linears
from fp8_helpers import write_fp8_checkpoint

pytest.importorskip("compressed_tensors")


@pytest.fixture(scope="module")
def checkpoints(demo_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {strategy: write_fp8_checkpoint(demo_dir / "base", root / strategy, strategy)
            for strategy in ("channel", "tensor")}


def load(folder):
    config = AutoConfig.from_pretrained(folder)
    scheme, refused = fp8_scheme(config)
    assert refused is None and check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(folder, config=dense_config(config), dtype=torch.float32).eval()
    paths = list(check_supported(config).target_shapes(config))
    assert load_fp8_linears(model, folder, paths, scheme) == len(paths)
    return model, scheme, paths


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_the_checkpoints_fp8_weights_and_scales_load_as_they_are(checkpoints, strategy):
    model, scheme, paths = load(checkpoints[strategy])
    assert scheme.weight_strategy == strategy and not scheme.quantized("lm_head")
    with safe_open(checkpoints[strategy] / "model.safetensors", "pt") as f:
        for path in paths:
            linear = model.get_submodule(path)
            assert type(linear) is Fp8Linear
            stored = f.get_tensor(f"{path}.weight")
            assert torch.equal(linear.weight_q.view(torch.uint8), stored.view(torch.uint8)), path
            scales = f.get_tensor(f"{path}.weight_scale").float().flatten().expand(stored.shape[0])
            assert torch.equal(linear.weight_scale, scales), path
    assert type(model.lm_head) is torch.nn.Linear


def test_a_per_channel_checkpoint_is_the_model_this_engine_quantizes_itself(demo_dir, checkpoints):
    """compressed-tensors' FP8 bytes and scales equal app/model/fp8.py's of the same dense weights, so the
    loaded model's logits equal those of the dense model quantized here, bit for bit."""
    loaded, _, _ = load(checkpoints["channel"])
    dense = AutoModelForCausalLM.from_pretrained(demo_dir / "base", dtype=torch.float32).eval()
    quantize_linears(dense, check_supported(dense.config).target_shapes(dense.config))
    ids = torch.tensor([[1, 5, 9, 14, 3, 27, 8]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, dense(ids).logits)


@pytest.mark.parametrize(("qc", "named"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quant_method 'fp8'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "int-quantized"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                           "block_structure": [128, 128]}}}}, "strategy=block"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     "input activations"),
])
def test_other_quantizations_are_refused_by_name(demo_dir, qc, named):
    config = AutoConfig.from_pretrained(demo_dir / "base")
    config.quantization_config = qc
    with pytest.raises(UnsupportedModel, match=named.replace("(", r"\(")):
        check_supported(config)


def test_an_fp8_checkpoint_is_refused_on_a_cpu_engine(checkpoints):
    from app.engine.engine import LLMEngine

    with pytest.raises(Fp8Unsupported, match="device is cpu"):
        LLMEngine(EngineConfig(base_model=str(checkpoints["channel"]), device="cpu"))
