"""Reference rotary position embedding (Su et al., 2021), rotate-half layout.

Convention (the one Hugging Face Llama and Megatron's non-interleaved RoPE use):
the head dimension ``d`` is split into halves ``x1 = x[..., :d/2]`` and
``x2 = x[..., d/2:]``, and pair ``(x1[i], x2[i])`` is rotated by the angle
``position * inv_freq[i]``. The interleaved layout (pairs ``(x[2i], x[2i+1])``,
GPT-J / Meta's original code) is a different op and is not this one.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_tables(
    seq_len: int,
    head_dim: int,
    theta: float = 10000.0,
    offset: int = 0,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Cosine and sine tables for :func:`rope` (a helper, not a kernel op).

    ``inv_freq[i] = 1 / theta ** (2i / head_dim)`` for ``i < head_dim // 2`` and
    positions ``offset, ..., offset + seq_len - 1`` (``offset`` serves a
    context-parallel shard or a decode step).

    Returns:
        ``(cos, sin)``, each ``[seq_len, head_dim // 2]`` float32 on ``device``.
        The angles are computed in float64 on the host and rounded once: in
        float32, ``position * inv_freq`` loses ~1e-3 rad by position 1e5, and
        float64 is not available on every accelerator.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    positions = torch.arange(offset, offset + seq_len, dtype=torch.float64)
    angles = torch.outer(positions, inv_freq)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply rotary embedding to queries or keys.

    ``out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin, dim=-1)``

    Args:
        x: ``[batch, seq, heads, head_dim]``, any floating dtype, ``head_dim`` even.
        cos, sin: ``[seq, head_dim // 2]`` (float32, see :func:`rope_tables`),
            broadcast over batch and heads.

    Returns:
        ``[batch, seq, heads, head_dim]`` in ``x.dtype``, computed in float32
        (float64 for float64 ``x``).
        Differentiable with respect to ``x`` (and the tables).
    """
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, seq, heads, head_dim], got shape {list(x.shape)}")
    seq, d = x.shape[1], x.shape[3]
    if d % 2:
        raise ValueError(f"head_dim must be even, got {d}")
    half = d // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (seq, half):
            raise ValueError(
                f"{name} must be [{seq}, {half}] (seq, head_dim // 2), got {list(t.shape)}"
            )
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    x1, x2 = xf[..., :half], xf[..., half:]
    # [seq, d/2] -> [1, seq, 1, d/2]: the same angle for every batch row and head.
    c = cos.to(acc)[None, :, None, :]
    s = sin.to(acc)[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
