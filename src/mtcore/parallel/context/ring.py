"""Ring attention (Liu et al. 2023): K/V blocks travel around the cp ranks.

Each of ``cp`` steps attends this rank's queries to one K/V block and merges the
result online with the log-sum-exp (``mtcore.ops.merge_attention``). The next
block's transfer (one batched send to the next rank and receive from the
previous, through the collective interface) is posted *before* the current
block's compute, so communication hides behind attention.

Causal blocks under the load-balanced split (rank ``r`` holds chunks ``r`` and
``2cp-1-r``; the block from rank ``j`` holds chunks ``j`` and ``2cp-1-j``):

- ``j == r`` (step 0): the local sequence against itself, causal (its positions
  increase, so the lower-triangular mask is the global one);
- ``j < r``: every query sees chunk ``j`` (the first half of the block) whole and
  nothing of chunk ``2cp-1-j``;
- ``j > r``: only the second half of the queries (chunk ``2cp-1-r``) sees anything,
  and it sees the whole block.

So every step is one plain (causal or full) attention call of equal size. With a
sliding window each step attends the chunk pairs inside the window instead
(``mtcore.parallel.context.window``): a pair wholly outside it is skipped (the K/V
block still travels, as later ranks need it). The
backward runs the ring again: it recomputes each block, gets its gradients from
the merged output and LSE, keeps dQ, and sends the block's dK/dV accumulator on
after it. That hop is posted once the block's gradients are added and waited for
only after the next block's gradients are computed, so it too hides behind
compute; one last hop brings each rank its own block's dK/dV.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.backend import tracing
from mtcore.backend.collective import P2P
from mtcore.ops import merge_attention
from mtcore.parallel.context.documents import DocumentIds, kernel_documents
from mtcore.parallel.context.group import CPGroup, chunk_ids
from mtcore.parallel.context.window import windowed_chunks_lse

_ALL = slice(None)


def _plan(step: int, cp: CPGroup, causal: bool, length: int, window) -> tuple[slice, slice, bool]:
    """(query slice, key slice, causal) of the block this rank attends at ``step``."""
    if not causal or window is not None:
        return _ALL, _ALL, False
    src = (cp.rank - step) % cp.size
    half = length // 2
    if src == cp.rank:
        return _ALL, _ALL, True
    if src < cp.rank:
        return _ALL, slice(0, half), False
    return slice(half, length), _ALL, False


def _block_lse(q, k, v, causal: bool, mask, step: int, cp: CPGroup, window, kernels, ids):
    """``(out, lse)`` of one step's block (q, k, v already sliced by ``_plan``; ``ids``
    the block's (query, key) document ids or (None, None))."""
    if window is None:
        return kernels.attention_lse(q, k, v, causal, mask, **kernel_documents(*ids))
    src = (cp.rank - step) % cp.size
    mine, theirs = chunk_ids(cp.size, cp.rank), chunk_ids(cp.size, src)
    return windowed_chunks_lse(q, k, v, mask, mine, theirs, window, kernels, *ids)


def _block_keys(keys_of_all: Tensor | None, src: int, length: int, keys: slice):
    """The key padding mask's or the key document ids' part for one step's block:
    rank ``src``'s tokens (cp order), sliced by ``_plan``'s key slice."""
    if keys_of_all is None:
        return None
    return keys_of_all[:, src * length : (src + 1) * length][:, keys]


def _block_ids(documents: DocumentIds | None, src: int, length: int, rows: slice, keys: slice):
    if documents is None:
        return None, None
    return documents.queries[:, rows], _block_keys(documents.keys, src, length, keys)


def _rotate(cp: CPGroup, tensor: Tensor) -> tuple[Tensor, list]:
    """Post: send ``tensor`` to the next rank, receive the previous rank's into a new one."""
    recv = torch.empty_like(tensor)
    handles = cp.collective.batch_send_recv(
        [P2P("send", tensor, cp.next_rank, cp.group), P2P("recv", recv, cp.prev_rank, cp.group)]
    )
    return recv, handles


def _wait(cp: CPGroup, posted: tuple[Tensor, list], what: str, step: int) -> Tensor:
    """Wait for a ``_rotate`` and return the tensor it received."""
    recv, handles = posted
    with tracing.phase(f"cp ring {what}", "comm", ring_step=step):
        for handle in handles:
            handle.wait()
    _note(cp, what, step)
    return recv


def _note(cp: CPGroup, what: str, step: int) -> None:
    if cp.trace is not None:
        cp.trace.append((what, step))


