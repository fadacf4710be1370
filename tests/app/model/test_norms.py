import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from app.model.norms import fuse_rms_norms


class GemmaStyleRMSNorm(nn.Module):
    """Another semantics under the same attribute names: the weight is an offset from 1."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)


def test_llama_norms_are_swapped_and_agree_and_other_semantics_are_kept():
    torch.manual_seed(0)
    model = nn.Sequential(LlamaRMSNorm(64, eps=1e-5), GemmaStyleRMSNorm(64), nn.Linear(64, 64))
    with torch.no_grad():
        model[0].weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 7, 64)
    want = [model[0](x), model[1](x)]
    assert fuse_rms_norms(model) == 0  # CPU: nothing unless forced
    assert fuse_rms_norms(model, force=True) == 1
    assert "forward" in vars(model[0]) and "forward" not in vars(model[1])
    torch.testing.assert_close(model[0](x), want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model[1](x), want[1])


def test_fused_norms_keep_the_demo_models_logits(demo_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_dir / "base", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 42, 7, 3]])
    with torch.no_grad():
        want = model(ids).logits
        assert fuse_rms_norms(model, force=True) == 2 * model.config.num_hidden_layers + 1
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
