"""The all-gather and all-to-all (Ulysses) methods, and the one entry point for all three.

- **all-gather**: every rank gathers the whole sequence's K and V (cp order, put in
  global order for a causal mask) and attends its own queries to it; the backward
  reduce-scatters dK/dV. One collective each way, but each rank holds all K/V.
- **a2a** (Ulysses, Jacobs et al. 2023): an all-to-all turns sequence shards into
  head shards (``[b, h, S/cp, d]`` -> ``[b, h/cp, S, d]``), each rank attends its
  heads over the whole sequence, and a second all-to-all turns the output back.
  cp must divide the (local) query and key/value heads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.parallel.context.comm import gather_sequence, heads_to_sequence, sequence_to_heads
from mtcore.parallel.context.group import CPGroup, chunk_ids, cp_to_global
from mtcore.parallel.context.ring import ring_attention


def allgather_attention(q, k, v, causal: bool, key_mask, cp: CPGroup, kernels) -> Tensor:
    """Attention of the local queries over the gathered K/V (arguments: ``ring_attention``)."""
    kv = gather_sequence(torch.stack([k, v]), 3, cp)  # [2, b, hkv, S, d], cp order
    if not causal:
        return kernels.attention(q, kv[0], kv[1], causal=False, key_padding_mask=key_mask)
    full = kv.shape[3]
    order = cp_to_global(full, cp.size, q.device)
    kv = kv.index_select(3, order)
    mask = key_mask.index_select(1, order) if key_mask is not None else None
    c = q.shape[2] // 2
    outs = []
    for half, chunk in enumerate(chunk_ids(cp.size, cp.rank)):
        # Queries of chunk ``chunk`` see the keys before its end; the causal mask is
        # aligned to the bottom-right corner, so it is the global one.
        end = (chunk + 1) * c
        outs.append(
            kernels.attention(
                q[:, :, half * c : (half + 1) * c],
                kv[0][:, :, :end],
                kv[1][:, :, :end],
                causal=True,
                key_padding_mask=mask[:, :end] if mask is not None else None,
            )
        )
    return torch.cat(outs, dim=2)


def a2a_attention(q, k, v, causal: bool, key_mask, cp: CPGroup, kernels) -> Tensor:
    """Ulysses attention: heads sharded, the whole sequence per rank (arguments: ``ring_attention``)."""
    qh, kh, vh = (sequence_to_heads(t, cp) for t in (q, k, v))  # [b, h / cp, S, d], cp order
    if causal:
        order = cp_to_global(qh.shape[2], cp.size, q.device)
        qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))
        key_mask = key_mask.index_select(1, order) if key_mask is not None else None
    out = kernels.attention(qh, kh, vh, causal=causal, key_padding_mask=key_mask)
    if causal:
        out = out.index_select(2, torch.argsort(order))
    return heads_to_sequence(out, cp)


METHOD_FUNCTIONS = {"ring": ring_attention, "allgather": allgather_attention, "a2a": a2a_attention}


def context_attention(
    q: Tensor, k: Tensor, v: Tensor, cp: CPGroup, kernels, causal: bool = True,
    key_padding_mask: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Self-attention of a sequence split over the cp ranks, by ``cp.method``.

    q ``[b, hq, S/cp, d]``, k/v ``[b, hkv, S/cp, d]``: this rank's local sequence
    (``mtcore.parallel.context.group``). ``key_padding_mask``: bool ``[b, S]`` for the
    whole sequence in cp order (``gather_key_mask``), True = a real token. Returns
    ``[b, hq, S/cp, d]``: equal to one process's attention at this rank's positions.
    """
    try:
        fn = METHOD_FUNCTIONS[cp.method]
    except KeyError:
        raise ValueError(
            f"unknown cp method {cp.method!r}; known: {', '.join(METHOD_FUNCTIONS)}"
        ) from None
    return fn(q, k, v, causal, key_padding_mask, cp, kernels)
