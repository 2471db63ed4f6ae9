"""Loss scaling for fp16: keep small gradients above fp16's underflow.

The loss is multiplied by ``scale`` before backward; the optimizer divides the
fp32 gradients by it again. A dynamic scaler halves the scale when a gradient
overflowed (and the step is skipped) and doubles it after ``growth_interval``
clean steps, as Megatron-Core and ``torch.amp.GradScaler`` do.

Every rank must take the same decision, or the replicas drift apart: the
found-inf flag is all-reduced (max) over the model-parallel and data-parallel
groups before anyone acts on it (``agree_found_inf``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


class LossScaler:
    """A constant scale (1.0 means no scaling); the base of ``DynamicLossScaler``."""

    def __init__(self, scale: float = 1.0):
        if scale <= 0:
            raise ValueError(f"loss scale must be positive, got {scale}")
        self._scale = float(scale)

    @property
    def scale(self) -> float:
        return self._scale

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self._scale if self._scale != 1.0 else loss

    @torch.no_grad()
    def unscale_(self, grads: Iterable[Tensor]) -> None:
        """Divide ``grads`` by the scale in place (a multiply: exact for powers of two)."""
        if self._scale == 1.0:
            return
        inv = 1.0 / self._scale
        for g in grads:
            g.mul_(inv)

    def update(self, found_inf: bool) -> None:
        """Called once per step with the agreed flag; a constant scale ignores it."""

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """Back off on overflow, grow after ``growth_interval`` steps without one.

    hysteresis: how many overflowing steps (since the last growth) are
    tolerated before the scale backs off; 1 backs off at the first, like
    ``torch.amp.GradScaler`` (Megatron-Core's default is 2). The step is
    skipped on every overflow either way.
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ):
        super().__init__(initial_scale)
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(
                f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}, "
                f"{backoff_factor}"
            )
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError("growth_interval and hysteresis must be at least 1")
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale = min(self._scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])


@torch.no_grad()
def found_non_finite(tensors: Iterable[Tensor], device: torch.device | None = None) -> Tensor:
    """A float32 scalar: 1.0 if any element of ``tensors`` is inf or nan, else 0.0.

    device: where the flag lives when ``tensors`` is empty (it is all-reduced).
    """
    tensors = list(tensors)
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    flags = [torch.isfinite(t).all().logical_not() for t in tensors]
    return torch.stack(flags).any().to(torch.float32)


def agree_found_inf(found: Tensor, collective, groups: Sequence[object | None]) -> bool:
    """All-reduce (max) ``found`` over each group so every rank skips or steps together.

    groups: torch process groups; ``None`` entries (a single process) are skipped.
    """
    found = found.detach().to(torch.float32).clone()
    for group in groups:
        if group is not None and collective.world_size(group) > 1:
            collective.all_reduce(found, op="max", group=group)
    return bool(found.item() > 0)
