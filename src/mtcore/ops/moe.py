"""Reference grouped matrix multiply for mixture-of-experts layers."""

from __future__ import annotations

import torch
from torch import Tensor


def grouped_mm(x: Tensor, weight: Tensor, tokens_per_expert: Tensor) -> Tensor:
    """One matmul per expert over contiguous row blocks of ``x``.

    Rows of ``x`` are sorted by expert: the first ``tokens_per_expert[0]`` rows
    belong to expert 0, the next ``tokens_per_expert[1]`` to expert 1, and so on.
    ``out[rows of e] = x[rows of e] @ weight[e]``. An expert may have zero rows
    (its weight then gets a zero gradient).

    Args:
        x: ``[T, k]``, floating.
        weight: ``[E, k, n]``, same dtype as ``x``.
        tokens_per_expert: 1-D integer tensor ``[E]``, non-negative, summing to
            ``T``. It may live on any device; it is read once with ``.tolist()``
            (a host sync, acceptable in a reference).

    Returns:
        ``[T, n]`` in ``x.dtype``; products are accumulated in float32 (float64
        for float64 inputs) and rounded once. Differentiable with respect to ``x`` and ``weight``.

    Raises:
        ValueError: on wrong ranks, ``k`` or ``E`` mismatch, negative counts, or
            counts that do not sum to ``T``.
    """
    if x.dim() != 2 or weight.dim() != 3:
        raise ValueError(
            f"x must be [T, k] and weight [E, k, n], got {list(x.shape)} and {list(weight.shape)}"
        )
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight dtypes differ: {x.dtype} vs {weight.dtype}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"inner dims differ: x has k={x.shape[1]}, weight has k={weight.shape[1]}")
    if tokens_per_expert.dim() != 1 or tokens_per_expert.is_floating_point():
        raise ValueError("tokens_per_expert must be a 1-D integer tensor [E]")
    counts = [int(c) for c in tokens_per_expert.tolist()]
    if len(counts) != weight.shape[0]:
        raise ValueError(
            f"tokens_per_expert has {len(counts)} experts, weight has {weight.shape[0]}"
        )
    if any(c < 0 for c in counts):
        raise ValueError(f"tokens_per_expert must be non-negative, got {counts}")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {sum(counts)}, but x has {x.shape[0]} rows")

    acc = torch.promote_types(x.dtype, torch.float32)
    if not counts:  # E == 0 (and therefore T == 0)
        return x.new_zeros(0, weight.shape[2])
    return _GroupedMM.apply(x.to(acc), weight.to(acc), counts).to(x.dtype)


def _blocks(counts: list[int]):
    """``(expert, row slice)`` of every expert with rows."""
    start = 0
    for e, c in enumerate(counts):
        if c:
            yield e, slice(start, start + c)
        start += c


class _GroupedMM(torch.autograd.Function):
    """The per-expert products written into one output, and their backward into one
    ``grad_x`` and one ``grad_weight``: the same ``mm`` calls autograd makes for
    ``cat([x_e @ w[e]])``, without the concatenation, nor the full-size zero gradient
    that indexing ``w[e]`` gives each expert's backward (summed over the experts).
    ``grad_weight`` is zero-filled only for the experts that got no rows: every other
    block is written whole by its ``mm``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        out = x.new_empty(x.shape[0], weight.shape[2])
        for e, rows in _blocks(counts):
            torch.mm(x[rows], weight[e], out=out[rows])
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x)
            for e, rows in _blocks(ctx.counts):
                torch.mm(grad[rows], weight[e].t(), out=grad_x[rows])
        if ctx.needs_input_grad[1]:
            grad_weight = torch.empty_like(weight)  # every expert's block written below
            for e, c in enumerate(ctx.counts):
                if not c:
                    grad_weight[e].zero_()
            for e, rows in _blocks(ctx.counts):
                torch.mm(x[rows].t(), grad[rows], out=grad_weight[e])
        return grad_x, grad_weight, None
