"""How a tensor-parallel parameter maps to its full tensor, and back.

Every sharded parameter has a ``TPPartition``: the dim it is split along and
the *sections* of the full tensor along that dim. A fused weight such as QKV (sections q, k, v) or the SwiGLU ``fc1``
(sections gate, up) is not one contiguous slice per rank: rank ``r`` holds the
``r``-th chunk of *each* section, concatenated, so its local ``[q_r | k_r |
v_r]`` splits like the full ``[q | k | v]``. With one section this is the usual
contiguous slice.

Replicated parameters whose gradient is only a partial sum under sequence
parallelism (norm weights and biases applied to sequence shards) are flagged
with ``mark_sequence_parallel``; ``allreduce_sequence_parallel_grads`` sums
their grads over tp after backward.

Both facts are recorded twice:

* on the module that owns the parameter, by parameter name: the record that
  ``named_tp_parameters`` (and so ``full_tensors``, ``load_full_tensors``,
  ``allreduce_sequence_parallel_grads``) reads. It survives ``copy.deepcopy``,
  ``load_state_dict(assign=True)`` and ``to_empty``, which make new Parameter
  objects without the old tensor's attributes;
* as attributes of the Parameter, ``param.tp_partition`` (a ``TPPartition``)
  and ``param.sequence_parallel = True``, for code that only sees a list of
  parameters (gradient clipping, the data-parallel grad buffers, optimizers).
  Megatron uses such attributes alone; they are lost when the Parameter
  object is replaced.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mtcore.parallel.tensor.mappings import TPGroup


@dataclass(frozen=True)
class TPPartition:
    """dim: the split dim; sections: sizes of the full tensor's sections along it."""

    dim: int
    sections: tuple[int, ...]

    def check(self, tp_size: int) -> None:
        for size in self.sections:
            if size % tp_size:
                raise ValueError(
                    f"section of size {size} (of {self.sections}) is not divisible by tp={tp_size}"
                )


_PARTITIONS = "_tp_partitions"  # on the owning module: {param name: TPPartition}
_SP_PARAMS = "_sequence_parallel_params"  # on the owning module: {param name}


def set_tp_partition(module: nn.Module, name: str, partition: TPPartition) -> None:
    """Record that ``module.<name>`` is this rank's shard along ``partition``."""
    module.__dict__.setdefault(_PARTITIONS, {})[name] = partition
    getattr(module, name).tp_partition = partition


def mark_sequence_parallel(module: nn.Module, name: str) -> None:
    """Flag replicated ``module.<name>`` as seeing only a sequence shard under SP."""
    module.__dict__.setdefault(_SP_PARAMS, set()).add(name)
    getattr(module, name).sequence_parallel = True


def named_tp_parameters(
    model: nn.Module,
) -> Iterator[tuple[str, nn.Parameter, TPPartition | None, bool]]:
    """``(name, param, partition or None, sequence_parallel)`` for every parameter,
    named and ordered as ``model.named_parameters()``."""
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        partitions = module.__dict__.get(_PARTITIONS, {})
        sp = module.__dict__.get(_SP_PARAMS, set())
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            partition = partitions.get(name) or getattr(param, "tp_partition", None)
            flagged = name in sp or getattr(param, "sequence_parallel", False)
            yield f"{prefix}.{name}" if prefix else name, param, partition, flagged


def shard_tensor(full: Tensor, partition: TPPartition, rank: int, size: int) -> Tensor:
    """This rank's shard of ``full`` (a copy)."""
    partition.check(size)
    sections = full.split(list(partition.sections), partition.dim)
    return torch.cat([s.chunk(size, partition.dim)[rank] for s in sections], partition.dim).clone()


def unshard_tensor(shards: Sequence[Tensor], partition: TPPartition) -> Tensor:
    """The full tensor from every rank's shard, in tp-rank order."""
    size = len(shards)
    local = [s // size for s in partition.sections]
    per_rank = [shard.split(local, partition.dim) for shard in shards]
    return torch.cat(
        [torch.cat([pieces[i] for pieces in per_rank], partition.dim) for i in range(len(local))],
        partition.dim,
    )


def full_tensor(value: Tensor, tp: TPGroup, partition: TPPartition | None) -> Tensor:
    """The unsharded ``value`` (a parameter or its grad), on every rank; a tp collective."""
    if partition is None or tp.size == 1:
        return value.detach().clone()
    stacked = tp.all_gather(value.detach().unsqueeze(0), 0)  # [tp, *shard]
    return unshard_tensor(list(stacked), partition)


def full_tensors(module: nn.Module, tp: TPGroup, grads: bool = False) -> dict[str, Tensor | None]:
    """Every parameter (or its grad) unsharded, keyed by name; call on every tp rank.

    With ``grads``, a parameter without a grad maps to None.
    """
    out: dict[str, Tensor | None] = {}
    for name, p, partition, _ in named_tp_parameters(module):
        value = p.grad if grads else p
        out[name] = None if value is None else full_tensor(value, tp, partition)
    return out


@torch.no_grad()
def load_full_tensors(module: nn.Module, full: dict[str, Tensor], tp: TPGroup) -> None:
    """Copy this rank's shard of each full tensor into ``module`` (checkpoint resharding)."""
    for name, p, partition, _ in named_tp_parameters(module):
        value = full[name]
        if partition is not None and tp.size > 1:
            value = shard_tensor(value, partition, tp.rank, tp.size)
        if value.shape != p.shape:
            raise ValueError(
                f"{name}: shard {list(value.shape)} does not fit parameter {list(p.shape)}"
            )
        p.copy_(value)


def allreduce_sequence_parallel_grads(module: nn.Module, tp: TPGroup) -> None:
    """Sum over tp the grads of parameters flagged ``sequence_parallel``.

    Call once after the backward of the last micro-batch, before the optimizer
    (a per-accumulation hook would sum already-summed grads again). Under
    sequence parallelism a norm weight or a bias applied to ``[b, s / tp, h]``
    gets the gradient of this rank's positions only; the sum makes it the
    full-sequence gradient, equal on every tp rank. One coalesced all-reduce.
    """
    if tp.size == 1:
        return
    grads = [p.grad for _, p, _, sp in named_tp_parameters(module) if sp and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    tp.collective.all_reduce(flat, group=tp.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
