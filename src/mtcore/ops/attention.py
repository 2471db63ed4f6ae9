"""Reference scaled dot-product attention with grouped-query heads and masks."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _check(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, head_dim], got {list(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}"
        )
    b, hq, _, d = q.shape
    bk, hkv, sk, dk = k.shape
    if bk != b or dk != d:
        raise ValueError(
            f"k/v batch and head_dim must match q: q {list(q.shape)}, k {list(k.shape)}"
        )
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (b, sk)
    ):
        raise ValueError(
            f"key_padding_mask must be bool [{b}, {sk}] (batch, key seq), got "
            f"{key_padding_mask.dtype} {list(key_padding_mask.shape)}"
        )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """``softmax(q @ k^T * scale + mask) @ v`` over grouped-query heads.

    Args:
        q: ``[batch, hq, sq, d]``.
        k, v: ``[batch, hkv, sk, d]`` with ``hq % hkv == 0``. Query head ``i``
            reads key/value head ``i // (hq // hkv)`` (grouped-query attention;
            ``hkv == 1`` is multi-query, ``hkv == hq`` plain multi-head).
        causal: query ``i`` may attend key ``j`` iff ``j <= i + (sk - sq)``,
            i.e. the mask is aligned to the bottom-right corner, so the last
            query sees every key (decode with a KV cache, chunked prefill).
            With ``sq == sk`` this is the usual lower-triangular mask.
        key_padding_mask: optional bool ``[batch, sk]``; ``True`` marks a key
            that may be attended, ``False`` a padding key. Combined with the
            causal mask by logical AND.
        scale: multiplier of the logits; ``None`` means ``1 / sqrt(d)``.

    Returns:
        ``[batch, hq, sq, d]`` in ``q.dtype``. Logits, softmax and the product
        with ``v`` are float32 (float64 for float64 ``q``). A query row whose
        keys are all masked outputs exactly 0 and passes zero gradient (not NaN,
        as a naive ``-inf`` softmax would): padded rows must not poison the loss.
    """
    _check(q, k, v, key_padding_mask)
    _, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)

    # Expanding kv to hq heads is the definition of GQA; kernels avoid the copy.
    group = hq // hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    logits = torch.matmul(q.to(acc), kf.transpose(-1, -2)) * scale  # [b, hq, sq, sk]

    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        allowed = j <= i + (sk - sq)
    allowed = allowed[None, None]  # [1, 1, sq, sk]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(q.device)[:, None, None, :]

    # Rows with no allowed key get finite logits, so no NaN appears even in
    # intermediates (softmax of all -inf is NaN, and anomaly detection or NaN
    # hooks would fire); their probabilities are then zeroed, and so is the row.
    has_key = allowed.any(dim=-1, keepdim=True)
    logits = logits.masked_fill(~allowed, float("-inf"))
    logits = logits.masked_fill(~has_key, 0.0)
    probs = torch.softmax(logits, dim=-1).masked_fill(~allowed, 0.0)
    return torch.matmul(probs, vf).to(q.dtype)
