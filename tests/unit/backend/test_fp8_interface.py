"""FP8 interface: which path scaled_matmul takes for shapes the device GEMM refuses."""

from __future__ import annotations

import torch

from mtcore.backend import FP8

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
        expected = a.dequantize() @ b.dequantize().t()
        assert torch.equal(fp8.scaled_matmul(a, b), expected), (m, k, n)


def test_aligned_shapes_run_native_and_agree_with_the_fallback():
    fp8, a, b = _operands(5, 32, 48)
    native = fp8.scaled_matmul(a, b)
    fallback = a.dequantize() @ b.dequantize().t()
    assert native.shape == (5, 48)
    torch.testing.assert_close(native, fallback, rtol=1e-5, atol=1e-5)
