"""The GPT's rotary tables: plain RoPE, or with Llama 3.1's frequency scaling.

Plain RoPE is ``mtcore.ops.rope_tables`` (unchanged numbers for every model without
``rope_scaling``). ``llama3`` scaling (Meta's Llama 3.1 release, transformers'
``rope_type: llama3``) changes only the inverse frequencies, band by band of their
wavelength ``2 pi / inv_freq``, with ``L`` = ``original_max_position_embeddings``:

* longer than ``L / low_freq_factor``: divided by ``factor`` (stretched to the longer
  context);
* shorter than ``L / high_freq_factor``: kept (local detail);
* between: ``(1 - a) inv_freq / factor + a inv_freq`` with
  ``a = (L / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

The attention scores need no extra factor (llama3's attention scaling is 1). Angles
are computed in float64 on the host and rounded once, as ``rope_tables`` does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mtcore.ops import rope_tables


def llama3_inv_freq(inv_freq: Tensor, scaling) -> Tensor:
    """``inv_freq`` (float64) scaled by a ``RopeScaling`` of type llama3."""
    old = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    smooth = (old / wavelength - low) / (high - low)
    between = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelength > old / low, inv_freq / scaling.factor, inv_freq)
    medium = (wavelength <= old / low) & (wavelength >= old / high)
    return torch.where(medium, between, scaled)


def gpt_rope_tables(config, device=None) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` ``[seq_len, head_dim // 2]`` float32 for a GPT config."""
    if config.rope_scaling is None:
        return rope_tables(config.seq_len, config.head_dim, config.rope_theta, device=device)
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    inv_freq = llama3_inv_freq(inv_freq, config.rope_scaling)
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float().to(device), angles.sin().float().to(device)
