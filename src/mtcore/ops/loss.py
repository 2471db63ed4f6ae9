"""Reference token-level cross-entropy."""

from __future__ import annotations

import torch
from torch import Tensor


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100) -> Tensor:
    """Per-token negative log-likelihood ``-log_softmax(logits)[n, target[n]]``.

    Args:
        logits: ``[N, V]``, any floating dtype. The log-softmax is float32:
            a bf16 log-sum-exp over a 100k+ vocabulary is visibly wrong.
        target: ``[N]`` int64 class indices in ``[0, V)`` or ``ignore_index``.
        ignore_index: target value whose position contributes nothing.

    Returns:
        ``[N]`` float32 loss (float64 for float64 logits), unreduced: the
        caller chooses the normaliser (tokens per micro-batch, per global
        batch...), a training decision, not the kernel's. Ignored positions
        have loss exactly 0 and give zero gradient to their logits row.
    """
    check_cross_entropy_args(logits, target)
    valid = target != ignore_index
    # Any in-range index serves for ignored rows; their loss is masked below.
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    acc = torch.promote_types(logits.dtype, torch.float32)
    logp = torch.log_softmax(logits.to(acc), dim=-1)
    nll = -logp.gather(1, safe_target[:, None]).squeeze(1)
    return nll.masked_fill(~valid, 0.0)


def check_cross_entropy_args(logits: Tensor, target: Tensor) -> None:
    """The shape and dtype rules of :func:`cross_entropy` (ValueError), for every
    implementation of the op."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {list(logits.shape)}")
    if target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(f"target must be [N] with N = {logits.shape[0]}, got {list(target.shape)}")
    if target.dtype != torch.int64:
        raise ValueError(f"target must be int64, got {target.dtype}")
