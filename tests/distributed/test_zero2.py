"""ZeRO-2 (``parallel.zero: 2``) trains as one process does (gloo, one spawn per world size).

Each case runs the trainer's ``Engine`` with gradient sharding: every micro-batch's
backward reduce-scatters each bucket into the owned shard and frees the bucket's whole
gradient. Compared with a one-process ``Engine`` (``mtcore.testing.equivalence``): the
loss, gradient norm (clipping active), evaluation values and final weights, relative
1e-5 (ZeRO-1's tolerance). Two micro-batches per dp rank, so the shard accumulates over
micro-batches; 700-element buckets, so several buckets are in flight during backward.

2 ranks: GPT-2 (tied embedding) dp2, BERT (MLM + NSP, padded pairs) dp2, T5 dp2.
4 ranks: GPT-2 tp2 x dp2 with sequence parallel (norm gradients summed over tp on the
shards), pp2 x dp2 (tied halves on two stages: whole-gradient buffers summed over the
stages, then reduce-scattered), Llama pp2 x vpp2 x dp2 (interleaved: a chunk's buckets
reduce during the other chunk's backward), the same pp2 x dp2 under the zero-bubble
``zb_h1`` schedule (weight gradients, and so the buckets, arrive in the W passes), GPT-2 cp2 x dp2 (sharded over the 4 dp x cp
ranks), a mixture-of-experts GPT at ep2 x dp4 (expert buffers sharded over their 2
expert-data-parallel replicas, dense ones over dp4), T5 with tied embeddings at
pp2 x dp2 (the shared embedding's halves on the encoder and decoder stages).

In the 2-rank spawn, bf16 and fp16 (dynamic loss scaling) runs of ZeRO-2 against ZeRO-1
on the same batches: the fp32 master weights and moments are sharded alike (ZeRO-2
changes where gradients live, not the optimizer), so the losses and masters agree to the
reduction-order rounding (ZeRO-2 sums each micro-batch over dp, ZeRO-1 the accumulated
gradient once).

A probe checks after the steps that no whole fp32 gradient is left: each sharded buffer
holds ``1/dp`` of its gradients and no bucket keeps a ``full_grad``.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.models.bert import BertConfig
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.data import DataParallelConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.precision import MixedPrecision
from mtcore.testing.compare import rel_error
from mtcore.testing.equivalence import (
    Case,
    Setup,
    assert_matches,
    micro_batches,
    spawn,
    token_batches,
)
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine
from tests.distributed.test_bert_equivalence import _batches as bert_batches
from tests.distributed.test_t5_equivalence import MODELS as T5_MODELS
from tests.distributed.test_t5_equivalence import _batches as t5_batches

# ZeRO-2 builds on ZeRO-1, which the default suite checks: CI runs this file after make
# test (make test-extended).
pytestmark = pytest.mark.extended

STEPS, BATCH, MB = 3, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
MODELS = {
    "gpt2": GPTConfig(style="gpt2", init_std=0.1, **SIZES),
    "llama": GPTConfig(style="llama", init_std=0.1, **SIZES),
    "moe": GPTConfig(init_std=0.1, moe=dict(num_experts=4, top_k=2, ffn_size=32), **SIZES),
    "bert": BertConfig(
        dropout=0.0, init_std=0.1, pair_task="nsp", vocab_size=64, hidden_size=32,
        num_layers=4, num_heads=4, seq_len=16,
    ),
    "t5": T5_MODELS["base"],
    "t5_tied": T5_MODELS["tied"],
}  # fmt: skip
# Measured: equal bitwise (sums of a few bf16/fp16 gradients are exact in fp32); the
# tolerance only allows for a platform whose reduction rounds differently.
LOW_PRECISION_RTOL = 1e-6
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)


def _shards_only(engine, record: dict) -> None:
    """What is left of the gradients after the steps: per sharded buffer, its gradient
    storage and element count, whether a bucket still has a whole gradient, and whether
    a parameter still has a ``main_grad``."""
    ddp = engine.ddp
    record["shards"] = [
        (buf.grad.numel(), buf.numel, ddp.reductions[buf.reduce_group][1])
        for buf in ddp.grad_buffers
        if buf.shard is not None
    ]
    record["whole_left"] = any(b.full_grad is not None for b in ddp.buckets if b.buffer.shard)
    record["main_grads_left"] = sum(
        hasattr(p, "main_grad") for buf in ddp.grad_buffers if buf.shard for p in buf.params
    )


def _low_precision(ctx) -> dict | None:
    """Per dtype and ZeRO stage 1 and 2 on dp2: losses, the gathered fp32 masters and
    the master/moment bytes this rank holds."""
    if ctx.world_size != 2:
        return None
    layout = ParallelLayout.build(LayoutSpec(dp=2), ctx.backend.collective, ctx.rank, 2)
    rows = slice(ctx.rank * BATCH // 2, (ctx.rank + 1) * BATCH // 2)
    batches = token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64)
    out = {}
    for dtype in ("bf16", "fp16"):
        for zero in (1, 2):
            engine = Engine(MODELS["gpt2"], layout, ctx.backend, micro_batch_size=MB,
                            num_microbatches=BATCH // 2 // MB, optimizer=OPT, seed=3,
                            precision=MixedPrecision(dtype), zero=zero, bucket_size=700)  # fmt: skip
            losses = [engine.train_step(micro_batches(b, rows, MB)).loss for b in batches]
            opt = engine.optimizer
            masters = torch.cat([s.master for s in opt.segments])
            state = sum(t.numel() for ts in opt.state_tensors().values() for t in ts)
            out[dtype, zero] = (losses, masters, state, opt.loss_scaler is not None)
    return out


SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=3,
              reference_micro_batch_size=MB, first_step_grads=False,
              probe=_shards_only, extras=_low_precision)  # fmt: skip
CASES = {
    "gpt2_dp2": Case(2, "gpt2", dict(dp=2), zero=2),
    "bert_dp2": Case(2, "bert", dict(dp=2), zero=2),
    "t5_dp2": Case(2, "t5", dict(dp=2), zero=2),
    "gpt2_tp2_dp2_sp": Case(4, "gpt2", dict(tp=2, dp=2, sequence_parallel=True), zero=2),
    "gpt2_pp2_dp2_tied": Case(4, "gpt2", dict(pp=2, dp=2), zero=2),
    "llama_pp2_vpp2_dp2": Case(4, "llama", dict(pp=2, vpp=2, dp=2), zero=2),
    "gpt2_pp2_dp2_zb_h1": Case(4, "gpt2", dict(pp=2, dp=2), schedule="zb_h1", zero=2),
    "gpt2_cp2_dp2": Case(4, "gpt2", dict(cp=2, dp=2), zero=2),
    "moe_ep2_dp4": Case(4, "moe", dict(ep=2), zero=2),
    "t5_tied_pp2_dp2": Case(4, "t5_tied", dict(pp=2, dp=2), zero=2),
}
# The ranks each sharded buffer is split over: dp x cp; for the MoE model's expert
# buffers the expert-data-parallel group (dp4 / ep2), its dense ones dp4.
SHARDS = {"gpt2_cp2_dp2": {4}, "moe_ep2_dp4": {2, 4}}
EVAL_NAMES = {
    "gpt2": {"loss", "lm"},
    "llama": {"loss", "lm"},
    "bert": {"loss", "mlm", "pair", "mlm_accuracy", "pair_accuracy"},
    "moe": None,
    "t5": None,
    "t5_tied": None,
}


def model_batches() -> dict:
    """The global batches of each model."""
    tokens = token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64)
    t5 = t5_batches()
    batches = {"gpt2": tokens, "llama": tokens, "moe": tokens, "bert": bert_batches()}
    return batches | {"t5": t5, "t5_tied": t5}


@pytest.fixture(scope="module")
def runs():
    return spawn(SETUP, CASES, model_batches())


@pytest.mark.parametrize("case", list(CASES))
def test_zero2_matches_one_process(runs, case):
    model = CASES[case].model
    # MoE load statistics relative to max(|value|, 1), as test_moe_equivalence compares them
    assert_matches(SETUP, case, CASES[case], *runs[case], eval_names=EVAL_NAMES[model],
                   moe_floor=1.0)  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_zero2_keeps_only_gradient_shards(runs, case):
    ranks, _ = runs[case]
    for rank, got in enumerate(ranks):
        assert got["shards"], (case, rank, "no sharded gradient buffer")
        assert {size for _, _, size in got["shards"]} == SHARDS.get(case, {2}), (case, rank)
        for held, numel, size in got["shards"]:
            assert held * size == numel, (case, rank, held, numel, size)
        assert not got["whole_left"] and got["main_grads_left"] == 0, (case, rank)


def test_clipping_was_active(runs):
    _, ref = runs["gpt2_dp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_zero2_low_precision_matches_zero1(runs, dtype):
    for rank, got in enumerate(runs.extras[2]):
        (loss1, master1, state1, scaled1) = got[dtype, 1]
        (loss2, master2, state2, scaled2) = got[dtype, 2]
        assert master2.dtype == torch.float32 and state1 == state2 > 0, (rank, state1, state2)
        assert scaled1 == scaled2 == (dtype == "fp16")
        for a, b in zip(loss1, loss2, strict=True):
            assert abs(a - b) <= LOW_PRECISION_RTOL * abs(a), (dtype, rank, loss1, loss2)
        err = rel_error(master2, master1)
        assert err <= LOW_PRECISION_RTOL, (dtype, rank, err)


def test_gradient_shards_need_the_sharded_optimizer():
    with pytest.raises(ValueError, match=r"shard_gradients \(ZeRO-2\) needs shard_optimizer"):
        DataParallelConfig(shard_gradients=True)
