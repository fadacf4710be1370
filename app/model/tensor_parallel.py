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

After `shard_model`, the model's config holds the rank's local head counts and MLP width, so the model's own code
and `target_shapes(config)` see the local shapes; `ShardPlan` keeps the global ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from transformers import PretrainedConfig

from app.model.architectures import Architecture, Dims, UnsupportedModel, head_dim


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


class RowParallelLinear(nn.Linear):
    """A row-parallel projection: the rank's input columns of the weight. Its partial output is summed over the
    ranks, then the bias (which every rank holds whole) is added once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel):
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = tp

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's partial output, plus the bias."""
        if self.tp.size > 1:
            dist.all_reduce(partial, group=self.tp.group)
        return partial if self.bias is None else partial + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(nn.functional.linear(x, self.weight))


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


def _localize(model: nn.Module, arch: Architecture, config: PretrainedConfig, plan: ShardPlan) -> None:
    """The config and attention modules with the rank's head counts and MLP width (the head size stays)."""
    config.head_dim = head_dim(config)
    config.num_attention_heads = plan.local_heads
    config.num_key_value_heads = plan.local_kv_heads
    config.intermediate_size = plan.local_inter
    for layer in model.get_submodule(arch.layers):
        attention = layer.self_attn
        attention.num_key_value_groups = plan.local_heads // plan.local_kv_heads
        for name, value in (("num_heads", plan.local_heads), ("num_key_value_heads", plan.local_kv_heads)):
            if hasattr(attention, name):
                setattr(attention, name, value)
