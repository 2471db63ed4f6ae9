"""Data parallelism's settings, apart from the buffers and hooks that carry them out
(``ddp``): a training config reads them without torch."""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from mtcore.distributed.settings import Settings

DEFAULT_BUCKET_SIZE = 40_000_000  # elements, Megatron-Core's default
DP_OVERLAP_ENV = "MTCORE_DP_OVERLAP"


def dp_overlap(backend) -> tuple[bool, str]:
    """``(overlap, why)``: whether the dp gradient buckets reduce during backward
    (``DataParallelConfig.overlap_grad_reduce``). ``MTCORE_DP_OVERLAP=1``/``0`` decides;
    unset, the backend's advice (``BackendSpec.dp_overlap``; none: overlap)."""
    choice = os.environ.get(DP_OVERLAP_ENV, "").strip()
    if choice in ("0", "1"):
        return choice == "1", f"{DP_OVERLAP_ENV}={choice}"
    if choice:
        raise ValueError(f"{DP_OVERLAP_ENV} must be 0 or 1 (unset: the backend's advice), got {choice!r}")
    advice = backend.spec.dp_overlap
    if advice is None:
        return True, f"backend {backend.name!r}: overlap"
    advised = advice()
    if advised:
        return True, f"backend {backend.name!r}: overlap"
    return False, f"backend {backend.name!r}: after backward ({advised.reason})"


class DataParallelConfig(Settings):
    """bucket_size: elements per bucket (a bucket closes once it reaches this).

    shard_optimizer: reduce-scatter gradients for a ZeRO-1 optimizer instead of
    all-reducing them. overlap_grad_reduce: launch each bucket's reduction from
    backward as soon as it is ready (False: all at ``finish_grad_sync``).
    average: divide by the data-parallel size (False: plain sum).
    shard_gradients: ZeRO-2, keep only this rank's reduced gradient shard (needs
    ``shard_optimizer``); its buckets reduce from backward whatever
    ``overlap_grad_reduce`` and ``no_sync`` say.
    """

    bucket_size: int = Field(DEFAULT_BUCKET_SIZE, ge=1)
    shard_optimizer: bool = False
    overlap_grad_reduce: bool = True
    average: bool = True
    shard_gradients: bool = False
    shard_params: bool = False

    @model_validator(mode="after")
    def _shards_need_sharded_optimizer(self) -> DataParallelConfig:
        if self.shard_gradients and not self.shard_optimizer:
            raise ValueError("shard_gradients (ZeRO-2) needs shard_optimizer (ZeRO-1) too")
        if self.shard_params and not self.shard_gradients:
            raise ValueError("shard_params (ZeRO-3) needs shard_gradients (ZeRO-2) too")
        return self
