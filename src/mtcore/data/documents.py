"""Document boundaries inside a packed sample: the batch's ``documents`` and ``positions``.

A packed sample holds several documents back to back. With document masks a token
attends only the earlier tokens of its own document (Megatron-LM's
``--reset-attention-mask``; flash-attn's varlen ``cu_seqlens``; torchtitan's document
mask), so each document trains as if it were alone. A micro-batch then carries, beside
``tokens`` and ``labels``:

- ``documents``: int64 ``[batch, seq]``, the index of each token's document within its
  sample, non-decreasing from 0 along the sequence. Padding after the last document is
  a document of its own (its labels are ``-100``), so it attends nothing real and
  nothing real attends it.
- ``positions`` (with ``data.reset_position_ids``): int64 ``[batch, seq]``, each token's
  position counted from the start of its document (Megatron-LM's
  ``--reset-position-ids``), read by RoPE and learned position embeddings.

Both are per-token tensors ``[batch, seq]``, so context parallelism shards them with the
tokens (``mtcore.parallel.context.shard_batch``).
"""

from __future__ import annotations

import torch
from torch import Tensor

DOCUMENTS, POSITIONS = "documents", "positions"


def documents_from_separators(tokens: Tensor, separator_id: int) -> Tensor:
    """``documents`` of packed ``tokens [batch, seq]`` whose documents each end with
    ``separator_id`` (the ``<|endoftext|>`` id of a packed pretraining stream): the
    separator belongs to the document it ends, the token after it starts the next."""
    ends = (tokens == separator_id).to(torch.int64)
    return torch.cumsum(ends, dim=1) - ends


def positions_in_documents(documents: Tensor) -> Tensor:
    """Each token's position within its document, from ``documents [batch, seq]``
    (non-decreasing along the sequence)."""
    if documents.dim() != 2:
        raise ValueError(f"documents must be [batch, seq], got {list(documents.shape)}")
    seq = documents.shape[1]
    index = torch.arange(seq, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    # The index of the latest document start at or before each token.
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def check_documents(documents: Tensor, tokens: Tensor) -> None:
    """Raise ValueError unless ``documents`` is an int64 ``[batch, seq]`` like ``tokens``,
    non-decreasing along each row and starting at 0."""
    if documents.shape != tokens.shape or documents.dtype != torch.int64:
        raise ValueError(
            f"documents must be int64 {list(tokens.shape)} like tokens, got "
            f"{documents.dtype} {list(documents.shape)}"
        )
    if documents.numel() and (
        bool((documents[:, :1] != 0).any()) or bool((documents.diff(dim=1) < 0).any())
    ):
        raise ValueError("documents must start at 0 and never decrease along a sample")
