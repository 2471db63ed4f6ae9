"""The GPT's rotary tables: plain RoPE, or with Llama 3.1's or YaRN's frequency scaling.

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


def yarn_inv_freq(inv_freq: Tensor, scaling, dim: int, theta: float) -> Tensor:
    """``inv_freq`` (float64) under YaRN: kept where a frequency turns more than
    ``beta_fast`` times over ``original_max_position_embeddings``, divided by ``factor``
    below ``beta_slow`` turns, a linear ramp over the (whole) dims between."""
    old = scaling.original_max_position_embeddings

    def dim_of(turns: float) -> float:  # the dim whose frequency turns ``turns`` times
        return dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(scaling.beta_fast)), 0)
    high = min(math.ceil(dim_of(scaling.beta_slow)), dim - 1)
    high = high + 0.001 if high == low else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def yarn_attention_factor(scaling) -> float:
    """The factor YaRN multiplies cos and sin by: ``mscale(factor, mscale) /
    mscale(factor, mscale_all_dim)`` when both are set, else ``mscale(factor, 1)``,
    with ``mscale(f, m) = 0.1 m ln f + 1`` (1 for ``f <= 1``)."""

    def mscale(m: float) -> float:
        return 1.0 if scaling.factor <= 1 else 0.1 * m * math.log(scaling.factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale(1.0)


def gpt_rope_tables(config, device=None) -> tuple[Tensor, Tensor]:
    """``(cos, sin)`` ``[seq_len, rope_dim // 2]`` float32 for a GPT config (``rope_dim``:
    the head size, or the decoupled rope part of multi-head latent attention)."""
    d = config.rope_dim
    if config.rope_scaling is None:
        return rope_tables(config.seq_len, d, config.rope_theta, device=device)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    factor = 1.0
    if config.rope_scaling.rope_type == "yarn":
        inv_freq = yarn_inv_freq(inv_freq, config.rope_scaling, d, config.rope_theta)
        factor = yarn_attention_factor(config.rope_scaling)
    else:
        inv_freq = llama3_inv_freq(inv_freq, config.rope_scaling)
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float64), inv_freq)
    return (factor * angles.cos()).float().to(device), (factor * angles.sin()).float().to(device)
