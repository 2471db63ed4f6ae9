"""Whether a job's ranks fit in the memory they will have, asked before any rank starts.

A model far too large for its layout used to end in the ranks: an out-of-memory
traceback on a device, or on a host the kernel's OOM killer taking a rank (exit
-9) and the job with it. `mtcore train` asks the planner (``mtcore.plan``, whose
memory model follows the trainer's layout: weights, gradients, optimizer state,
activations, buffers) for the peak of the busiest rank, and compares it with what
this node has: a device's memory for accelerator ranks (one each), the host's
available memory (``MemAvailable``) for CPU ranks, which all share it, each also
carrying a process's own size (its interpreter, torch and libraries: the
launcher's, which holds the same). Only a clear excess is refused (more than
``MARGIN`` over what is there): the estimate is within a few per cent of measured
peaks, and a job that might fit is left to try.
"""

from __future__ import annotations

import resource
import warnings
from pathlib import Path

from mtcore.training.config import ConfigError

MARGIN = 1.10


def available_host_memory() -> int | None:
    """Bytes the kernel can give new allocations without swapping (``MemAvailable``)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_size() -> int:
    """This process's peak resident size (bytes): what a rank occupies before its model."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def planned_peak(config, world: int, backend) -> float | None:
    """The planner's peak bytes of the busiest rank for ``config`` on ``world`` ranks of
    ``backend``; None when the planner cannot size it (a family without a plan shape)."""
    from mtcore.plan import HardwareError, NotModelled, load_hardware, plan
    from mtcore.plan.hardware import fill_from_backend
    from mtcore.plan.sweep import options_here

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # Only memory is asked: the host description's bandwidths do not matter here.
            hardware, _ = fill_from_backend(load_hardware("cpu-host"), backend)
            return plan(config, world, hardware, options_here(config)).peak_memory
    except (NotModelled, HardwareError, ValueError, KeyError):
        return None


def check_memory(config, world: int, ranks_here: int, backend) -> None:
    """ConfigError, saying the bytes needed and available, when the job clearly does not
    fit: ``ranks_here`` ranks of a ``world``-rank job on this node."""
    if backend.device.type != "cpu":
        memory = backend.device.capabilities().memory_bytes
        if memory is not None and memory <= 0:  # it holds nothing: not the job either
            raise ConfigError(
                f"backend {backend.name!r} reports {memory} bytes of {backend.device.type} "
                "device memory (capabilities().memory_bytes); a device must have memory"
            )
    peak = planned_peak(config, world, backend)
    if peak is None:
        return
    gib = 2**30
    if backend.device.type == "cpu":
        available = available_host_memory()
        if available is None:
            return
        baseline = process_size()
        need = ranks_here * (peak + baseline)
        where = (
            f"{ranks_here} rank(s) on this host need about {need / gib:.1f} GiB ({peak / gib:.2f} "
            f"GiB of tensors each, plus {baseline / gib:.2f} GiB of process), but it has "
            f"{available / gib:.1f} GiB available"
        )
    else:
        available = backend.device.capabilities().memory_bytes
        if not available:
            return
        need = peak
        where = (
            f"the busiest rank needs about {need / gib:.1f} GiB, but a "
            f"{backend.device.type} device has {available / gib:.1f} GiB"
        )
    if need > MARGIN * available:
        raise ConfigError(
            f"the model does not fit: {where} (mtcore plan's estimate: weights, gradients, "
            "optimizer state, activations). Use more ranks or nodes, a smaller model or "
            "micro-batch, parallel.zero1, or model.recompute"
        )
