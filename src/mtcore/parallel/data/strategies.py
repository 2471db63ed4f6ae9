"""The data-parallel strategy table: one entry per way of sharding and reducing over dp x cp.

An entry names the ZeRO stage, the reducer's strategy for it (``zero.py``), the optimizer
that steps what the stage leaves on the rank and the optimizer settings it takes besides
AdamW's. The engine picks its entry by ``(parallel.zero, optimizer.name)``; a bare
``DataParallel`` picks its stage from its ``DataParallelConfig``, through the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtcore.parallel.data.config import DataParallelConfig
from mtcore.parallel.data.zero import (
    Replicated,
    ShardedGradients,
    ShardedOptimizer,
    ShardedParameters,
)
from mtcore.parallel.optimizer import AdamW, DistributedAdamW, OneBitAdam


@dataclass(frozen=True)
class DataParallelStrategy:
    """zero: the ZeRO stage (1 shards the optimizer state, 2 the gradients too, 3 the
    blocks' params too). optimizer_name: the ``optimizer.name`` it serves. stage: the
    reducer's strategy class. optimizer: the optimizer class. optimizer_options: the
    ``OptimizerConfig`` fields the optimizer takes besides AdamW's."""

    name: str
    zero: int
    optimizer_name: str
    stage: type[Replicated]
    optimizer: type[AdamW]
    optimizer_options: tuple[str, ...] = ()

    def data_parallel_config(self, **settings) -> DataParallelConfig:
        """The reducer's settings for this stage (``settings``: bucket size, overlap)."""
        return DataParallelConfig(
            **settings,
            shard_optimizer=self.zero >= 1,
            shard_gradients=self.zero >= 2,
            shard_params=self.zero >= 3,
        )

    def build_optimizer(self, ddp, options, **adamw) -> AdamW:
        """The optimizer over ``ddp``: ``adamw`` (lr, betas, ...) and this entry's
        ``optimizer_options`` read from ``options`` (an ``OptimizerConfig``)."""
        extra = {name: getattr(options, name) for name in self.optimizer_options}
        return self.optimizer(ddp, **extra, **adamw)


STRATEGIES: dict[str, DataParallelStrategy] = {
    entry.name: entry
    for entry in (
        DataParallelStrategy("ddp", 0, "adamw", Replicated, AdamW),
        DataParallelStrategy("zero1", 1, "adamw", ShardedOptimizer, DistributedAdamW),
        DataParallelStrategy("zero2", 2, "adamw", ShardedGradients, DistributedAdamW),
        DataParallelStrategy("zero3", 3, "adamw", ShardedParameters, DistributedAdamW),
        # 1-bit Adam: replicated, its compression stage switches the reduction off
        # (``DataParallel.reduce_gradients``) and reduces the compressed momentum itself
        DataParallelStrategy("onebit_adam", 0, "onebit_adam", Replicated, OneBitAdam,
                             ("freeze_step", "block_size")),
    )
}  # fmt: skip


def strategy_for(zero: int, optimizer_name: str = "adamw") -> DataParallelStrategy:
    """The entry for ZeRO stage ``zero`` under optimizer ``optimizer_name``."""
    for entry in STRATEGIES.values():
        if entry.zero == zero and entry.optimizer_name == optimizer_name:
            return entry
    known = ", ".join(f"{e.optimizer_name} with ZeRO-{e.zero}" for e in STRATEGIES.values())
    raise ValueError(
        f"no data-parallel strategy runs {optimizer_name} with ZeRO stage {zero}; known: {known}"
    )


def stage_of(config: DataParallelConfig) -> Replicated:
    """A fresh reducer strategy for the ZeRO stage ``config``'s flags ask for."""
    zero = 3 if config.shard_params else 2 if config.shard_gradients else int(config.shard_optimizer)
    return strategy_for(zero).stage()
