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
ones, and each tensor is quantized once. Blockwise scaling quantizes ``x`` and
``dy`` along a different dimension in each GEMM: the fused quantize-and-transpose
(``FP8.quantize_transpose``) writes both 1x128 forms in one pass, and backward
keeps the FP8 ``x^T``. ``W^T`` in 128x128 blocks has the same blocks (and scales)
as ``W``, so it is ``W``'s FP8 bytes and scales transposed (``Quantized.transpose``: a
view, which a fallback GEMM widens through its source, once). Either way only
FP8 copies are saved for backward.

The parameters stay in the model dtype and the optimizer keeps fp32 master
weights; the FP8 copies exist only inside one forward/backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.precision.fp8.state import FP8Scaling


class _FP8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, scaling: FP8Scaling, record: bool):
        fp8, recipe = scaling.fp8, scaling.recipe
        ctx.scaling, ctx.x_dtype, ctx.w_dtype = scaling, x.dtype, weight.dtype
        ctx.per_tensor = recipe.granularity("input") == "tensor"
        if ctx.per_tensor:
            qx, qw = scaling.quantize_forward(x, weight, record)
            keep = qx
        else:  # blockwise: x along K for this GEMM, along M (x^T) for wgrad, in one pass
            qx, keep = fp8.quantize_transpose(x, recipe.dtype("input"), "1x128")
            qw = scaling.quantize_weight(weight, record)  # 128x128 blocks
        # The FP8 weight object itself (a weight, not an activation): a fallback GEMM's
        # dequantized copy of it serves dgrad, and later micro-batches of the step.
        ctx.granularity, ctx.weight = keep.granularity, qw
        ctx.save_for_backward(keep.data, keep.scale_inv)
        return fp8.scaled_matmul(qx, qw, out_dtype=x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        scaling = ctx.scaling
        fp8, recipe = scaling.fp8, scaling.recipe
        dy = dy.contiguous()
        data, scale_inv = ctx.saved_tensors
        kept = fp8.quantized(data, scale_inv, scale_inv, ctx.granularity)
        w_t = ctx.weight.transpose()
        if ctx.per_tensor:
            qg = scaling.quantize(dy, "grad")
            g_t, x_t = qg.transpose(), kept.transpose()
        else:
            x_t = kept
            qg, g_t = fp8.quantize_transpose(dy, recipe.dtype("grad"), "1x128")
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
