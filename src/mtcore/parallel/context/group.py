"""The context-parallel group as attention sees it, and where each token of a sequence lives.

A sequence of ``S`` tokens is cut into ``2 * cp`` equal chunks; cp rank ``r`` holds
chunks ``r`` and ``2cp - 1 - r``, in that order (Megatron-Core's load-balanced
split). Under a causal mask a late chunk has more keys to look at than an early
one, and each rank pairs the i-th earliest with the i-th latest, so every rank
does the same work. This rank's tokens, concatenated, are its *local sequence*;
the cp ranks' local sequences, concatenated in rank order, are the *cp order*
of the whole sequence (K/V blocks, gathered masks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mtcore.backend.collective import Support
from mtcore.parallel.layout import Axis

METHODS = ("ring", "allgather", "a2a")
# What each method moves K/V (and their gradients) with.
METHOD_COLLECTIVES = {
    "ring": ("send_recv",),
    "allgather": ("all_gather", "reduce_scatter"),
    "a2a": ("all_to_all",),
}


@dataclass
class CPGroup:
    """The cp ranks of one (tp, dp, pp) coordinate.

    backend: the ``mtcore.backend.Backend`` (collectives and kernels).
    group: their process group; ranks: their global ranks, in cp-rank order.
    rank, size: this rank's cp index and the cp size.
    method: ``ring``, ``allgather`` or ``a2a`` (``parallel.cp_method``).
    trace: when a list, the ring method appends what it does in order
      (``("post", step)``, ``("compute", step)``, ``("wait", step)``; in backward
      ``("grad", step)``, ``("post dkv", step)``, ``("wait dkv", step)`` too), so a test
      can see that each transfer is posted before the compute it hides behind.
    """

    backend: object
    group: object
    ranks: tuple[int, ...]
    rank: int
    size: int
    method: str = "ring"
    trace: list | None = field(default=None, repr=False)

    @classmethod
    def from_layout(cls, layout, backend) -> CPGroup | None:
        """The cp group of a ``ParallelLayout``, or None when cp is 1."""
        if layout.cp == 1:
            return None
        ranks = layout.ranks_of[Axis.CP]
        return cls(
            backend, layout.group(Axis.CP), ranks, layout.coordinate(Axis.CP), layout.cp,
            layout.spec.cp_method,
        )  # fmt: skip

    @property
    def collective(self):
        return self.backend.collective

    @property
    def next_rank(self) -> int:
        return self.ranks[(self.rank + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank - 1) % self.size]


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) cp rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> Tensor:
    """Global positions of cp rank ``rank``'s tokens, in local order (``seq_len / cp``)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}")
    c = seq_len // (2 * cp)
    a, b = chunk_ids(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)]).to(
        device
    )


def cp_order(seq_len: int, cp: int, device=None) -> Tensor:
    """Global positions of the whole sequence in cp order (rank 0's tokens, rank 1's, ...)."""
    return torch.cat([local_positions(seq_len, cp, r) for r in range(cp)]).to(device)


def cp_to_global(seq_len: int, cp: int, device=None) -> Tensor:
    """Index that puts a cp-ordered sequence into global order (``x[:, idx]``)."""
    return torch.argsort(cp_order(seq_len, cp)).to(device)


def shard_batch(
    batch: dict[str, Tensor], seq_len: int | Mapping[str, int | None], cp: int, rank: int
) -> dict[str, Tensor]:
    """cp rank ``rank``'s share of a micro-batch: every tensor ``[b, seq_len, ...]``
    (tokens, labels, masks, token types) keeps this rank's tokens; per-sequence tensors
    ``[b]`` (pair labels) stay whole. cp=1: the batch itself.

    ``seq_len`` may instead map tensor names to their own sequence length (T5's encoder
    and decoder tensors differ), or to None for a tensor that stays whole on every cp
    rank (LLaVA's ``pixel_values``). A tensor of two or more dimensions whose second is
    not its sequence length, or that the mapping does not name, cannot be split by
    position and is refused (ValueError naming it), rather than passed on whole.
    """
    if cp == 1:
        return batch
    out = {}
    for name, t in batch.items():
        length = seq_len.get(name, -1) if isinstance(seq_len, Mapping) else seq_len
        if t.dim() >= 2 and length is not None:
            if length == -1:
                raise ValueError(
                    f"batch tensor {name!r} has no sequence length to split over cp={cp}"
                )
            if t.shape[1] != length:
                raise ValueError(
                    f"batch tensor {name!r} of shape {list(t.shape)} has no sequence "
                    f"dimension of seq_len={length} (dim 1) to split over cp={cp}"
                )
            t = t.index_select(1, local_positions(length, cp, rank).to(t.device))
        out[name] = t
    return out


def causal_pairs(seq_len: int, cp: int, rank: int) -> int:
    """Key-query pairs cp rank ``rank``'s queries attend under a causal mask (its work)."""
    pos = local_positions(seq_len, cp, rank)
    return int((pos + 1).sum())


def check_backend_serves(spec, backend, dtype: torch.dtype) -> None:
    """Raise ValueError, naming the method, the collective and the dtype, when ``backend``'s
    collective capability table has no path (``Support.NONE``) for a collective that
    ``spec.cp_method`` needs at ``dtype``. Nothing to check at cp = 1."""
    if spec.cp == 1:
        return
    for op in METHOD_COLLECTIVES[spec.cp_method]:
        if backend.collective.support(op, dtype) is Support.NONE:
            others = [
                m for m, ops in METHOD_COLLECTIVES.items()
                if all(backend.collective.support(o, dtype) is not Support.NONE for o in ops)
            ]  # fmt: skip
            hint = f"; use cp_method {' or '.join(others)}" if others else ""
            raise ValueError(
                f"parallel.cp_method {spec.cp_method} (cp={spec.cp}) needs the collective "
                f"{op} for {str(dtype).removeprefix('torch.')}, which backend "
                f"{backend.name!r} does not provide{hint}"
            )
