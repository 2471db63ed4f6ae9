"""Which dtypes a model trains in.

Megatron-Core's scheme: params and compute in ``param_dtype`` (bf16 or fp16),
gradients accumulated and reduced in fp32, fp32 master weights and AdamW state
in the optimizer. fp16 needs a loss scaler; bf16 has fp32's exponent range and
does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtcore.precision.fp8 import FP8Recipe
from mtcore.precision.loss_scaler import DynamicLossScaler, LossScaler

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def _dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        dtype = value
    elif value in DTYPES:
        dtype = DTYPES[value]
    else:
        raise ValueError(f"unknown dtype {value!r}; use one of {', '.join(DTYPES)}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"param dtype must be fp32, bf16 or fp16, got {dtype}")
    return dtype


@dataclass(frozen=True)
class MixedPrecision:
    """param_dtype: "fp32", "bf16" or "fp16" (or the torch dtype).

    loss_scale: "dynamic", a constant, or None for the default (dynamic for
    fp16, none otherwise). The remaining fields configure the dynamic scaler.
    fp8: an ``FP8Recipe`` for the transformer blocks' linears (None: no FP8); it
    runs on top of fp32 or bf16 params, not fp16.
    """

    param_dtype: torch.dtype | str = torch.float32
    loss_scale: str | float | None = None
    initial_scale: float = 2.0**16
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    hysteresis: int = 1
    min_scale: float = 1.0
    fp8: FP8Recipe | None = None

    def __post_init__(self):
        object.__setattr__(self, "param_dtype", _dtype(self.param_dtype))
        if self.fp8 is not None and self.param_dtype == torch.float16:
            raise ValueError(
                "fp8 needs param dtype bf16 or fp32, not fp16 (FP8 scaling replaces loss scaling)"
            )
        if isinstance(self.loss_scale, str) and self.loss_scale != "dynamic":
            raise ValueError(
                f"loss_scale must be 'dynamic', a number or None, got {self.loss_scale!r}"
            )

    @property
    def grad_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def master_dtype(self) -> torch.dtype:
        return torch.float32

    def make_loss_scaler(self) -> LossScaler | None:
        """The scaler this precision needs, or None when gradients need no scaling."""
        scale = self.loss_scale
        if scale is None:
            scale = "dynamic" if self.param_dtype == torch.float16 else None
        if scale is None:
            return None
        if scale == "dynamic":
            return DynamicLossScaler(
                initial_scale=self.initial_scale,
                growth_factor=self.growth_factor,
                backoff_factor=self.backoff_factor,
                growth_interval=self.growth_interval,
                hysteresis=self.hysteresis,
                min_scale=self.min_scale,
            )
        return LossScaler(float(scale))

    def cast_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Cast floating-point params and buffers to ``param_dtype`` (in place)."""
        return module.to(self.param_dtype)
