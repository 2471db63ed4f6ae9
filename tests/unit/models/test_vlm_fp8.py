"""FP8 on LLaVA's language model: every linear of its transformer blocks runs FP8 under
the recipe (the vision tower, the projector and the output layer stay in the model
dtype), and the logits and gradients stay near the unquantized model's
(tests/unit/training/test_vlm_fp8_training.py: the trainer)."""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models import parse_model_config
from mtcore.models.vlm.model import build
from mtcore.parallel.layout import ParallelLayout
from mtcore.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from mtcore.precision.fp8 import FP8Recipe
from mtcore.testing.compare import rel_error

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(
    family="llava", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32,
    vocab_size=64, vision=dict(image_size=8, patch_size=4, hidden_size=32, num_layers=1, num_heads=2),
)  # fmt: skip
BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")


def _batch(config):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 60, (2, config.seq_len), generator=g)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, 3 : 3 + config.image_tokens] = True
    labels = tokens.roll(-1, 1).masked_fill(mask, -100)
    pixels = torch.randn(2, 1, 3, 8, 8, generator=g)
    return {"tokens": tokens, "labels": labels, "image_mask": mask, "pixel_values": pixels}


def _loss_and_grads(model, batch):
    logits = model(batch)
    loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100
    )
    loss.backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("scaling", ["current", "blockwise"])
def test_the_language_model_linears_run_fp8_near_the_unquantized_model(scaling):
    config = parse_model_config(SMALL)
    backend = select_backend("cpu")
    (plain,) = build(config, ParallelLayout.single(), backend, seed=3).chunks
    (fp8,) = build(
        config, ParallelLayout.single(), backend, seed=3, fp8=FP8Recipe("hybrid", scaling)
    ).chunks
    fp8.load_state_dict(plain.state_dict(), strict=False)
    linears = {
        n: m
        for n, m in fp8.named_modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    }
    on = sorted(n for n, m in linears.items() if m.fp8 is not None)
    assert on == sorted(f"layers.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS)
    assert any(n.startswith("vision.") for n in linears)  # the tower's linears: not FP8

    batch = _batch(config)
    want_logits, want_grads = _loss_and_grads(plain, batch)
    got_logits, got_grads = _loss_and_grads(fp8, batch)
    error = rel_error(got_logits, want_logits)
    assert 0 < error < 0.1, error  # quantized (not the same numbers), and close
    for name in (
        "layers.0.attn.qkv.weight",
        "layers.1.mlp.fc2.weight",
        "vision.layers.0.attn.qkv.weight",
    ):
        cosine = torch.nn.functional.cosine_similarity(
            got_grads[name].flatten(), want_grads[name].flatten(), dim=0
        )
        assert cosine > 0.98, (name, cosine.item())