class RingAttention(torch.autograd.Function):
    """``(q, k, v)`` of the local sequence -> attention over the whole sequence."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, key_mask, cp: CPGroup, kernels, window, documents):
        b, hq, length, d = q.shape
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros((b, hq, length, d), dtype=acc)
        lse = q.new_full((b, hq, length), float("-inf"), dtype=acc)
        kv = torch.stack([k, v])
        for step in range(cp.size):
            pending = None
            if step + 1 < cp.size:
                pending = _rotate(cp, kv)
                _note(cp, "post", step + 1)
            rows, keys, block_causal = _plan(step, cp, causal, length, window)
            src = (cp.rank - step) % cp.size
            _note(cp, "compute", step)
            o, o_lse = _block_lse(
                q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], block_causal,
                _block_keys(key_mask, src, length, keys), step, cp, window, kernels,
                _block_ids(documents, src, length, rows, keys),
            )  # fmt: skip
            out[:, :, rows], lse[:, :, rows] = merge_attention(
                out[:, :, rows], lse[:, :, rows], o, o_lse
            )
            if pending is not None:
                kv = _wait(cp, pending, "wait", step + 1)
        ctx.save_for_backward(q, k, v, out, lse, key_mask)
        ctx.causal, ctx.cp, ctx.kernels, ctx.window = causal, cp, kernels, window
        ctx.documents = documents  # integer ids: no gradient, kept as they are
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_mask = ctx.saved_tensors
        cp, causal, kernels, window = ctx.cp, ctx.causal, ctx.kernels, ctx.window
        documents = ctx.documents
        length, acc = q.shape[2], out.dtype
        dout = dout.to(acc)
        dq = torch.zeros_like(q, dtype=acc)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv, dtype=acc)
        # exp(-inf - 0) = 0: a row with no key anywhere takes no gradient.
        lse_safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        dkv_pending = None  # the previous block's dK/dV hop, in flight during this compute
        for step in range(cp.size):
            pending = None
            if step + 1 < cp.size:
                pending = _rotate(cp, kv)
                _note(cp, "post", step + 1)
            rows, keys, block_causal = _plan(step, cp, causal, length, window)
            src = (cp.rank - step) % cp.size
            _note(cp, "grad", step)
            with torch.enable_grad():
                qb = q[:, :, rows].detach().requires_grad_()
                kb = kv[0][:, :, keys].detach().requires_grad_()
                vb = kv[1][:, :, keys].detach().requires_grad_()
                o, o_lse = _block_lse(
                    qb, kb, vb, block_causal, _block_keys(key_mask, src, length, keys),
                    step, cp, window, kernels, _block_ids(documents, src, length, rows, keys),
                )  # fmt: skip
                # The merged output is sum_j w_j o_j with w_j = exp(lse_j - lse): o_j gets
                # w_j dO, and lse_j gets w_j <dO, o_j - O> (the softmax normalisation).
                w = torch.exp(o_lse.to(acc) - lse_safe[:, :, rows])
                g_out, merged = dout[:, :, rows], out[:, :, rows]
                g_o = (w[..., None] * g_out).to(o.dtype)
                g_lse = (w * (g_out * (o.to(acc) - merged)).sum(-1)).to(o_lse.dtype)
                dqb, dkb, dvb = torch.autograd.grad((o, o_lse), (qb, kb, vb), (g_o, g_lse))
            dq[:, :, rows] += dqb
            if dkv_pending is not None:
                dkv = _wait(cp, dkv_pending, "wait dkv", step - 1)
            dkv[0][:, :, keys] += dkb
            dkv[1][:, :, keys] += dvb
            # The block's gradient accumulator follows the block; it arrives while the
            # next block's gradients are computed, and is waited for only to add them.
            dkv_pending = _rotate(cp, dkv)
            _note(cp, "post dkv", step)
            if pending is not None:
                kv = _wait(cp, pending, "wait", step + 1)
        # One last hop brings this rank its own block's dK/dV.
        dkv = _wait(cp, dkv_pending, "wait dkv", cp.size - 1)
        grads = dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
        return (*grads, None, None, None, None, None, None)


def ring_attention(
    q, k, v, causal: bool, key_mask, cp: CPGroup, kernels, window=None,
    documents: DocumentIds | None = None,
) -> Tensor:  # fmt: skip
    """Attention of the local queries over the whole sequence's keys, K/V in a ring.

    q ``[b, hq, S/cp, d]``, k/v ``[b, hkv, S/cp, d]`` (local sequence); ``key_mask``
    ``[b, S]`` in cp order or None; ``window``: sliding window (causal only) or None;
    ``documents``: the tokens' document ids (``DocumentIds``) or None.
    Returns ``[b, hq, S/cp, d]``.
    """
    return RingAttention.apply(q, k, v, causal, key_mask, cp, kernels, window, documents)
