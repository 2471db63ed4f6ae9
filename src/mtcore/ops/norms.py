"""Reference normalisation ops: RMSNorm and LayerNorm.

Both normalise over the last dimension only, compute in float32 (float64 for
float64 inputs, so gradcheck works) whatever the input dtype, and return a
tensor of ``x.dtype`` and ``x.shape``. Computing in float32 is part of the
contract: a bf16 kernel that accumulates its variance in bf16 is wrong even when
it looks close on small hidden sizes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check_affine(name: str, x: Tensor, t: Tensor | None) -> None:
    if t is not None and tuple(t.shape) != (x.shape[-1],):
        raise ValueError(
            f"{name} must have shape [{x.shape[-1]}] (the last dim of x), got {list(t.shape)}"
        )


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """Root-mean-square normalisation (Zhang & Sennrich, 2019).

    ``y = x / sqrt(mean(x**2, dim=-1) + eps) * weight``

    Args:
        x: ``[..., hidden]``, any floating dtype.
        weight: ``[hidden]``, any floating dtype (upcast for the product).
        eps: added to the mean square inside the square root.

    Returns:
        ``[..., hidden]`` in ``x.dtype``; every intermediate is float32 (float64
        for float64 ``x``) and the result is rounded once, at the end.
    """
    _check_affine("weight", x, weight)
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    inv_rms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.to(acc)).to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """Layer normalisation (Ba et al., 2016) over the last dimension.

    ``y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias`` where ``var`` is
    the biased (population) variance, as in ``torch.nn.LayerNorm``.

    Args:
        x: ``[..., hidden]``, any floating dtype.
        weight: ``[hidden]``.
        bias: ``[hidden]`` or ``None`` (no shift).
        eps: added to the variance inside the square root.

    Returns:
        ``[..., hidden]`` in ``x.dtype``, computed in float32.
    """
    _check_affine("weight", x, weight)
    _check_affine("bias", x, bias)
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    mean = xf.mean(dim=-1, keepdim=True)
    var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype)
