"""Sliding-window attention between two chunks of the load-balanced split.

Under context parallelism a rank attends its two query chunks to K/V chunks that
start anywhere in the sequence, while the ``attention_lse`` op counts a window from
the bottom-right corner of one block. A query chunk ``qc`` and a key chunk ``kc <
qc`` of ``n`` tokens each are ``dist = (qc - kc) * n`` positions apart: query ``i``
may attend key ``j`` iff ``dist + i - j < window``, i.e. ``j >= i + first`` with
``first = dist - window + 1``. That is a causal band seen from the other corner, so
the block is attended with both axes reversed (``i' = n-1-i``, ``j' = n-1-j``:
``j' <= i' - first``), which is the op's own bottom-right causal mask on a slice of
the reversed keys (``first >= 0``) or of the reversed queries (``first < 0``). A
pair wholly outside the window is skipped; one wholly inside is a plain block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.ops import merge_attention
from mtcore.parallel.context.documents import kernel_documents


def windowed_chunks_lse(
    q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor | None,
    q_chunks: tuple[int, ...], k_chunks: tuple[int, ...], window: int, kernels,
    query_ids: Tensor | None = None, key_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out, lse)`` of queries ``q`` (chunks ``q_chunks``, in that order, each ``n``
    long) over keys ``k``/``v`` (chunks ``k_chunks``), causal within ``window``.

    ``key_mask``: bool ``[b, len(k_chunks) * n]`` or None; ``query_ids``/``key_ids``:
    the queries' and keys' document ids or None. Rows that see no key get
    ``(0, -inf)``, so merging them with other blocks changes nothing.
    """
    n = q.shape[2] // len(q_chunks)
    outs, lses = [], []
    for qi, qc in enumerate(q_chunks):
        rows = q[:, :, qi * n : (qi + 1) * n]
        row_ids = query_ids[:, qi * n : (qi + 1) * n] if query_ids is not None else None
        out = rows.new_zeros(rows.shape)
        acc = torch.promote_types(rows.dtype, torch.float32)
        lse = rows.new_full(rows.shape[:3], float("-inf"), dtype=acc)
        for ki, kc in enumerate(k_chunks):
            keys = slice(ki * n, (ki + 1) * n)
            mask = key_mask[:, keys] if key_mask is not None else None
            ids = (row_ids, key_ids[:, keys]) if key_ids is not None else (None, None)
            part = _pair_lse(
                rows, k[:, :, keys], v[:, :, keys], mask, qc - kc, n, window, kernels, ids
            )
            if part is not None:
                out, lse = merge_attention(out, lse, *part)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def _pair_lse(q, k, v, mask, chunk_gap: int, n: int, window: int, kernels, ids):
    """One (query chunk, key chunk) pair; ``ids``: their (query, key) document ids or
    (None, None)."""
    if chunk_gap < 0:
        return None  # keys after every query
    if chunk_gap == 0:
        return kernels.attention_lse(q, k, v, True, mask, None, window, **kernel_documents(*ids))
    first = chunk_gap * n - window + 1
    if first >= n:
        return None  # every key is out of every query's window
    if first <= 1 - n:
        return kernels.attention_lse(q, k, v, False, mask, **kernel_documents(*ids))
    rq, rk, rv = q.flip(2), k.flip(2), v.flip(2)
    rmask = mask.flip(1) if mask is not None else None
    rq_ids, rk_ids = (t.flip(1) if t is not None else None for t in ids)
    if first >= 0:  # reversed query i' sees reversed keys 0 .. i' - first
        kept = n - first
        out, lse = kernels.attention_lse(
            rq, rk[:, :, :kept], rv[:, :, :kept], True,
            rmask[:, :kept] if rmask is not None else None,
            **kernel_documents(rq_ids, rk_ids[:, :kept] if rk_ids is not None else None),
        )  # fmt: skip
    else:  # reversed query i' sees keys 0 .. i' + extra: the last `extra` rows see all
        extra = -first
        band, full = slice(0, n - extra), slice(n - extra, n)
        band_out, band_lse = kernels.attention_lse(
            rq[:, :, band], rk, rv, True, rmask, **_rows_documents(rq_ids, rk_ids, band)
        )
        full_out, full_lse = kernels.attention_lse(
            rq[:, :, full], rk, rv, False, rmask, **_rows_documents(rq_ids, rk_ids, full)
        )
        out, lse = torch.cat([band_out, full_out], 2), torch.cat([band_lse, full_lse], 2)
    return out.flip(2), lse.flip(2)


def _rows_documents(query_ids, key_ids, rows: slice) -> dict:
    return kernel_documents(query_ids[:, rows] if query_ids is not None else None, key_ids)
