"""Deferred weight gradients: the B/W split of a zero-bubble pipeline schedule.

A zero-bubble schedule (``mtcore.parallel.pipeline.schedules.zb_h1``) runs each
micro-batch's backward in two passes: B computes the input gradients, which the
previous stage waits for, and W the weight gradients, which nobody waits for and
which therefore fill the pipeline's idle time. The linears hold most of a
transformer's backward work, so they are what W defers: a linear built while a
``WeightGradStore`` is active (``deferring_weight_grads``, around the forward of
one micro-batch) gives no weight gradient in its backward; it records how to
compute it from its saved input and the output gradient, and W runs the records
(``WeightGradStore.compute``). Every other parameter (norms, embeddings, biases,
expert weights) gets its gradient in B, from the same autograd call.

The deferred product is the one the undeferred backward computes
(``dy^T @ x`` over the flattened tokens), so the gradients are the same numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor


class WeightGradStore:
    """The weight gradients one (micro-batch, chunk) has left for W, in backward order."""

    def __init__(self):
        self._pending: list[tuple[torch.nn.Parameter, Callable[[], Tensor]]] = []

    def defer(self, weight: torch.nn.Parameter, compute: Callable[[], Tensor]) -> None:
        self._pending.append((weight, compute))

    def __len__(self) -> int:
        return len(self._pending)

    def weights(self) -> list[torch.nn.Parameter]:
        """The parameters whose gradients wait here, in the order ``compute`` gives them."""
        return [weight for weight, _ in self._pending]

    def compute(self) -> list[tuple[torch.nn.Parameter, Tensor]]:
        """Run every deferred product (each once) and let go of the saved tensors."""
        pending, self._pending = self._pending, []
        with torch.no_grad():
            return [(weight, compute()) for weight, compute in pending]


class _HandOver(torch.autograd.Function):
    """A node whose backward gives ``compute()``'s gradients to ``params``."""

    @staticmethod
    def forward(ctx, compute: Callable[[], list[Tensor]], *params):
        ctx.compute = compute
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx, _):
        compute, ctx.compute = ctx.compute, None
        return (None, *compute())


def hand_over(params: list[torch.nn.Parameter], compute: Callable[[], list[Tensor]]) -> None:
    """Accumulate ``compute()`` (one gradient per parameter) into ``params`` as a
    backward does: ``.grad`` and the post-accumulate hooks (data parallel's) included.

    The gradients are made inside autograd's own pass, so that nothing else holds them
    when they reach the parameters and accumulation takes them over instead of copying
    each (``torch.autograd.backward(params, grads)`` copies, its caller holding them).
    ``compute`` should let go of them too."""
    torch.autograd.backward(_HandOver.apply(compute, *params))


_active: WeightGradStore | None = None


@contextlib.contextmanager
def deferring_weight_grads(store: WeightGradStore | None) -> Iterator[None]:
    """Linears run forward inside this block defer their weight gradient to ``store``
    (None: they compute it in backward, as usual)."""
    global _active
    previous, _active = _active, store
    try:
        yield
    finally:
        _active = previous


def active_store() -> WeightGradStore | None:
    """The store linears defer to right now (read in forward, so backward may run on
    any thread)."""
    return _active


def weight_grad(grad: Tensor, total: Tensor) -> Tensor:
    """``dL/dW`` of ``y = x W^T``: ``dy^T @ x`` over the flattened tokens."""
    return grad.flatten(0, -2).t().matmul(total.flatten(0, -2))


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose weight gradient goes to a store instead of to backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, store: WeightGradStore):
        ctx.save_for_backward(x, weight)
        # the parameter itself: under recompute, saved_tensors gives an alias of it
        ctx.store, ctx.param, ctx.has_bias = store, weight, bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)
        if ctx.needs_input_grad[1]:
            ctx.store.defer(ctx.param, lambda: weight_grad(grad, x))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.flatten(0, -2).sum(0)
        return grad_x, None, grad_b, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``; inside ``deferring_weight_grads`` its weight gradient waits for W."""
    store = active_store()
    if store is None or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return _DeferredLinear.apply(x, weight, bias, store)
