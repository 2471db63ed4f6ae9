"""gmlp trains the same under every layout it supports as in one process.

mtcore's equivalence harness (``mtcore.testing.equivalence``) runs the trainer's own
engine on 2 and then 4 CPU ranks (gloo) and compares each layout with a one-process
run on the same batches: the loss and gradient norm of every step, the evaluation loss
and accuracy, the first step's gradients and the final weights, all gathered whole.
Run it with the family installed: ``python -m pytest tests``.
"""

from __future__ import annotations

import pytest

from mtcore.testing.equivalence import Case, Setup, assert_matches, spawn, token_batches
from mtcore.training.config import OptimizerConfig
from mtcore_example_family import GMLPConfig

STEPS, BATCH, MB, SEQ, VOCAB = 3, 8, 2, 16, 64
MODELS = {
    "gmlp": GMLPConfig(vocab_size=VOCAB, hidden_size=32, gate_size=64, gate_heads=4,
                       seq_len=SEQ, num_layers=4, init_std=0.1),
}  # fmt: skip
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
SETUP = Setup(MODELS, OPT, batch_size=BATCH, micro_batch_size=MB, seed=3)
CASES = {
    "tp2": Case(2, "gmlp", {"tp": 2}),
    "tp2_sp": Case(2, "gmlp", {"tp": 2, "sequence_parallel": True}),
    "pp2_vpp2": Case(2, "gmlp", {"pp": 2, "vpp": 2}),
    "dp2_zero1": Case(2, "gmlp", {"dp": 2}, zero1=True),
    "tp2_pp2": Case(4, "gmlp", {"tp": 2, "pp": 2}),
}


@pytest.fixture(scope="module")
def runs():
    return spawn(SETUP, CASES, token_batches(STEPS, BATCH, SEQ, VOCAB))


@pytest.mark.parametrize("case", list(CASES))
def test_layout_matches_one_process(runs, case):
    assert_matches(SETUP, case, CASES[case], *runs[case], eval_names={"loss", "lm", "accuracy"})


def test_clipping_was_active(runs):
    _, ref = runs["tp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]
