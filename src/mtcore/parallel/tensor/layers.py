"""Tensor-parallel layers: each rank holds only its shard of the weight.

Activations are ``[batch, seq, hidden]`` (see ``mappings``); under sequence
parallelism the tensors between tp regions are sequence shards ``[b, s/tp, h]``.

Initialisation gives the same full weight as one process: every rank draws the
*full* master weight from the same generator (on the host, in float32, so the
numbers do not depend on the accelerator) and keeps its slice. A model built
with one generator, layer by layer in the same order, therefore has the same
parameters at any tp size, which is what makes "TP equals one process" a
testable statement. The full weight exists briefly on every rank; for weights
too large for that, initialise at tp=1 once and load shards with
``sharding.load_full_tensors``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.parallel.tensor.linear import column_parallel_matmul
from mtcore.parallel.tensor.mappings import (
    TPGroup,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
)
from mtcore.parallel.tensor.sharding import (
    TPPartition,
    mark_sequence_parallel,
    set_tp_partition,
    shard_tensor,
)
from mtcore.parallel.tensor.vocab_check import check_vocab_ids
from mtcore.parallel.tensor.weight_grad import linear
from mtcore.precision.fp8 import FP8Recipe, FP8Scaling, accept_fp8_state, fp8_linear

InitMethod = Callable[[Tensor, torch.Generator | None], None]


def normal_init(std: float = 0.02) -> InitMethod:
    """``N(0, std^2)`` in place, drawn from ``generator``."""

    def init(t: Tensor, generator: torch.Generator | None) -> None:
        with torch.no_grad():
            t.normal_(0.0, std, generator=generator)

    return init


def _add_sharded_param(
    module: nn.Module,
    name: str,
    full_shape: tuple[int, ...],
    partition: TPPartition,
    init: InitMethod,
    generator: torch.Generator | None,
    device,
    dtype,
) -> None:
    """Draw the full master tensor, keep this rank's shard as ``module.<name>``."""
    tp = module.tp
    partition.check(tp.size)
    master = torch.empty(full_shape, dtype=torch.float32)
    init(master, generator)
    shard = shard_tensor(master, partition, tp.rank, tp.size) if tp.size > 1 else master
    setattr(module, name, nn.Parameter(shard.to(device=device, dtype=dtype or torch.float32)))
    set_tp_partition(module, name, partition)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W [out, in]`` split by rows (output features).

    Input ``[b, s, in]`` replicated, or ``[b, s/tp, in]`` under sequence
    parallel (all-gathered here, reduce-scattered in backward). Output
    ``[b, s, out/tp]``, or ``[b, s, out]`` with ``gather_output``. The
    backward overlaps the input-grad collective with the weight-grad matmul
    (``linear.column_parallel_matmul``).

    sections: for a fused weight, the sizes of its parts along ``out`` (q, k, v
      or gate, up); each part is split over tp separately, so the local output
      is ``[part0_r | part1_r | ...]`` and splits like the full one.
    fp8: an ``FP8Recipe``: the three matmuls run in FP8 (``mtcore.precision.fp8``)
      and the recipe's state is the submodule ``fp8``; None: the model dtype.
    fp8_replicas: ``(collective, group)`` of this layer's data-parallel replicas;
      delayed-scaling amaxes are reduced over it as well as over tp.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        *,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        sections: Sequence[int] | None = None,
        init_method: InitMethod | None = None,
        generator: torch.Generator | None = None,
        device=None,
        dtype=None,
        fp8: FP8Recipe | None = None,
        fp8_replicas=None,
    ):
        super().__init__()
        sections = tuple(sections or (out_features,))
        if sum(sections) != out_features:
            raise ValueError(f"sections {sections} do not add up to out_features={out_features}")
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp.size > 1
        init = init_method or normal_init()
        rows = TPPartition(0, sections)
        _add_sharded_param(
            self, "weight", (out_features, in_features), rows, init, generator, device, dtype
        )
        self.bias = None
        if bias:
            _add_sharded_param(self, "bias", (out_features,), rows, _zeros, None, device, dtype)
        self.fp8 = _fp8_scaling(fp8, tp, device, self, fp8_replicas)
        self.lora = None  # low-rank adapters (``lora.SectionAdapters``), added by fine-tuning

    def forward(self, x: Tensor) -> Tensor:
        if self.fp8 is not None:  # FP8: the collectives around the matmul, not overlapped
            tp = self.tp
            total = gather_from_sp(x, tp) if self.sequence_parallel else copy_to_tp(x, tp)
            y = fp8_linear(total, self.weight, self.bias, self.fp8)
        else:
            y = column_parallel_matmul(x, self.weight, self.bias, self.tp, self.sequence_parallel)
        if self.lora is not None:
            y = y + self.lora(x)
        return gather_from_tp(y, self.tp) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}, "
            f"sp={self.sequence_parallel}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W [out, in]`` split by columns (input features).

    Input ``[b, s, in/tp]`` (``input_is_parallel``, the output of a
    ColumnParallelLinear) or ``[b, s, in]`` replicated (split here). The local
    products are partial sums: all-reduced to ``[b, s, out]``, or
    reduce-scattered to the sequence shard ``[b, s/tp, out]`` under sequence
    parallel. The bias is replicated and added after the reduction; under
    sequence parallel its grad is flagged for ``allreduce_sequence_parallel_grads``.
    fp8: as for ``ColumnParallelLinear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPGroup,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        generator: torch.Generator | None = None,
        device=None,
        dtype=None,
        fp8: FP8Recipe | None = None,
        fp8_replicas=None,
    ):
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and tp.size > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel needs input_is_parallel=True")
        columns = TPPartition(1, (in_features,))
        init = init_method or normal_init()
        _add_sharded_param(
            self, "weight", (out_features, in_features), columns, init, generator, device, dtype
        )
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
            if self.sequence_parallel:
                mark_sequence_parallel(self, "bias")
        self.fp8 = _fp8_scaling(fp8, tp, device, self, fp8_replicas)
        self.lora = None  # low-rank adapters (``lora.SectionAdapters``), added by fine-tuning

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp)
        if self.fp8 is not None:
            y = fp8_linear(x, self.weight, None, self.fp8)
        else:
            y = linear(x, self.weight)
        # y is the fresh matmul output: reduce it in place (no copy).
        y = (
            reduce_scatter_to_sp(y, self.tp)
            if self.sequence_parallel
            else reduce_from_tp(y, self.tp, inplace=True)
        )
        if self.lora is not None:
            y = y + self.lora(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}, "
            f"sp={self.sequence_parallel}, input_is_parallel={self.input_is_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over tp.

    ``tokens [b, s]`` int64 -> ``[b, s, h]`` replicated, or ``[b, s/tp, h]``
    under sequence parallel. Rank ``r`` holds rows ``[r V/tp, (r+1) V/tp)``;
    a token outside that range looks up row 0 and is zeroed, so the all-reduce
    (or reduce-scatter) of the per-rank partial lookups is the full lookup.
    That mask would also zero an id outside the whole vocabulary, silently, so
    such an id raises IndexError first, at every tp size (``vocab_check``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TPGroup,
        *,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        generator: torch.Generator | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.tp = tp
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel = sequence_parallel and tp.size > 1
        rows = TPPartition(0, (num_embeddings,))
        init = init_method or normal_init()
        _add_sharded_param(
            self, "weight", (num_embeddings, embedding_dim), rows, init, generator, device, dtype
        )
        self.vocab_start = tp.rank * (num_embeddings // tp.size)
        self.vocab_end = self.vocab_start + num_embeddings // tp.size

    def forward(self, tokens: Tensor) -> Tensor:
        check_vocab_ids(tokens, self.num_embeddings)
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        y = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return (
            reduce_scatter_to_sp(y, self.tp)
            if self.sequence_parallel
            else reduce_from_tp(y, self.tp, inplace=True)
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.size}, sp={self.sequence_parallel}"


def _fp8_scaling(
    recipe: FP8Recipe | None, tp: TPGroup, device, module: nn.Module, replicas=None
) -> FP8Scaling | None:
    """The FP8 state of a linear (None: high precision, which still loads checkpoints
    that carry FP8 state); delayed scales agree over tp and the ``replicas`` group."""
    if recipe is None:
        accept_fp8_state(module)
        return None
    group = (tp.collective, tp.group) if tp.size > 1 else None
    return FP8Scaling(
        recipe, tp.backend.fp8, amax_group=group, device=device, replica_group=replicas
    )


def _zeros(t: Tensor, generator: torch.Generator | None) -> None:
    with torch.no_grad():
        t.zero_()
