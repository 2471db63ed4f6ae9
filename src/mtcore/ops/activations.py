"""Reference gated activation: SwiGLU (Shazeer, 2020)."""

from __future__ import annotations

import torch
from torch import Tensor


def swiglu(x: Tensor) -> Tensor:
    """SwiGLU on a fused gate/up projection.

    ``x`` holds the gate and the up projection side by side in its last
    dimension, ``[..., 2n] = [gate | up]`` (Megatron's fused ``linear_fc1``
    layout, not interleaved), and ``out = silu(gate) * up`` with
    ``silu(g) = g * sigmoid(g)``.

    Args:
        x: ``[..., 2n]``, any floating dtype.

    Returns:
        ``[..., n]`` in ``x.dtype``, computed in float32 (float64 for float64 ``x``).

    Raises:
        ValueError: if the last dimension is odd.
    """
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim [..., 2n], got shape {list(x.shape)}")
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    # chunk (not slicing): its backward is one cat instead of two zero-filled buffers.
    gate, up = xf.chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)
