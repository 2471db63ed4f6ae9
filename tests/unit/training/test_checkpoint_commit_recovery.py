"""Committing a step that is already committed (a rewound run saving the same step
again) swaps directories: ``step_N`` -> ``step_N.replaced-<pid>``, then the new
``step_N.partial`` -> ``step_N``. A kill between the two renames must not lose the only
committed copy of step N: the set-aside directory stays loadable until a later commit
of that step replaces it."""

from __future__ import annotations

import os

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.training.checkpoint import (
    IncompleteCheckpointWarning,
    has_checkpoint,
    read_model_weights,
    resolve_checkpoint,
    write_model_weights,
)

CONFIG = GPTConfig(
    hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, seq_len=16, vocab_size=64
)


def test_a_kill_mid_swap_keeps_the_old_copy_loadable(tmp_path):
    model = GPT(CONFIG, single_context(CONFIG, select_backend("cpu"), seed=1))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    root = tmp_path / "ck"
    write_model_weights(root, weights, CONFIG, step=5)
    # The disk as a kill between commit()'s two renames leaves it:
    os.rename(root / "step_000005", root / "step_000005.replaced-4242")
    (root / "step_000005.partial").mkdir()
    assert has_checkpoint(root)
    with pytest.warns(IncompleteCheckpointWarning):  # the new copy's .partial
        found = resolve_checkpoint(root)
    assert found.name == "step_000005.replaced-4242"
    with pytest.warns(IncompleteCheckpointWarning):
        _, back, step = read_model_weights(root)
    assert step == 5 and all(torch.equal(back[k], weights[k]) for k in weights)

    # Committing step 5 again replaces it and clears the set-aside copy.
    write_model_weights(root, weights, CONFIG, step=5)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_000005"]
