"""Mixed precision: low-precision params and compute, fp32 master weights and grads.

``MixedPrecision`` says which dtype the model runs in; the optimizers of
``mtcore.parallel.optimizer`` keep fp32 master weights and fp32 gradients for
it. fp16 needs loss scaling (``DynamicLossScaler``); bf16 and fp32 do not.
"""

from mtcore.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    agree_found_inf,
    found_non_finite,
)
from mtcore.precision.mixed import DTYPES, MixedPrecision

__all__ = [
    "DTYPES",
    "DynamicLossScaler",
    "LossScaler",
    "MixedPrecision",
    "agree_found_inf",
    "found_non_finite",
]
