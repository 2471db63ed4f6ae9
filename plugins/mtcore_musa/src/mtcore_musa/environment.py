"""The environment variables MT-MegatronLM's MUSA launch scripts export: the one the
plugin sets (hook ``mtcore_environment``) and, for ``mtcore doctor``, each one's value
here beside the scripts'.

MooreThreads/MT-MegatronLM's MUSA scripts (examples/{llama2,llama3,mixtral,deepseek-v2,
deepseek-v3}/.../run_pretrain_*_musa.sh) export the four below. Which have one value that
only makes sense one way, from the sources read:

* ``MCCL_CHECK_POINTERS=0``: MCCL's per-call argument (pointer) checks, NCCL's
  ``NCCL_CHECK_POINTERS`` under MCCL's prefix, a debugging aid that costs time on every
  collective. Every MUSA script that names it, in MT-MegatronLM and in the other public
  MUSA launch scripts read (DeepSpeed's and verl's, for MUSA), sets 0; none sets 1. Set by the plugin when the user has not set it (1 to debug is kept).
* ``MUSA_KERNEL_TIMEOUT``: a driver watchdog whose unit and default no source read
  documents, and whose value differs between projects (MT-MegatronLM 3200000, other
  MUSA scripts 1200000, 5400000, 1800000000000): a site's choice. Not set.
* ``MCCL_PROTOS=2``: MCCL's protocol choice, tuning for a network and message sizes
  (the same scripts also tune MCCL_ALGOS and MCCL_BUFFSIZE). Not set.
* ``CUDA_DEVICE_MAX_CONNECTIONS=1``: the name Megatron's Python checks. One hardware queue
  orders the tensor-parallel backward's collective before the weight-gradient GEMM
  (megatron/core/tensor_parallel/layers.py, "Here we rely on CUDA_DEVICE_MAX_CONNECTIONS=1";
  mtcore's column-parallel backward issues them in the same order, for speed only), but
  Megatron-LM itself refuses 1 with FSDP and asks for more queues for MoE all-to-all
  overlap (megatron/training/arguments.py:622-623 and 929-947, core_v0.16.1): a
  trade-off, not one value. torch_musa's source never reads it nor
  MUSA_DEVICE_MAX_CONNECTIONS, so which name the MUSA runtime honours is not known
  here either. Not set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from mtcore.backend.environment import set_by_plugin

PLUGIN = "mtcore_musa"

# What the plugin sets for the musa backend (only where unset).
MUSA_ENVIRONMENT: dict[str, str] = {"MCCL_CHECK_POINTERS": "0"}

# name -> (the scripts' value, what mtcore does with it)
MT_MEGATRON_VARIABLES: dict[str, tuple[str, str]] = {
    "MUSA_KERNEL_TIMEOUT": ("3200000", "a driver watchdog, unit undocumented; not set by mtcore"),
    "MCCL_PROTOS": ("2", "MCCL protocol choice (tuning); not set by mtcore"),
    "MCCL_CHECK_POINTERS": (
        "0",
        "MCCL's per-call pointer checks (debugging); mtcore-musa sets 0 where unset",
    ),
    "CUDA_DEVICE_MAX_CONNECTIONS": (
        "1",
        "Megatron's tp ordering vs FSDP/EP overlap, a trade-off; not set by mtcore "
        "(docs/musa.md, section 4)",
    ),
}


def launch_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{"env NAME": "VALUE here (who set it); MT-MegatronLM's scripts: V (what it is)"}``."""
    environ = os.environ if environ is None else environ
    facts = {}
    for name, (theirs, what) in MT_MEGATRON_VARIABLES.items():
        here = environ.get(name)
        if here is None:
            shown = "unset"
            if name in MUSA_ENVIRONMENT:
                shown += f" (mtcore-musa sets {MUSA_ENVIRONMENT[name]!r} when the backend is built)"
        else:
            who = set_by_plugin(name, environ)
            shown = repr(here) + (" (set by mtcore-musa: it was unset)" if who == PLUGIN else "")
        facts[f"env {name}"] = f"{shown} here; MT-MegatronLM's scripts: {theirs} ({what})"
    return facts
