"""How equivalence tests compare a parallel run with the one-process run."""

from __future__ import annotations

import torch


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (a zero ``b`` gives ``||a||`` / 1e-30, i.e. huge)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()
