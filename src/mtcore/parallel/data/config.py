"""Data parallelism's settings, apart from the buffers and hooks that carry them out
(``ddp``): a training config reads them without torch."""

from __future__ import annotations

from pydantic import Field, model_validator

from mtcore.parallel.settings import Settings

DEFAULT_BUCKET_SIZE = 40_000_000  # elements, Megatron-Core's default


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
