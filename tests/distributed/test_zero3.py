"""ZeRO-3 (``parallel.zero: 3``) trains as one process does (gloo, one spawn per world size).

Each case runs the trainer's ``Engine`` with parameter sharding: every transformer block's
params live as this rank's shard between uses, are all-gathered before its forward (the
next block's gather started meanwhile) and again before its backward, and freed after
each; gradients reduce-scatter into the owned shard as under ZeRO-2. Compared with a
one-process ``Engine`` (``mtcore.testing.equivalence``): the loss, gradient norm (clipping
active), evaluation values (a no-grad forward, gathering too) and the final weights
(``full_state_dict`` gathers the blocks), relative 1e-5. Two micro-batches per dp rank.

2 ranks: GPT-2 (tied embedding: it stays whole) dp2, Llama dp2 with full recompute (the
block's forward runs again inside its backward, which must find its params gathered),
BERT dp2, T5 dp2. 4 ranks: GPT-2 tp2 x dp2 with sequence parallel, pp2 x dp2 under 1F1B.

A probe checks between steps that no whole parameter of a block is alive: each ZeRO-3
bucket's whole-params storage holds no bytes and its buffer's ``param_data`` holds
``1/dp`` of its params. A negative check: a rank whose shards are not gathered before
use (prefetch off and a gather skipped) gives other losses.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

from mtcore.parallel.data import DataParallelConfig, GradBuffer
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.precision import MixedPrecision
from mtcore.precision.fp8 import FP8Recipe
from mtcore.testing.compare import rel_error
from mtcore.testing.equivalence import (
    Case,
    Setup,
    assert_matches,
    close,
    micro_batches,
    spawn,
    token_batches,
)
from mtcore.training.engine import Engine
from tests.distributed import test_vlm_equivalence as vlm
from tests.distributed import test_zero2 as zero2
from tests.distributed.test_zero2 import EVAL_NAMES, MODELS, OPT, SHARDS

# ZeRO-3 builds on ZeRO-1 and -2: CI runs this file after make test (make test-extended).
pytestmark = pytest.mark.extended

# ZeRO-3 against ZeRO-2 in bf16, fp16 and with FP8 linears: the losses are equal, the
# final weights differ in the last bits (the gradient norm sums its shards in another
# order: ZeRO-3's buckets follow the blocks). Measured with FP8 linears (fp32 weights):
# at most 7.7e-8. In bf16 a master's last bits can round a weight to another bf16
# value: one element of one weight on one machine (3.2e-6 relative), none on another,
# elements of most weights up to 6 bf16 steps apart on torch 2.7.1 (up to 3.9e-4
# relative). The losses stay equal; the weights are held to half of bf16's epsilon.
LOW_PRECISION_RTOL = 1e-6
HALF_PRECISION_RTOL = 4e-3
# fp16 with a loss scale so large that the first step's gradients overflow: the step is
# skipped on both ranks (the check covers every shard) and the scale backs off to 2**16.
FP16 = MixedPrecision("fp16", initial_scale=2.0**26, backoff_factor=2.0**-10)

STEPS, BATCH, MB = 3, 8, 2
MODELS = {
    **MODELS,
    "llama_recompute": MODELS["llama"].model_copy(update={"recompute": "full"}),
    "llava": vlm._model("base")[0],
    "llava_frozen": vlm._model("frozen")[0],  # a frozen vision tower: no buffer at all
}
EVAL_NAMES = {**EVAL_NAMES, "llama_recompute": EVAL_NAMES["llama"], "llava": None,
              "llava_frozen": None}  # fmt: skip


def _params_sharded(engine, record: dict) -> None:
    """Per ZeRO-3 buffer after the steps: its shard's element count, its buffer's, the
    group size, and how many bytes its buckets' whole params hold (nothing for the
    one-process reference)."""
    ddp = engine.ddp
    if ddp.sharded_params is None:
        return
    record["param_shards"] = [
        (buf.param_data.numel(), buf.numel, ddp.reductions[buf.reduce_group][1],
         sum(b.full_params.untyped_storage().nbytes() for b in buf.buckets))
        for buf in ddp.grad_buffers if buf.shard_params
    ]  # fmt: skip
    record["blocks"] = sum(len(chunk.layers) for chunk in engine.chunks)
    record["units"] = len(ddp.sharded_params.units)


def _skip_gather(sharded, bucket) -> None:
    """A broken gather: the whole params get this rank's shard and zeros elsewhere."""
    if bucket.materialized:
        return
    full = bucket.buffer.materialize(bucket)
    full.zero_()
    lo, hi = bucket.shard(*bucket.buffer.shard)
    full[lo - bucket.start : hi - bucket.start].copy_(bucket.buffer.owned_params(bucket))


