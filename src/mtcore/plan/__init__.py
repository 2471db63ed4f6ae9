"""Planning: per-rank memory and predicted step time of a training layout (docs/plan.md).

Layer 5 (beside ``training`` and ``cli``): it reads model families only through the
seam (``mtcore.models``: the family's ``shape``, a ``ModelShape``, and the config's
``num_params``, ``flops_per_step``, ``check_layout``, ``experts``) and checks layouts
with the trainer's own ``TrainConfig.check``.
"""

from mtcore.plan.hardware import Hardware, HardwareError, builtin_names, load_hardware
from mtcore.plan.options import OptionsError
from mtcore.plan.planner import DP_OVERLAP, Options, Plan, plan
from mtcore.plan.shapes import NotModelled, model_shape

__all__ = [
    "DP_OVERLAP",
    "Hardware",
    "HardwareError",
    "NotModelled",
    "Options",
    "OptionsError",
    "Plan",
    "builtin_names",
    "load_hardware",
    "model_shape",
    "plan",
]
