"""The conformance kit's bias check (``kernel_cases.check_unbiased``) on its own.

It must pass honest bfloat16 rounding on every tensor (a false alarm would fail
a correct vendor kernel) and fail a kernel whose errors do not average out,
even when each element is within the element-wise tolerance. In-process: the
kit's subprocess runs (test_conformance_cpu.py, test_conformance_lies.py) show
the same on real kernels and plugins.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.backend.checks.kernel_cases import (
    MIN_EFFECTIVE_ELEMENTS,
    TOLERANCES,
    check_unbiased,
    compare,
)


def _exact(seed: int, n: int) -> torch.Tensor:
    """float64 values of mixed sign and magnitude, as kernel outputs are."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(
        torch.randn(n, generator=g, dtype=torch.float64)
    )


def _truncated(x: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 by dropping the low 16 bits (round toward zero)."""
    bits = x.float().contiguous().view(torch.int32) & ~0xFFFF
    return bits.view(torch.float32).to(torch.bfloat16)


def test_honest_rounding_passes_on_every_seed_and_size():
    for seed in range(300):
        want = _exact(seed, n=[64, 300, 1000, 5000][seed % 4])
        check_unbiased(want.to(torch.bfloat16), want, f"seed {seed}")


@pytest.mark.parametrize("n", [300, 1000, 10000])
def test_one_percent_high_fails_though_within_tolerance(n):
    want = _exact(7, n)
    got = (want * 1.01).to(torch.bfloat16)
    compare(got, want, "biased", TOLERANCES[torch.bfloat16])  # element-wise: passes
    with pytest.raises(AssertionError, match=r"relative error \+0\.0(09|1).* systematic bias"):
        check_unbiased(got, want, "biased")


def test_one_percent_low_fails_whatever_the_signs():
    want = -_exact(8, 1000).abs()  # all negative: the bias is relative, not absolute
    with pytest.raises(AssertionError, match=r"relative error -0\.0(09|1)"):
        check_unbiased((want * 0.99).to(torch.bfloat16), want, "biased")


def test_truncating_to_bfloat16_is_a_bias():
    want = _exact(9, 2000)
    with pytest.raises(AssertionError, match="systematic bias"):
        check_unbiased(_truncated(want), want, "truncated")


def test_small_tensors_other_dtypes_and_infinities_are_not_checked():
    few = torch.ones(MIN_EFFECTIVE_ELEMENTS - 1, dtype=torch.float64)
    check_unbiased((few * 1.01).to(torch.bfloat16), few, "too few elements")
    want = _exact(10, 1000)
    check_unbiased((want * 1.01).float(), want, "float32: its element-wise rtol catches this")
    lse = want.clone()
    lse[::3] = float("-inf")  # rows without keys: skipped, the rest is honest
    check_unbiased(lse.to(torch.bfloat16), lse, "lse")
