"""Attention-probability dropout whose mask is a function of coordinates, not of a stream.

The keep mask of element ``(b, h, i, j)`` (batch row, query head, query position, key
position) is a hash of ``(seeds[h], b, i, j)``, so it does not depend on how the heads
or the batch are laid out over ranks, nor on the order kernels visit the blocks: a
rank holding heads ``4..7`` draws exactly the masks one process draws for them, as
long as it is given those heads' seeds. The hash is 32-bit integer mixing (shifts,
xors and multiplies by an odd constant) in int64 arithmetic that never overflows,
so every device computes the same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

_LOW32 = 0xFFFFFFFF
_MULTIPLIER = 0x45D9F3B  # odd, < 2**27: a product with a 32-bit value stays below 2**59


def mix32(x: Tensor) -> Tensor:
    """A bijective scramble of 32-bit values held in int64 (every input bit moves
    every output bit)."""
    x = x & _LOW32
    x = ((x ^ (x >> 16)) * _MULTIPLIER) & _LOW32
    x = ((x ^ (x >> 16)) * _MULTIPLIER) & _LOW32
    return x ^ (x >> 16)


def head_seeds(base: Tensor, first_head: int, heads: int) -> Tensor:
    """int64 ``[heads]``: the seeds of global query heads ``first_head ..`` for one
    forward of one layer, from ``base`` (an int64 scalar tensor drawn per forward)."""
    ids = torch.arange(first_head, first_head + heads, device=base.device, dtype=torch.int64)
    return mix32(mix32(base.to(torch.int64)) ^ mix32(ids + 1))


def keep_mask(seeds: Tensor, batch: int, sq: int, sk: int, p: float) -> Tensor:
    """Bool ``[batch, heads, sq, sk]``: True where a probability is kept (rate ``1 - p``).

    Query ``i`` is numbered from the bottom-right corner (``i + sk - sq``), as the
    causal mask counts it, so a decoding step draws what the full sequence draws.
    """
    device = seeds.device
    heads = seeds.shape[0]
    b = torch.arange(batch, device=device, dtype=torch.int64).view(batch, 1, 1, 1)
    i = torch.arange(sk - sq, sk, device=device, dtype=torch.int64).view(1, 1, sq, 1)
    j = torch.arange(sk, device=device, dtype=torch.int64).view(1, 1, 1, sk)
    x = mix32(seeds.to(device, torch.int64).view(1, heads, 1, 1) ^ mix32(b))
    x = mix32(x ^ mix32(i + 0x9E3779B9))
    x = mix32(x ^ j)
    return x >= int(p * 2**32)


def check_dropout(p: float, seeds: Tensor | None, heads: int) -> None:
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {p}")
    if p > 0 and (seeds is None or tuple(seeds.shape) != (heads,)):
        shape = None if seeds is None else list(seeds.shape)
        raise ValueError(
            f"dropout_p={p} needs dropout_seeds, int64 [{heads}] (one per query head), got {shape}"
        )
