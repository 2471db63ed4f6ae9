"""RMSNorm and LayerNorm, forward and backward, in Triton.

One program normalises one row in float32 (the reference's contract) and saves
the per-row statistics (``rstd``, and ``mean`` for LayerNorm) for the backward.
The backward gives each program a block of rows: it writes the input gradient
of every row and one partial weight (and bias) gradient for the block, and the
partials are summed by torch. That two-level sum differs from the reference's
order only by float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtcore_triton.launch import row_warps
from mtcore_triton.rounding import store_rounded

MAX_HIDDEN = 16384  # one row lives in registers; larger rows go to the reference
ROWS_PER_BLOCK = 16  # rows per backward program (one weight-gradient partial each)


@triton.jit
def _norm_fwd(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    n,
    eps,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / n
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / n + eps)
    tl.store(rstd_ptr + row, rstd)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    store_rounded(y_ptr + row * n + cols, y, mask)


@triton.jit
def _norm_bwd(
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    db_part_ptr,
    rows,
    n,
    RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ROWS):
        row = pid * ROWS + i
        if row < rows:
            x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            if RMS:  # noqa: SIM108 (a constexpr branch, not a value select)
                xhat = x * rstd
            else:
                xhat = tl.where(mask, (x - tl.load(mean_ptr + row)) * rstd, 0.0)
            g = dy * w
            # d/dx of (x - mean) * rstd: project out the mean (LayerNorm) and xhat directions.
            dx = g - xhat * (tl.sum(g * xhat, axis=0) / n)
            if not RMS:
                dx -= tl.sum(g, axis=0) / n
            store_rounded(dx_ptr + row * n + cols, dx * rstd, mask)
            dw += dy * xhat
            db += dy
    tl.store(dw_part_ptr + pid * n + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(db_part_ptr + pid * n + cols, db, mask=mask)


def _block(n: int) -> int:
    return triton.next_power_of_2(n)


def _warps(n: int) -> int:
    # A row lives in registers: 8 columns per thread, 512 threads at most (16 warps
    # of 32, 4 of 128), so a 16384-wide row is 32 float32 per thread for each live
    # row tensor whatever the target's warp size.
    return row_warps(_block(n))


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms):
        shape, n = x.shape, x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        rows = x2.shape[0]
        y = torch.empty_like(x2)
        stats = torch.empty((2, rows), dtype=torch.float32, device=x.device)
        w = weight.contiguous()
        b = bias.contiguous() if bias is not None else w
        if rows:
            _norm_fwd[(rows,)](
                x2,
                w,
                b,
                y,
                stats[0],
                stats[1],
                n,
                eps,
                RMS=rms,
                HAS_BIAS=bias is not None,
                BLOCK=_block(n),
                num_warps=_warps(n),
            )
        ctx.save_for_backward(x2, w, stats)
        ctx.rms, ctx.has_bias, ctx.shape = rms, bias is not None, shape
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x2, w, stats = ctx.saved_tensors
        rows, n = x2.shape
        dy2 = dy.reshape(-1, n).contiguous()
        dx = torch.empty_like(x2)
        blocks = triton.cdiv(rows, ROWS_PER_BLOCK)
        parts = torch.zeros((2, max(blocks, 1), n), dtype=torch.float32, device=x2.device)
        if rows:
            _norm_bwd[(blocks,)](
                dy2,
                x2,
                w,
                stats[0],
                stats[1],
                dx,
                parts[0],
                parts[1],
                rows,
                n,
                RMS=ctx.rms,
                HAS_BIAS=ctx.has_bias,
                ROWS=ROWS_PER_BLOCK,
                BLOCK=_block(n),
                num_warps=_warps(n),
            )
        dw = parts[0].sum(0).to(ctx.dtypes[0])
        db = parts[1].sum(0).to(ctx.dtypes[1]) if ctx.has_bias else None
        return dx.view(ctx.shape), dw, db, None, None


def _check(x, weight, bias):
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(
                f"{name} must have shape [{n}] (the last dim of x), got {list(t.shape)}"
            )


def rms_norm(x, weight, eps=1e-6):
    """``mtcore.ops.rms_norm`` in Triton (float32 statistics, one rounding)."""
    _check(x, weight, None)
    return _Norm.apply(x, weight, None, eps, True)


def layer_norm(x, weight, bias, eps=1e-5):
    """``mtcore.ops.layer_norm`` in Triton (float32 statistics, one rounding)."""
    _check(x, weight, bias)
    return _Norm.apply(x, weight, bias, eps, False)
