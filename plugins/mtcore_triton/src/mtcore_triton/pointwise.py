"""Rotary embedding and SwiGLU, forward and backward, in Triton.

Both are element-wise in float32 with one rounding at the end, as the reference.
RoPE's backward is the same rotation by the opposite angle (``sin -> -sin``);
SwiGLU's backward recomputes ``sigmoid(gate)`` instead of saving it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtcore_triton.launch import DEFAULT_THREADS, num_warps
from mtcore_triton.rounding import store_rounded

SWIGLU_BLOCK = 1024  # columns per program: 8 per thread of DEFAULT_THREADS


@triton.jit
def _rope(
    x_ptr,
    cos_ptr,
    sin_ptr,
    y_ptr,
    seq,
    heads,
    half,
    sign,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (batch, position): every head shares that position's angles.
    bs = tl.program_id(0).to(tl.int64)
    s = bs % seq
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < half)
    c = tl.load(cos_ptr + s * half + d, mask=d < half, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + s * half + d, mask=d < half, other=0.0).to(tl.float32) * sign
    base = bs * heads * 2 * half + h * 2 * half + d
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + half, mask=mask, other=0.0).to(tl.float32)
    store_rounded(y_ptr + base, x1 * c - x2 * sn, mask)
    store_rounded(y_ptr + base + half, x2 * c + x1 * sn, mask)


def _rotate(x, cos, sin, sign: float):
    b, s, h, d = x.shape
    y = torch.empty_like(x)
    if x.numel():
        _rope[(b * s,)](
            x,
            cos,
            sin,
            y,
            s,
            h,
            d // 2,
            sign,
            BLOCK_H=triton.next_power_of_2(h),
            BLOCK_D=triton.next_power_of_2(d // 2),
            num_warps=num_warps(DEFAULT_THREADS),
        )
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return _rotate(x.contiguous(), cos, sin, 1.0)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _rotate(dy.contiguous(), cos, sin, -1.0), None, None


def rope(x, cos, sin):
    """``mtcore.ops.rope`` in Triton; differentiable in ``x`` only (the guard keeps
    tables that require grad on the reference)."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"x must be [batch, seq, heads, even head_dim], got {list(x.shape)}")
    want = (x.shape[1], x.shape[3] // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"{name} must be {list(want)} (seq, head_dim // 2), got {list(t.shape)}"
            )
    return _Rope.apply(x, cos, sin)


@triton.jit
def _swiglu_fwd(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    store_rounded(y_ptr + row * n + cols, y, mask)


@triton.jit
def _swiglu_bwd(x_ptr, dy_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    store_rounded(dx_ptr + row * 2 * n + cols, dgate, mask)
    store_rounded(dx_ptr + row * 2 * n + n + cols, dy * silu, mask)


def _grid(rows: int, n: int):
    return (rows, triton.cdiv(n, SWIGLU_BLOCK))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        n = x.shape[-1] // 2
        x2 = x.reshape(-1, 2 * n).contiguous()
        y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        if y.numel():
            _swiglu_fwd[_grid(x2.shape[0], n)](
                x2, y, n, BLOCK=SWIGLU_BLOCK, num_warps=num_warps(DEFAULT_THREADS)
            )
        ctx.save_for_backward(x2)
        ctx.shape = x.shape
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        (x2,) = ctx.saved_tensors
        n = x2.shape[1] // 2
        dx = torch.empty_like(x2)
        if dx.numel():
            _swiglu_bwd[_grid(x2.shape[0], n)](
                x2,
                dy.reshape(-1, n).contiguous(),
                dx,
                n,
                BLOCK=SWIGLU_BLOCK,
                num_warps=num_warps(DEFAULT_THREADS),
            )
        return dx.view(ctx.shape)


def swiglu(x):
    """``mtcore.ops.swiglu`` in Triton: ``silu(gate) * up`` on ``[..., 2n] = [gate | up]``."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim [..., 2n], got shape {list(x.shape)}")
    return _SwiGLU.apply(x)
