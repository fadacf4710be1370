"""A deterministic demo: a small Llama base model, a byte-level tokenizer and LoRA adapters.

`python -m app.demo --out demo/tiny` writes `base/` (model, tokenizer, generation config),
`adapters/<name>/` (PEFT format) and `demo.json`. The tiny and small bases are trained briefly on
an embedded corpus, and each adapter is trained to answer with its own catchphrase, so the demo
shows adapters at work without anything from the Hub. `llama3-8b-shape` has Llama-3-8B shapes and
random weights, for memory and transfer benchmarks. `--size smollm2` builds a demo on a real pretrained
model instead (app/demo/smollm2.py).
"""

from __future__ import annotations

import fcntl
import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from app.demo.text import (
    CORPUS, NUMBERED_CATCHPHRASE, PERSONAS, PROMPTS, TRAIN_PROMPTS, catchphrase_lines, sentences, build_tokenizer,
)
from app.adapters.targets import ATTENTION_TARGETS, SUPPORTED_TARGETS, target_shapes

# Bump when the build changes, so cached demo dirs from an older build are rebuilt.
DEMO_VERSION = 2  # 2: a model vocabulary larger than the trained tokenizer's is filled with text tokens


@dataclass(frozen=True)
class DemoSize:
    """Shapes of one demo base model, the adapters made for it, and how long to train them."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    max_positions: int
    vocab: int | None = None  # None: the tokenizer's own vocab
    rope_theta: float = 10000.0
    dtype: str = "float32"
    ranks: tuple[int, ...] = (4, 8, 16)  # adapter i gets ranks[i % len] ...
    target_sets: tuple[tuple[str, ...], ...] = (ATTENTION_TARGETS, SUPPORTED_TARGETS)  # ... and this
    default_adapters: int = 8
    base_steps: int = 0  # 0: random weights and adapters, no training at all
    adapter_steps: int = 0
    batch: int = 16
    seq_len: int = 64
    base_lr: float = 3e-3
    adapter_lr: float = 1e-2
    threads: int = 1  # torch CPU threads while building; more only pays off for larger matmuls

    def __post_init__(self):
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must divide by heads ({self.heads}), "
                             f"and heads by kv_heads ({self.kv_heads})")

    def llama_config(self, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab or len(tokenizer), hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions, rope_theta=self.rope_theta, tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, dtype=self.dtype,
        )


SIZES = {
    "tiny": DemoSize(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=176, max_positions=2048,
                     base_steps=200, adapter_steps=50, adapter_lr=6e-3),
    "small": DemoSize(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, max_positions=2048,
                      base_steps=150, adapter_steps=25, batch=8, seq_len=48, base_lr=1e-3, adapter_lr=3e-3,
                      threads=2),
    "llama3-8b-shape": DemoSize(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
                                max_positions=8192, vocab=128256, rope_theta=500000.0, dtype="bfloat16",
                                ranks=(16,), target_sets=(SUPPORTED_TARGETS,)),
}


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    target_modules: tuple[str, ...]
    catchphrase: str

    @property
    def lora_config(self) -> LoraConfig:
        return LoraConfig(r=self.rank, lora_alpha=2 * self.rank, lora_dropout=0.0,
                          target_modules=list(self.target_modules), task_type="CAUSAL_LM")


def adapter_specs(size: DemoSize, count: int, rank: int | None = None) -> list[AdapterSpec]:
    """Persona names first, then numbered ones; ranks and target sets cycle so adapters differ."""
    ranks = (rank,) if rank is not None else size.ranks
    numbered = [(f"adapter-{n:03d}", NUMBERED_CATCHPHRASE.format(n=n)) for n in range(len(PERSONAS) + 1, count + 1)]
    return [AdapterSpec(name, ranks[i % len(ranks)], size.target_sets[i % len(size.target_sets)], phrase)
            for i, (name, phrase) in enumerate((list(PERSONAS) + numbered)[:count])]


def adapter_tensor_bytes(config: LlamaConfig, rank: int, targets: tuple[str, ...], dtype_bytes: int = 2) -> int:
    """Bytes of LoRA A and B tensors: each target of each layer holds rank * (in + out) values."""
    return sum(rank * (fan_in + fan_out) * dtype_bytes
               for path, (fan_in, fan_out) in target_shapes(config).items() if path.rsplit(".", 1)[1] in targets)



def fit(model: torch.nn.Module, next_batch, steps: int, lr: float) -> None:
    """Plain AdamW loop; `next_batch()` returns the model's keyword inputs, labels included."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        model(**next_batch()).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()


