"""Context parallelism: one sequence split over the cp ranks, attention across them.

``group`` says where each token lives (the load-balanced ``2 * cp`` chunk split) and
shards a batch; ``comm`` holds the differentiable movements over the cp group;
``ring``, ``methods`` the three attention methods (``parallel.cp_method``: ring,
allgather, a2a) behind ``context_attention``. Everything else in a transformer
block is per token and needs no change beyond positions (``local_positions``).
"""

from mtcore.parallel.context.comm import (
    broadcast_from_first,
    gather_key_mask,
    gather_sequence,
    heads_to_sequence,
    sequence_to_heads,
)
from mtcore.parallel.context.documents import DocumentIds
from mtcore.parallel.context.group import (
    METHOD_COLLECTIVES,
    METHODS,
    CPGroup,
    causal_pairs,
    check_backend_serves,
    chunk_ids,
    cp_order,
    cp_to_global,
    local_positions,
    shard_batch,
)
from mtcore.parallel.context.methods import (
    a2a_attention,
    allgather_attention,
    context_attention,
)
from mtcore.parallel.context.ring import ring_attention

__all__ = [
    "METHODS",
    "METHOD_COLLECTIVES",
    "CPGroup",
    "DocumentIds",
    "a2a_attention",
    "allgather_attention",
    "broadcast_from_first",
    "causal_pairs",
    "check_backend_serves",
    "chunk_ids",
    "context_attention",
    "cp_order",
    "cp_to_global",
    "gather_key_mask",
    "gather_sequence",
    "heads_to_sequence",
    "local_positions",
    "ring_attention",
    "sequence_to_heads",
    "shard_batch",
]
