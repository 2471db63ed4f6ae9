"""Moving routed tokens to the ranks that hold their experts, and back.

Dispatchers over the expert-parallel (ep) group, all through
``backend.collective``; each is used as ``dispatch`` (tokens -> rows sorted by
this rank's local experts, plus the row count of each) then ``combine``
(expert outputs -> ``[T, h]`` in the original token order, each token the sum
of its kept assignments weighted by their router probabilities).

* ``AllToAllDispatcher``: every rank sends each assignment only to the rank of
  its expert (two all-to-alls with variable split sizes, after a small
  all-to-all of the counts). Traffic ~ ``T * k * h`` per rank.
  ``dispatch_dedup.DedupAllToAllDispatcher`` sends a token once per
  destination rank instead of once per assignment.
* ``AllGatherDispatcher``: every rank gathers all ranks' tokens and routing,
  runs the ones its experts chose, and a reduce-scatter sums the weighted
  outputs back to their owners. Traffic ~ ``ep * T * h``; no count exchange, so
  it suits small ep or high top-k. Needs the same token count on every ep rank.

With ``ep == 1`` they skip every collective. Rows are sorted stably by expert,
so each expert sees its tokens in source-rank, then token order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.backend import tracing
from mtcore.parallel.tensor.mappings import TPGroup, gather_rows, reduce_scatter_rows


class _AllToAll(torch.autograd.Function):
    """Variable-split all-to-all of rows; the backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: Tensor, group: TPGroup, out_splits: list[int], in_splits: list[int]):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return _all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: Tensor):
        back = _all_to_all(grad, ctx.group, ctx.in_splits, ctx.out_splits, "moe all-to-all back")
        return back, None, None, None


class _PermuteRows(torch.autograd.Function):
    """``x.index_select(0, order)`` for a permutation ``order``, whose backward is the
    gather by the inverse permutation (autograd's ``index_select`` backward zero-fills a
    buffer and scatters into it: every row receives exactly one gradient row here)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, inverse: Tensor):
        ctx.save_for_backward(inverse)
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _inverse_permutation(order: Tensor) -> Tensor:
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    return inverse


def _all_to_all(
    x: Tensor, group: TPGroup, out_splits: list[int], in_splits: list[int], what="moe all-to-all"
) -> Tensor:
    """The one place MoE's tokens cross ranks (dispatch, then combine; a trace names it)."""
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with tracing.phase(what, "comm", rows=x.shape[0]):
        group.collective.all_to_all(out, x, out_splits, in_splits, group=group.group)
    return out


def _assignments(experts: Tensor, probs: Tensor, keep: Tensor | None):
    """Flat kept assignments: (token index, expert id, weight), in token-major order."""
    tokens, k = experts.shape
    token = torch.arange(tokens, device=experts.device).repeat_interleave(k)
    expert, weight = experts.reshape(-1), probs.reshape(-1)
    if keep is not None:
        kept = keep.reshape(-1).nonzero().squeeze(1)
        token, expert, weight = token[kept], expert[kept], weight.index_select(0, kept)
    return token, expert, weight


class Dispatcher:
    """Common state: the ep group and this rank's slice of the experts."""

    def __init__(self, num_experts: int, ep: TPGroup):
        if num_experts % ep.size:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep.size}")
        self.num_experts, self.ep = num_experts, ep
        self.local = num_experts // ep.size
        self.first = ep.rank * self.local  # first global expert id on this rank

    def dispatch(self, x: Tensor, experts: Tensor, probs: Tensor, keep: Tensor | None):
        """``x [T, h]``, ``experts/probs/keep [T, k]`` -> (rows ``[M, h]`` sorted by
        local expert, ``[E_local]`` int64 row counts)."""
        raise NotImplementedError

    def combine(self, out: Tensor) -> Tensor:
        """Expert outputs (rows as ``dispatch`` returned them) -> ``[T, h]``."""
        raise NotImplementedError

    def _forget(self) -> None:
        """Drop the per-forward state (it references the router's graph)."""
        self.token = self.weight = self.regroup = self.ungroup = None


class AllToAllDispatcher(Dispatcher):
    def dispatch(self, x, experts, probs, keep):
        self.tokens = x.shape[0]
        token, expert, weight = _assignments(experts, probs, keep)
        order = torch.argsort(expert, stable=True)
        self.token, self.weight = token[order], weight.index_select(0, order)
        counts = torch.bincount(expert, minlength=self.num_experts)  # [E], by global expert
        rows = x.index_select(0, self.token)  # sorted by global expert = by destination rank
        if self.ep.size == 1:
            return rows, counts
        p, e = self.ep.size, self.local
        received = _all_to_all(counts, self.ep, [e] * p, [e] * p).view(p, e)  # [src, local e]
        self.in_splits = counts.view(p, e).sum(1).tolist()
        self.out_splits = received.sum(1).tolist()
        rows = _AllToAll.apply(rows, self.ep, self.out_splits, self.in_splits)
        if e == 1:  # one local expert: arrival order is already grouped by expert
            self.regroup = None
            return rows, received.sum(0)
        # rows arrive grouped by (source rank, local expert); a stable sort on
        # (local expert, source rank) regroups them by expert.
        source = torch.arange(p, device=x.device).repeat_interleave(e)
        local = torch.arange(e, device=x.device).repeat(p)
        row_key = (local * p + source).repeat_interleave(received.reshape(-1))
        self.regroup = torch.argsort(row_key, stable=True)
        self.ungroup = _inverse_permutation(self.regroup)
        return _PermuteRows.apply(rows, self.regroup, self.ungroup), received.sum(0)

    def combine(self, out):
        if self.ep.size > 1:
            if self.regroup is not None:
                out = _PermuteRows.apply(out, self.ungroup, self.regroup)
            out = _AllToAll.apply(out, self.ep, self.in_splits, self.out_splits)
        weighted = out * self.weight.to(out.dtype).unsqueeze(1)
        y = out.new_zeros((self.tokens, out.shape[1])).index_add(0, self.token, weighted)
        self._forget()
        return y


class AllGatherDispatcher(Dispatcher):
    def dispatch(self, x, experts, probs, keep):
        self.tokens = x.shape[0]
        if self.ep.size > 1:
            x = gather_rows(x, self.ep)
            probs = gather_rows(probs, self.ep)
            experts = self.ep.all_gather(experts, 0)
            keep = None if keep is None else self.ep.all_gather(keep.to(torch.uint8), 0).bool()
        token, expert, weight = _assignments(experts, probs, keep)
        mine = ((expert >= self.first) & (expert < self.first + self.local)).nonzero().squeeze(1)
        local = expert[mine] - self.first
        order = torch.argsort(local, stable=True)
        pick = mine[order]
        self.token, self.weight = token[pick], weight.index_select(0, pick)
        self.gathered = x.shape[0]
        return x.index_select(0, self.token), torch.bincount(local, minlength=self.local)

    def combine(self, out):
        weighted = out * self.weight.to(out.dtype).unsqueeze(1)
        y = out.new_zeros((self.gathered, out.shape[1])).index_add(0, self.token, weighted)
        self._forget()
        return reduce_scatter_rows(y, self.ep)
