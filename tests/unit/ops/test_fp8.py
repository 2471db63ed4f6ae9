"""fp8_quantize / fp8_dequantize against a per-unit loop and the format's rounding bound."""

import math

import pytest
import torch

from mtcore.ops import FP8_MAX, GRANULARITIES, fp8_dequantize, fp8_quantize

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (mantissa bits, smallest normal exponent) of each format.
FORMAT = {E4M3: (3, -6), E5M2: (2, -14)}


def _units(m, k, gran):
    """Yield (unit index, row slice, col slice) by plain loops: the independent spec."""
    if gran == "tensor":
        yield (), slice(0, m), slice(0, k)
    elif gran == "row":
        for i in range(m):
            yield (i, 0), slice(i, i + 1), slice(0, k)
    else:
        rows = 1 if gran == "1x128" else 128
        for bi in range(math.ceil(m / rows)):
            for bj in range(math.ceil(k / 128)):
                yield (bi, bj), slice(bi * rows, (bi + 1) * rows), slice(bj * 128, (bj + 1) * 128)


def _unit_shape(m, k, gran):
    return {
        "tensor": (),
        "row": (m, 1),
        "1x128": (m, math.ceil(k / 128)),
        "128x128": (math.ceil(m / 128), math.ceil(k / 128)),
    }[gran]


def _x(m, k, dtype=torch.float32):
    g = torch.Generator().manual_seed(m * 1000 + k)
    # Magnitudes spread over 6 decades across rows and columns, so a wrong unit shows.
    rs = 10 ** torch.empty(m, 1).uniform_(-3, 3, generator=g)
    cs = 10 ** torch.empty(1, k).uniform_(-1, 1, generator=g)
    return (torch.randn(m, k, generator=g) * rs * cs).to(dtype)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("shape", [(130, 200), (3, 128), (1, 1), (256, 129)])
def test_quantize_units_amax_and_round_trip(dtype, gran, shape):
    m, k = shape
    x = _x(m, k)
    data, scale_inv, amax = fp8_quantize(x, dtype, gran)
    fmax = FP8_MAX[dtype]
    assert data.shape == x.shape and data.dtype == dtype
    assert scale_inv.shape == amax.shape == _unit_shape(m, k, gran)
    assert scale_inv.dtype == amax.dtype == torch.float32

    mant, emin = FORMAT[dtype]
    deq = fp8_dequantize(data, scale_inv, gran)
    for idx, rs, cs in _units(m, k, gran):
        xu = x[rs, cs]
        ref_amax = xu.abs().max()
        assert amax[idx] == ref_amax, idx
        scale = fmax / ref_amax.item()
        # The unit's largest element lands on the largest finite FP8 value.
        assert data[rs, cs].float().abs().max() == fmax, idx
        torch.testing.assert_close(scale_inv[idx], torch.tensor(1 / scale), rtol=2**-22, atol=0)
        # Round to nearest in the scaled domain y = x * scale: error <= half an ulp,
        # i.e. 2^-(mant+1) |y| for normals and half the subnormal spacing,
        # 2^(emin-mant-1), below. The factor covers the fp32 roundings of x*scale,
        # 1/scale and data*scale_inv (3 x 2^-24).
        y = xu.double() * scale
        err = (deq[rs, cs].double() - xu.double()).abs() * scale
        bound = torch.clamp(y.abs() * 2.0 ** -(mant + 1), min=2.0 ** (emin - mant - 1))
        assert (err <= bound * (1 + 2**-20)).all(), idx


@pytest.mark.parametrize("gran", GRANULARITIES)
def test_bf16_input_and_not_differentiable(gran):
    x = _x(130, 200, torch.bfloat16).requires_grad_()
    data, scale_inv, amax = fp8_quantize(x, E4M3, gran)
    assert not data.requires_grad and not scale_inv.requires_grad
    ref, _, ref_amax = fp8_quantize(x.detach().float(), E4M3, gran)
    assert torch.equal(data.float(), ref.float()) and torch.equal(amax, ref_amax)
    assert fp8_dequantize(data, scale_inv, gran, out_dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("gran", GRANULARITIES)
def test_zero_tensor(gran):
    x = torch.zeros(130, 200)
    data, scale_inv, amax = fp8_quantize(x, E4M3, gran)
    assert torch.equal(data.float(), x)
    assert torch.equal(scale_inv, torch.ones(_unit_shape(130, 200, gran)))
    assert torch.equal(amax, torch.zeros(_unit_shape(130, 200, gran)))


def test_zero_block_keeps_scale_one_while_others_scale():
    x = _x(4, 300)
    x[2, 128:256] = 0
    _, scale_inv, amax = fp8_quantize(x, E4M3, "1x128")
    assert amax[2, 1] == 0 and scale_inv[2, 1] == 1
    assert (amax[2, [0, 2]] > 0).all() and (scale_inv[2, [0, 2]] != 1).all()


def test_tiny_amax_gives_finite_scale():
    x = torch.full((2, 3), 1e-40)  # an fp32 denormal: FP8_MAX / amax overflows fp32
    data, scale_inv, _ = fp8_quantize(x, E4M3, "tensor")
    assert torch.isfinite(scale_inv) and scale_inv > 0
    assert torch.isfinite(data.float()).all()


def test_given_scale_delayed_scaling():
    x = _x(130, 200)
    for scale in (0.5, torch.tensor([1e-2])):
        data, scale_inv, amax = fp8_quantize(x, E4M3, "tensor", scale=scale)
        s = float(scale)
        assert torch.equal(data.float(), (x * s).clamp(-448, 448).to(E4M3).float())
        assert scale_inv.shape == () and scale_inv == torch.tensor(1 / s)
        # amax is this tensor's, for the history, not one implied by the scale.
        assert amax == x.abs().max()
    # A scale too large for the data saturates to the largest finite value instead of
    # producing NaN (e4m3fn has no inf) or inf (a plain e5m2 cast overflows).
    for dtype in (E4M3, E5M2):
        data, _, _ = fp8_quantize(x, dtype, "tensor", scale=1e9)
        assert data.float().abs().max() == FP8_MAX[dtype] and data.float().isfinite().all()


def test_validation():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="only allowed for 'tensor'"):
        fp8_quantize(x, E4M3, "row", scale=1.0)
    with pytest.raises(ValueError, match="2-D"):
        fp8_quantize(torch.randn(2, 3, 4), E4M3, "tensor")
    with pytest.raises(ValueError, match="granularity"):
        fp8_quantize(x, E4M3, "64x64")
    with pytest.raises(ValueError, match="dtype"):
        fp8_quantize(x, torch.bfloat16, "tensor")
    with pytest.raises(ValueError, match="non-empty"):
        fp8_quantize(torch.randn(0, 8), E4M3, "tensor")
    data, scale_inv, _ = fp8_quantize(x, E4M3, "row")
    with pytest.raises(ValueError, match="scale_inv"):
        fp8_dequantize(data, scale_inv, "tensor")
