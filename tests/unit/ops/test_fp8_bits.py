"""fp8_quantize, fp8_quantize_transpose and fp8_dequantize against plain torch, byte for byte.

The ops work through padded buffers, 4-D views of the scaling units and scratch memory
(``mtcore.ops.fp8``); here every result is compared with the formula of the docstrings
written element by element: each unit's scale expanded to ``x``'s shape, the product
clamped and converted by torch's own ``.to(dtype)``. Compared as bytes, so -0, the
rounding of every tie and each subnormal count.
"""

import math

import pytest
import torch

from mtcore.ops import FP8_MAX, GRANULARITIES, fp8_dequantize, fp8_quantize, fp8_quantize_transpose

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SOURCES = (torch.float32, torch.bfloat16, torch.float16)
M, K = 130, 300  # partial 128-blocks along both dimensions


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _tricky_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 values that probe the conversion: every finite FP8 value, each midpoint
    between neighbours (a tie: rounds to the even one) and the float32 values just
    either side of it, the subnormal range, float32 denormals, zeros of both signs, and
    random magnitudes from 2^-40 to the format's maximum."""
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()  # sorted, +0 to FP8_MAX
    mid = (grid[1:] + grid[:-1]) / 2  # exact in float32
    below = torch.nextafter(mid, torch.zeros(()))
    above = torch.nextafter(mid, torch.full((), math.inf))
    smallest = grid[1].item()  # the smallest subnormal
    subnormal = torch.linspace(0, 8 * smallest, 97)
    denormal = torch.tensor([1e-45, 1e-40, 1.1754942e-38])
    g = torch.Generator().manual_seed(0)
    log2 = torch.empty(2000).uniform_(-40, math.log2(FP8_MAX[dtype]), generator=g)
    magnitudes = torch.cat([grid, mid, below, above, subnormal, denormal, 2.0**log2])
    magnitudes = magnitudes.clamp(max=FP8_MAX[dtype])
    signs = torch.randint(0, 2, magnitudes.shape, generator=g) * 2.0 - 1
    return torch.cat([magnitudes * signs, torch.tensor([0.0, -0.0])])


def _planted(dtype: torch.dtype) -> torch.Tensor:
    """[M, K] of the tricky values with FP8_MAX in every row block and column strip of
    128, so every scaling unit of x and of x.T has amax FP8_MAX and scale exactly 1:
    the data is then torch's conversion of x itself."""
    values = _tricky_values(dtype)
    x = values.repeat(M * K // values.numel() + 1)[: M * K].view(M, K).clone()
    x[:, ::128] = FP8_MAX[dtype]
    x[::128, :] = -FP8_MAX[dtype]
    return x


def _expand(per_unit: torch.Tensor, granularity: str, m: int, k: int) -> torch.Tensor:
    """A unit tensor expanded to one value per element of ``[m, k]``."""
    if granularity in ("tensor", "row"):
        return per_unit.expand(m, k)
    rows = 1 if granularity == "1x128" else 128
    return per_unit.repeat_interleave(rows, 0).repeat_interleave(128, 1)[:m, :k]


def _plain_quantize(x: torch.Tensor, dtype: torch.dtype, granularity: str):
    """The docstring of fp8_quantize, element by element."""
    xf, fmax = x.float(), FP8_MAX[dtype]
    m, k = xf.shape
    a = xf.abs()
    if granularity == "tensor":
        amax = a.max()
    elif granularity == "row":
        amax = a.amax(1, keepdim=True)
    else:
        rows = 1 if granularity == "1x128" else 128
        padded = torch.zeros(math.ceil(m / rows) * rows, math.ceil(k / 128) * 128)
        padded[:m, :k] = a
        amax = padded.view(-1, rows, padded.shape[1] // 128, 128).amax(dim=(1, 3))
    scale = torch.where(amax > 0, fmax / amax, 1.0).clamp(max=torch.finfo(torch.float32).max)
    data = (xf * _expand(scale, granularity, m, k)).clamp(-fmax, fmax).to(dtype)
    return data, 1.0 / scale, amax


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_every_unit_at_scale_one_is_torchs_conversion(dtype):
    x = _planted(dtype)
    for source in SOURCES:
        xs = x.to(source)
        want = xs.float().to(dtype)
        for granularity in GRANULARITIES:
            data, scale_inv, amax = fp8_quantize(xs, dtype, granularity)
            assert _same_bits(data, want), (source, granularity)
            assert (scale_inv == 1).all() and (amax == FP8_MAX[dtype]).all()
            (d, _, _), (dt, st, _) = fp8_quantize_transpose(xs, dtype, granularity)
            assert _same_bits(d, want) and _same_bits(dt, want.t()), (source, granularity)
            assert (st == 1).all()


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_saturation_beyond_the_maximum(dtype):
    x = _tricky_values(dtype).view(1, -1)
    for scale in (3.0, 1e9):  # a delayed scale too large for the data: it saturates
        data, _, _ = fp8_quantize(x, dtype, "tensor", scale=scale)
        fmax = FP8_MAX[dtype]
        assert _same_bits(data, (x * scale).clamp(-fmax, fmax).to(dtype))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_computed_scales_and_dequantize_match_the_plain_formula(dtype, granularity):
    g = torch.Generator().manual_seed(1)
    for source in SOURCES:
        # Magnitudes over 2^-60 .. 2^60 (2^-30 .. 2^12 in float16, which holds no more),
        # a zero row and a zero block, -0 in places.
        low, high = (-30, 12) if source == torch.float16 else (-60, 60)
        x = torch.randn(M, K, generator=g) * 2.0 ** torch.randint(low, high, (M, K), generator=g)
        x[3], x[5:7, 128:256], x[9, ::7] = 0.0, 0.0, -0.0
        xs = x.to(source)
        want = _plain_quantize(xs, dtype, granularity)
        got = fp8_quantize(xs, dtype, granularity)
        assert all(_same_bits(a, b) for a, b in zip(got, want, strict=True)), source
        first, second = fp8_quantize_transpose(xs, dtype, granularity)
        plain_t = _plain_quantize(xs.t().contiguous(), dtype, granularity)
        assert all(_same_bits(a, b) for a, b in zip(first, want, strict=True)), source
        assert all(_same_bits(a, b) for a, b in zip(second, plain_t, strict=True)), source
        data, scale_inv, _ = got
        for out in SOURCES:
            plain = (data.float() * _expand(scale_inv, granularity, M, K)).to(out)
            assert _same_bits(fp8_dequantize(data, scale_inv, granularity, out), plain), out
