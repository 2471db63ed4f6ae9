"""The documents a self-attention call's tokens belong to, as attention sees them.

A packed sample carries each token's document (``mtcore.data.documents``); attention
then lets a query see only keys of its own document (the ``query_documents`` and
``key_documents`` of ``mtcore.ops.attention``). The queries' ids are those of this
rank's tokens; the keys' are the whole sequence's, which under context parallelism
means gathering every cp rank's ids once per micro-batch, in cp order, as the key
padding mask is (``gather_key_mask``). A document may then straddle cp ranks: each
method slices these ids exactly as it slices its queries and keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mtcore.parallel.context.group import CPGroup


@dataclass(frozen=True)
class DocumentIds:
    """``queries``: int64 ``[b, s]``, the documents of this rank's tokens (its local
    sequence under cp); ``keys``: int64 ``[b, S]``, every key's document: the same
    tensor at cp = 1, the whole sequence in cp order under cp."""

    queries: Tensor
    keys: Tensor

    @classmethod
    def of(cls, documents: Tensor, cp: CPGroup | None) -> DocumentIds:
        """From the batch's ``documents`` (this rank's share of them under cp)."""
        if cp is None:
            return cls(documents, documents)
        front = documents.transpose(0, 1).contiguous()  # [s, b]: gathered along dim 0
        out = front.new_empty((cp.size * front.shape[0], front.shape[1]))
        cp.collective.all_gather(out, front, group=cp.group)
        return cls(documents, out.transpose(0, 1))

    def kernel_args(self) -> dict[str, Tensor]:
        """The attention ops' keyword arguments for a call over all of them."""
        return {"query_documents": self.queries, "key_documents": self.keys}


def kernel_documents(query_ids: Tensor | None, key_ids: Tensor | None) -> dict[str, Tensor]:
    """The attention ops' document arguments for one block (none without documents)."""
    if query_ids is None:
        return {}
    return {"query_documents": query_ids, "key_documents": key_ids}

