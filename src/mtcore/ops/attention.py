"""Reference scaled dot-product attention with grouped-query heads and masks."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mtcore.ops.attention_dropout import check_dropout, keep_mask


def _check(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_padding_mask: Tensor | None,
    causal: bool = True,
    window: int | None = None,
    query_documents: Tensor | None = None,
    key_documents: Tensor | None = None,
) -> None:
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
    if window is not None and (not causal or isinstance(window, bool) or window < 1):
        raise ValueError(
            f"window must be a positive int with causal=True, got window={window!r}, "
            f"causal={causal}"
        )
    _check_documents(query_documents, key_documents, b, q.shape[2], sk)


def _check_documents(
    query_documents: Tensor | None, key_documents: Tensor | None, b: int, sq: int, sk: int
) -> None:
    if query_documents is None and key_documents is None:
        return
    for name, ids, length in (("query", query_documents, sq), ("key", key_documents, sk)):
        if ids is None:
            raise ValueError(
                "query_documents and key_documents go together: pass both or neither"
            )
        if ids.dtype in (torch.bool, *_FLOATS) or tuple(ids.shape) != (b, length):
            raise ValueError(
                f"{name}_documents must be an integer [{b}, {length}] (batch, {name} seq), "
                f"got {ids.dtype} {list(ids.shape)}"
            )


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def has_documents(query_documents: Tensor | None, key_documents: Tensor | None) -> bool:
    """Whether a call carries document boundaries (kernels without them decline it)."""
    return query_documents is not None or key_documents is not None


def allowed_keys(
    sq: int,
    sk: int,
    causal: bool,
    window: int | None,
    key_padding_mask: Tensor | None,
    device: torch.device,
    query_documents: Tensor | None = None,
    key_documents: Tensor | None = None,
) -> Tensor:
    """Bool ``[1 or batch, 1, sq, sk]``: True where query ``i`` may attend key ``j``.

    Causal masks are aligned to the bottom-right corner (query ``i`` sits at key
    position ``i + sk - sq``); ``window`` keeps the ``window`` keys up to and
    including that position (``0 <= i + sk - sq - j < window``); with document ids,
    only the keys of the query's own document (``query_documents[b, i] ==
    key_documents[b, j]``).
    """
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        distance = torch.arange(sq, device=device)[:, None] + (sk - sq)
        distance = distance - torch.arange(sk, device=device)[None, :]
        allowed = distance >= 0
        if window is not None:
            allowed = allowed & (distance < window)
    allowed = allowed[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.to(device)[:, None, None, :]
    if query_documents is not None:
        queries = query_documents.to(device)[:, None, :, None]
        allowed = allowed & (queries == key_documents.to(device)[:, None, None, :])
    return allowed


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    dropout_p: float = 0.0,
    dropout_seeds: Tensor | None = None,
    query_documents: Tensor | None = None,
    key_documents: Tensor | None = None,
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
        window: sliding-window attention (Mistral's; causal only): query ``i``
            attends only the ``window`` keys ending at its own position, i.e. key
            ``j`` iff ``0 <= i + (sk - sq) - j < window``. ``None``: no window.
        dropout_p: attention-probability dropout: each probability is zeroed with
            this chance and the kept ones scaled by ``1 / (1 - dropout_p)``.
        dropout_seeds: int64 ``[hq]``, one seed per query head (needed when
            ``dropout_p > 0``). The mask is a function of (seed of the head, batch row,
            query position counted from the bottom-right corner, key position) only
            (``mtcore.ops.attention_dropout``), so any split of heads over ranks that
            passes each head its seed draws one process's masks.
        query_documents, key_documents: optional integer ``[batch, sq]`` and
            ``[batch, sk]``, both or neither: the document of each query and key
            (packed samples, ``mtcore.data.documents``). Query ``i`` may then attend
            key ``j`` only if they are of the same document, on top of the other
            masks: each document of a packed sequence is attended as if alone
            (flash-attn's varlen ``cu_seqlens``, FlexAttention's document mask).

    Returns:
        ``[batch, hq, sq, d]`` in ``q.dtype``. Logits, softmax and the product
        with ``v`` are float32 (float64 for float64 ``q``). A query row whose
        keys are all masked outputs exactly 0 and passes zero gradient (not NaN,
        as a naive ``-inf`` softmax would): padded rows must not poison the loss.
    """
    _check(q, k, v, key_padding_mask, causal, window, query_documents, key_documents)
    b, hq, sq, d = q.shape
    check_dropout(dropout_p, dropout_seeds, hq)
    hkv, sk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)

    # Expanding kv to hq heads is the definition of GQA; kernels avoid the copy.
    group = hq // hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    logits = torch.matmul(q.to(acc), kf.transpose(-1, -2)) * scale  # [b, hq, sq, sk]

    allowed = allowed_keys(
        sq, sk, causal, window, key_padding_mask, q.device, query_documents, key_documents
    )

    # Rows with no allowed key get finite logits, so no NaN appears even in
    # intermediates (softmax of all -inf is NaN, and anomaly detection or NaN
    # hooks would fire); their probabilities are then zeroed, and so is the row.
    has_key = allowed.any(dim=-1, keepdim=True)
    logits = logits.masked_fill(~allowed, float("-inf"))
    logits = logits.masked_fill(~has_key, 0.0)
    probs = torch.softmax(logits, dim=-1).masked_fill(~allowed, 0.0)
    if dropout_p > 0:
        keep = keep_mask(dropout_seeds, b, sq, sk, dropout_p)
        probs = probs.masked_fill(~keep, 0.0) * (1.0 / (1.0 - dropout_p))
    return torch.matmul(probs, vf).to(q.dtype)
