"""FP8 training: recipes (delayed, current, blockwise scaling), per-layer scaling
state, and the FP8 linear that the tensor-parallel layers run when given a recipe.

Only the backend's FP8 interface is used (``backend.fp8``); see docs/fp8.md.
"""

from mtcore.precision.fp8.linear import fp8_linear
from mtcore.precision.fp8.recipes import (
    FORMATS,
    ROLES,
    SCALINGS,
    FP8Recipe,
    check_backend_fp8,
)
from mtcore.precision.fp8.state import (
    FP8Scaling,
    accept_fp8_state,
    replay_delayed_scales,
    snapshot_delayed_scales,
)
from mtcore.precision.fp8.step import FP8StepBookkeeping

__all__ = [
    "FORMATS",
    "ROLES",
    "SCALINGS",
    "FP8Recipe",
    "FP8Scaling",
    "FP8StepBookkeeping",
    "accept_fp8_state",
    "check_backend_fp8",
    "fp8_linear",
    "replay_delayed_scales",
    "snapshot_delayed_scales",
]
