"""Logical tensors: what a checkpoint stores, independent of the layout that saved it.

A parameter is stored as its full, global tensor, named as in the one-process
``GPT(config)``. A fused parameter whose tensor-parallel shard is not one
contiguous slice of the full tensor (QKV: sections q, k, v; SwiGLU ``fc1``:
gate, up; see ``TPPartition``) is stored as one logical tensor per section,
``<name>.section<i>``: every tp rank's share of a section *is* a rectangle
of that section (its ``tp_rank``-th chunk along the partition dim), so DCP
can record it as a chunk and read any other rectangle back on load. This is
how a checkpoint saved at tp=2 loads at tp=4 or in one process.

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
    replicated, the rectangle is the whole tensor)."""

    key: str
    local: Tensor
    dim: int | None


def section_key(name: str, index: int, count: int) -> str:
    return name if count == 1 else f"{name}.section{index}"


def split_pieces(name: str, local: Tensor, partition: TPPartition | None, tp: int) -> list[Piece]:
    """The pieces of a parameter (or of a same-shaped optimizer state) on one tp rank."""
    if partition is None:
        return [Piece(name, local, None)]
    sizes = [s // tp for s in partition.sections]
    parts = local.split(sizes, partition.dim)
    return [
        Piece(section_key(name, i, len(parts)), part, partition.dim) for i, part in enumerate(parts)
    ]


def join_pieces(pieces: list[Tensor], dim: int | None) -> Tensor:
    return pieces[0] if dim is None or len(pieces) == 1 else torch.cat(pieces, dim)


def section_entry(partition: TPPartition | None) -> dict | None:
    """The manifest's record for a parameter, or None when it is one logical tensor."""
    if partition is None or len(partition.sections) == 1:
        return None
    return {"dim": partition.dim, "sizes": list(partition.sections)}


def to_logical(piece: Tensor, dim: int | None, tp: int, mesh) -> Tensor:
    """``piece`` as DCP should see it: a DTensor sharded over the tp mesh, or the tensor."""
    if dim is None or tp == 1:
        return piece
    from torch.distributed.tensor import DTensor, Shard

    piece = piece.contiguous()
    shape = list(piece.shape)
    shape[dim] *= tp
    full = torch.Size(shape)
    stride = torch.empty(full, device="meta").stride()
    return DTensor.from_local(piece, mesh, [Shard(dim)], run_check=False, shape=full, stride=stride)


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
