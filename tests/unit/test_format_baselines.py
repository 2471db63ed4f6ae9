"""benchmarks/format_baselines.py's context-free BERT predictor, against the same Bayes
predictor worked out case by case on a five-token vocabulary (docs/models.md quotes its
loss and accuracy on the embedded corpus)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "format_baselines.py"


def _baselines():
    spec = importlib.util.spec_from_file_location("format_baselines", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def enumerated(probs, valid, replacement_ids):
    """Every (answer, what the position shows) case with its weight; the predictor's
    distribution is the posterior over the answer given what it sees."""
    vocab = len(probs)
    uniform = np.zeros(vocab)
    uniform[replacement_ids] = 1 / len(replacement_ids)
    loss = right = 0.0
    for answer in valid:
        cases = [(0.8, probs)]  # [MASK]: the prior
        shown = [(0.1, answer)] + [(0.1 * uniform[r], r) for r in replacement_ids]
        for weight, visible in shown:  # kept, or each random replacement
            joint = 0.1 * uniform[visible] * probs
            joint[visible] += 0.1 * probs[visible]
            cases.append((weight, joint / joint.sum()))
        for weight, predicted in cases:
            loss -= weight * math.log(predicted[answer]) / len(valid)
            right += weight * (int(np.argmax(predicted)) == answer) / len(valid)
    return loss, right


def test_the_context_free_predictor_is_the_bayes_one():
    probs = np.array([0.001, 0.5, 0.25, 0.148, 0.101])  # id 0 special: never a replacement; no ties
    valid = np.array([1, 1, 2, 3, 4, 4, 4, 2, 1, 3, 2])
    replacement_ids = np.array([1, 2, 3, 4])
    loss, accuracy = _baselines().bert_format_only(probs, valid, replacement_ids)
    expected_loss, expected_accuracy = enumerated(probs, valid, replacement_ids)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    assert accuracy == pytest.approx(expected_accuracy, rel=1e-12)
    # Reading the visible token is worth something: below the unigram cross-entropy.
    assert loss < -np.log(probs[valid]).mean()
