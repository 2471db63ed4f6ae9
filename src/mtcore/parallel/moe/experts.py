"""The routed experts of one rank: grouped matmuls over rows sorted by expert.

Weights are stored for the grouped-matmul op (``x [T, k] @ w[e] [k, n]``):

* ``fc1`` ``[E_local, hidden, n1 / tp]`` with ``n1 = 2 * ffn`` (SwiGLU: gate |
  up, each section split over tp, ``TPPartition(2, (ffn, ffn))``) or ``ffn``
  (GELU, ``TPPartition(2, (ffn,))``);
* ``fc2`` ``[E_local, ffn / tp, hidden]``, ``TPPartition(1, (ffn,))``.

So each tp rank computes a partial sum of every expert's output (expert-tensor
parallel, like a column- then row-parallel MLP); the layer reduces over tp.
Both carry ``expert_parallel = True`` and ``expert_partition = (0, E)``: dim 0
is this rank's ``E / ep`` consecutive experts of ``E``.

Initialisation draws the full ``[E, ...]`` tensors on the host from the given
generator (fc1 then fc2) and keeps this rank's experts and tp shard, so every
ep x tp layout holds pieces of the same numbers as one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.parallel.tensor.mappings import TPGroup
from mtcore.parallel.tensor.sharding import (
    TPPartition,
    full_tensor,
    set_tp_partition,
    shard_tensor,
)

_EXPERT_PARAMS = "_expert_params"  # on the owning module: {param name: (dim, num_experts)}


def mark_expert_parallel(module: nn.Module, name: str, num_experts: int, dim: int = 0) -> None:
    """Record that ``module.<name>`` holds this rank's experts along ``dim`` (of ``num_experts``).

    Kept on the module (survives Parameter replacement) and as Parameter attributes.
    """
    module.__dict__.setdefault(_EXPERT_PARAMS, {})[name] = (dim, num_experts)
    param = getattr(module, name)
    param.expert_parallel = True
    param.expert_partition = (dim, num_experts)


def named_expert_parameters(model: nn.Module):
    """``(name, param, (dim, num_experts))`` for every expert-parallel parameter of ``model``."""
    for prefix, module in model.named_modules():
        for name, part in module.__dict__.get(_EXPERT_PARAMS, {}).items():
            yield f"{prefix}.{name}" if prefix else name, getattr(module, name), part


def full_expert_tensor(value: Tensor, tp: TPGroup, ep: TPGroup, partition=None) -> Tensor:
    """All ``E`` experts of an expert parameter (or grad), unsharded over tp, on every rank.

    A collective over tp and over the ep group (``mtcore.parallel.moe.ep_group``);
    ``partition`` is the parameter's ``tp_partition``.
    """
    full = full_tensor(value, tp, partition)
    if ep.size == 1:
        return full
    return ep.all_gather(full, 0)


def is_expert_parameter(param: Tensor) -> bool:
    """True for a parameter flagged by ``mark_expert_parallel`` (attribute form)."""
    return bool(getattr(param, "expert_parallel", False))


class GroupedExperts(nn.Module):
    """``E / ep`` experts of one rank, each an MLP with a ``1 / tp`` shard of its hidden units."""

    def __init__(
        self,
        hidden_size: int,
        ffn_size: int,
        num_experts: int,
        *,
        activation: str,
        tp: TPGroup,
        ep_size: int,
        ep_rank: int,
        backend,
        generator: torch.Generator,
        init_std: float,
        out_std: float,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.kernels, self.swiglu = backend.kernels, activation == "swiglu"
        self.num_experts, self.local = num_experts, num_experts // ep_size
        sections = (ffn_size, ffn_size) if self.swiglu else (ffn_size,)
        first = ep_rank * self.local
        shapes = {
            "fc1": ((num_experts, hidden_size, sum(sections)), TPPartition(2, sections), init_std),
            "fc2": ((num_experts, ffn_size, hidden_size), TPPartition(1, (ffn_size,)), out_std),
        }
        for name, (shape, partition, std) in shapes.items():
            full = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            mine = full[first : first + self.local]
            if tp.size > 1:
                mine = shard_tensor(mine, partition, tp.rank, tp.size)
            value = mine.to(device=device, dtype=dtype or torch.float32).contiguous()
            setattr(self, name, nn.Parameter(value))
            set_tp_partition(self, name, partition)
            mark_expert_parallel(self, name, num_experts)

    def forward(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """``x [M, h]`` sorted by local expert, counts ``[E_local]`` -> ``[M, h]`` (tp-partial)."""
        h = self.kernels.grouped_mm(x, self.fc1, tokens_per_expert)
        h = self.kernels.swiglu(h) if self.swiglu else F.gelu(h, approximate="tanh")
        return self.kernels.grouped_mm(h, self.fc2, tokens_per_expert)

    def extra_repr(self) -> str:
        return f"experts={self.local}/{self.num_experts}, fc1={list(self.fc1.shape)}"
