"""FP8 quantize with amax, and the fused quantize-and-transpose, in Triton.

Two launches over 128x128 tiles. The first writes, per tile, the max |x| of each
of its rows and of each of its columns; every granularity's amax (and that of
the transpose) is a max over those partials, taken by torch on a tensor 128x
smaller than ``x``. The scales follow from the amax with the reference's own
torch expression, so ``scale_inv`` and ``amax`` equal the reference exactly.
The second launch scales each tile, rounds and writes ``data`` and, for the
fused op, the transposed tile into ``data_t`` with the transpose's scales.

Rounding to FP8 is done in float32 arithmetic (round to nearest even on the
format's grid, subnormals included) before the cast: the cast of an exactly
representable value is exact everywhere, whereas Triton's interpreter does not
round fp32 -> fp8 to nearest even.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from mtcore.ops import FP8_MAX
from mtcore_triton.launch import TILE_THREADS, num_warps

TILE = 128  # the block granularities' side; also the tile of both launches
_FP32_MAX = torch.finfo(torch.float32).max
# (mantissa bits, exponent of the smallest normal) per format.
_FORMAT = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}
# granularity -> (rows per scaling unit, row stride in the scale tensor, column-block stride)
# for x [M, K]; filled per call since strides depend on the number of column blocks.
_ROWDIV = {"tensor": 1, "row": 1, "1x128": 1, "128x128": TILE}


@triton.jit
def _tile_amax(x_ptr, rowmax_ptr, colmax_ptr, m, k, TILE: tl.constexpr):
    bm, bk = tl.program_id(0), tl.program_id(1)
    rows = bm * TILE + tl.arange(0, TILE)[:, None]
    cols = bk * TILE + tl.arange(0, TILE)[None, :]
    mask = (rows < m) & (cols < k)
    a = tl.abs(tl.load(x_ptr + rows.to(tl.int64) * k + cols, mask=mask, other=0.0).to(tl.float32))
    kb = tl.cdiv(k, TILE)
    r = bm * TILE + tl.arange(0, TILE)
    c = bk * TILE + tl.arange(0, TILE)
    tl.store(rowmax_ptr + r.to(tl.int64) * kb + bk, tl.max(a, axis=1), mask=r < m)
    tl.store(colmax_ptr + bm.to(tl.int64) * k + c, tl.max(a, axis=0), mask=c < k)


@triton.jit
def _round_fp8(v, fmax, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Round float32 ``v`` to the FP8 grid (nearest even), saturating at ``fmax``."""
    v = tl.minimum(tl.maximum(v, -fmax), fmax)
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    # Adding 2**(e - MANT + 23) leaves exactly MANT fraction bits below 2**e: the
    # float32 add rounds |v| to nearest even on the FP8 grid; subtracting is exact.
    big = ((e - MANT + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (a + big) - big
    return tl.where(v < 0, -r, r)


@triton.jit
def _quantize(
    x_ptr,
    scale_ptr,
    data_ptr,
    scale_t_ptr,
    data_t_ptr,
    m,
    k,
    s_row,
    s_blk,
    t_row,
    t_blk,
    fmax,
    ROWDIV: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    TILE: tl.constexpr,
):
    bm, bk = tl.program_id(0), tl.program_id(1)
    rows = bm * TILE + tl.arange(0, TILE)[:, None]
    cols = bk * TILE + tl.arange(0, TILE)[None, :]
    mask = (rows < m) & (cols < k)
    x = tl.load(x_ptr + rows.to(tl.int64) * k + cols, mask=mask, other=0.0).to(tl.float32)
    # The scaling unit of element (row, col): (row // ROWDIV, col // TILE) in unit
    # coordinates; strides of 0 collapse a dimension (tensor, row granularities).
    scale = tl.load(
        scale_ptr + (rows // ROWDIV) * s_row + (cols // TILE) * s_blk, mask=mask, other=1.0
    )
    q = _round_fp8(x * scale, fmax, MANT, EMIN)
    tl.store(data_ptr + rows.to(tl.int64) * k + cols, q.to(data_ptr.dtype.element_ty), mask=mask)
    if TRANSPOSE:
        # x.T[col, row]: its unit is (col // ROWDIV, row // TILE).
        scale_t = tl.load(
            scale_t_ptr + (cols // ROWDIV) * t_row + (rows // TILE) * t_blk, mask=mask, other=1.0
        )
        qt = _round_fp8(x * scale_t, fmax, MANT, EMIN)
        # Store the transposed tile row by row of x.T, so consecutive threads write
        # consecutive bytes; tl.trans moves the data between layouts on chip.
        rows_t = bm * TILE + tl.arange(0, TILE)[None, :]  # columns of x.T
        cols_t = bk * TILE + tl.arange(0, TILE)[:, None]  # rows of x.T
        tl.store(
            data_t_ptr + cols_t.to(tl.int64) * m + rows_t,
            tl.trans(qt).to(data_t_ptr.dtype.element_ty),
            mask=(cols_t < k) & (rows_t < m),
        )


def _unit_amax(rowmax, colmax, granularity: str, m: int, k: int, transpose: bool):
    """Per-unit amax of x (or of x.T) from the per-tile row and column maxima."""
    if granularity == "tensor":
        return rowmax.amax()
    if granularity == "row":
        return colmax.amax(0)[:, None] if transpose else rowmax.amax(1, keepdim=True)
    if granularity == "1x128":
        return colmax.t().contiguous() if transpose else rowmax
    mb = math.ceil(m / TILE)
    padded = torch.nn.functional.pad(rowmax, (0, 0, 0, mb * TILE - m))
    blocks = padded.view(mb, TILE, -1).amax(1)
    return blocks.t().contiguous() if transpose else blocks


def _unit_scale(amax, fmax: float):
    return torch.where(amax > 0, fmax / amax, torch.ones_like(amax)).clamp(max=_FP32_MAX)


def _strides(granularity: str, units: torch.Tensor) -> tuple[int, int]:
    if granularity == "tensor":
        return 0, 0
    if granularity == "row":
        return 1, 0
    return units.shape[1], 1


def _run(x, dtype, granularity, scale, transpose: bool):
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"x must be a non-empty 2-D [M, K] tensor, got shape {list(x.shape)}")
    if dtype not in _FORMAT:
        raise ValueError(f"dtype must be one of {list(_FORMAT)}, got {dtype}")
    if granularity not in _ROWDIV:
        raise ValueError(f"granularity must be one of {tuple(_ROWDIV)}, got {granularity!r}")
    if scale is not None and granularity != "tensor":
        raise ValueError(
            f"a given scale is only allowed for 'tensor' granularity, not {granularity!r}"
        )
    x = x.detach().contiguous()
    m, k = x.shape
    fmax = FP8_MAX[dtype]
    mb, kb = math.ceil(m / TILE), math.ceil(k / TILE)
    rowmax = torch.empty((m, kb), dtype=torch.float32, device=x.device)
    colmax = torch.empty((mb, k), dtype=torch.float32, device=x.device)
    _tile_amax[(mb, kb)](x, rowmax, colmax, m, k, TILE=TILE, num_warps=num_warps(TILE_THREADS))
    amax = _unit_amax(rowmax, colmax, granularity, m, k, False)
    amax_t = _unit_amax(rowmax, colmax, granularity, m, k, True) if transpose else None
    if scale is None:
        unit_scale = _unit_scale(amax, fmax)
        unit_scale_t = _unit_scale(amax_t, fmax) if transpose else None
    else:
        unit_scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        if unit_scale.numel() != 1:
            raise ValueError(f"scale must have one element, got shape {list(unit_scale.shape)}")
        unit_scale = unit_scale_t = unit_scale.reshape(()).contiguous()
    data = torch.empty((m, k), dtype=dtype, device=x.device)
    data_t = torch.empty((k, m), dtype=dtype, device=x.device) if transpose else data
    scale_t = unit_scale_t if transpose else unit_scale
    mant, emin = _FORMAT[dtype]
    _quantize[(mb, kb)](
        x,
        unit_scale,
        data,
        scale_t,
        data_t,
        m,
        k,
        *_strides(granularity, unit_scale),
        *_strides(granularity, scale_t),
        fmax,
        ROWDIV=_ROWDIV[granularity],
        TRANSPOSE=transpose,
        MANT=mant,
        EMIN=emin,
        TILE=TILE,
        num_warps=num_warps(TILE_THREADS),  # a 128x128 float32 tile: 64 values per thread
    )
    first = (data, 1.0 / unit_scale, amax)
    if not transpose:
        return first
    return first, (data_t, 1.0 / unit_scale_t, amax_t)


def fp8_quantize(x, dtype, granularity, scale=None):
    """``mtcore.ops.fp8_quantize`` in Triton."""
    return _run(x, dtype, granularity, scale, transpose=False)


def fp8_quantize_transpose(x, dtype, granularity, scale=None):
    """``mtcore.ops.fp8_quantize_transpose`` in Triton: reads ``x`` once per launch."""
    return _run(x, dtype, granularity, scale, transpose=True)
