"""RMSNorm in one kernel for the eager steps on CUDA.

transformers' Llama-family RMSNorm runs as seven kernels (upcast, square, mean, rsqrt, scale,
downcast, weight), each a pass over the step's activations, most in float32: for an 8 x 512-token
prefill of Llama-3-8B its 65 norms move, by count, about nine times the bytes fused kernels would.
`torch.rms_norm` computes the same in one kernel on CUDA (ATen's fused RMSNorm). Under torch.compile (the
decode graphs) the module's own forward runs, which inductor fuses with the neighbouring elementwise work.

A norm is swapped only if its output on a probe equals the original forward's within the dtype's
rounding, so a norm with other semantics (Gemma's `1 + weight`, for one) keeps its own. The result
differs from transformers' in the last bit: transformers rounds the normalized value to the model's
dtype before the weight multiplies it; the fused kernel rounds once. FUSED_NORM=0 keeps
transformers' norms (benches).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

log = logging.getLogger(__name__)


def _fused_forward(module: nn.Module):
    shape, eps, own = (module.weight.shape[-1],), module.variance_epsilon, module.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inductor fuses transformers' norm with the residual add before it;
            return own(hidden_states)  # ATen's fused kernel would run alone, and decode slower
        return torch.rms_norm(hidden_states, shape, module.weight, eps)

    return forward


def _is_rms_norm(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float))


@torch.inference_mode()
def _agrees(module: nn.Module, fused) -> bool:
    weight = module.weight
    probe = torch.randn(4, weight.shape[0], dtype=weight.dtype, device=weight.device,
                        generator=torch.Generator(weight.device).manual_seed(0)) * 3
    want, got = module.forward(probe), fused(probe)
    tolerance = 1e-5 if weight.dtype == torch.float32 else 2e-2
    return want.shape == got.shape and torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance)


def fuse_rms_norms(model: nn.Module, force: bool = False) -> int:
    """Swap every Llama-style RMSNorm's forward for torch.rms_norm (CUDA, or anywhere with force).
    Returns how many were swapped."""
    device = next(model.parameters()).device
    if not force and (device.type != "cuda" or os.environ.get("FUSED_NORM", "1") == "0"):
        return 0
    swapped = kept = 0
    for module in model.modules():
        if not _is_rms_norm(module):
            continue
        fused = _fused_forward(module)
        if _agrees(module, fused):
            module.forward = fused
            swapped += 1
        else:
            kept += 1
    if kept:
        log.info("kept %d RMSNorm modules of other semantics unfused", kept)
    return swapped
