"""The plugin's own kernel: SwiGLU written with torch.sigmoid.

A kernel must have exactly the parameter names of the reference op it replaces
(here ``mtcore.ops.swiglu(x)``) and agree with it within the conformance kit's
tolerances, including the error it raises on bad input.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.backend import KernelQuery


def sigmoid_swiglu(x: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dim [..., 2n], got shape {list(x.shape)}")
    # Compute in float32 (float64 stays float64) like the reference, then cast back.
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    gate, up = xf.chunk(2, dim=-1)
    return (gate * torch.sigmoid(gate) * up).to(x.dtype)


def floating_on_cpu(query: KernelQuery) -> bool:
    """The predicate: decided once per (device type, dtype), then cached by mtcore."""
    return query.device_type == "cpu" and query.dtype.is_floating_point
