"""The environment variables MT-MegatronLM's MUSA launch scripts export, for
``mtcore doctor`` to show beside what this machine has.

MooreThreads/MT-MegatronLM, examples/deepseek-v2/deepseek-v2-lite/
run_pretrain_deepseekv2_musa.sh exports each with the value below. mtcore reads none
of them and sets none: the drivers and MCCL read them, and no public source we read
(MT-MegatronLM, torch_musa) says what the first three change, so no value can be called
the only sensible one without a MUSA machine to measure on. Doctor shows each one's
value here next to the scripts', so a user comparing a slow or failing run with an
MT-MegatronLM one sees the difference.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# name -> (the scripts' value, what mtcore knows of it)
MT_MEGATRON_VARIABLES: dict[str, tuple[str, str]] = {
    "MUSA_KERNEL_TIMEOUT": ("3200000", "read by the MUSA driver; not documented in the sources read"),
    "MCCL_PROTOS": ("2", "MCCL protocol choice (tuning); MCCL's default when unset"),
    "MCCL_CHECK_POINTERS": ("0", "MCCL argument checks (debugging); MCCL's default when unset"),
    "CUDA_DEVICE_MAX_CONNECTIONS": (
        "1",
        "the name Megatron's Python checks; MUSA's own is MUSA_DEVICE_MAX_CONNECTIONS "
        "(docs/musa.md, section 4)",
    ),
}


def launch_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{"env NAME": "VALUE here; MT-MegatronLM's scripts: V (what it is)"}``."""
    environ = os.environ if environ is None else environ
    facts = {}
    for name, (theirs, what) in MT_MEGATRON_VARIABLES.items():
        here = environ.get(name)
        shown = "unset" if here is None else repr(here)
        facts[f"env {name}"] = f"{shown} here; MT-MegatronLM's scripts: {theirs} ({what})"
    return facts
