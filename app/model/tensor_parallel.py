"""Tensor parallelism within a replica, as Megatron-LM lays it out: each of `size` workers (ranks) holds a shard of
every decoder layer's projections and computes its share of each layer, and one all-reduce after each row-parallel
projection sums the shares.

- **Column-parallel** (q, k, v, gate, up; Phi-3's fused qkv_proj and gate_up_proj, split part by part): a rank holds
  the output rows of its attention heads, key/value heads or MLP columns, and their biases. Its output is its part of
  the activation, which the next projection reads as it is.
- **Row-parallel** (o, down): a rank holds the input columns that match its heads or MLP columns. Each rank's GEMM
  gives a partial sum of the full output; `RowParallelLinear` all-reduces it and adds the bias once.
- **Key/value heads** are split when there are at least as many as ranks, and replicated otherwise: with 8 KV
  heads and 16 ranks, ranks 2k and 2k+1 both hold KV head k, as the query heads they serve need.
- **Embeddings, norms and lm_head are replicated.** Every rank computes the full logits, so sampling needs no
  gather, at the cost of their memory on every GPU (2.1 GB each in bf16 at Llama-3-70B's 128,256 × 8,192).

Adapters follow their linears (`shard_adapter`): a column-parallel target keeps A whole and its rank's rows of B;
a row-parallel target keeps its rank's columns of A and B whole. A row-parallel target's LoRA adds
`(x_r @ A_rᵀ) @ Bᵀ` to the rank's partial sum before the all-reduce: the shrink is linear in x, so the sum over
ranks is `(x @ Aᵀ) @ Bᵀ` and the base projection's one all-reduce carries both (no second collective for the
rank-r shrink result).

`load_shard` builds the rank's model at its local sizes and reads only its shard of each projection from the
checkpoint's safetensors files (`safe_open(...).get_slice`), so no worker ever holds the whole base;
`shard_model` shards a model already loaded whole. Either way the model's config then holds the rank's head counts
and MLP width, so the model's own code and `target_shapes(config)` see the local shapes; `ShardPlan` keeps the
global ones.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from app.model.architectures import Architecture, Dims, UnsupportedModel, head_dim
from app.model.fp8 import FP8, Fp8Linear, Fp8Weight, fp8_linear
from app.model.fp8_checkpoint import dense_config, fp8_scheme, tensor_files

try:
    from transformers.initialization import no_init_weights
except ImportError:  # transformers releases before the module moved
    from transformers.modeling_utils import no_init_weights


@dataclass(frozen=True)
class TensorParallel:
    """This worker's place in its replica: rank of size, and the process group the all-reduces run over (None:
    torch.distributed's default group)."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = field(default=None, compare=False)


def check_tensor_parallel(config: PretrainedConfig, size: int) -> None:
    """Refuses, naming tensor_parallel_size and the numbers, a size that cannot shard this model exactly."""
    if size < 1:
        raise UnsupportedModel(f"tensor_parallel_size must be at least 1, got {size}")
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    problems = []
    if heads % size:
        problems.append(f"the {heads} attention heads")
    if kv_heads % size and size % kv_heads:
        problems.append(f"the {kv_heads} key/value heads (nor is it a multiple of them)")
    if inter % size:
        problems.append(f"the MLP's intermediate_size {inter}")
    if problems:
        raise UnsupportedModel(f"tensor_parallel_size {size} does not divide {' or '.join(problems)}")


@dataclass(frozen=True)
class Split:
    """How one projection is sharded: `kind` "column" (output rows) or "row" (input columns), and the global
    indices of the rows or columns this rank holds."""

    kind: str
    index: torch.Tensor  # [local] int64


