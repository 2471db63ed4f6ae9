"""BERT trains the same under any layout as in one process (gloo, two spawns).

Every case runs the trainer's ``Engine`` for three optimizer steps on the same
global batches (fp32, clipping active), in micro-batches of 2, and is compared
with a one-process ``Engine`` that takes each global batch as one micro-batch
(the plain token-weighted mean): the loss and its terms (MLM, pair) at every step, the gradient norm,
every gradient of the first step (gathered whole), the evaluation metrics and
the weights after the last step, relative error <= 1e-5.

The batches pad every sequence to a different length and the two halves of the
global batch differ a lot (short sequences first), so the ranks of a dp2 run hold
different numbers of masked tokens: a mean of micro-batch means (over
micro-batches or dp) would not match one process.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.models.bert import BertConfig
from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn
from mtcore.training.config import OptimizerConfig

STEPS, BATCH, MB, SEQ, VOCAB, PAD = 3, 8, 2, 16, 64, 4
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4, seq_len=SEQ)
MODELS = {
    "nsp": BertConfig(dropout=0.0, init_std=0.1, pair_task="nsp", **SIZES),
    "nsp_full": BertConfig(dropout=0.0, init_std=0.1, pair_task="nsp", recompute="full", **SIZES),
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=5)
CASES = {
    "tp2": Case(2, "nsp", dict(tp=2)),
    "tp2_sp": Case(2, "nsp", dict(tp=2, sequence_parallel=True)),
    "pp2": Case(2, "nsp", dict(pp=2)),
    "pp2_vpp2": Case(2, "nsp", dict(pp=2, vpp=2)),
    "dp2_zero1": Case(2, "nsp", dict(dp=2), zero1=True),
    "tp2_pp2": Case(4, "nsp", dict(tp=2, pp=2)),
    "tp2_dp2_full": Case(4, "nsp_full", dict(tp=2, dp=2)),
}


def _batches() -> list[list[dict[str, torch.Tensor]]]:
    """STEPS global batches of BATCH padded sentence pairs, shortest first."""
    g = torch.Generator().manual_seed(11)
    steps = []
    for _ in range(STEPS):
        lengths = torch.sort(torch.randint(5, SEQ + 1, (BATCH,), generator=g)).values
        lengths[: BATCH // 2] = torch.clamp(lengths[: BATCH // 2] // 2, min=5)
        positions = torch.arange(SEQ)[None, :]
        real = positions < lengths[:, None]
        tokens = torch.randint(PAD + 1, VOCAB, (BATCH, SEQ), generator=g).masked_fill(~real, PAD)
        split = (lengths // 2)[:, None]
        token_types = ((positions >= split) & real).long()
        masked = (torch.rand(BATCH, SEQ, generator=g) < 0.3) & real
        masked[:, 1] = True  # at least one masked token per sequence
        labels = torch.randint(PAD + 1, VOCAB, (BATCH, SEQ), generator=g).masked_fill(~masked, -100)
        pair = torch.randint(0, 2, (BATCH,), generator=g)
        full = dict(tokens=tokens, token_types=token_types, padding_mask=real, labels=labels, pair_labels=pair)
        steps.append(full)
    return steps


@pytest.fixture(scope="module")
def runs():
    return spawn(SETUP, CASES, _batches())


@pytest.mark.parametrize("case", list(CASES))
def test_bert_layout_matches_one_process(runs, case):
    names = {"loss", "mlm", "pair", "mlm_accuracy", "pair_accuracy"}
    assert_matches(SETUP, case, CASES[case], *runs[case], eval_names=names)


def test_the_batches_weight_ranks_unequally(runs):
    """The two dp halves hold different numbers of masked tokens (the weighting matters),
    and clipping was active (the clipped path is what matched)."""
    batches = _batches()
    halves = [(b["labels"][rows] != -100).sum().item() for b in batches for rows in (slice(0, 4), slice(4, 8))]
    assert any(halves[i] != halves[i + 1] for i in range(0, len(halves), 2)), halves
    _, ref = runs["tp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]
