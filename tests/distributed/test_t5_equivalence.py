"""T5 trains the same under any layout as in one process (gloo, two spawns).

Every case runs the trainer's ``Engine`` for three optimizer steps on the same global
batches (fp32, clipping active), in micro-batches of 2, and is compared with a
one-process ``Engine`` that takes each global batch as one micro-batch (the plain
token-weighted mean): the loss at every step, the gradient norm, every gradient of the
first step (gathered whole), the evaluation metrics and the weights after the last
step, relative error <= 1e-5.

The pipeline cases put the encoder/decoder boundary at a stage boundary
(2 + 2 layers over pp2) and inside the second stage's run (2 + 4 layers: stage 0 holds
the encoder and the decoder's first layer), a tied head whose copy lives on the last
stage, and interleaved virtual stages (the encoder on rank 0 and rank 1's first chunks).
The context-parallel cases split the encoder (16) and decoder (8) sequences into four
chunks each, alone, with tp2 + sp, and with pp2; the bias buckets (``relative_max_distance``
12) tell apart distances that a shard's local positions would get wrong.
Encoder inputs and targets are padded to a different length per sequence
and the two dp halves hold different numbers of target tokens, so a mean of
micro-batch means would not match one process.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.models.t5 import T5Config
from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn
from mtcore.training.config import OptimizerConfig

STEPS, BATCH, MB, SEQ, DEC, VOCAB, PAD = 3, 8, 2, 16, 8, 64, 0
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, num_heads=4, ffn_hidden_size=64, seq_len=SEQ,
    decoder_seq_len=DEC, relative_buckets=8, relative_max_distance=12, dropout=0.0,
)  # fmt: skip
MODELS = {
    "base": T5Config(**SIZES),
    "deep_decoder": T5Config(decoder_layers=4, **SIZES),
    "tied": T5Config(tie_embeddings=True, **SIZES),
    "full": T5Config(recompute="full", **SIZES),
    "selective": T5Config(recompute="selective", **SIZES),
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=5)
CASES = {
    "tp2": Case(2, "base", dict(tp=2)),
    "tp2_sp": Case(2, "base", dict(tp=2, sequence_parallel=True)),
    "pp2_at_boundary": Case(2, "base", dict(pp=2)),
    "pp2_inside_decoder": Case(2, "deep_decoder", dict(pp=2)),
    "pp2_tied": Case(2, "tied", dict(pp=2)),
    "pp2_vpp2": Case(2, "base", dict(pp=2, vpp=2)),
    "dp2_zero1": Case(2, "base", dict(dp=2), zero1=True),
    "dp2_selective": Case(2, "selective", dict(dp=2)),
    "tp2_pp2": Case(4, "deep_decoder", dict(tp=2, pp=2)),
    "tp2_dp2_full": Case(4, "full", dict(tp=2, dp=2)),
    "tp2_pp2_sp_tied": Case(4, "tied", dict(tp=2, pp=2, sequence_parallel=True)),
    # context parallel: every attention all-gathers K/V, the biases see global positions
    "cp2": Case(2, "base", dict(cp=2, cp_method="allgather")),
    "cp2_tp2_sp": Case(4, "base", dict(cp=2, tp=2, sequence_parallel=True, cp_method="allgather")),
    "cp2_pp2": Case(4, "deep_decoder", dict(cp=2, pp=2, cp_method="allgather")),
}


def _batches() -> list[dict[str, torch.Tensor]]:
    """STEPS global batches of BATCH padded pairs (input, target), shortest first."""
    g = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(STEPS):
        enc_len = torch.sort(torch.randint(3, SEQ + 1, (BATCH,), generator=g)).values
        dec_len = torch.sort(torch.randint(2, DEC + 1, (BATCH,), generator=g)).values
        enc_len[: BATCH // 2] = torch.clamp(enc_len[: BATCH // 2] // 2, min=3)
        dec_len[: BATCH // 2] = torch.clamp(dec_len[: BATCH // 2] // 2, min=2)
        enc_real = torch.arange(SEQ)[None, :] < enc_len[:, None]
        dec_real = torch.arange(DEC)[None, :] < dec_len[:, None]
        tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g).masked_fill(~enc_real, PAD)
        target = torch.randint(1, VOCAB, (BATCH, DEC), generator=g)
        decoder = torch.cat([torch.full((BATCH, 1), PAD), target[:, :-1]], 1).masked_fill(
            ~dec_real, PAD
        )
        labels = target.masked_fill(~dec_real, -100)
        steps.append(
            dict(tokens=tokens, padding_mask=enc_real, decoder_tokens=decoder, labels=labels)
        )
    return steps


@pytest.fixture(scope="module")
def runs():
    return spawn(SETUP, CASES, _batches())


@pytest.mark.parametrize("case", list(CASES))
def test_t5_layout_matches_one_process(runs, case):
    assert_matches(SETUP, case, CASES[case], *runs[case], eval_names={"loss", "lm", "accuracy"})


def test_the_batches_weight_ranks_unequally(runs):
    """The dp halves hold different numbers of target tokens (the weighting matters),
    and clipping was active (the clipped path is what matched)."""
    batches = _batches()
    halves = [
        (b["labels"][rows] != -100).sum().item()
        for b in batches
        for rows in (slice(0, 4), slice(4, 8))
    ]
    assert any(halves[i] != halves[i + 1] for i in range(0, len(halves), 2)), halves
    _, ref = runs["tp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]
