"""Trust a backend only after checking it: the self-check every job makes before step 1.

Each node's first rank checks the kernels the job will call that are not the
reference ops (``mtcore.backend.checks.selfcheck``: the kit's cases, cached
per machine, plugin versions and torch), every rank checks a few collectives,
and all of them learn the outcome together, so a lying kernel or collective
stops the whole job in one line (exit 2, like any unusable backend) before it
trains on wrong numbers. ``training.self_check: false`` skips it.
"""

from __future__ import annotations

import os

from mtcore.backend import BackendError


def verify_backend(backend, dtype, rank: int, world: int, say) -> None:
    """Raise BackendError on every rank when a kernel or collective fails the check."""
    from mtcore.backend.checks.selfcheck import cached_check, check_collectives
    from mtcore.training.checkpoint.checkpointer import gather_json

    device = backend.torch_device()
    found: dict[str, list[str]] = {}
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per node: its machine, its plugins
        result, cached = cached_check(backend, dtype)
        found[f"kernels on rank {rank}"] = result.failures
        if not cached and result.checked:
            say(
                f"backend self-check: {len(result.checked)} kernel(s) of {backend.name} against "
                f"the reference ops in {result.seconds:.2f} s: "
                + ("passed" if result.passed else f"{len(result.failures)} failed")
            )
    if world > 1:
        found[f"collectives on rank {rank}"] = check_collectives(
            backend.collective, rank, world, device
        )
        found = gather_json(found, backend.collective, world, device)
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
