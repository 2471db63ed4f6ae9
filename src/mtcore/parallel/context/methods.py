"""The all-gather and all-to-all (Ulysses) methods, and the one entry point for all three.

- **all-gather**: every rank gathers the whole sequence's K and V (cp order, put in
  global order for a causal mask) and attends its own queries to it; the backward
  reduce-scatters dK/dV. One collective each way, but each rank holds all K/V. Causal
  query chunks are attended without a dense mask and recomputed in backward
  (``_causal_chunk``, ``allgather_attention``), so a rank saves about 1/cp of one
  process's activations plus the gathered K/V.
- **a2a** (Ulysses, Jacobs et al. 2023): an all-to-all turns sequence shards into
  head shards (``[b, h, S/cp, d]`` -> ``[b, h/cp, S, d]``), each rank attends its
  heads over the whole sequence, and a second all-to-all turns the output back.
  cp must divide the (local) query and key/value heads.

A sliding window (causal only) reaches each method: all-gather attends each query
chunk to the keys of its window only (the blocks before it are skipped), a2a passes
it to the kernel over the whole sequence, and ring skips or bands its chunk pairs
(``mtcore.parallel.context.window``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.ops import merge_attention
from mtcore.parallel.context.comm import gather_sequence, heads_to_sequence, sequence_to_heads
from mtcore.parallel.context.documents import DocumentIds, kernel_documents
from mtcore.parallel.context.group import CPGroup, chunk_ids, cp_to_global
from mtcore.parallel.context.ring import ring_attention
from mtcore.parallel.recompute import checkpoint


def allgather_attention(
    q, k, v, causal: bool, key_mask, cp: CPGroup, kernels, window=None,
    documents: DocumentIds | None = None,
) -> Tensor:  # fmt: skip
    """Attention of the local queries over the gathered K/V (arguments: ``ring_attention``)."""
    kv = gather_sequence(torch.stack([k, v]), 3, cp)  # [2, b, hkv, S, d], cp order
    if not causal:
        ids = documents.kernel_args() if documents is not None else {}
        return kernels.attention(q, kv[0], kv[1], causal=False, key_padding_mask=key_mask, **ids)
    full = kv.shape[3]
    order = cp_to_global(full, cp.size, q.device)
    kv = kv.index_select(3, order)
    mask = key_mask.index_select(1, order) if key_mask is not None else None
    ids = (None, None)
    if documents is not None:
        ids = (documents.queries, documents.keys.index_select(1, order))
    # Recomputed in backward: what the chunks' kernels and merges would save (folded
    # queries, grouped-query K/V expanded per call, partial outputs) is several times
    # this rank's share of q, k, v; kept are only q and the gathered K/V.
    return checkpoint(
        _causal_chunks, q, kv, mask, cp.rank, cp.size, kernels, window, ids, backend=cp.backend
    )


def _causal_chunks(q, kv, mask, rank: int, size: int, kernels, window, ids) -> Tensor:
    """Causal attention of this rank's two query chunks over the gathered K/V (global
    order); ``ids``: (this rank's query document ids, every key's in global order)."""
    c = q.shape[2] // 2
    query_ids, key_ids = ids
    outs = []
    for half, chunk in enumerate(chunk_ids(size, rank)):
        rows = q[:, :, half * c : (half + 1) * c]
        row_ids = (query_ids[:, half * c : (half + 1) * c] if query_ids is not None else None,
                   key_ids)  # fmt: skip
        if window is None:
            outs.append(_causal_chunk(rows, kv, mask, chunk * c, c, kernels, row_ids))
        else:
            outs.append(_window_chunk(rows, kv, mask, chunk * c, c, kernels, window, row_ids))
    return torch.cat(outs, dim=2)


def _keys(keys_of_all, keys: slice):
    """The key padding mask's or the key document ids' part at ``keys`` (None stays)."""
    return keys_of_all[:, keys] if keys_of_all is not None else None


def _window_chunk(rows, kv, mask, start: int, c: int, kernels, window: int, ids) -> Tensor:
    """Queries at ``start..start+c-1`` over the keys of their windows only: one causal
    call whose keys end with the chunk, so the op's bottom-right band is the global one."""
    keys = slice(max(0, start - window + 1), start + c)
    return kernels.attention(
        rows, kv[0][:, :, keys], kv[1][:, :, keys], causal=True,
        key_padding_mask=_keys(mask, keys), window=window,
        **kernel_documents(ids[0], _keys(ids[1], keys)),
    )  # fmt: skip


