"""Low-rank adapters (LoRA, Hu et al. 2021) on the tensor-parallel linears.

An adapted linear computes ``y = x W^T + scale * dropout(x) A^T B^T`` with ``A [r, in]``,
``B [out, r]`` and ``scale = alpha / r``; ``W`` stays frozen. The split over tp follows
NeMo / Megatron-Bridge, so the collectives move ``r``-wide tensors only:

    column-parallel (W split by rows)        row-parallel (W split by columns)
    A replicated, B split by rows            A split by columns, B replicated
    h = x A^T          (x replicated)        h = reduce(x_r A_r^T)   (partial sums)
    y_r = h B_r^T      (this rank's rows)    y = h B^T

With ``sections`` (the fused q|k|v or gate|up weight) each section has its own
adapter, as PEFT's separate q_proj / k_proj / v_proj do, and the local output is
``[q_r | k_r | v_r]`` like the base layer's.

Sequence parallel: a column layer's input is this rank's sequence shard, so
``h = gather_from_sp(x_shard A^T)`` (an ``[b, s, r]`` gather, not the ``[b, s, in]``
one the base layer needs) and A's gradient covers this rank's positions only (flagged
``sequence_parallel``: summed over tp after backward, as norm weights are). A row
layer's ``h`` is reduce-scattered to the shard and B is the flagged one.

Without sequence parallel, ``h`` of a column layer is replicated but each rank's
gradient of it comes from its rows of B only: ``copy_to_tp`` sums it over tp.

Init as PEFT's default (``init_lora_weights=True``): A kaiming-uniform with
``a = sqrt(5)`` (uniform in ``+-1/sqrt(in)``), drawn whole from the adapter's own
generator and then sliced, so every layout starts from one process's numbers; B
zeros, so an adapted model starts as its base. The matmuls go through
``weight_grad.linear``, so a zero-bubble schedule defers their weight gradients too.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.parallel.tensor.mappings import (
    TPGroup,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from mtcore.parallel.tensor.random import RNGTracker
from mtcore.parallel.tensor.sharding import (
    TPPartition,
    mark_sequence_parallel,
    set_tp_partition,
    shard_tensor,
)
from mtcore.parallel.tensor.weight_grad import linear


def kaiming_uniform_a(rank: int, in_features: int, generator: torch.Generator) -> Tensor:
    """PEFT's default A: ``nn.init.kaiming_uniform_(A, a=math.sqrt(5))``, fp32 on the host."""
    a = torch.empty(rank, in_features)
    nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return a


class LoRA(nn.Module):
    """One adapter pair ``A``, ``B`` of a tensor-parallel linear (see the module docstring).

    parallel: "column" (A replicated, B split by rows) or "row" (A split by columns,
    B replicated). out_features / in_features: the full sizes of the adapted section.
    """

    def __init__(
        self,
        parallel: str,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        generator: torch.Generator,
        tracker: RNGTracker | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if parallel not in ("column", "row"):
            raise ValueError(f"parallel must be 'column' or 'row', got {parallel!r}")
        self.parallel, self.tp, self.rank = parallel, tp, rank
        self.in_features, self.out_features = in_features, out_features
        self.scale, self.dropout = alpha / rank, dropout
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.tracker = tracker
        dtype = dtype or torch.float32
        full_a = kaiming_uniform_a(rank, in_features, generator)
        full_b = torch.zeros(out_features, rank)
        split = (
            TPPartition(0, (out_features,))
            if parallel == "column"
            else TPPartition(1, (in_features,))
        )
        sharded = "B" if parallel == "column" else "A"
        for name, full in (("A", full_a), ("B", full_b)):
            if name == sharded and tp.size > 1:
                full = shard_tensor(full, split, tp.rank, tp.size)
            setattr(self, name, nn.Parameter(full.to(device=device, dtype=dtype)))
        set_tp_partition(self, sharded, split)
        if self.sequence_parallel:  # the replicated one sees this rank's positions only
            mark_sequence_parallel(self, "A" if parallel == "column" else "B")

    def forward(self, x: Tensor) -> Tensor:
        """``x`` as the base linear receives it -> the delta of this rank's output."""
        x = self._dropout(x)
        h = linear(x, self.A)  # [b, s(/tp), r]
        tp, sp = self.tp, self.sequence_parallel
        if self.parallel == "column":
            h = gather_from_sp(h, tp) if sp else copy_to_tp(h, tp)
        else:
            h = reduce_scatter_to_sp(h, tp) if sp else reduce_from_tp(h, tp)
        return linear(h, self.B) * self.scale

    def _dropout(self, x: Tensor) -> Tensor:
        if not self.training or self.dropout == 0.0:
            return x
        # A tensor that differs over tp ranks (a sequence shard, a row layer's input
        # columns) draws from the tp stream; a replicated one from the default stream,
        # the same mask on every tp rank.
        differs = self.sequence_parallel or (self.parallel == "row" and self.tp.size > 1)
        fork = (
            self.tracker.fork()
            if differs and self.tracker is not None
            else contextlib.nullcontext()
        )
        with fork:
            return F.dropout(x, self.dropout, training=True)

    def merged_delta(self) -> Tensor:
        """``scale * B @ A`` of this rank's shard, the shape of its slice of the base weight."""
        return (self.B.float() @ self.A.float()) * self.scale

    def extra_repr(self) -> str:
        return (
            f"{self.parallel}, in={self.in_features}, out={self.out_features}, r={self.rank}, "
            f"scale={self.scale:g}, tp={self.tp.size}, sp={self.sequence_parallel}"
        )


class SectionAdapters(nn.ModuleDict):
    """The adapters of one linear, by section name (a linear's ``lora`` submodule, so
    the names read ``layers.0.attn.qkv.lora.q.A``).

    sections: ``(name, full size)`` of every section of the base layer's output, in
    order; the names in ``adapted`` get their ``LoRA``, the others add nothing.
    """

    def __init__(
        self,
        sections: Sequence[tuple[str, int]],
        adapted: dict[str, LoRA],
        tp: TPGroup,
        parallel: str = "column",
    ):
        super().__init__(adapted)
        split = tp.size if parallel == "column" else 1  # a row layer's output is whole
        self.sections = [(name, size // split) for name, size in sections]  # local sizes

    def forward(self, x: Tensor) -> Tensor:
        if len(self.sections) == 1:
            return self[self.sections[0][0]](x)
        deltas = {name: self[name](x) for name, _ in self.sections if name in self}
        template = next(iter(deltas.values()))
        parts = [
            deltas[name] if name in deltas else template.new_zeros(*template.shape[:-1], size)
            for name, size in self.sections
        ]
        return torch.cat(parts, -1)

    @torch.no_grad()
    def merged_delta(self) -> Tensor:
        """The change to this rank's shard of the base weight, section by section."""
        width = next(iter(self.values())).A.shape[1]  # the local input features
        rows = [
            self[name].merged_delta() if name in self else torch.zeros(size, width)
            for name, size in self.sections
        ]
        return torch.cat(rows, 0)