class ShardPlan:
    """Every sharded projection of the model (module path -> Split) for one rank, and the global config's shapes."""

    def __init__(self, arch: Architecture, config: PretrainedConfig, tp: TensorParallel):
        check_tensor_parallel(config, tp.size)
        self.tp = tp
        self.global_dims = Dims.of(config)
        self.global_shapes = arch.target_shapes(config)
        dims, d = self.global_dims, head_dim(config)
        kv_heads = config.num_key_value_heads
        if kv_heads >= tp.size:
            kv_range = _share(dims.kv, tp)
        else:  # replicated: rank r serves the query heads of KV head r // (size / kv_heads)
            kv_head = tp.rank // (tp.size // kv_heads)
            kv_range = torch.arange(kv_head * d, (kv_head + 1) * d)
        part_index = {"q": _share(dims.q, tp), "kv": kv_range, "inter": _share(dims.inter, tp)}
        part_width = {"q": dims.q, "kv": dims.kv, "inter": dims.inter}
        self.splits: dict[str, Split] = {}
        for layer in range(config.num_hidden_layers):
            for target in arch.targets:
                pieces, offset = [], 0
                for part in target.parts:  # a fused projection's parts, each sharded on its own
                    pieces.append(part_index[part] + offset)
                    offset += part_width[part]
                self.splits[arch.module_path(layer, target)] = Split(target.split, torch.cat(pieces))
        self.local_heads = config.num_attention_heads // tp.size
        self.local_kv_heads = max(1, kv_heads // tp.size)
        self.local_inter = dims.inter // tp.size

    def local_shape(self, module: str) -> tuple[int, int]:
        (n_in, n_out), split = self.global_shapes[module], self.splits[module]
        return (n_in, len(split.index)) if split.kind == "column" else (len(split.index), n_out)

    def shard_adapter(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's A [r, in] and B [out, r] for `module`, as this rank holds them."""
        split = self.splits[module]
        if split.kind == "column":
            return a, b.index_select(0, split.index)
        return a.index_select(1, split.index), b


def _share(width: int, tp: TensorParallel) -> torch.Tensor:
    """Rank tp.rank's contiguous share of `width` indices (width divides by tp.size)."""
    n = width // tp.size
    return torch.arange(tp.rank * n, (tp.rank + 1) * n)


class RowParallel:
    """What row-parallel projections share: the rank's input columns of the weight; the partial output is summed
    over the ranks, then the bias (which every rank holds whole) is added once."""

    tp: TensorParallel
    bias: torch.Tensor | None

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's partial output, plus the bias."""
        if self.tp.size > 1:
            dist.all_reduce(partial, group=self.tp.group)
        return partial if self.bias is None else partial + self.bias


class RowParallelLinear(RowParallel, nn.Linear):
    """A row-parallel projection in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel):
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = tp

    @torch.compiler.disable  # the all-reduce runs as it is, outside the model runner's torch.compile
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(nn.functional.linear(x, self.weight))

    def to_fp8(self) -> RowParallelFp8Linear:
        """This projection with its weight in FP8, one scale per output channel over the rank's input columns (so
        a rank's scales may differ from another's, and from the unsharded weight's)."""
        return RowParallelFp8Linear(Fp8Weight.quantize(self.weight), self.bias, self.tp)


class RowParallelFp8Linear(RowParallel, Fp8Linear):
    """A row-parallel projection with its weight in FP8 (`quantization: fp8`): each rank quantizes its share of the
    input per token, so a token's activation scales differ between ranks (the unsharded layer has one per token;
    agreeing on it would take one more collective per projection)."""

    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None, tp: TensorParallel):
        super().__init__(weight, bias)
        self.tp = tp

    @torch.compiler.disable  # as RowParallelLinear's
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(fp8_linear(x, self.fp8))


def shard_model(model: nn.Module, arch: Architecture, tp: TensorParallel) -> ShardPlan:
    """Shard a model that holds the full weights, in place, for rank tp.rank; returns its plan."""
    config = model.config
    plan = ShardPlan(arch, config, tp)
    with torch.no_grad():
        for path, split in plan.splits.items():
            linear = model.get_submodule(path)
            if type(linear) is not nn.Linear:
                raise UnsupportedModel(f"{path} is {type(linear).__name__}, not torch.nn.Linear: it cannot be "
                                       "sharded for tensor parallelism")
            index = split.index.to(linear.weight.device)
            if split.kind == "column":
                sharded = nn.Linear(linear.in_features, len(index), bias=linear.bias is not None, device="meta")
                sharded.weight = nn.Parameter(linear.weight.index_select(0, index), requires_grad=False)
                if linear.bias is not None:
                    sharded.bias = nn.Parameter(linear.bias.index_select(0, index), requires_grad=False)
            else:
                sharded = RowParallelLinear(linear.weight.index_select(1, index).contiguous(), linear.bias, tp)
            model.set_submodule(path, sharded)
    _localize(model, arch, config, plan)
    return plan


def load_shard(folder: Path, config: PretrainedConfig, arch: Architecture, tp: TensorParallel,
               dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, ShardPlan]:
    """The model of rank tp.rank, built at its local sizes on `device`, with only its shard of each projection read
    from the checkpoint in `folder`; an FP8 checkpoint's projections as they are published (their FP8 weights and
    scales, never dequantized)."""
    scheme, _ = fp8_scheme(config)
    plan = ShardPlan(arch, config, tp)
    local = local_config(config if scheme is None else dense_config(config), plan)
    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(local, dtype=dtype)
    fp8_paths = {path for path in arch.target_shapes(config) if scheme is not None and scheme.quantized(path)}
    files = tensor_files(Path(folder))
    tied = {"lm_head.weight"} if getattr(local, "tie_word_embeddings", False) else set()
    with contextlib.ExitStack() as stack, torch.no_grad():
        opened = {file: stack.enter_context(safe_open(file, "pt")) for file in set(files.values())}

        def tensor_slice(name: str):
            if name not in files:
                raise ValueError(f"the checkpoint in {folder} has no tensor {name}")
            return opened[files[name]].get_slice(name)

        for name, tensor in model.state_dict().items():
            module, _, leaf = name.rpartition(".")
            if name in tied or (module in fp8_paths and leaf == "weight"):
                continue
            tensor.copy_(_read_shard(tensor_slice(name), plan.splits.get(module), leaf))
        use_row_parallel(model, plan)
        for path in fp8_paths:
            _use_fp8_shard(model, path, plan, tensor_slice(f"{path}.weight"), tensor_slice(f"{path}.weight_scale"))
    if tied:
        model.tie_weights()
    return model.eval(), plan


def _use_fp8_shard(model: nn.Module, path: str, plan: ShardPlan, weight_slice, scale_slice) -> None:
    """The projection at `path` as its shard of an FP8 checkpoint's weight: a column-parallel rank's rows and their
    scales, a row-parallel rank's columns and every row's scale (a scale per tensor serves every row)."""
    split, dense = plan.splits[path], model.get_submodule(path)
    q = _read_shard(weight_slice, split, "weight")
    if q.dtype != FP8 or q.shape != dense.weight.shape:
        raise ValueError(f"{path}.weight's shard is {q.dtype} {list(q.shape)}; float8_e4m3fn "
                         f"{list(dense.weight.shape)} was expected")
    scale = scale_slice[:].float().flatten()
    rows = plan.global_shapes[path][1]
    if scale.numel() not in (1, rows):
        raise ValueError(f"{path}.weight_scale has {scale.numel()} values; 1 or {rows} were expected")
    scale = scale.expand(rows)
    if split.kind == "column":
        scale = scale[split.index]
    weight = Fp8Weight(q.to(dense.weight.device), scale.contiguous().to(dense.weight.device))
    model.set_submodule(path, RowParallelFp8Linear(weight, dense.bias, plan.tp) if split.kind == "row"
                        else Fp8Linear(weight, dense.bias))


def _read_shard(tensor_slice, split: Split | None, leaf: str) -> torch.Tensor:
    """The rows (column-parallel, and their biases) or columns (row-parallel weights) of `split`, one read per
    contiguous run of indices; the whole tensor where the module is not sharded or for a row-parallel bias."""
    if split is None or (split.kind == "row" and leaf == "bias"):
        return tensor_slice[:]
    runs = _runs(split.index.tolist())
    if split.kind == "column":
        return torch.cat([tensor_slice[start:stop] for start, stop in runs])
    return torch.cat([tensor_slice[:, start:stop] for start, stop in runs], dim=1)


def _runs(index: list[int]) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive indices, in order."""
    runs = []
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def local_config(config: PretrainedConfig, plan: ShardPlan) -> PretrainedConfig:
    """A copy of the whole model's config with the rank's head counts and MLP width: a model built from it has the
    rank's shapes."""
    local = type(config).from_dict(config.to_dict())
    _localize_config(local, plan)
    return local


def use_row_parallel(model: nn.Module, plan: ShardPlan) -> None:
    """Each row-parallel projection of a model built at the rank's sizes becomes a RowParallelLinear over the same
    weight and bias."""
    for path, split in plan.splits.items():
        if split.kind == "row":
            linear = model.get_submodule(path)
            model.set_submodule(path, RowParallelLinear(linear.weight.detach(), None if linear.bias is None
                                                        else linear.bias.detach(), plan.tp))


def _localize_config(config: PretrainedConfig, plan: ShardPlan) -> None:
    config.head_dim = head_dim(config)
    config.num_attention_heads = plan.local_heads
    config.num_key_value_heads = plan.local_kv_heads
    config.intermediate_size = plan.local_inter


def _localize(model: nn.Module, arch: Architecture, config: PretrainedConfig, plan: ShardPlan) -> None:
    """The config and attention modules with the rank's head counts and MLP width (the head size stays)."""
    _localize_config(config, plan)
    for layer in model.get_submodule(arch.layers):
        attention = layer.self_attn
        attention.num_key_value_groups = plan.local_heads // plan.local_kv_heads
        for name, value in (("num_heads", plan.local_heads), ("num_key_value_heads", plan.local_kv_heads)):
            if hasattr(attention, name):
                setattr(attention, name, value)
