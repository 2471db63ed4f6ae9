"""Context parallelism trains the same as one process (gloo; one 2-rank and one 4-rank spawn).

Each case runs the trainer's ``Engine`` for three optimizer steps, fp32 with clipping
active, each rank taking its dp rows and its cp share of every sequence
(``shard_batch``), against a one-process ``Engine`` on the whole batches: the loss
(and its terms) at every step, the gradient norm, every gradient of the first step
(gathered whole; not under ZeRO-1, whose gradients are shards), the evaluation loss
and the weights after the last step, relative error <= 1e-5.

2 ranks: cp2 causal GPT with GQA (RoPE) for ring, allgather and a2a, and with a sliding
window of 5 (ring; the op itself with windows for every method); cp2 GPT-2 style
(learned positions, tied output); cp2 with full and with selective recompute; cp2
BERT with uneven padding (bidirectional, padding mask, [CLS] pair head) for each
method; the ring op itself against one process (fully masked rows included) and the
order of its transfers. 4 ranks (ring): cp2 x tp2 with sp (GPT-2 style and BERT), cp2 x
pp2, cp2 x pp2 x vpp2 (tied output), cp2 x dp2 with ZeRO-1; and MoE GPTs (2 ranks) with
router losses on, whose per-step load statistics must match too: cp2 x ep2 (the experts split
over the cp ranks; "batch" balancing loss and z-loss) and cp2 a2a with sigmoid scores, the
"seq" balancing loss, z-loss and aux-loss-free bias updates. Slow: cp4 for each method, BERT
cp4, cp2 x tp2 x pp2 (8 ranks), MoE cp4 x ep2 and cp2 x tp2 with sp ("seq").
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from mtcore.models.bert import BertConfig
from mtcore.models.gpt import GPTConfig
from mtcore.ops import attention
from mtcore.ops.flash_lse import cpu_flash_attention_lse
from mtcore.parallel.context import (
    CPGroup,
    causal_pairs,
    context_attention,
    ring_attention,
    shard_batch,
)
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.testing.compare import rel_error
from mtcore.testing.equivalence import Case, Runs, Setup, assert_matches, spawn, token_batches
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

STEPS, BATCH, MB, SEQ, VOCAB, PAD = 3, 8, 2, 16, 64, 4
GPT_SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=SEQ
)
BERT_SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4, seq_len=SEQ)
MODELS = {
    "llama": GPTConfig(style="llama", init_std=0.1, **GPT_SIZES),
    "llama8": GPTConfig(
        style="llama", init_std=0.1, **{**GPT_SIZES, "num_heads": 8, "num_kv_heads": 4}
    ),
    "gpt2": GPTConfig(style="gpt2", init_std=0.1, **GPT_SIZES),
    "llama_window": GPTConfig(style="llama", init_std=0.1, sliding_window=5, **GPT_SIZES),
    "llama_full": GPTConfig(style="llama", init_std=0.1, recompute="full", **GPT_SIZES),
    "gpt2_selective": GPTConfig(style="gpt2", init_std=0.1, recompute="selective", **GPT_SIZES),
    # Large router-loss coefficients so that a cp rank using only its own tokens' expert
    # counts (not the micro-batch's) would move the weights visibly.
    "moe": GPTConfig(
        init_std=0.1,
        moe=dict(num_experts=4, top_k=2, ffn_size=32, aux_loss_coeff=0.1, z_loss_coeff=0.01),
        **GPT_SIZES,
    ),
    "moe_seq": GPTConfig(
        init_std=0.1,
        moe=dict(
            num_experts=4,
            top_k=2,
            ffn_size=32,
            score="sigmoid",
            aux_loss="seq",
            aux_loss_coeff=0.1,
            z_loss_coeff=0.01,
            bias_update_rate=0.01,
        ),
        **GPT_SIZES,
    ),
    "bert": BertConfig(dropout=0.0, init_std=0.1, pair_task="nsp", **BERT_SIZES),
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
CASES = {
    "cp2_ring": Case(2, "llama", dict(cp=2)),
    "cp2_allgather": Case(2, "llama", dict(cp=2, cp_method="allgather")),
    "cp2_a2a": Case(2, "llama", dict(cp=2, cp_method="a2a")),
    "cp2_window_ring": Case(2, "llama_window", dict(cp=2)),
    "cp2_gpt2_allgather": Case(2, "gpt2", dict(cp=2, cp_method="allgather")),
    "cp2_full_recompute": Case(2, "llama_full", dict(cp=2)),
    "cp2_selective_a2a": Case(2, "gpt2_selective", dict(cp=2, cp_method="a2a")),
    "bert_cp2_ring": Case(2, "bert", dict(cp=2)),
    "bert_cp2_allgather": Case(2, "bert", dict(cp=2, cp_method="allgather")),
    "bert_cp2_a2a": Case(2, "bert", dict(cp=2, cp_method="a2a")),
    "cp2_ep2_moe": Case(2, "moe", dict(cp=2, ep=2)),
    "cp2_moe_seq_a2a": Case(2, "moe_seq", dict(cp=2, cp_method="a2a")),
    "cp2_tp2_sp": Case(4, "gpt2", dict(cp=2, tp=2, sequence_parallel=True)),
    "cp2_pp2": Case(4, "llama", dict(cp=2, pp=2)),
    "cp2_pp2_vpp2": Case(4, "gpt2", dict(cp=2, pp=2, vpp=2)),
    "cp2_dp2_zero1": Case(4, "gpt2", dict(cp=2, dp=2), zero1=True),
    "bert_cp2_tp2_sp": Case(4, "bert", dict(cp=2, tp=2, sequence_parallel=True)),
}
SLOW_CASES = {
    "cp4_ring": Case(4, "llama8", dict(cp=4)),
    "cp4_allgather": Case(4, "llama8", dict(cp=4, cp_method="allgather")),
    "cp4_a2a": Case(4, "llama8", dict(cp=4, cp_method="a2a")),
    "bert_cp4_ring": Case(4, "bert", dict(cp=4)),
    "bert_cp2_tp2_pp2": Case(8, "bert", dict(cp=2, tp=2, pp=2)),
    "cp4_ep2_moe": Case(4, "moe", dict(cp=4, ep=2)),
    "cp2_tp2_sp_moe_seq": Case(4, "moe_seq", dict(cp=2, tp=2, sequence_parallel=True)),
}


def _bert_batches():
    """Padded sentence pairs of very different lengths: cp ranks hold different
    numbers of real and masked tokens (rank 1's second chunk is mostly padding)."""
    g = torch.Generator().manual_seed(11)
    steps = []
    for _ in range(STEPS):
        lengths = torch.sort(torch.randint(5, SEQ + 1, (BATCH,), generator=g)).values
        lengths[: BATCH // 2] = torch.clamp(lengths[: BATCH // 2] // 2, min=5)
        positions = torch.arange(SEQ)[None, :]
        real = positions < lengths[:, None]
        tokens = torch.randint(PAD + 1, VOCAB, (BATCH, SEQ), generator=g).masked_fill(~real, PAD)
        token_types = ((positions >= (lengths // 2)[:, None]) & real).long()
        masked = (torch.rand(BATCH, SEQ, generator=g) < 0.3) & real
        masked[:, 1] = True
        labels = torch.randint(PAD + 1, VOCAB, (BATCH, SEQ), generator=g).masked_fill(~masked, -100)
        pair = torch.randint(0, 2, (BATCH,), generator=g)
        steps.append(
            dict(
                tokens=tokens,
                token_types=token_types,
                padding_mask=real,
                labels=labels,
                pair_labels=pair,
            )
        )
    return steps


def _batches_for(model: str):
    return _bert_batches() if model == "bert" else token_batches(STEPS, BATCH, SEQ, VOCAB)


def _shard_heads(t: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """This cp rank's tokens of a ``[b, h, S, d]`` tensor."""
    return shard_batch({"x": t.transpose(1, 2)}, SEQ, cp.size, cp.rank)["x"].transpose(1, 2)


def _cp_mask(key_mask, cp: CPGroup):
    """The whole sequence's key mask in cp order (what the model gathers)."""
    if key_mask is None:
        return None
    return torch.cat(
        [shard_batch({"m": key_mask}, SEQ, cp.size, r)["m"] for r in range(cp.size)], 1
    )


def _ring_op_checks(ctx) -> dict:
    """ring_attention against one process's attention, forward and backward, with GQA,
    causal and bidirectional with padding (a batch row with no real key at all), through
    the reference op (float64) and torch's CPU flash kernel (float32), the same cases
    for the allgather method, and the recorded order of one forward and its backward."""
    layout = ParallelLayout.build(
        LayoutSpec(cp=ctx.world_size), ctx.backend.collective, ctx.rank, ctx.world_size
    )
    trace: list = []
    cp = CPGroup.from_layout(layout, ctx.backend)
    cp.trace = trace
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, h, SEQ, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    dout = torch.randn(2, 4, SEQ, 8, generator=g, dtype=torch.float64)
    mask = torch.arange(SEQ)[None, :] < torch.tensor([[11], [0]])  # row 1: no key at all
    errors = {}
    native = types.SimpleNamespace(attention_lse=cpu_flash_attention_lse)
    for causal, key_mask in ((True, None), (False, mask), (True, mask)):
        # torch's CPU flash kernel (float32) in the ring, as a backend would serve it.
        local = [_shard_heads(t, cp).float().requires_grad_() for t in (q, k, v)]
        got = ring_attention(*local, causal, _cp_mask(key_mask, cp), cp, native)
        got_grads = torch.autograd.grad(got, local, _shard_heads(dout, cp).float())
        cp.trace = None  # the trace holds the first forward and its backward
        want = [t.float().requires_grad_() for t in (q, k, v)]
        ref = attention(*want, causal=causal, key_padding_mask=key_mask)
        want_grads = torch.autograd.grad(ref, want, dout.float())
        errors[f"native causal={causal} mask={key_mask is not None}"] = [
            rel_error(a, _shard_heads(b, cp))
            for a, b in zip((got, *got_grads), (ref.detach(), *want_grads), strict=True)
        ]
    for causal, key_mask in ((True, None), (False, mask), (True, mask)):
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        want = attention(*full, causal=causal, key_padding_mask=key_mask)
        want_grads = torch.autograd.grad(want, full, dout)
        local = [_shard_heads(t, cp).clone().requires_grad_() for t in (q, k, v)]
        got = ring_attention(*local, causal, _cp_mask(key_mask, cp), cp, ctx.backend.kernels)
        got_grads = torch.autograd.grad(got, local, _shard_heads(dout, cp))
        key = f"causal={causal} mask={key_mask is not None}"
        errors[key] = [rel_error(got, _shard_heads(want.detach(), cp))] + [
            rel_error(a, _shard_heads(b, cp)) for a, b in zip(got_grads, want_grads, strict=True)
        ]
        errors[key + " finite"] = all(torch.isfinite(t).all().item() for t in (got, *got_grads))
        # allgather's causal chunks (keys before the chunk merged with its own block).
        gather = dataclasses.replace(cp, method="allgather")
        local = [_shard_heads(t, cp).clone().requires_grad_() for t in (q, k, v)]
        got = context_attention(*local, gather, ctx.backend.kernels, causal, _cp_mask(key_mask, cp))
        got_grads = torch.autograd.grad(got, local, _shard_heads(dout, cp))
        errors["allgather " + key] = [rel_error(got, _shard_heads(want.detach(), cp))] + [
            rel_error(a, _shard_heads(b, cp)) for a, b in zip(got_grads, want_grads, strict=True)
        ]
        finite = all(torch.isfinite(t).all().item() for t in (got, *got_grads))
        errors["allgather " + key + " finite"] = finite
    errors.update(_window_checks(cp, ctx.backend.kernels, (q, k, v), dout, mask))
    return {"errors": errors, "trace": trace}


def _window_checks(cp: CPGroup, kernels, qkv, dout, mask) -> dict:
    """Each method with a sliding window (3: inside one chunk of 4; 6: across chunks)
    against one process's windowed attention, forward and backward (float64)."""
    errors = {}
    for window, key_mask in ((3, None), (6, mask)):
        full = [t.clone().requires_grad_() for t in qkv]
        want = attention(*full, causal=True, key_padding_mask=key_mask, window=window)
        want_grads = torch.autograd.grad(want, full, dout)
        for method in ("ring", "allgather", "a2a"):
            group = dataclasses.replace(cp, method=method, trace=None)
            local = [_shard_heads(t, cp).clone().requires_grad_() for t in qkv]
            got = context_attention(
                *local, group, kernels, True, _cp_mask(key_mask, cp), window=window
            )
            got_grads = torch.autograd.grad(got, local, _shard_heads(dout, cp))
            errors[f"window={window} {method}"] = [
                rel_error(a, _shard_heads(b, cp))
                for a, b in zip((got, *got_grads), (want.detach(), *want_grads), strict=True)
            ]
    return errors


def _capacity_under_cp(ctx) -> str:
    """The error building a dropping (capacity-limited) MoE model under cp2 raises."""
    layout = ParallelLayout.build(LayoutSpec(cp=2), ctx.backend.collective, ctx.rank, 2)
    moe = MODELS["moe"].moe.model_copy(update={"capacity_factor": 1.0})
    config = MODELS["moe"].model_copy(update={"moe": moe})
    try:
        Engine(config, layout, ctx.backend, micro_batch_size=MB, num_microbatches=1, optimizer=OPT)
    except ValueError as e:
        return str(e)
    return ""


def _op_checks(ctx) -> dict | None:
    """The ring op and the capacity refusal, on the 2-rank spawn."""
    if ctx.world_size != 2:
        return None
    return {"ring_op": _ring_op_checks(ctx), "capacity_under_cp": _capacity_under_cp(ctx)}


# The reference takes the same micro-batches (a MoE aux loss is per micro-batch).
SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=5,
              reference_micro_batch_size=MB, extras=_op_checks)  # fmt: skip


def _spawn(cases: dict) -> Runs:
    return spawn(SETUP, cases, {m: _batches_for(m) for m in {case.model for case in cases.values()}})


@pytest.fixture(scope="module")
def runs():
    return _spawn(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_matches_one_process(runs, case):
    assert_matches(SETUP, case, CASES[case], *runs[case])


@pytest.mark.slow
def test_cp4_and_long_compositions_match_one_process():
    out = _spawn(SLOW_CASES)
    for case in SLOW_CASES:
        assert_matches(SETUP, case, SLOW_CASES[case], *out[case])


def test_ring_and_allgather_ops_match_one_process_with_fully_masked_rows(runs):
    for rank, result in enumerate(e["ring_op"] for e in runs.extras[2]):
        for key, errors in result["errors"].items():
            if key.endswith("finite"):
                assert errors, f"rank {rank} {key}: NaN or inf"
            elif key.startswith("native"):
                assert max(errors) <= 1e-5, (
                    f"rank {rank} {key}: out, dq, dk, dv rel errors {errors}"
                )
            else:
                assert max(errors) <= 1e-12, (
                    f"rank {rank} {key}: out, dq, dk, dv rel errors {errors}"
                )


def test_ring_posts_next_block_before_computing_the_current_one(runs):
    """The recorded order: block t+1's send/receive is posted before block t's compute,
    and waited for only after it."""
    for result in (e["ring_op"] for e in runs.extras[2]):
        forward = result["trace"][:4]
        assert forward == [("post", 1), ("compute", 0), ("wait", 1), ("compute", 1)], forward


def test_ring_backward_overlaps_both_hops_with_the_next_blocks_gradients(runs):
    """Backward: block 1's K/V is posted before block 0's gradients are computed, and
    block 0's dK/dV hop right after they are added; the K/V is waited for before block
    1's gradients, the dK/dV only after them (so it hides behind them), and the last
    hop returns this rank's own dK/dV."""
    for result in (e["ring_op"] for e in runs.extras[2]):
        backward = result["trace"][4:]
        assert backward == [
            ("post", 1),
            ("grad", 0),
            ("post dkv", 0),
            ("wait", 1),
            ("grad", 1),
            ("wait dkv", 0),
            ("post dkv", 1),
            ("wait dkv", 1),
        ], backward


def test_moe_capacity_dropping_is_refused_under_cp(runs):
    """A cp rank cannot rank the micro-batch's assignments as one process does."""
    for message in (e["capacity_under_cp"] for e in runs.extras[2]):
        assert "capacity_factor=1.0" in message and "cp=2" in message, message


def test_clipping_was_active(runs):
    _, ref = runs["cp2_ring"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_load_balanced_split_gives_every_rank_the_same_causal_work(cp):
    seq = 64
    work = [causal_pairs(seq, cp, r) for r in range(cp)]
    assert len(set(work)) == 1, work
    assert sum(work) == seq * (seq + 1) // 2
    # A contiguous split would not be balanced: its last rank does (2cp - 1)x the first's work.
    contiguous = [sum(range(r * seq // cp + 1, (r + 1) * seq // cp + 1)) for r in range(cp)]
    assert contiguous[-1] > contiguous[0]
