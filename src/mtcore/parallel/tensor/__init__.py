"""Tensor and sequence parallelism: layers, mappings, vocab-parallel loss, RNG.

Activation layout: ``[batch, seq, hidden]``; sequence-parallel shards split
dim 1, tensor-parallel shards split the last dim (see ``mappings``).
"""

from mtcore.parallel.tensor.cross_entropy import (
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
)
from mtcore.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    normal_init,
)
from mtcore.parallel.tensor.linear import column_parallel_matmul
from mtcore.parallel.tensor.mappings import (
    SEQ_DIM,
    TPGroup,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)
from mtcore.parallel.tensor.random import TP_STREAM, RNGTracker, model_parallel_seed
from mtcore.parallel.tensor.sharding import (
    TPPartition,
    allreduce_sequence_parallel_grads,
    full_tensor,
    full_tensors,
    load_full_tensors,
    mark_sequence_parallel,
    named_tp_parameters,
    set_tp_partition,
    shard_tensor,
    unshard_tensor,
)

__all__ = [
    "SEQ_DIM",
    "TP_STREAM",
    "ColumnParallelLinear",
    "RNGTracker",
    "RowParallelLinear",
    "TPGroup",
    "TPPartition",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "column_parallel_matmul",
    "copy_to_tp",
    "full_tensor",
    "full_tensors",
    "gather_from_sp",
    "gather_from_tp",
    "load_full_tensors",
    "mark_sequence_parallel",
    "model_parallel_seed",
    "named_tp_parameters",
    "normal_init",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "scatter_to_tp",
    "set_tp_partition",
    "shard_tensor",
    "unshard_tensor",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
]
