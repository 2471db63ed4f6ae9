"""Gradient clipping by global norm, across tensor, pipeline and data parallel ranks.

The global norm is the norm of the full model's gradient as one process would
see it. Each rank adds up the squares of the gradient elements it is
responsible for, and the sums are all-reduced:

* tensor parallel: a sharded param (``param.tp_partition`` set by the tp
  layers) contributes from every tp rank; a replicated one (norm weights,
  row-parallel biases) only from tp rank 0, so it is counted once (Megatron's
  "tensor-parallel duplicate" rule);
* pipeline parallel: every stage contributes its own layers;
* data parallel: the gradients are identical replicas after the all-reduce,
  so dp ranks do not add up; under ZeRO-1 each rank holds only its shard of
  the reduced gradient, so the shards add up over dp too;
* expert parallel: a mixture-of-experts expert weight (``param.expert_parallel``)
  holds different experts on each rank of the ``ep`` group, so its squares add
  up over ``ep`` first (over all of ``dp_cp`` under ZeRO-1, where the ``edp``
  replicas hold shards: ``ep`` x ``edp`` is the ``dp_cp`` block), then over tp
  and pp with the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from mtcore.parallel.layout import Axis

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


def is_tensor_parallel(param: Tensor) -> bool:
    """Whether ``param`` is a tensor-parallel shard (a different slice on each tp rank)."""
    return getattr(param, "tp_partition", None) is not None


def is_expert_parallel(param: Tensor) -> bool:
    """Whether ``param`` is a mixture-of-experts expert weight: each expert-parallel rank
    holds different experts, replicated over the expert-data-parallel group ``edp`` only."""
    return bool(getattr(param, "expert_parallel", False))


def is_pipeline_copy(param: Tensor) -> bool:
    """Whether ``param`` is another stage's parameter held again here (a tied output
    weight on the last stage): its gradient is counted once, on the owning stage."""
    return bool(getattr(param, "pipeline_copy", False))


def counts_for_norm(param: Tensor, tp_rank: int) -> bool:
    """Whether this rank adds ``param``'s gradient to the global norm."""
    return (tp_rank == 0 or is_tensor_parallel(param)) and not is_pipeline_copy(param)


@torch.no_grad()
def global_norm(
    grads: Iterable[Tensor],
    collective,
    groups: Sequence[object | None],
    norm_type: float = 2.0,
    device: torch.device | None = None,
    *,
    expert_grads: Iterable[Tensor] = (),
    expert_groups: Sequence[object | None] = (),
) -> Tensor:
    """The norm of the gradients of every rank of ``groups`` together (a float32 scalar).

    grads: the gradients this rank contributes (already filtered for duplicates).
    groups: process groups to reduce over; ``None`` entries (single process) are
    skipped. norm_type: 2.0 or ``inf``. device: where the result lives when
    this rank contributes nothing (default: the first gradient's device).
    expert_grads: gradients of expert-parallel params, reduced over
    ``expert_groups`` before they join ``grads`` for the reduction over ``groups``.
    """
    grads = [g for g in grads if g.numel()]
    expert_grads = [g for g in expert_grads if g.numel()]
    inf = math.isinf(norm_type)
    if not inf and norm_type != 2.0:
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type}")
    if device is None and (grads or expert_grads):
        device = (grads or expert_grads)[0].device
    op = "max" if inf else "sum"
    local = _local_norm(grads, inf, device)
    if expert_grads or any(_spans(collective, g) for g in expert_groups):
        experts = _local_norm(expert_grads, inf, device)
        _reduce(experts, collective, expert_groups, op)
        local = torch.maximum(local, experts) if inf else local + experts
    _reduce(local, collective, groups, op)
    return local if inf else local.sqrt()


def _local_norm(grads: list[Tensor], inf: bool, device) -> Tensor:
    """This rank's max |g| (inf) or sum of squares (2-norm)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    if inf:
        return torch.stack([g.detach().abs().max().float() for g in grads]).max()
    norms = torch.stack(
        [torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32) for g in grads]
    )
    return torch.linalg.vector_norm(norms, 2.0) ** 2


def _spans(collective, group) -> bool:
    return group is not None and collective.world_size(group) > 1


def _reduce(value: Tensor, collective, groups, op: str) -> None:
    for group in groups:
        if _spans(collective, group):
            collective.all_reduce(value, op=op, group=group)


@torch.no_grad()
def clip_by_total_norm_(grads: Iterable[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` when that is below 1."""
    coef = torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)
    if coef.item() < 1.0:
        for g in grads:
            g.mul_(coef.to(g.dtype))


def clip_grad_norm_(
    params: Iterable[Tensor],
    max_norm: float,
    layout,
    collective,
    *,
    grad_attr: str = "main_grad",
    sharded_over_dp: bool = False,
    norm_type: float = 2.0,
) -> float:
    """Clip the gradients of ``params`` (this rank's) by the global norm; return that norm.

    grad_attr: where a param keeps its gradient ("main_grad" under
    ``DataParallel``, "grad" for a plain module). sharded_over_dp: the
    gradients are this rank's ZeRO shards, so the norm sums over dp as well.
    ZeRO optimizers clip their own shards (``max_grad_norm``); this function is
    for gradients held whole on each rank.
    """
    pairs = [(p, getattr(p, grad_attr, None)) for p in params]
    pairs = [(p, g) for p, g in pairs if g is not None]
    counted = [(p, g) for p, g in pairs if counts_for_norm(p, layout.tp_rank)]
    dense = [g for p, g in counted if not is_expert_parallel(p)]
    experts = [g for p, g in counted if is_expert_parallel(p)]
    groups = [layout.dp_cp.group] if sharded_over_dp else []
    groups.append(layout.mp.group)
    expert_groups = [layout.group(Axis.EP)] if layout.ep > 1 and not sharded_over_dp else []
    total = global_norm(
        dense, collective, groups, norm_type, expert_grads=experts, expert_groups=expert_groups
    )
    clip_by_total_norm_([g for _, g in pairs], max_norm, total)
    return float(total.item())
