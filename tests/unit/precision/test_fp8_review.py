"""FP8 edge cases found in review: each test failed before its fix."""

from __future__ import annotations

import torch

from mtcore.backend import select_backend
from mtcore.data import lm_batches
from mtcore.precision.fp8 import FP8Recipe, FP8Scaling


def test_delayed_scale_stays_finite_for_a_tiny_amax():
    """An amax below fp8_max / float32_max (~1e-36) made ``fp8_max / amax`` infinite:
    zeros quantized to NaN (0 * inf) and every other element dequantized to 0.
    The delayed scale is capped at the largest float32, as the current recipe's is."""
    scaling = FP8Scaling(FP8Recipe(scaling="delayed"), select_backend("cpu").fp8)
    x = torch.tensor([[1e-38, 0.0, -5e-39, 2e-38]])
    for _ in range(2):  # the just-in-time first call, then the history's scale
        with torch.enable_grad():
            q = scaling.quantize(x, "input")
        back = q.dequantize()
        assert torch.isfinite(scaling.scale).all(), scaling.scale
        assert torch.isfinite(back).all(), back
        assert back[0, 3] > 0 and back[0, 2] < 0, back  # not flushed to zero
        torch.testing.assert_close(back, x, rtol=0.07, atol=0.0)


def _train(recompute: str, moe: dict | None, steps: int = 2) -> list[tuple[float, float]]:
    from mtcore.models.gpt import GPTConfig
    from mtcore.parallel.layout import ParallelLayout
    from mtcore.precision import MixedPrecision
    from mtcore.training.config import OptimizerConfig
    from mtcore.training.engine import Engine

    config = GPTConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16,
        recompute=recompute, moe=moe,
    )  # fmt: skip
    engine = Engine(
        config,
        ParallelLayout.single(),
        select_backend("cpu"),
        micro_batch_size=2,
        num_microbatches=2,
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0),
        precision=MixedPrecision("fp32", fp8=FP8Recipe(scaling="delayed")),
    )
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        batch = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]
        result = engine.train_step(lm_batches(batch, batch))
        out.append((result.loss, result.grad_norm))
    return out


def test_delayed_recompute_replays_the_forward_scales():
    """A recomputed forward must quantize with the scales its original forward used.

    It used the latest ones, which that forward (and later micro-batches) had already
    moved: the recomputed activations differed from the forward's, so the gradient was
    not the forward's, and in a MoE model the router chose other experts, which
    ``torch.utils.checkpoint`` rejects (CheckpointError: different shapes)."""
    moe = dict(num_experts=4, top_k=2, ffn_size=32)
    for model in (None, moe):
        plain, recomputed = _train("none", model), _train("full", model)
        assert recomputed == plain, (model, plain, recomputed)
