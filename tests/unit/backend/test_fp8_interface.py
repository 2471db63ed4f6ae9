"""FP8 interface: which path scaled_matmul takes for shapes the device GEMM refuses."""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import FP8, cpu_scaled_mm_pairs
from mtcore.backend.fp8 import fallback_scaled_matmul

# torch 2.7 has no CPU torch._scaled_mm (from 2.8): the native path cannot run there.
needs_cpu_scaled_mm = pytest.mark.skipif(
    ("tensor", "tensor") not in cpu_scaled_mm_pairs(),
    reason="no CPU torch._scaled_mm before torch 2.8",
)
E4M3 = torch.float8_e4m3fn


def _operands(m: int, k: int, n: int):
    g = torch.Generator().manual_seed(0)
    fp8 = FP8(native_granularities=frozenset({("tensor", "tensor")}))
    a = fp8.quantize(torch.randn(m, k, generator=g), E4M3)
    b = fp8.quantize(torch.randn(n, k, generator=g), E4M3)
    return fp8, a, b


def test_k_or_n_not_multiple_of_16_takes_the_dequantize_path():
    for m, k, n in [(8, 20, 32), (8, 32, 24), (3, 40, 8)]:
        fp8, a, b = _operands(m, k, n)
        expected = fallback_scaled_matmul(a, b, torch.float32)
        assert torch.equal(fp8.scaled_matmul(a, b), expected), (m, k, n)


@needs_cpu_scaled_mm
def test_aligned_shapes_run_native_and_agree_with_the_fallback():
    fp8, a, b = _operands(5, 32, 48)
    native = fp8.scaled_matmul(a, b)
    fallback = a.dequantize() @ b.dequantize().t()
    assert native.shape == (5, 48)
    torch.testing.assert_close(native, fallback, rtol=1e-5, atol=1e-5)


def test_the_fallback_sums_fp8_values_then_scales_in_float32():
    """Per tensor and per row: the exact product (float64 here) rounded as one float32
    or bfloat16 GEMM rounds it; a K split in two (tensor parallel's row-parallel
    linear) sums to the same float32 result to a few ulps of the largest element."""
    g = torch.Generator().manual_seed(1)
    fp8 = FP8()
    x, w = torch.randn(24, 96, generator=g) * 3, torch.randn(40, 96, generator=g) * 0.02
    for granularity in ("tensor", "row"):
        a, b = fp8.quantize(x, E4M3, granularity), fp8.quantize(w, E4M3, granularity)
        exact = a.dequantize().double() @ b.dequantize().double().t()
        top = exact.abs().max()
        got = fallback_scaled_matmul(a, b, torch.float32).double()
        assert (got - exact).abs().max() <= 1e-6 * top, granularity
        bf16 = fallback_scaled_matmul(a, b, torch.bfloat16)
        assert bf16.dtype == torch.bfloat16
        assert ((bf16.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-6 * top).all()
        if granularity == "tensor":
            halves = [
                fp8.quantize(t[:, cols], E4M3, scale=1 / q.scale_inv)
                for cols in (slice(0, 48), slice(48, 96))
                for t, q in ((x, a), (w, b))
            ]
            split = sum(
                fallback_scaled_matmul(halves[i], halves[i + 1], torch.float32) for i in (0, 2)
            )
            assert (split.double() - exact).abs().max() <= 1e-6 * top