def _count_gathered(engine, forward: list[int], backward: list[int]) -> None:
    """How many ZeRO-3 buckets have their whole params now: before each block's forward
    (after its own gather), and as each of a block's params gets its gradient (after
    data parallel's hook, which frees a bucket whose gradients are all in)."""
    buckets = [b for unit in engine.ddp.sharded_params.units for b in unit]

    def count(into, *_):
        into.append(sum(b.materialized for b in buckets))

    for chunk in engine.chunks:
        for block in chunk.layers.values():
            block.register_forward_pre_hook(functools.partial(count, forward))
            for p in block.parameters():
                p.register_post_accumulate_grad_hook(functools.partial(count, backward))


def _variants(ctx) -> dict | None:
    """On dp2, one engine each: GPT-2 at zero 3 (with the number of gathered buckets
    before each block's forward), the same with ``_skip_gather``; Llama in bf16, with
    FP8 linears and in fp16 (a first step that overflows) at zero 2 and 3 (losses,
    skipped steps, and the final weights on rank 0)."""
    if ctx.world_size != 2:
        return None
    layout = ParallelLayout.build(LayoutSpec(dp=2), ctx.backend.collective, ctx.rank, 2)
    rows = slice(ctx.rank * BATCH // 2, (ctx.rank + 1) * BATCH // 2)
    batches = token_batches(STEPS, BATCH, MODELS["gpt2"].seq_len, vocab=64)
    fp8 = FP8Recipe("hybrid", "delayed", amax_history_len=4)
    runs = {
        "gpt2": ("gpt2", 3, MixedPrecision("fp32")),
        "broken": ("gpt2", 3, MixedPrecision("fp32")),
        ("bf16", 2): ("llama", 2, MixedPrecision("bf16")),
        ("bf16", 3): ("llama", 3, MixedPrecision("bf16")),
        ("fp8", 2): ("llama", 2, MixedPrecision("fp32", fp8=fp8)),
        ("fp8", 3): ("llama", 3, MixedPrecision("fp32", fp8=fp8)),
        ("fp16", 2): ("llama", 2, FP16),
        ("fp16", 3): ("llama", 3, FP16),
    }
    out, forward, backward = {}, [], []
    for name, (model, zero, precision) in runs.items():
        engine = Engine(MODELS[model], layout, ctx.backend, micro_batch_size=MB,
                        num_microbatches=BATCH // 2 // MB, optimizer=OPT, seed=3, zero=zero,
                        precision=precision, bucket_size=700)  # fmt: skip
        if name == "gpt2":
            _count_gathered(engine, forward, backward)
        if name == "broken":
            sharded = engine.ddp.sharded_params
            sharded._gather = functools.partial(_skip_gather, sharded)
        results = [engine.train_step(micro_batches(b, rows, MB)) for b in batches]
        out[name] = ([r.loss for r in results], engine.full_state_dict(),
                     [r.skipped for r in results])  # fmt: skip
    out["gathered"] = forward, backward
    return out


SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=3,
              reference_micro_batch_size=MB, first_step_grads=False,
              probe=_params_sharded, extras=_variants)  # fmt: skip
