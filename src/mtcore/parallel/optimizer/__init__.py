"""Optimizers over ``DataParallel``'s flat buffers: ``AdamW`` (replicated) and
``DistributedAdamW`` (ZeRO-1, state sharded over data parallel)."""

from mtcore.parallel.optimizer.adamw import AdamW, DistributedAdamW, StepResult
from mtcore.parallel.optimizer.segments import Segment, build_param_groups, default_no_decay

__all__ = [
    "AdamW",
    "DistributedAdamW",
    "Segment",
    "StepResult",
    "build_param_groups",
    "default_no_decay",
]
