"""The model architectures the engine serves, one declaration each, and the start-up check that refuses the rest.

The engine keeps transformers' model code and swaps in two things: attention (app/model/attention.py) and the
linears adapters target (app/model/lora.py). A declaration therefore says where those linears sit and their
shapes, which of them read the same input (run as one GEMM), and the features the engine itself must compute
for the family: sliding windows and score soft-capping in the paged attention, final-logit soft-capping after
lm_head. What stays in transformers' modules (q/k/v biases, q/k norms, Gemma's `1 + weight` norms and scaled
embeddings, RoPE) is declared too, and tests check that the built model has it.

`check_supported(config)` refuses at start-up, by name, a model_type not declared here and any feature of a
declared one the engine does not compute exactly: serving a model approximately is worse than refusing it.
Adding an architecture is one declaration below plus its fidelity case in tests/app/engine/test_architectures.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig

from app.model.fp8_checkpoint import fp8_scheme


class UnsupportedModel(ValueError):
    """The base model cannot be served exactly; raised at start-up."""


@dataclass(frozen=True)
class Dims:
    """A config's widths, the terms target shapes are written in."""

    hidden: int
    q: int  # attention heads * head_dim
    kv: int  # key/value heads * head_dim
    inter: int  # MLP intermediate size

    @classmethod
    def of(cls, config: PretrainedConfig) -> Dims:
        d = head_dim(config)
        return cls(config.hidden_size, config.num_attention_heads * d, config.num_key_value_heads * d,
                   config.intermediate_size)


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Target:
    """A linear of every decoder layer that adapters may target, named as PEFT's target_modules names it."""

    name: str
    block: str  # its parent in the decoder layer
    shape: Callable[[Dims], tuple[int, int]]  # (in_features, out_features)
    # Tensor parallelism (app/model/tensor_parallel.py): "column" shards the output, "row" the input; parts: the
    # sharded dimension's pieces ("q": query heads, "kv": key/value heads, "inter": MLP columns), each sharded alone.
    split: str = "column"
    parts: tuple[str, ...] = ()


def every_layer(config: PretrainedConfig) -> list[int | None]:
    """Every layer attends within config.sliding_window (Mistral, Phi-3 pass it to every layer)."""
    return [config.sliding_window] * config.num_hidden_layers


def by_layer_type(config: PretrainedConfig) -> list[int | None]:
    """Layers typed "sliding_attention" in config.layer_types attend within config.sliding_window."""
    return [config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types]


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]
    targets: tuple[Target, ...]
    fused: tuple[tuple[str, ...], ...] = ()  # targets that read the same input, in call order: one GEMM each
    layers: str = "model.layers"  # the decoder layers' path; each holds `self_attn`
    # Computed by the engine:
    layer_windows: Callable[[PretrainedConfig], list[int | None]] | None = None  # None: no sliding windows
    attn_softcap: bool = False  # scores capped by tanh at config.attn_logit_softcapping
    final_softcap: bool = False  # logits capped by tanh at config.final_logit_softcapping
    # Computed by transformers' modules, which the engine keeps:
    qkv_bias: bool | None = False  # None: as config.attention_bias says
    qk_norm: bool = False  # RMSNorm of each head's q and k before RoPE
    norm: str = "x*w"  # RMSNorm convention: "x*w", or Gemma's "x*(1+w)" (app/model/norms.py fuses only x*w)
    scaled_embeddings: bool = False  # embeddings times sqrt(hidden_size)

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(target.name for target in self.targets)

    def module_path(self, layer: int, target: Target) -> str:
        return f"{self.layers}.{layer}.{target.block}.{target.name}"

    def target_shapes(self, config: PretrainedConfig) -> dict[str, tuple[int, int]]:
        """module path (as PEFT names it after its prefix) -> (in_features, out_features), every layer's targets."""
        dims = Dims.of(config)
        return {self.module_path(layer, target): target.shape(dims)
                for layer in range(config.num_hidden_layers) for target in self.targets}

    def windows(self, config: PretrainedConfig) -> list[int | None]:
        """Each layer's sliding window (None: full causal attention)."""
        if self.layer_windows is None:
            return [None] * config.num_hidden_layers
        return self.layer_windows(config)

    def attention_softcap(self, config: PretrainedConfig) -> float | None:
        return config.attn_logit_softcapping if self.attn_softcap else None

    def logit_softcap(self, config: PretrainedConfig) -> float | None:
        return config.final_logit_softcapping if self.final_softcap else None


Q_K_V_O = (
    Target("q_proj", "self_attn", lambda d: (d.hidden, d.q), "column", ("q",)),
    Target("k_proj", "self_attn", lambda d: (d.hidden, d.kv), "column", ("kv",)),
    Target("v_proj", "self_attn", lambda d: (d.hidden, d.kv), "column", ("kv",)),
    Target("o_proj", "self_attn", lambda d: (d.q, d.hidden), "row", ("q",)),
)
GATE_UP_DOWN = (
    Target("gate_proj", "mlp", lambda d: (d.hidden, d.inter), "column", ("inter",)),
    Target("up_proj", "mlp", lambda d: (d.hidden, d.inter), "column", ("inter",)),
    Target("down_proj", "mlp", lambda d: (d.inter, d.hidden), "row", ("inter",)),
)
QKV_AND_GATE_UP = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

