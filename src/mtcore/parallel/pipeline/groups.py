"""This rank's pipeline: its stage-to-stage group and the (tied) embedding group.

Both groups come from ``ParallelLayout`` ("pp" and "embed"); this module only
gathers what a pipeline stage needs from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mtcore.parallel.layout import Axis


@dataclass
class PipelineGroups:
    """This rank's pipeline: its ranks, its position, its groups.

    ``group`` carries activations and gradients (the layout's pp group);
    ``embedding_group`` joins the first and last stage (None on other stages,
    and where pp == 1, when the tied weight is a single parameter).
    """

    ranks: tuple[int, ...]
    pp_rank: int
    group: object
    embedding_ranks: tuple[int, ...] = ()
    embedding_group: object | None = None

    @property
    def pp(self) -> int:
        return len(self.ranks)

    @property
    def in_embedding_group(self) -> bool:
        return self.embedding_group is not None

    @classmethod
    def build(cls, layout, collective) -> PipelineGroups:
        """All ranks call this together (it creates the embedding groups)."""
        mine = tuple(layout.ranks_of[Axis.PP])
        out = cls(mine, mine.index(layout.rank), layout.group(Axis.PP))
        if layout.pp > 1:
            # NCCL-style backends set a communicator up on its first call, which
            # must involve every member; a pipeline's first transfers do not.
            collective.barrier(out.group)
            if "embed" in layout.ranks_of:
                out.embedding_ranks = layout.ranks_of[Axis.EMBED]
                out.embedding_group = layout.group(Axis.EMBED)
        return out


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor:
    """Where the gradient lives: ``main_grad`` under DataParallel, else ``.grad``."""
    grad = getattr(p, "main_grad", None)
    if grad is None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
    return grad


def sync_tied_weights(params: Sequence[torch.nn.Parameter], groups: PipelineGroups, collective) -> None:
    """Make the last stage's copies equal to the first stage's (once, after init).

    Both stages pass their copies in the same order; other stages may call it
    (it does nothing there).
    """
    if not groups.in_embedding_group:
        return
    with torch.no_grad():
        for p in params:
            collective.broadcast(p.data, src=groups.embedding_ranks[0], group=groups.embedding_group)


def allreduce_tied_grads(params: Sequence[torch.nn.Parameter], groups: PipelineGroups, collective) -> None:
    """Sum the gradients of tied weights over the first and last stage.

    Call after backward (and after the data-parallel reduction, when there is
    one) and before the optimizer step, so both copies take the same update.
    """
    if not groups.in_embedding_group or not params:
        return
    grads = [_grad_of(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    collective.all_reduce(flat, op="sum", group=groups.embedding_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
