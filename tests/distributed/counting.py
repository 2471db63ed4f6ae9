"""A Collective wrapper for tests that counts calls and bytes, by op and by group.

``mtcore.backend.collective.Collective`` has no counting hook; tests put this
wrapper where parallel code reads its collective (``ddp.collective``, a
``DataParallel``'s optimizer, an FP8 module's reducer) and read ``calls``.
Every call still goes to the real collective (gloo), so what is counted ran.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Call:
    """One collective call: the op, the group object, and the bytes this rank handed in
    (the input tensor for reductions, all-to-all and all-gather)."""

    op: str
    group: object
    nbytes: int


class CountingCollective:
    """Forwards everything to ``inner``; records each reduction and data-movement call."""

    def __init__(self, inner):
        self._inner = inner
        self.calls: list[Call] = []

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _record(self, op: str, tensor, group) -> None:
        self.calls.append(Call(op, group, tensor.numel() * tensor.element_size()))

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        self._record("all_reduce", tensor, group)
        return self._inner.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def reduce_scatter(self, output, input, op="sum", group=None, async_op=False):
        self._record("reduce_scatter", input, group)
        return self._inner.reduce_scatter(output, input, op=op, group=group, async_op=async_op)

    def all_gather(self, output, input, group=None, async_op=False):
        self._record("all_gather", input, group)
        return self._inner.all_gather(output, input, group=group, async_op=async_op)

    def all_to_all(
        self, output, input, output_splits=None, input_splits=None, group=None, async_op=False
    ):
        self._record("all_to_all", input, group)
        return self._inner.all_to_all(
            output, input, output_splits, input_splits, group=group, async_op=async_op
        )

    def on(self, group) -> list[Call]:
        """The calls made over ``group``."""
        return [c for c in self.calls if c.group is group]

    def clear(self) -> None:
        self.calls.clear()