def _causal_chunk(rows, kv, mask, start: int, c: int, kernels, ids) -> Tensor:
    """Causal attention of the ``c`` queries at global positions ``start..start+c-1``.

    One causal call over keys ``[0, start + c)`` would need a rectangular causal mask,
    which the kernels build densely and save for backward (``O(S^2/cp)`` per layer).
    Instead: the keys before the chunk, which every query sees (no causal mask), and
    the chunk's own square causal block (the kernels' maskless causal path), merged
    exactly by their log-sum-exps.
    """
    query_ids, key_ids = ids
    own = slice(start, start + c)
    own_mask, own_ids = _keys(mask, own), kernel_documents(query_ids, _keys(key_ids, own))
    if start == 0:
        return kernels.attention(
            rows, kv[0][:, :, own], kv[1][:, :, own], causal=True, key_padding_mask=own_mask,
            **own_ids,
        )  # fmt: skip
    before = slice(0, start)
    out_a, lse_a = _full_attention_lse(
        rows, kv[0][:, :, before], kv[1][:, :, before], _keys(mask, before), kernels,
        (query_ids, _keys(key_ids, before)),
    )  # fmt: skip
    out_b, lse_b = kernels.attention_lse(
        rows, kv[0][:, :, own], kv[1][:, :, own], True, own_mask, **own_ids
    )
    return merge_attention(out_a, lse_a, out_b, lse_b)[0]


def _full_attention_lse(q, k, v, key_mask, kernels, ids=(None, None)) -> tuple[Tensor, Tensor]:
    """``attention_lse`` without a causal mask, grouped-query heads folded into the rows.

    Without a causal mask every query row is independent, so the ``hq / hkv`` query
    heads of one key/value head can attend it as one head with that many times the
    rows: a kernel then never expands K/V to ``hq`` heads (which it would save for
    backward, a copy of every key before the chunk per layer).
    """
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    query_ids, key_ids = ids
    if hq == hkv:
        return kernels.attention_lse(q, k, v, False, key_mask, **kernel_documents(*ids))
    folded = q.reshape(b, hkv, (hq // hkv) * sq, d)
    if query_ids is not None:  # folded row g * sq + i is query i of the group's head g
        query_ids = query_ids.repeat(1, hq // hkv)
    out, lse = kernels.attention_lse(
        folded, k, v, False, key_mask, **kernel_documents(query_ids, key_ids)
    )
    return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq)


def a2a_attention(
    q, k, v, causal: bool, key_mask, cp: CPGroup, kernels, window=None,
    documents: DocumentIds | None = None,
) -> Tensor:  # fmt: skip
    """Ulysses attention: heads sharded, the whole sequence per rank (arguments: ``ring_attention``)."""
    qh, kh, vh = (sequence_to_heads(t, cp) for t in (q, k, v))  # [b, h / cp, S, d], cp order
    ids = documents.keys if documents is not None else None  # queries: the whole sequence too
    if causal:
        order = cp_to_global(qh.shape[2], cp.size, q.device)
        qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))
        key_mask = key_mask.index_select(1, order) if key_mask is not None else None
        ids = ids.index_select(1, order) if ids is not None else None
    out = kernels.attention(
        qh, kh, vh, causal=causal, key_padding_mask=key_mask, window=window,
        **kernel_documents(ids, ids),
    )  # fmt: skip
    if causal:
        out = out.index_select(2, torch.argsort(order))
    return heads_to_sequence(out, cp)


METHOD_FUNCTIONS = {"ring": ring_attention, "allgather": allgather_attention, "a2a": a2a_attention}


def context_attention(
    q: Tensor, k: Tensor, v: Tensor, cp: CPGroup, kernels, causal: bool = True,
    key_padding_mask: Tensor | None = None, window: int | None = None,
    documents: DocumentIds | None = None,
) -> Tensor:  # fmt: skip
    """Self-attention of a sequence split over the cp ranks, by ``cp.method``.

    q ``[b, hq, S/cp, d]``, k/v ``[b, hkv, S/cp, d]``: this rank's local sequence
    (``mtcore.parallel.context.group``). ``key_padding_mask``: bool ``[b, S]`` for the
    whole sequence in cp order (``gather_key_mask``), True = a real token. ``window``:
    sliding window over global positions (causal only; ``mtcore.ops.attention``).
    ``documents``: the tokens' document ids (``DocumentIds.of``: this rank's queries',
    the whole sequence's keys' in cp order) for packed samples, or None.
    Returns ``[b, hq, S/cp, d]``: equal to one process's attention at this rank's
    positions.
    """
    if window is not None and not causal:
        raise ValueError(f"a sliding window (window={window}) needs causal attention")
    try:
        fn = METHOD_FUNCTIONS[cp.method]
    except KeyError:
        raise ValueError(
            f"unknown cp method {cp.method!r}; known: {', '.join(METHOD_FUNCTIONS)}"
        ) from None
    return fn(q, k, v, causal, key_padding_mask, cp, kernels, window, documents)
