"""Mixture of experts with expert parallelism (router, dispatchers, grouped experts).

See docs/moe.md. The layer: ``MoELayer(hidden, MoESpec(...), tp=..., layout=..., ...)``.
"""

from mtcore import lazy_exports
from mtcore.parallel.moe.spec import MoESpec, expert_capacity

# The settings load with the package (a model config holds them without torch); the
# layer, router, dispatchers and experts on first use.
_WITH_TORCH = {
    "AllGatherDispatcher": ".dispatch",
    "AllToAllDispatcher": ".dispatch",
    "DedupAllToAllDispatcher": ".dispatch_dedup",
    "GroupedExperts": ".experts",
    "full_expert_tensor": ".experts",
    "is_expert_parameter": ".experts",
    "mark_expert_parallel": ".experts",
    "named_expert_parameters": ".experts",
    "DISPATCHERS": ".layer",
    "MoELayer": ".layer",
    "MoEStats": ".layer",
    "ep_group": ".layer",
    "capacity_keep_mask": ".router",
    "load_balancing_loss": ".router",
    "route": ".router",
    "sequence_load_balancing_loss": ".router",
    "update_bias": ".router",
    "z_loss": ".router",
}


__getattr__ = lazy_exports(__name__, _WITH_TORCH)


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
