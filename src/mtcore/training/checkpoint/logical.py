"""Logical tensors: what a checkpoint stores, independent of the layout that saved it.

A parameter is stored as its full, global tensor, named as in the one-process
model of its family (``ModelFamily.one_process``). A fused parameter whose tensor-parallel shard is not one
contiguous slice of the full tensor (QKV: sections q, k, v; SwiGLU ``fc1``:
gate, up; see ``TPPartition``) is stored as one logical tensor per section,
``<name>.section<i>``: every tp rank's share of a section *is* a rectangle
of that section (its ``tp_rank``-th chunk along the partition dim), so DCP
can record it as a chunk and read any other rectangle back on load. This is
how a checkpoint saved at tp=2 loads at tp=4 or in one process.

Mixture-of-experts expert weights (``experts.fc1`` ``[E/ep, h, n1/tp]``,
``experts.fc2``) are split twice: dim 0 over the ``ep`` group, the tp
partition dim over tp. Their logical tensors keep the experts dimension whole
(``[E, h, f]`` per section, as in one process), and a rank's share is still
one rectangle of each: its ``ep_rank``-th block of experts times its tp chunk.
``to_logical`` hands DCP that rectangle as a DTensor on an ep x tp mesh, so an
ep=2 checkpoint loads at ep=4, at ep=1 or in one process like any other.

``sections`` (in the manifest) records ``{name: {"dim", "sizes"}}`` for the
multi-section parameters, so a one-process reader can join them without
building a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtcore.parallel.tensor import TPPartition


@dataclass
class Piece:
    """This rank's rectangle of one logical tensor. ``dim``: the tp split dim (None:
    replicated over tp); ``expert_dim``: the dim split over ep (None: not an expert
    weight, or ep = 1). Neither: the rectangle is the whole tensor."""

    key: str
    local: Tensor
    dim: int | None
    expert_dim: int | None = None

    def splits(self, tp: int, ep: int) -> list[tuple[str, int, int]]:
        """``(mesh axis, tensor dim, count)`` for each split of more than one part,
        ep first (the mesh order of ``to_logical``)."""
        out = []
        if self.expert_dim is not None and ep > 1:
            out.append(("ep", self.expert_dim, ep))
        if self.dim is not None and tp > 1:
            out.append(("tp", self.dim, tp))
        return out

    def global_shape(self, tp: int, ep: int) -> list[int]:
        shape = list(self.local.shape)
        for _, dim, count in self.splits(tp, ep):
            shape[dim] *= count
        return shape


def section_key(name: str, index: int, count: int) -> str:
    return name if count == 1 else f"{name}.section{index}"


def split_pieces(
    name: str,
    local: Tensor,
    partition: TPPartition | None,
    tp: int,
    expert_dim: int | None = None,
) -> list[Piece]:
    """The pieces of a parameter (or of a same-shaped optimizer state) on one rank.
    ``expert_dim``: the dim an expert weight is split along over ep."""
    if partition is None:
        return [Piece(name, local, None, expert_dim)]
    if partition.dim == expert_dim:
        raise ValueError(f"{name}: tp and ep split the same dim {expert_dim}")
    sizes = [s // tp for s in partition.sections]
    parts = local.split(sizes, partition.dim)
    return [
        Piece(section_key(name, i, len(parts)), part, partition.dim, expert_dim)
        for i, part in enumerate(parts)
    ]


def join_pieces(pieces: list[Tensor], dim: int | None) -> Tensor:
    return pieces[0] if dim is None or len(pieces) == 1 else torch.cat(pieces, dim)


def section_entry(partition: TPPartition | None) -> dict | None:
    """The manifest's record for a parameter, or None when it is one logical tensor."""
    if partition is None or len(partition.sections) == 1:
        return None
    return {"dim": partition.dim, "sizes": list(partition.sections)}


def to_logical(piece: Piece, tp: int, ep: int, mesh_for) -> Tensor:
    """``piece.local`` as DCP should see it: a DTensor sharded over the mesh of its
    splits (``mesh_for(("ep", "tp"))`` or a 1-D part of it), or the tensor itself."""
    splits = piece.splits(tp, ep)
    if not splits:
        return piece.local
    from torch.distributed.tensor import DTensor, Shard

    local = piece.local.contiguous()
    full = torch.Size(piece.global_shape(tp, ep))
    stride = torch.empty(full, device="meta").stride()
    mesh = mesh_for(tuple(axis for axis, _, _ in splits))
    placements = [Shard(dim) for _, dim, _ in splits]
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full, stride=stride)


def join_full(tensors: dict[str, Tensor], sections: dict[str, dict]) -> dict[str, Tensor]:
    """One-process names: section tensors ``<name>.section<i>`` joined into ``<name>``."""
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for name, entry in sections.items():
        keys = [section_key(name, i, len(entry["sizes"])) for i in range(len(entry["sizes"]))]
        if not all(k in tensors for k in keys):
            continue
        out[name] = torch.cat([tensors[k] for k in keys], entry["dim"])
        used.update(keys)
    out.update({k: v for k, v in tensors.items() if k not in used})
    return out


def split_full(weights: dict[str, Tensor], sections: dict[str, dict]) -> dict[str, Tensor]:
    """The inverse of ``join_full``: a fused full tensor into its section tensors."""
    out: dict[str, Tensor] = {}
    for name, value in weights.items():
        entry = sections.get(name)
        if entry is None:
            out[name] = value
            continue
        if value.shape[entry["dim"]] != sum(entry["sizes"]):
            raise ValueError(
                f"{name}: size {value.shape[entry['dim']]} along dim {entry['dim']} is not "
                f"the sum of its sections {entry['sizes']}"
            )
        parts = value.split(entry["sizes"], entry["dim"])
        for i, part in enumerate(parts):
            out[section_key(name, i, len(parts))] = part.contiguous()
    return out
