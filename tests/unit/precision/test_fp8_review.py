"""FP8 edge cases found in review: each test failed before its fix."""

from __future__ import annotations

import torch

from mtcore.backend import select_backend
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
