"""Reference attention over one block of keys, with the softmax log-sum-exp.

Context parallelism splits the keys of a sequence over ranks: each rank attends
its queries to one block of keys at a time and merges the partial results. The
merge is exact when each partial result carries the log-sum-exp (LSE) of its
logits: for two blocks a and b of the same queries,

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

which is attention over the union of the keys (Milakov & Gimelshein 2018, the
online softmax; Liu et al. 2023, ring attention). A query row that may attend no
key of a block has ``lse = -inf`` and output 0; merging it with anything leaves
the other side unchanged, and a row masked in every block stays (0, -inf). No NaN
appears forward or backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mtcore.ops.attention import _check, allowed_keys


def attention_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    query_documents: Tensor | None = None,
    key_documents: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``mtcore.ops.attention`` that also returns the log-sum-exp of each query's logits.

    Args: as ``mtcore.ops.attention`` (grouped-query heads; ``causal`` aligned to the
        bottom-right corner, so a block of queries that ends where its keys end sees
        them causally; ``key_padding_mask`` bool ``[batch, sk]``, True = may attend;
        ``window`` the sliding window, counted from the same corner; ``query_documents``
        and ``key_documents`` the document of each query and key: a query attends
        only keys of its own document).

    Returns:
        ``(out, lse)``: ``out`` ``[batch, hq, sq, d]`` in ``q.dtype``, exactly what
        ``attention`` returns; ``lse`` ``[batch, hq, sq]`` in float32 (float64 for
        float64 ``q``): ``logsumexp_j(q_i . k_j * scale)`` over the keys query ``i``
        may attend, ``-inf`` where it may attend none. Both outputs are
        differentiable (a merge of blocks backpropagates through the LSE).
    """
    _check(q, k, v, key_padding_mask, causal, window, query_documents, key_documents)
    _, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    group = hq // hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    kf = k.to(acc).repeat_interleave(group, dim=1)
    vf = v.to(acc).repeat_interleave(group, dim=1)
    logits = torch.matmul(q.to(acc), kf.transpose(-1, -2)) * scale  # [b, hq, sq, sk]

    allowed = allowed_keys(
        sq, sk, causal, window, key_padding_mask, q.device, query_documents, key_documents
    )
    has_key = allowed.any(dim=-1, keepdim=True)
    # Finite logits in rows without a key (as in ``attention``): no NaN even in
    # intermediates; the row's output and LSE are then set by ``has_key``.
    logits = logits.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0)
    probs = torch.softmax(logits, dim=-1).masked_fill(~allowed, 0.0)
    out = torch.matmul(probs, vf).to(q.dtype)  # bit for bit ``attention``'s
    lse = torch.logsumexp(logits, dim=-1)
    lse = torch.where(has_key[..., 0], lse, torch.full_like(lse, float("-inf")))
    return out, lse


def merge_attention(
    out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
) -> tuple[Tensor, Tensor]:
    """Attention over the union of two key blocks from each block's ``(out, lse)``.

    ``out_*`` ``[..., sq, d]``, ``lse_*`` ``[..., sq]`` (as ``attention_lse`` returns
    them). Exact, differentiable, and NaN-free when either or both LSEs are
    ``-inf``. The output has ``out_a``'s dtype; the LSE and the arithmetic are
    float32 or wider.
    """
    acc = torch.promote_types(lse_a.dtype, torch.float32)
    lse_a, lse_b = lse_a.to(acc), lse_b.to(acc)
    top = torch.maximum(lse_a, lse_b)
    empty = torch.isneginf(top)  # neither block has a key for this row
    top = torch.where(empty, torch.zeros_like(top), top)
    wa, wb = torch.exp(lse_a - top), torch.exp(lse_b - top)  # exp(-inf) = 0, grad 0
    total = wa + wb
    safe_total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(top, float("-inf")), top + torch.log(safe_total))
    wa, wb = (wa / safe_total)[..., None], (wb / safe_total)[..., None]
    out = wa * out_a.to(acc) + wb * out_b.to(acc)
    return out.to(out_a.dtype), lse