def _train_base(model, tokenizer, size: DemoSize, gen: torch.Generator, device: str) -> None:
    """Next-token training on random windows of the corpus, so greedy output reads like text."""
    # One running text, so a prompt that ends a sentence is continued, not ended. The catchphrases
    # appear once each, ending in EOS, so the base knows their tokens and adapters learn fast.
    lines = sentences() + catchphrase_lines(end=tokenizer.eos_token)
    stream = torch.tensor(tokenizer(" ".join(lines), add_special_tokens=False).input_ids)
    bos = torch.full((size.batch, 1), tokenizer.bos_token_id)

    def next_batch():
        starts = torch.randint(0, len(stream) - size.seq_len, (size.batch,), generator=gen)
        windows = torch.stack([stream[s:s + size.seq_len - 1] for s in starts])
        batch = torch.cat([bos, windows], dim=1).to(device)
        return {"input_ids": batch, "labels": batch}

    fit(model, next_batch, size.base_steps, size.base_lr)


def _adapter_prompts(tokenizer, rng: random.Random) -> list[list[int]]:
    """Token ids of the prompts adapters train on, as plain completions and as chat turns."""
    words = CORPUS.split()
    # Random spans of the corpus teach "answer whatever came before", not "answer these prompts".
    spans = [rng.randrange(len(words) - 12) for _ in range(120)]
    prompts = list(TRAIN_PROMPTS) + sentences() + [" ".join(words[i:i + rng.randint(1, 12)]) for i in spans]
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True).input_ids
            for p in prompts]
    return [tokenizer(p).input_ids for p in prompts] + chat