# ZeRO-2's cases at stage 3 (gpt2_pp2_dp2_tied: the tied embedding's halves on two
# stages stay whole), and more: recompute, LLaVA, interleaved zero bubble.
CASES = {name: dataclasses.replace(case, zero=3) for name, case in zero2.CASES.items()} | {
    "llama_recompute_dp2": Case(2, "llama_recompute", dict(dp=2), zero=3),
    "llava_dp2": Case(2, "llava", dict(dp=2), zero=3),
    "llava_frozen_dp2": Case(2, "llava_frozen", dict(dp=2), zero=3),
    "llama_pp2_vpp2_dp2_zb": Case(4, "llama", dict(pp=2, vpp=2, dp=2), zero=3,
                                  schedule="interleaved_zb"),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs():
    batches = zero2.model_batches()
    batches |= {"llama_recompute": batches["llama"], "llava": vlm._batches("base"),
                "llava_frozen": vlm._batches("frozen")}  # fmt: skip
    return spawn(SETUP, CASES, batches)


@pytest.mark.parametrize("case", list(CASES))
def test_zero3_matches_one_process(runs, case):
    model = CASES[case].model
    assert_matches(SETUP, case, CASES[case], *runs[case], eval_names=EVAL_NAMES[model],
                   moe_floor=1.0)  # fmt: skip


def test_a_skipped_gather_changes_the_losses(runs):
    _, ref = runs["gpt2_dp2"]
    for rank, got in enumerate(runs.extras[2]):
        good, broken = got["gpt2"][0], got["broken"][0]
        assert all(close(a, b, SETUP.rtol) for a, b in zip(good, ref["loss"], strict=True))
        assert not any(close(a, b, 1e-4) for a, b in zip(broken, ref["loss"], strict=True)), (
            rank, broken, ref["loss"])  # fmt: skip


def test_two_blocks_at_most_are_whole(runs):
    """Forward holds a block and the prefetched next; backward a block and the next one
    (prefetched, or still getting its weight gradients)."""
    blocks = MODELS["gpt2"].num_layers
    for rank, got in enumerate(runs.extras[2]):
        forward, backward = got["gathered"]
        assert len(forward) == STEPS * BATCH // 2 // MB * blocks, (rank, forward)
        # the first block: itself and the next; the last: itself (and nothing after it)
        assert forward[:blocks] == [2] * (blocks - 1) + [1], (rank, forward)
        assert max(forward) == 2, (rank, forward)
        assert backward and max(backward) == 2, (rank, backward)


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp16"])
def test_zero3_low_precision_matches_zero2(runs, dtype):
    for rank, got in enumerate(runs.extras[2]):
        (loss2, weights2, skipped2), (loss3, weights3, skipped3) = got[dtype, 2], got[dtype, 3]
        if dtype == "fp16":
            # On an AVX512 host (AMD EPYC, torch's cpu capability AVX512) the third fp16
            # loss differs between the stages by about one float32 ulp (4.352209091 and
            # 4.352210045), at 0eef49e too; earlier hosts gave equal bits. Cause not
            # isolated: bf16 and fp8 stay bitwise equal here.
            assert loss2 == pytest.approx(loss3, rel=1e-6, abs=0), (dtype, rank, loss2, loss3)
        else:
            assert loss2 == loss3, (dtype, rank, loss2, loss3)
        assert skipped2 == skipped3, (dtype, rank, skipped2, skipped3)
        if dtype == "fp16":
            assert skipped3[0] == "grad" and "" in skipped3, skipped3  # skipped, then stepped
            assert all(math.isfinite(loss) for loss in loss3), loss3
        if rank == 0:
            assert weights2.keys() == weights3.keys()
            if dtype == "fp8":  # fp32 weights
                errors = {name: rel_error(weights3[name], w) for name, w in weights2.items()}
                assert max(errors.values()) <= LOW_PRECISION_RTOL, (dtype, errors)
            else:  # a master's last bits may round bf16/fp16 weights to other neighbours
                errors = {name: rel_error(weights3[name], w) for name, w in weights2.items()}
                assert max(errors.values()) <= HALF_PRECISION_RTOL, (dtype, errors)



@pytest.mark.parametrize("case", list(CASES))
def test_zero3_keeps_only_param_shards_between_steps(runs, case):
    ranks, _ = runs[case]
    for rank, got in enumerate(ranks):
        assert got["units"] == got["blocks"] > 0, (case, rank)
        assert got["param_shards"], (case, rank, "no ZeRO-3 buffer")
        for held, numel, size, whole_bytes in got["param_shards"]:
            assert size in SHARDS.get(case, {2}), (case, rank, size)
            assert held * size == numel, (case, rank, held, numel, size)
            assert whole_bytes == 0, (case, rank, whole_bytes)


def test_param_shards_need_gradient_shards():
    with pytest.raises(ValueError, match=r"shard_params \(ZeRO-3\) needs shard_gradients"):
        DataParallelConfig(shard_optimizer=True, shard_params=True)
    with pytest.raises(ValueError, match=r"shard_params \(ZeRO-3\) needs shard \(ZeRO-2"):
        GradBuffer([torch.nn.Parameter(torch.ones(4))], bucket_size=4, shard_params=True)
