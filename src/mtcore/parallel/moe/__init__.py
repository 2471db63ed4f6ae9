"""Mixture of experts with expert parallelism (router, dispatchers, grouped experts).

See docs/moe.md. The layer: ``MoELayer(hidden, MoESpec(...), tp=..., layout=..., ...)``.
"""

from mtcore.parallel.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher
from mtcore.parallel.moe.dispatch_dedup import DedupAllToAllDispatcher
from mtcore.parallel.moe.experts import (
    GroupedExperts,
    full_expert_tensor,
    is_expert_parameter,
    mark_expert_parallel,
    named_expert_parameters,
)
from mtcore.parallel.moe.layer import DISPATCHERS, MoELayer, ep_group
from mtcore.parallel.moe.router import (
    capacity_keep_mask,
    load_balancing_loss,
    route,
    sequence_load_balancing_loss,
    update_bias,
    z_loss,
)
from mtcore.parallel.moe.spec import MoESpec, MoEStats, expert_capacity

__all__ = [
    "DISPATCHERS",
    "AllGatherDispatcher",
    "AllToAllDispatcher",
    "DedupAllToAllDispatcher",
    "GroupedExperts",
    "MoELayer",
    "MoESpec",
    "MoEStats",
    "capacity_keep_mask",
    "ep_group",
    "expert_capacity",
    "full_expert_tensor",
    "is_expert_parameter",
    "load_balancing_loss",
    "mark_expert_parallel",
    "named_expert_parameters",
    "route",
    "sequence_load_balancing_loss",
    "update_bias",
    "z_loss",
]
