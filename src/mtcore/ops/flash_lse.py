"""``mtcore.ops.attention_lse`` through a device's flash-attention kernels.

A flash forward returns the log-sum-exp (LSE) of each query's logits beside the
output, but no flash kernel differentiates the LSE, and ring attention needs it
differentiated (its merges backpropagate through it). The kernel's own backward
gets ``dS = P * (dO V^T - rowsum(dO * out))``; the LSE's gradient adds ``P * g_lse``.
Extra head-dim columns provide it: ``v' = [v, 1, 0...]`` and ``dO' = [dO, g_lse, 0...]``
add ``g_lse`` to every ``dO V^T`` entry, ``out' = [out, 0...]`` leaves the rowsum as
it was, and q and k get zero columns (their products do not change). The extra
columns of each gradient are dropped. Kernels that want the head dim a multiple of
some width get that many columns (``FlashKernels.head_pad``).

A kernel whose ``scale`` argument cannot be trusted (``takes_scale=False``) runs
with its default scale, ``1/sqrt(head dim)``: in backward the padded head dim would
change it, so q is multiplied by ``sqrt(d + pad) / sqrt(d)`` there (the logits stay
``q.k / sqrt(d)``) and its gradient by the same factor.

Each device plugin describes its kernels with a ``FlashKernels``; the CPU's (torch's
CPU flash kernel) is here, as the core's ``cpu`` backend registers it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtcore.ops.attention import _check, allowed_keys


@dataclass(frozen=True)
class FlashKernels:
    """One device's flash attention with its LSE, as ``flash_attention_lse`` calls it.

    forward: ``(q, k, v, is_causal, mask, scale) -> (out, lse, state)``; ``lse`` float32
      ``[b, h, sq]``; ``state``: whatever the backward needs besides the tensors.
    backward: ``(grad_out, q, k, v, out, lse, state, is_causal, mask, scale) -> (dq, dk, dv)``.
    mask: how a mask reaches the kernel: ``"additive"`` (float, ``-inf`` where not
      allowed), ``"bool"`` (True = may attend) or ``None`` (the kernel takes no mask).
    head_pad: extra head-dim columns in backward (at least 1; the kernel's multiple).
    takes_scale: whether ``scale`` may be passed (else the kernel's default is used).
    float32_backward: run backward on float32 copies (a kernel that rounds
      ``dO V^T + g_lse`` to bf16 before the rowsum is subtracted biases dQ).
    """

    forward: Callable
    backward: Callable
    mask: str | None = "additive"
    head_pad: int = 1
    takes_scale: bool = True
    float32_backward: bool = False


class _FlashLSE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernels: FlashKernels, q, k, v, is_causal: bool, mask, scale: float):
        out, lse, state = kernels.forward(
            q, k, v, is_causal, mask, scale if kernels.takes_scale else None
        )
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.kernels, ctx.state, ctx.is_causal, ctx.scale = kernels, state, is_causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, mask = ctx.saved_tensors
        kernels: FlashKernels = ctx.kernels
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        if grad_lse is None:
            grad_lse = torch.zeros_like(lse)
        dtype = torch.promote_types(q.dtype, torch.float32) if kernels.float32_backward else q.dtype
        pad, d = kernels.head_pad, q.shape[-1]

        def widen(t, first=None):
            extra = torch.zeros((*t.shape[:-1], pad), dtype=dtype, device=t.device)
            if first is not None:
                extra[..., 0] = first
            return torch.cat([t.to(dtype), extra], dim=-1)

        q_factor = 1.0 if kernels.takes_scale else math.sqrt(d + pad) / math.sqrt(d)
        if mask is not None and kernels.mask == "additive":
            mask = mask.to(dtype)
        dq, dk, dv = kernels.backward(
            widen(grad_out.contiguous(), grad_lse),
            widen(q.to(dtype) * q_factor),
            widen(k),
            widen(v, 1.0),
            widen(out),
            lse,
            ctx.state,
            ctx.is_causal,
            mask,
            ctx.scale if kernels.takes_scale else None,
        )
        dq = dq[..., :d] * q_factor if q_factor != 1.0 else dq[..., :d]
        grads = (dq, dk[..., :d], dv[..., : v.shape[-1]])
        return (
            None,
            *(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)),
            None,
            None,
            None,
        )


def flash_attention_lse(
    kernels: FlashKernels, q, k, v, causal=True, key_padding_mask=None, scale=None, window=None,
    query_documents=None, key_documents=None,
):  # fmt: skip
    """``mtcore.ops.attention_lse`` through ``kernels``, both outputs differentiable.

    Grouped-query heads are expanded (their gradients sum back through autograd); a
    causal block with fewer queries than keys, or a padding mask, becomes an explicit
    mask aligned to the bottom-right corner, as the op's contract says (a sliding
    ``window`` and document ids too: the kernels take none of their own). A row with no
    key to attend gets (0, -inf) and no gradient, as the reference's.
    """
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    sq, sk = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # Flash kernels read their operands as if contiguous: a strided q, k or v (the
    # conformance kit's transposed layout) gave wrong values from the CPU's, not an error.
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    plain = key_padding_mask is None and window is None and query_documents is None
    if plain and (not causal or sq == sk):
        return _FlashLSE.apply(kernels, q, k, v, causal, None, scale)
    if kernels.mask is None:
        raise ValueError("these flash kernels take no mask: see flash_lse_inputs_ok")
    _check(q, k, v, key_padding_mask, causal, window, query_documents, key_documents)
    allowed = allowed_keys(
        sq, sk, causal, window, key_padding_mask, q.device, query_documents, key_documents
    )
    allowed = allowed.expand(q.shape[0], 1, sq, sk)
    has_key = allowed.any(dim=-1)  # [b, 1, sq]
    # A row without a key attends everything in the kernel (finite numbers), then is
    # zeroed: its output, its LSE (-inf) and, through the where, its gradients.
    allowed = allowed | ~has_key[..., None]
    if kernels.mask == "additive":
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        mask = mask.masked_fill(~allowed, float("-inf"))
    else:
        mask = allowed.contiguous()
    out, lse = _FlashLSE.apply(kernels, q, k, v, False, mask, scale)
    out = torch.where(has_key[..., None], out, torch.zeros_like(out))
    lse = torch.where(has_key, lse, torch.full_like(lse, float("-inf")))
    return out, lse


def default_scale(q, scale) -> bool:
    """Whether ``scale`` is None or the default ``1/sqrt(head dim)`` (to float rounding)."""
    return scale is None or math.isclose(scale, 1.0 / math.sqrt(q.shape[-1]), rel_tol=1e-6)


# -- torch's CPU flash kernel --------------------------------------------------------
def _cpu_forward(q, k, v, is_causal, mask, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
    )
    return out, lse, None


def _cpu_backward(grad_out, q, k, v, out, lse, state, is_causal, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
    )


# The CPU kernel takes any head dim and an additive mask; in bf16 it rounds
# dO V^T + g_lse before subtracting the rowsum, so its backward runs in float32.
CPU_FLASH = FlashKernels(_cpu_forward, _cpu_backward, float32_backward=True)


def cpu_flash_attention_lse(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, query_documents=None,
    key_documents=None,
):  # fmt: skip
    """``mtcore.ops.attention_lse`` through torch's CPU flash-attention kernel
    (``aten._scaled_dot_product_flash_attention_for_cpu``), both outputs differentiable;
    a sliding window and document ids reach it as part of the additive mask."""
    return flash_attention_lse(
        CPU_FLASH, q, k, v, causal, key_padding_mask, scale, window, query_documents,
        key_documents,
    )  # fmt: skip


def cpu_flash_attention_lse_available() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
