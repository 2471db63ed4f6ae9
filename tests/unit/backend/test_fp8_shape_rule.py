"""The FP8 GEMM shape rule is the backend's: ``FP8(shape_ok=...)`` decides which operand
shapes go to ``torch._scaled_mm``; the default (K and N multiples of 16) is unchanged."""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import FP8, Availability, cpu_scaled_mm_pairs
from mtcore.backend.fp8 import fallback_scaled_matmul, k_n_multiple_of

# torch 2.7 has no CPU torch._scaled_mm (from 2.8): the native path cannot run there.
needs_cpu_scaled_mm = pytest.mark.skipif(
    ("tensor", "tensor") not in cpu_scaled_mm_pairs(),
    reason="no CPU torch._scaled_mm before torch 2.8",
)
E4M3 = torch.float8_e4m3fn
TENSORWISE = frozenset({("tensor", "tensor")})


def _operands(fp8: FP8, m: int, k: int, n: int):
    g = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    return (
        fp8.quantize(torch.randn(m, k, generator=g), E4M3),
        fp8.quantize(torch.randn(n, k, generator=g), E4M3),
    )


@pytest.mark.parametrize(
    ("multiple", "k", "n", "ok"),
    [(16, 48, 16, True), (32, 48, 32, False), (32, 32, 48, False), (32, 64, 256, True)],
)
def test_k_n_multiple_of(multiple, k, n, ok):
    rule = k_n_multiple_of(multiple)
    assert rule(torch.empty(16, k), torch.empty(n, k)) is ok
    assert rule(torch.empty(3, k), torch.empty(n, k)) is ok  # M is free


def test_default_rule_is_k_and_n_multiples_of_16():
    fp8 = FP8(TENSORWISE)
    assert fp8.shape_ok(torch.empty(4, 48), torch.empty(16, 48))
    assert not fp8.shape_ok(torch.empty(4, 24), torch.empty(16, 24))
    assert not fp8.shape_ok(torch.empty(4, 32), torch.empty(24, 32))


@needs_cpu_scaled_mm
def test_the_rule_decides_the_path_and_sees_the_quantized_operands():
    asked = []

    def rule_32(a, b):
        asked.append((tuple(a.shape), tuple(b.shape), a.dtype))
        return k_n_multiple_of(32)(a, b)

    fp8 = FP8(TENSORWISE, shape_ok=rule_32)
    a, b = _operands(fp8, 8, 48, 32)  # K = 48: fine for 16, not for 32
    out = fp8.scaled_matmul(a, b)
    assert asked == [((8, 48), (32, 48), E4M3)]
    assert torch.equal(out, fallback_scaled_matmul(a, b, torch.float32))

    a, b = _operands(fp8, 8, 64, 32)
    native = torch._scaled_mm(
        a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv, out_dtype=torch.float32
    )
    assert torch.equal(fp8.scaled_matmul(a, b), native)


def test_the_rule_is_not_asked_for_a_pair_that_is_not_native():
    asked = []
    fp8 = FP8(frozenset(), shape_ok=lambda a, b: asked.append(1) or True)
    a, b = _operands(fp8, 4, 32, 32)
    fp8.scaled_matmul(a, b)
    assert asked == []


def test_gated_and_bound_copies_keep_the_rule():
    rule = k_n_multiple_of(32)
    gated = FP8.gated(TENSORWISE, lambda: Availability(True), shape_ok=rule)
    assert gated.shape_ok is rule
    assert gated.bound_to(lambda *a: None).shape_ok is rule
    assert FP8.gated(TENSORWISE, lambda: Availability(True)).shape_ok(
        torch.empty(2, 48), torch.empty(16, 48)
    )


def test_a_multiple_below_one_is_refused():
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        k_n_multiple_of(0)
