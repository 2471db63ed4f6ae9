"""The data-parallel strategy table: each ZeRO stage and 1-bit Adam is one entry that
picks the reducer's strategy and the optimizer; an impossible pair is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mtcore.backend import select_backend
from mtcore.parallel.data import STRATEGIES, DataParallel, DataParallelConfig, strategy_for
from mtcore.parallel.data.zero import (
    Replicated,
    ShardedGradients,
    ShardedOptimizer,
    ShardedParameters,
)
from mtcore.parallel.layout import ParallelLayout
from mtcore.parallel.optimizer import AdamW, DistributedAdamW, OneBitAdam
from mtcore.training.config import OptimizerConfig


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4))


@pytest.mark.parametrize(
    "zero,optimizer,stage,kind",
    [
        (0, "adamw", Replicated, AdamW),
        (1, "adamw", ShardedOptimizer, DistributedAdamW),
        (2, "adamw", ShardedGradients, DistributedAdamW),
        (3, "adamw", ShardedParameters, DistributedAdamW),
        (0, "onebit_adam", Replicated, OneBitAdam),
    ],
)
def test_one_entry_picks_the_reducer_stage_and_the_optimizer(zero, optimizer, stage, kind):
    entry = strategy_for(zero, optimizer)
    assert (entry.zero, entry.stage, entry.optimizer) == (zero, stage, kind)
    model = _model()
    units = [model[0], model[2]] if zero == 3 else ()
    ddp = DataParallel(model, ParallelLayout.single(), select_backend("cpu"),
                       entry.data_parallel_config(bucket_size=40), units=units)  # fmt: skip
    assert type(ddp.stage) is stage and ddp.stage.stage == zero
    assert (ddp.sharded_params is not None) == (zero == 3)
    options = OptimizerConfig(name=optimizer, freeze_step=7, block_size=16)
    built = entry.build_optimizer(ddp, options, lr=1e-2)
    assert type(built) is kind
    if kind is OneBitAdam:
        assert built.freeze_step == 7  # the entry's own options come from the config
    model(torch.randn(3, 6)).square().mean().backward()
    ddp.finish_grad_sync()
    built.step()  # the stage's reduction matches what the optimizer reads
    assert built.step_count == 1


def test_a_bare_data_parallel_takes_its_stage_from_its_flags():
    flags = [{}, {"shard_optimizer": True}, {"shard_optimizer": True, "shard_gradients": True}]
    for zero, cfg in enumerate(flags):
        ddp = DataParallel(_model(), ParallelLayout.single(), select_backend("cpu"),
                           DataParallelConfig(**cfg))  # fmt: skip
        assert ddp.stage.stage == zero
    assert len({entry.name for entry in STRATEGIES.values()}) == len(STRATEGIES) == 5


def test_an_optimizer_no_entry_runs_is_refused_in_one_line():
    with pytest.raises(ValueError, match="no data-parallel strategy runs onebit_adam with ZeRO "
                                         "stage 1; known: adamw with ZeRO-0, ") as raised:  # fmt: skip
        strategy_for(1, "onebit_adam")
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        strategy_for(4)
