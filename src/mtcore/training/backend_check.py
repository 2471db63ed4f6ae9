"""Trust a backend only after checking it: the self-check every job makes before step 1.

Each node's first rank checks the kernels the job will call that are not the
reference ops (``mtcore.backend.checks.selfcheck``: the kit's cases plus an attention
case at the job's sequence length, a timing against the reference, and for an FP8
job the recipe's quantize and scaled matmuls; cached per machine and code), every
rank checks the collectives of the groups the job uses, at the job's dtype and its
largest messages (``job_collectives``), and all of them learn the outcome together,
so a lying kernel or collective stops the whole job in one line (exit 2, like any
unusable backend) before it trains on wrong numbers. Rank 0 saves the collective
results for ``mtcore doctor``. ``training.self_check: false`` skips it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import torch

from mtcore.backend import BackendError
from mtcore.parallel.layout import Axis


def kernel_use(config):
    """What the job asks of its kernels and FP8 path (``selfcheck.KernelUse``)."""
    from mtcore.backend.checks.job_fp8 import FP8Gemm
    from mtcore.backend.checks.selfcheck import KernelUse

    recipe = config.precision.fp8_config()
    if recipe is None:
        return KernelUse(seq_len=config.model.seq_len)
    roles = {r: (recipe.dtype(r), recipe.granularity(r)) for r in ("input", "weight", "grad")}
    gemms = (
        FP8Gemm("forward", roles["input"], roles["weight"]),
        FP8Gemm("dgrad", roles["grad"], roles["weight"]),
        FP8Gemm("wgrad", roles["grad"], roles["input"]),
    )
    param = config.precision.mixed_precision().param_dtype
    outs = tuple(dict.fromkeys((param, torch.float32)))  # activations' dtype, and master weights'
    return KernelUse(config.model.seq_len, gemms, outs, recipe.delayed)


def group_uses(config, layout, world: int) -> list:
    """The groups this job communicates over, what it sends on each and how much."""
    from mtcore.backend.checks.job_collectives import GroupUse

    dtype = config.precision.mixed_precision().param_dtype
    hidden = int(getattr(config.model, "hidden_size", 0) or 0)
    activations = config.training.micro_batch_size * config.model.seq_len * max(hidden, 1)
    # The loss, the gradient norm and overflow flags (sum, max, min), and what rank 0 sends.
    uses = [GroupUse("world", None, ("all_reduce", "broadcast"), 0, torch.float32)]
    sizes = {axis: layout.size(axis) for axis in (Axis.TP, Axis.CP, Axis.DP_CP, Axis.EP)}
    if sizes[Axis.TP] > 1:  # row-parallel sums; sequence parallelism's gathers and scatters
        ops = ("all_reduce", "all_gather", "reduce_scatter")
        uses.append(GroupUse("tp", layout.group(Axis.TP), ops, activations, dtype))
    if sizes[Axis.CP] > 1:  # K/V moved by all-gather or all-to-all
        ops = ("all_gather", "all_to_all")
        uses.append(GroupUse("cp", layout.group(Axis.CP), ops, activations, dtype))
    if sizes[Axis.DP_CP] > 1:  # gradients (as large as the checks go), ZeRO's shards
        sharded = config.parallel.zero_stage > 0
        ops = ("all_reduce", "reduce_scatter", "all_gather") if sharded else ("all_reduce",)
        bucket = config.parallel.bucket_size
        uses.append(GroupUse("dp", layout.group(Axis.DP_CP), ops, bucket, dtype))
    if sizes[Axis.EP] > 1:  # tokens to their experts and back, uneven
        uses.append(GroupUse("ep", layout.group(Axis.EP), ("all_to_all",), activations, dtype))
    return uses


def verify_backend(backend, config, layout, rank: int, world: int, say) -> None:
    """Raise BackendError on every rank when a kernel or collective fails the check."""
    from mtcore.backend.checks.job_collectives import check_collectives
    from mtcore.backend.checks.selfcheck import cached_check
    from mtcore.training.checkpoint.checkpointer import gather_json

    dtype = config.precision.mixed_precision().param_dtype
    device = backend.torch_device()
    found: dict[str, list[str]] = {}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per node: its machine, its plugins
        result, cached = cached_check(backend, dtype, use=kernel_use(config))
        found[f"kernels on rank {rank}"] = result.failures
        if not cached and result.checked:
            say(
                f"backend self-check: {len(result.checked)} kernel(s) of {backend.name} against "
                f"the reference ops in {result.seconds:.2f} s: "
                + ("passed" if result.passed else f"{len(result.failures)} failed")
            )
    if world > 1:
        uses = group_uses(config, layout, world)
        start = time.perf_counter()
        found[f"collectives on rank {rank}"] = check_collectives(backend.collective, uses, device)
        seconds = time.perf_counter() - start
        found = gather_json(found, backend.collective, world, device)
        if rank == 0:
            _save_collectives(backend, dtype, uses, world, found, seconds)
            say(
                f"backend self-check: collectives of {len(uses)} group(s) "
                f"({', '.join(u.label for u in uses)}) in {seconds:.2f} s on rank 0"
            )
    failures = [f"{where}: {problem}" for where, problems in found.items() for problem in problems]
    if failures:
        more = (
            f" (and {len(failures) - 1} more; mtcore doctor lists them)"
            if len(failures) > 1
            else ""
        )
        raise BackendError(
            f"backend {backend.name!r} failed its self-check: {failures[0]}{more}. Fix or remove "
            "the plugin, or set training.self_check false to train anyway"
        )


def _save_collectives(backend, dtype, uses, world: int, found: dict, seconds: float) -> None:
    """Every rank's collective results, sealed like the kernels', for ``mtcore doctor``."""
    from mtcore.backend.checks.job_collectives import large_size
    from mtcore.backend.checks.selfcheck import SelfCheck, save

    checked = [
        f"{u.label}: {', '.join(u.ops)} up to {large_size(u.elements)} elements" for u in uses
    ]
    what = json.dumps([backend.name, world, checked, str(dtype)]).encode()
    result = SelfCheck(
        key=hashlib.sha256(what).hexdigest()[:20],
        backend=backend.name,
        dtype=str(dtype).removeprefix("torch."),
        checked=checked,
        failures=[
            f"{where}: {p}" for where, ps in found.items() if where.startswith("coll") for p in ps
        ],
        seconds=seconds,
        when=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        kind="collectives",
    )
    save(result)


def local_device_index(backend, local_rank: int) -> int:
    """The accelerator of this node's ``local_rank`` (ranks take the node's devices in
    turn), or a BackendError when the backend's device module sees none (a driver that
    lost its devices, ``CUDA_VISIBLE_DEVICES=``): one line, not a division by zero."""
    count = backend.device.device_count()
    if not isinstance(count, int) or count < 1:
        raise BackendError(
            f"backend {backend.name!r} sees {count!r} {backend.device.type} devices on this "
            "node (device_count()); check the driver and the visible-devices variable, or "
            "choose another backend (training.backend, MTCORE_BACKEND)"
        )
    return local_rank % count
