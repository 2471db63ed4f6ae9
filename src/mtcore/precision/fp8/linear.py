"""The FP8 linear: ``y = x W^T (+ b)`` with all three GEMMs in FP8.

TN convention of the FP8 interface: ``scaled_matmul(a, b) = a @ b.T`` with both
operands quantized along the shared dimension K. For ``x [M, K]``, ``W [N, K]``,
``dy [M, N]``:

=======  ===================  =================  ==================
GEMM     result               a (quantized K)    b (quantized K)
=======  ===================  =================  ==================
forward  y  = x W^T  [M, N]   x      along K     W      along K
dgrad    dx = dy W   [M, K]   dy     along N     W^T    along N
wgrad    dW = dy^T x [N, K]   dy^T   along M     x^T    along M
=======  ===================  =================  ==================

Per-tensor scaling (delayed, current) has one scale per tensor, so the
transposed operands of the backward are the forward's FP8 bytes transposed:
only the FP8 ``x`` and ``W`` are kept for backward, never the high-precision
ones, and each tensor is quantized once. Blockwise scaling quantizes along a
different dimension in each GEMM, so it keeps ``x`` and quantizes ``x^T`` and
``dy^T`` again in 1x128 blocks (``W^T`` in 128x128 blocks has the same blocks
as ``W``).

The parameters stay in the model dtype and the optimizer keeps fp32 master
weights; the FP8 copies exist only inside one forward/backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.backend.fp8 import Quantized
from mtcore.precision.fp8.state import FP8Scaling


def _transposed(q: Quantized) -> Quantized:
    """The same per-tensor-scaled values, transposed (an FP8 byte copy, no rounding)."""
    return Quantized(q.data.t().contiguous(), q.scale_inv, q.amax, q.granularity)


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, scaling: FP8Scaling, record: bool):
        fp8 = scaling.fp8
        qx, qw = scaling.quantize_forward(x, weight, record)
        y = fp8.scaled_matmul(qx, qw, out_dtype=x.dtype)
        ctx.scaling, ctx.x_dtype, ctx.w_dtype = scaling, x.dtype, weight.dtype
        ctx.per_tensor = qx.granularity == "tensor"
        if ctx.per_tensor:
            ctx.save_for_backward(qx.data, qx.scale_inv, qw.data, qw.scale_inv)
        else:
            ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        scaling = ctx.scaling
        fp8, recipe = scaling.fp8, scaling.recipe
        dy = dy.contiguous()
        qg = scaling.quantize(dy, "grad")
        if ctx.per_tensor:
            x_data, x_sinv, w_data, w_sinv = ctx.saved_tensors
            qx = Quantized(x_data, x_sinv, x_sinv, "tensor")
            qw = Quantized(w_data, w_sinv, w_sinv, "tensor")
            w_t, g_t, x_t = _transposed(qw), _transposed(qg), _transposed(qx)
        else:
            x, weight = ctx.saved_tensors
            w_t = fp8.quantize(weight.t().contiguous(), recipe.dtype("weight"), "128x128")
            g_t = fp8.quantize(dy.t().contiguous(), recipe.dtype("grad"), "1x128")
            x_t = fp8.quantize(x.t().contiguous(), recipe.dtype("input"), "1x128")
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8.scaled_matmul(qg, w_t, out_dtype=ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = fp8.scaled_matmul(g_t, x_t, out_dtype=ctx.w_dtype)
        return grad_x, grad_w, None, None


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None, scaling: FP8Scaling) -> Tensor:
    """``x [..., K]`` @ ``weight [N, K]``^T in FP8, plus ``bias`` in ``x``'s dtype."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear: input features {x.shape[-1]} != weight in_features {weight.shape[1]}"
        )
    record = scaling.records_now()  # decided here: grad mode is off inside the Function
    y = _FP8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, scaling, record)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
