"""The fused quantize-and-transpose spec and its place on the FP8 interface."""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import FP8
from mtcore.ops import REFERENCE_OPS, fp8_dequantize, fp8_quantize, fp8_quantize_transpose

E4M3 = torch.float8_e4m3fn


def _x(m=130, k=257):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(3)) * 2.0


@pytest.mark.parametrize("granularity", ["tensor", "row", "1x128", "128x128"])
def test_transpose_half_is_the_transpose_quantized_along_its_rows(granularity):
    x = _x()
    (d, s, a), (dt, st, at) = fp8_quantize_transpose(x, E4M3, granularity)
    rd, rs, ra = fp8_quantize(x, E4M3, granularity)
    assert torch.equal(d.float(), rd.float()) and torch.equal(s, rs) and torch.equal(a, ra)
    assert dt.shape == (257, 130) and dt.is_contiguous()
    # Dequantized, the transpose half is x.T within the format's half-step bound.
    back = fp8_dequantize(dt, st, granularity)
    assert torch.allclose(back, x.t(), rtol=2.0**-4, atol=st.max().item() * 2.0**-9)
    unit_t = {"tensor": (), "row": (257, 1), "1x128": (257, 2), "128x128": (3, 2)}
    assert tuple(st.shape) == unit_t[granularity] == tuple(at.shape)
    if granularity in ("tensor", "128x128"):  # same scaling units, transposed
        assert torch.equal(st, s.t()) and torch.equal(dt.float(), d.float().t())
    else:  # the units are columns of x now: their amax is the column max
        col = x.abs().amax(0)
        assert torch.equal(at.amax(1) if granularity == "1x128" else at[:, 0], col)


def test_given_scale_serves_both_halves_and_bad_input_is_named():
    x = _x(5, 7)
    (_, s, _), (_, st, _) = fp8_quantize_transpose(x, E4M3, "tensor", 4.0)
    assert s.item() == st.item() == 0.25
    with pytest.raises(ValueError, match="2-D"):
        fp8_quantize_transpose(x[0], E4M3, "tensor")
    with pytest.raises(ValueError, match="only allowed for 'tensor'"):
        fp8_quantize_transpose(x, E4M3, "row", 4.0)
    assert REFERENCE_OPS["fp8_quantize_transpose"] is fp8_quantize_transpose


def test_fp8_interface_quantize_transpose_uses_the_bound_kernel():
    calls = []

    def kernel(x, dtype, granularity, scale=None):
        calls.append(granularity)
        return fp8_quantize_transpose(x, dtype, granularity, scale)

    fp8 = FP8().bound_to(fp8_quantize, kernel)
    q, qt = fp8.quantize_transpose(_x(), E4M3, "1x128")
    assert calls == ["1x128"]
    assert q.granularity == qt.granularity == "1x128"
    assert q.data.shape == (130, 257) and qt.data.shape == (257, 130)
    torch.testing.assert_close(qt.dequantize(), q.dequantize().t(), rtol=0.13, atol=0.05)
    # Unbound, the interface falls back to the reference op; bad granularities are named.
    _, plain_qt = FP8().quantize_transpose(_x(), E4M3, "row")
    assert plain_qt.scale_inv.shape == (257, 1)
    with pytest.raises(ValueError, match="granularity"):
        FP8().quantize_transpose(_x(), E4M3, "2x2")