LLAMA = Architecture("Llama", ("llama",), Q_K_V_O + GATE_UP_DOWN, QKV_AND_GATE_UP, qkv_bias=None)
ARCHITECTURES = (
    LLAMA,
    Architecture("Mistral", ("mistral",), Q_K_V_O + GATE_UP_DOWN, QKV_AND_GATE_UP, layer_windows=every_layer),
    Architecture("Qwen2", ("qwen2",), Q_K_V_O + GATE_UP_DOWN, QKV_AND_GATE_UP, layer_windows=by_layer_type,
                 qkv_bias=True),
    Architecture("Qwen3", ("qwen3",), Q_K_V_O + GATE_UP_DOWN, QKV_AND_GATE_UP, layer_windows=by_layer_type,
                 qkv_bias=None, qk_norm=True),
    Architecture("Gemma", ("gemma",), Q_K_V_O + GATE_UP_DOWN, QKV_AND_GATE_UP, qkv_bias=None, norm="x*(1+w)",
                 scaled_embeddings=True),
    Architecture("Gemma 2", ("gemma2",), Q_K_V_O + GATE_UP_DOWN, QKV_AND_GATE_UP, layer_windows=by_layer_type,
                 attn_softcap=True, final_softcap=True, qkv_bias=None, norm="x*(1+w)", scaled_embeddings=True),
    # transformers' Gemma 3 caps logits but never attention scores, so a config that sets attn_logit_softcapping
    # is refused: whether its checkpoint was trained with the cap is unknown.
    Architecture("Gemma 3", ("gemma3_text",), Q_K_V_O + GATE_UP_DOWN, QKV_AND_GATE_UP,
                 layer_windows=by_layer_type, final_softcap=True, qkv_bias=None, qk_norm=True, norm="x*(1+w)",
                 scaled_embeddings=True),
    # Phi-3's projections come fused in the checkpoint, and PEFT puts one LoRA on each fused linear.
    Architecture("Phi-3", ("phi3",), (
        Target("qkv_proj", "self_attn", lambda d: (d.hidden, d.q + 2 * d.kv), "column", ("q", "kv", "kv")),
        Target("o_proj", "self_attn", lambda d: (d.q, d.hidden), "row", ("q",)),
        Target("gate_up_proj", "mlp", lambda d: (d.hidden, 2 * d.inter), "column", ("inter", "inter")),
        Target("down_proj", "mlp", lambda d: (d.inter, d.hidden), "row", ("inter",)),
    ), layer_windows=every_layer),
)
MODEL_TYPE_TO_ARCHITECTURE = {model_type: arch for arch in ARCHITECTURES for model_type in arch.model_types}

_MOE = "a mixture-of-experts MLP, whose routed experts the LoRA kernels do not compute"
REFUSED_MODEL_TYPES = {
    "mixtral": _MOE,
    "qwen2_moe": _MOE,
    "qwen3_moe": _MOE,
    "gemma3": "Gemma 3 with its vision tower (Gemma3ForConditionalGeneration); the text-only model_type "
              "'gemma3_text' is served",
}
# RoPE whose frequencies follow the longest position in the forward: in a batch of sequences they would
# follow the batch, not each sequence as in transformers' own generate.
_BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_supported(config: PretrainedConfig) -> Architecture:
    """The declaration that serves `config` exactly, or UnsupportedModel naming the model_type and why."""
    model_type = getattr(config, "model_type", None)
    arch = MODEL_TYPE_TO_ARCHITECTURE.get(model_type)
    if arch is None:
        why = REFUSED_MODEL_TYPES.get(model_type, "no architecture is declared for it")
        raise UnsupportedModel(f"model_type {model_type!r} is not served: {why}. {_served()}")
    problems = _unsupported_features(arch, config)
    if problems:
        raise UnsupportedModel(f"model_type {model_type!r} ({arch.name}) is not served with this config: "
                               f"{'; '.join(problems)}. {_served()}")
    return arch


def _served() -> str:
    return f"Served model types: {', '.join(sorted(MODEL_TYPE_TO_ARCHITECTURE))}"


def _unsupported_features(arch: Architecture, config: PretrainedConfig) -> list[str]:
    problems = []
    _, refused = fp8_scheme(config)
    if refused:
        problems.append(refused)
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("bidirectional attention (use_bidirectional_attention); the engine attends causally")
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted(set(layer_types) - set(_LAYER_TYPES))
    if other:
        problems.append(f"attention layer types {other} (layer_types); served: {list(_LAYER_TYPES)}")
    window = getattr(config, "sliding_window", None)
    if arch.layer_windows is None and (window is not None or "sliding_attention" in layer_types):
        problems.append(f"a sliding window (sliding_window={window}), which {arch.name} is not declared to use")
    elif window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        problems.append(f"sliding_window={window!r}; a positive number of tokens is served")
    for field, implemented in (("attn_logit_softcapping", arch.attn_softcap),
                               ("final_logit_softcapping", arch.final_softcap)):
        cap = getattr(config, field, None)
        if cap is not None and not implemented:
            problems.append(f"soft-capping ({field}={cap}), which {arch.name} is not declared to use")
        elif cap is not None and not cap > 0:
            problems.append(f"{field}={cap!r}; a positive cap is served")
    dynamic = sorted(_rope_types(config) & set(_BATCH_DEPENDENT_ROPE))
    if dynamic:
        problems.append(f"RoPE type {dynamic[0]!r}, whose frequencies depend on the longest sequence of a batch")
    return problems


def _rope_types(config: PretrainedConfig) -> set[str]:
    params = getattr(config, "rope_parameters", None) or {}
    per_layer_type = [value for value in params.values() if isinstance(value, dict)]
    return {str(p.get("rope_type", "default")) for p in per_layer_type or [params]}
