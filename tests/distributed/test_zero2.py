"""ZeRO-2 (``parallel.zero: 2``) trains as one process does (gloo, one spawn per world size).

Each case runs the trainer's ``Engine`` with gradient sharding: every micro-batch's
backward reduce-scatters each bucket into the owned shard and frees the bucket's whole
gradient. Compared with a one-process ``Engine`` (``mtcore.testing.equivalence``): the
loss, gradient norm (clipping active), evaluation values and final weights, relative
1e-5 (ZeRO-1's tolerance). Two micro-batches per dp rank, so the shard accumulates over
micro-batches; 700-element buckets, so several buckets are in flight during backward.

2 ranks: GPT-2 (tied embedding) dp2, BERT (MLM + NSP, padded pairs) dp2.
4 ranks: GPT-2 tp2 x dp2 with sequence parallel (norm gradients summed over tp on the
shards), pp2 x dp2 (tied halves on two stages: whole-gradient buffers summed over the
stages, then reduce-scattered), Llama pp2 x vpp2 x dp2 (interleaved: a chunk's buckets
reduce during the other chunk's backward).

A probe checks after the steps that no whole fp32 gradient is left: each sharded buffer
holds ``1/dp`` of its gradients and no bucket keeps a ``full_grad``.
"""

from __future__ import annotations

import pytest

from mtcore.models.bert import BertConfig
from mtcore.models.gpt import GPTConfig
from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn, token_batches
from mtcore.training.config import OptimizerConfig
from tests.distributed.test_bert_equivalence import _batches as bert_batches

STEPS, BATCH, MB = 3, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
MODELS = {
    "gpt2": GPTConfig(style="gpt2", init_std=0.1, **SIZES),
    "llama": GPTConfig(style="llama", init_std=0.1, **SIZES),
    "bert": BertConfig(
        dropout=0.0, init_std=0.1, pair_task="nsp", vocab_size=64, hidden_size=32,
        num_layers=4, num_heads=4, seq_len=16,
    ),
}  # fmt: skip
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


SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=3,
              reference_micro_batch_size=MB, first_step_grads=False,
              probe=_shards_only)  # fmt: skip
CASES = {
    "gpt2_dp2": Case(2, "gpt2", dict(dp=2), zero=2),
    "bert_dp2": Case(2, "bert", dict(dp=2), zero=2),
    "gpt2_tp2_dp2_sp": Case(4, "gpt2", dict(tp=2, dp=2, sequence_parallel=True), zero=2),
    "gpt2_pp2_dp2_tied": Case(4, "gpt2", dict(pp=2, dp=2), zero=2),
    "llama_pp2_vpp2_dp2": Case(4, "llama", dict(pp=2, vpp=2, dp=2), zero=2),
}
EVAL_NAMES = {
    "gpt2": {"loss", "lm"},
    "llama": {"loss", "lm"},
    "bert": {"loss", "mlm", "pair", "mlm_accuracy", "pair_accuracy"},
}


@pytest.fixture(scope="module")
def runs():
    tokens = token_batches(STEPS, BATCH, SIZES["seq_len"], vocab=64)
    return spawn(SETUP, CASES, {"gpt2": tokens, "llama": tokens, "bert": bert_batches()})


@pytest.mark.parametrize("case", list(CASES))
def test_zero2_matches_one_process(runs, case):
    model = CASES[case].model
    assert_matches(SETUP, case, CASES[case], *runs[case], eval_names=EVAL_NAMES[model])


@pytest.mark.parametrize("case", list(CASES))
def test_zero2_keeps_only_gradient_shards(runs, case):
    ranks, _ = runs[case]
    for rank, got in enumerate(ranks):
        assert got["shards"], (case, rank, "no sharded gradient buffer")
        for held, numel, dp in got["shards"]:
            assert dp == 2 and held * dp == numel, (case, rank, held, numel)
        assert not got["whole_left"] and got["main_grads_left"] == 0, (case, rank)


def test_clipping_was_active(runs):
    _, ref = runs["gpt2_dp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]
