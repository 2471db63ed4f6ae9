"""FP8 bookkeeping batched per optimizer step (as TransformerEngine does it).

Per quantization, delayed scaling costs a collective per FP8 linear per forward
and per backward of every micro-batch (2 x linears x micro-batches per step, per
group), and every micro-batch quantizes each weight again although the weight
only changes at the optimizer step. ``FP8StepBookkeeping`` switches the FP8
linears of a model to per-step bookkeeping (``FP8Scaling.per_step``): within a
step they note local amaxes and reuse the step's FP8 weight; ``finish_step``
reduces every noted amax of every linear in one all-reduce (max) per reduction
group (tensor parallel, then data parallel), rolls each history once and drops
the cached weights before the optimizer changes them.

Within a step every micro-batch now quantizes with the scale the step started
with, rather than with a scale moved by the previous micro-batch: one step's
worth of delay instead of one micro-batch's, as in TransformerEngine.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mtcore.precision.fp8.state import FP8Scaling


class FP8StepBookkeeping:
    """The FP8 linears of ``modules`` (model chunks), bookkept once per step."""

    def __init__(self, modules: Iterable[nn.Module]):
        self.scalings = [m for mod in modules for m in mod.modules() if isinstance(m, FP8Scaling)]
        for scaling in self.scalings:
            scaling.per_step = True

    @torch.no_grad()
    def finish_step(self) -> None:
        """After the step's last backward, before the optimizer step: reduce and record
        the step's amaxes, drop the step's FP8 weights. Collective over the linears'
        groups (every rank of a group holds the same linears and ran the same passes,
        so they take part in the same reductions, in the same order)."""
        by_groups: dict[tuple, list[FP8Scaling]] = {}
        for scaling in self.scalings:
            if scaling.noted_amaxes() is not None:
                key = tuple((id(c), id(g)) for c, g in scaling.amax_groups)
                by_groups.setdefault(key, []).append(scaling)
        for members in by_groups.values():
            reduced = members[0].reduce_amaxes(torch.stack([s.noted_amaxes() for s in members]))
            for scaling, row in zip(members, reduced, strict=True):
                scaling.record_noted(row)
        for scaling in self.scalings:
            scaling.new_step()
