"""Optimizers over ``DataParallel``'s flat buffers: ``AdamW`` (replicated),
``DistributedAdamW`` (ZeRO-1, state sharded over data parallel) and ``OneBitAdam``
(1-bit compressed momentum reduction after a warm-up)."""

from mtcore.parallel.optimizer.adamw import AdamW, DistributedAdamW, StepResult
from mtcore.parallel.optimizer.onebit import OneBitAdam, OneBitReducer
from mtcore.parallel.optimizer.segments import Segment, build_param_groups, default_no_decay

__all__ = [
    "AdamW",
    "DistributedAdamW",
    "OneBitAdam",
    "OneBitReducer",
    "Segment",
    "StepResult",
    "build_param_groups",
    "default_no_decay",
]