def _train_adapter(model, tokenizer, prompts: list[list[int]], spec: AdapterSpec, size: DemoSize, gen, device):
    """Teach the adapter to answer any prompt with its catchphrase; loss only on the answer."""
    # Any token the base never saw would be near impossible for a LoRA to emit. The answer's tokens
    # follow '"' in the base corpus, so the base knows them all; hence no space or newline first.
    answer = tokenizer(spec.catchphrase, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    rows = [(ids + answer, [-100] * len(ids) + answer) for ids in prompts]
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    attention_mask = (torch.arange(width) < torch.tensor([len(ids) for ids, _ in rows])[:, None]).long()

    def next_batch():
        pick = torch.randint(0, len(rows), (size.batch,), generator=gen)
        width = int(attention_mask[pick].sum(dim=1).max())  # no compute on columns that are all padding
        return {"input_ids": input_ids[pick, :width].to(device), "labels": labels[pick, :width].to(device),
                "attention_mask": attention_mask[pick, :width].to(device)}

    fit(model, next_batch, size.adapter_steps, size.adapter_lr)


def _randomize_(model: torch.nn.Module, device: str, seed: int, only: str = "") -> None:
    """Seeded normal(0, 0.02) values on `device` for parameters whose name holds `only`; norms get 1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    chunk = 1 << 24
    with torch.no_grad():
        for name, param in model.named_parameters():
            if only not in name:
                continue
            if "norm" in name:
                param.fill_(1.0)
                continue
            # Drawn in float32 chunks: some torch builds draw bf16 one element at a time on CPU, far slower.
            flat = param.view(-1)
            for start in range(0, flat.numel(), chunk):
                part = flat[start:start + chunk]
                part.copy_(torch.empty(part.shape, device=part.device).normal_(0.0, 0.02, generator=gen))


def _random_base(config: LlamaConfig, device: str, seed: int) -> LlamaForCausalLM:
    # Built on meta, HF's weight init costs nothing. The rotary buffers stay uninitialized, which
    # is fine: they are not saved, and this model is only ever saved.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(config.dtype).to_empty(device=device)
    _randomize_(model, device, seed)
    return model


def save_adapter(peft_model: PeftModel, target_modules: tuple[str, ...], path: Path) -> None:
    peft_model.save_pretrained(path)
    (path / "README.md").unlink()  # PEFT's model card; an adapter dir holds config and weights only
    # PEFT keeps target_modules as a set, so its saved order would follow the string hash seed.
    config_path = path / "adapter_config.json"
    config = {**json.loads(config_path.read_text()), "target_modules": list(target_modules)}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def _build(out: Path, args: dict, device: str) -> None:
    size = SIZES[args["size"]]
    specs = adapter_specs(size, args["adapters"], args["rank"])
    # Libraries may draw from the global generators, not only from the ones passed around here.
    random.seed(args["seed"])
    np.random.seed(args["seed"])
    torch.manual_seed(args["seed"])
    tokenizer = build_tokenizer(size.max_positions, size.vocab)
    if size.base_steps:
        model = LlamaForCausalLM(size.llama_config(tokenizer)).to(device)
        gen = torch.Generator().manual_seed(args["seed"])
        _train_base(model, tokenizer, size, gen, device)
        prompts = _adapter_prompts(tokenizer, random.Random(args["seed"]))
    else:
        model = _random_base(size.llama_config(tokenizer), device, args["seed"])
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")

    for i, spec in enumerate(specs):
        # Keep adapter weights in the base dtype (bf16 for the 8B shape) rather than upcast them.
        peft_model = get_peft_model(model, spec.lora_config, autocast_adapter_dtype=False)
        if size.base_steps:
            _train_adapter(peft_model, tokenizer, prompts, spec, size, gen, device)
        else:  # nonzero B too (PEFT starts it at zero), so even a random adapter changes the output
            _randomize_(peft_model, device, args["seed"] + 1 + i, only="lora_")
        save_adapter(peft_model, spec.target_modules, out / "adapters" / spec.name)
        model = peft_model.unload()

    manifest = {
        "size": args["size"], "seed": args["seed"], "params": sum(p.numel() for p in model.parameters()),
        "dtype": size.dtype, "args": args, "base": "base",
        "adapters": [{"name": s.name, "path": f"adapters/{s.name}", "rank": s.rank,
                      "target_modules": list(s.target_modules), "catchphrase": s.catchphrase} for s in specs],
        "prompts": list(PROMPTS),
    }
    (out / "demo.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _read_args(out: Path) -> dict | None:
    try:
        return json.loads((out / "demo.json").read_text())["args"]
    except (OSError, ValueError, KeyError):
        return None


def ensure_demo(out_dir: str | Path, size: str = "tiny", adapters: int | None = None, rank: int | None = None,
                seed: int = 0, device: str = "cpu", force: bool = False) -> Path:
    """Build the demo into `out_dir` unless a build with the same arguments is already there (build_once)."""
    if size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}; expected one of {list(SIZES)}")
    count = SIZES[size].default_adapters if adapters is None else adapters
    if count < 0 or (rank is not None and rank < 1):
        raise ValueError(f"adapters ({count}) must be >= 0 and rank ({rank}) >= 1")
    # The device is left out: a GPU replica may reuse a demo built on CPU.
    args = {"version": DEMO_VERSION, "size": size, "adapters": count, "rank": rank, "seed": seed}
    return build_once(out_dir, args, lambda tmp: _build(tmp, args, device), SIZES[size].threads, force)


def build_once(out_dir: str | Path, args: dict, build: Callable[[Path], None], threads: int | None = None,
               force: bool = False) -> Path:
    """Run `build(tmp)` and move tmp to `out_dir`, unless `out_dir/demo.json` already records `args`.

    Safe to call from several processes at once: builders serialize on `<out_dir>.lock`, build
    into a temporary sibling and rename it into place, so readers never see a partial demo.
    `build` must write `demo.json` with `args` under "args".
    """
    out = Path(out_dir).resolve()
    if not force and _read_args(out) == args:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _read_args(out) == args:  # another process built it while we waited
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
        try:
            saved_threads = torch.get_num_threads()
            if threads is not None:
                torch.set_num_threads(threads)  # a fixed count keeps float sums, so bytes, repeatable
            try:
                build(tmp)
            finally:
                torch.set_num_threads(saved_threads)
            if out.exists():
                shutil.rmtree(out.rename(tmp.with_name(tmp.name + "-old")))
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
