"""1-bit Adam through the trainer's ``Engine`` under tp2 x dp2 and pp2 x dp2 (tied).

It compresses the dp reduction only: up to the step after ``freeze_step`` the run is
AdamW's bit for bit (the losses match an AdamW engine exactly), afterwards the dp
replicas still hold identical weights (the compressed momentum is the same on every
rank) and the loss keeps falling.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.data import lm_batches
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig, TrainConfig
from mtcore.training.engine import Engine

STEPS, FREEZE, BATCH, MB = 8, 2, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)
MODELS = {"llama": GPTConfig(style="llama", **SIZES), "gpt2": GPTConfig(style="gpt2", **SIZES)}
CASES = {"tp2_dp2": ("llama", dict(tp=2, dp=2)), "pp2_dp2_tied": ("gpt2", dict(pp=2, dp=2))}
OPT = dict(lr=3e-3, warmup_steps=0, max_grad_norm=1.0)


def _run(ctx, model, layout_kw, optimizer: OptimizerConfig, tokens):
    layout = ParallelLayout.build(LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, 4)
    local = BATCH // 2
    rows = slice(layout.dp_cp.rank * local, (layout.dp_cp.rank + 1) * local)
    engine = Engine(
        MODELS[model], layout, ctx.backend, micro_batch_size=MB, num_microbatches=local // MB,
        optimizer=optimizer, seed=3, bucket_size=500,
    )  # fmt: skip
    losses = []
    for step in range(STEPS):
        x = tokens[step % 2][rows]  # two batches in turn: the loss must fall on both
        out = engine.train_step(lm_batches(x[:, :-1].split(MB), x[:, 1:].split(MB)))
        assert not out.skipped, out
        losses.append(out.loss)
    weights = torch.cat([b.param_data.clone() for b in engine.ddp.grad_buffers])
    return losses, weights, (layout.tp_rank, layout.coordinate(Axis.PP))


def _rank_main(ctx, tokens):
    out = {}
    for name, (model, layout_kw) in CASES.items():
        onebit = OptimizerConfig(name="onebit_adam", freeze_step=FREEZE, **OPT)
        out[name] = {
            "adamw": _run(ctx, model, layout_kw, OptimizerConfig(**OPT), tokens)[0],
            "onebit": _run(ctx, model, layout_kw, onebit, tokens),
        }
    return out


@pytest.fixture(scope="module")
def ranks():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (2, BATCH, SIZES["seq_len"] + 1), generator=g)
    return run_ranks(_rank_main, 4, tokens)


@pytest.mark.parametrize("case", list(CASES))
def test_warm_up_is_adamw_and_replicas_stay_equal(ranks, case):
    for r in ranks:
        adamw, (onebit, _, _) = r[case]["adamw"], r[case]["onebit"]
        assert onebit[: FREEZE + 1] == adamw[: FREEZE + 1]  # bitwise: the same AdamW
        assert onebit[FREEZE + 1 :] != adamw[FREEZE + 1 :]  # compressed from then on
        assert onebit[-2] < onebit[1] and onebit[-1] < onebit[0], onebit
    by_shard: dict = {}
    for r in ranks:
        _, weights, shard = r[case]["onebit"]
        by_shard.setdefault(shard, []).append(weights)
    assert len(by_shard) == 2
    for replicas in by_shard.values():  # the dp replicas of one tp/pp shard
        assert len(replicas) == 2 and torch.equal(replicas[0], replicas[1])


def test_config_refuses_onebit_with_zero1():
    with pytest.raises(ValueError, match=r"onebit_adam cannot run with parallel\.zero1"):
        TrainConfig.model_validate(
            {"optimizer": {"name": "onebit_adam"}, "parallel": {"zero1": True}}
        )
    with pytest.raises(ValueError, match="mixture-of-experts"):
        TrainConfig.model_validate(
            {
                "optimizer": {"name": "onebit_adam"},
                "model": {"moe": {"num_experts": 4, "ffn_size": 64}},
            }
        )
    with pytest.raises(ValueError, match="freeze_step"):
        OptimizerConfig(name="onebit_adam", freeze_step=0)
