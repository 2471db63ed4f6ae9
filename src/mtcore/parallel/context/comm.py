"""Differentiable movements of activations over the cp group (collective interface only).

- ``gather_sequence``: every rank's local sequence, concatenated in cp order
  (backward: reduce-scatter, each rank gets the summed gradient of its own tokens);
- ``sequence_to_heads`` / ``heads_to_sequence``: the all-to-all pair of Ulysses
  (Jacobs et al. 2023): ``[b, h, S/cp, d]`` <-> ``[b, h/cp, S, d]``, each the other's
  backward;
- ``gather_key_mask``: a key-padding mask in cp order (no gradient);
- ``broadcast_from_first``: cp rank 0's tensor on every cp rank (backward: the
  gradients summed into rank 0), for heads that read one position (BERT's [CLS]).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.parallel.context.group import CPGroup


def _gather(x: Tensor, dim: int, cp: CPGroup) -> Tensor:
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((cp.size * front.shape[0], *front.shape[1:]))
    cp.collective.all_gather(out, front, group=cp.group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, dim: int, cp: CPGroup) -> Tensor:
    front = x.movedim(dim, 0).contiguous()
    out = front.new_empty((front.shape[0] // cp.size, *front.shape[1:]))
    cp.collective.reduce_scatter(out, front, group=cp.group)
    return out.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, dim: int, cp: CPGroup) -> Tensor:
        ctx.dim, ctx.cp = dim, cp
        return _gather(x, dim, cp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _reduce_scatter(grad, ctx.dim, ctx.cp), None, None


def gather_sequence(x: Tensor, dim: int, cp: CPGroup) -> Tensor:
    """All cp ranks' ``x`` concatenated along ``dim`` (cp order); backward reduce-scatters."""
    return _GatherSequence.apply(x, dim, cp)


def _seq_to_heads(x: Tensor, cp: CPGroup) -> Tensor:
    b, h, s, d = x.shape
    send = x.reshape(b, cp.size, h // cp.size, s, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)  # [source rank, b, h / cp, s, d]
    cp.collective.all_to_all(recv, send, group=cp.group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp.size, cp.size * s, d)


def _heads_to_seq(x: Tensor, cp: CPGroup) -> Tensor:
    b, hl, full, d = x.shape
    s = full // cp.size
    send = x.reshape(b, hl, cp.size, s, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)  # [source rank (its head group), b, h / cp, s, d]
    cp.collective.all_to_all(recv, send, group=cp.group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp.size * hl, s, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cp: CPGroup) -> Tensor:
        ctx.cp = cp
        return _seq_to_heads(x, cp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _heads_to_seq(grad, ctx.cp), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cp: CPGroup) -> Tensor:
        ctx.cp = cp
        return _heads_to_seq(x, cp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _seq_to_heads(grad, ctx.cp), None


def sequence_to_heads(x: Tensor, cp: CPGroup) -> Tensor:
    """``[b, h, S/cp, d]`` (local sequence, all heads) -> ``[b, h/cp, S, d]`` (this rank's
    head group ``[rank * h/cp, (rank + 1) * h/cp)``, the whole sequence in cp order)."""
    return _SeqToHeads.apply(x, cp)


def heads_to_sequence(x: Tensor, cp: CPGroup) -> Tensor:
    """The inverse of ``sequence_to_heads``."""
    return _HeadsToSeq.apply(x, cp)


@torch.no_grad()
def gather_key_mask(mask: Tensor | None, cp: CPGroup) -> Tensor | None:
    """A ``[b, S/cp]`` key-padding mask of the local sequence -> ``[b, S]`` in cp order."""
    if mask is None:
        return None
    return _gather(mask.to(torch.uint8), 1, cp).bool()


class _BroadcastFromFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cp: CPGroup) -> Tensor:
        ctx.cp = cp
        out = x.clone() if cp.rank == 0 else torch.zeros_like(x)
        cp.collective.all_reduce(out, group=cp.group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        ctx.cp.collective.all_reduce(grad, group=ctx.cp.group)
        return (grad if ctx.cp.rank == 0 else torch.zeros_like(grad)), None


def broadcast_from_first(x: Tensor, cp: CPGroup) -> Tensor:
    """cp rank 0's ``x`` on every cp rank; backward sums every rank's gradient into rank 0
    (the others' ``x`` gets none). Every rank may then compute the same loss term."""
    return _BroadcastFromFirst.apply(x, cp)
