"""Run a function on N local ranks, each in its own process, and collect results.

Ranks start from a fork server that has imported torch once, so a rank costs a
fork, not a torch import (seconds each on a small machine); where fork servers
do not exist, or ``MTCORE_START_METHOD=spawn``, ranks are spawned. Either way a
rank sees the caller's current environment (the fork server's own is older)
plus ``env``. Tests still group many checks into one ``run_ranks`` call. The
function must be importable (module level); its return value must be
picklable. A rank's exception comes back with its traceback; a rank that dies
or hangs is reported, not waited on forever; a rank that hangs is reported with
the Python stack of each of its threads at the moment it was given up on.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300.0
# Once a rank has failed, the others usually wait in a collective for it forever:
# they get this long to report, then are killed (a failure costs seconds, not the timeout).
FAILURE_GRACE_S = 10.0
# A rank that hangs writes its threads' stacks to <tmp>/stacks-<rank> on this signal.
STACKS_SIGNAL = signal.SIGUSR1
START_METHOD_ENV = "MTCORE_START_METHOD"
# Imported once by the fork server; every rank inherits them already loaded.
# torch.optim pulls in torch._dynamo on first use (seconds per rank): import it once, here.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.optim",
    "torch._dynamo",
    "mtcore.backend",
    "mtcore.testing.distributed",
]


@dataclass(frozen=True)
class RankContext:
    """What the function receives: its rank, the world size and the backend in use."""

    rank: int
    world_size: int
    backend: object  # mtcore.backend.Backend


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out."""


def run_ranks(
    fn: Callable,
    world_size: int,
    *args,
    backend: str = "cpu",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> list:
    """Call ``fn(ctx, *args)`` on ``world_size`` ranks; return the results by rank."""
    ctx = _context()
    results = ctx.Queue()
    rank_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="mtcore-ranks-") as tmp:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, rank, world_size, backend, tmp, rank_env, args, results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome = _collect(results, procs, timeout_s, tmp)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    failures = [f"rank {r}:\n{tb}" for r, (ok, tb) in sorted(outcome.items()) if not ok]
    if failures:
        raise RankFailure("\n".join(failures))
    return [_decode(outcome[r][1]) for r in range(world_size)]


def _context():
    method = os.environ.get(START_METHOD_ENV, "").strip()
    if not method:
        method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _collect(results, procs, timeout_s: float, tmp: str) -> dict[int, tuple[bool, object]]:
    outcome: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcome) < len(procs):
        try:
            rank, ok, value = results.get(timeout=1.0)
            outcome[rank] = (ok, value)
            if not ok:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
            continue
        except queue.Empty:
            pass
        dead = [r for r, p in enumerate(procs) if r not in outcome and not p.is_alive()]
        if dead and results.empty():
            for r in dead:
                outcome[r] = (
                    False,
                    f"process exited with code {procs[r].exitcode} before reporting",
                )
            for r, p in enumerate(procs):
                if r not in outcome:
                    p.kill()
                    outcome[r] = (False, "killed after another rank died")
        if time.monotonic() > deadline:
            failed = any(not ok for ok, _ in outcome.values())
            why = "killed: another rank failed" if failed else f"timed out after {timeout_s:.0f} s"
            stuck = {r: p for r, p in enumerate(procs) if r not in outcome}
            stacks = _stacks(stuck, tmp)
            for r, p in stuck.items():
                p.kill()
                outcome[r] = (False, f"{why}; its threads were at:\n{stacks[r]}")
    return outcome


def _stacks(stuck: dict, tmp: str) -> dict[int, str]:
    """Ask each stuck rank for its threads' stacks (faulthandler, which answers even
    when the rank holds the GIL) and return what each wrote within a second."""
    for p in stuck.values():
        with contextlib.suppress(OSError):
            os.kill(p.pid, STACKS_SIGNAL)
    time.sleep(1.0)
    found = {}
    for rank in stuck:
        path = os.path.join(tmp, f"stacks-{rank}")
        try:
            with open(path) as f:
                found[rank] = f.read().strip() or "(nothing written)"
        except OSError:
            found[rank] = "(nothing written)"
    return found


def _rank_main(fn, rank, world_size, backend_name, tmp, env, args, results) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_file = os.path.join(tmp, "rendezvous")
    stacks = open(os.path.join(tmp, f"stacks-{rank}"), "w")  # noqa: SIM115 (lives with the rank)
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    try:
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        from mtcore.backend import select_backend

        backend = select_backend(backend_name)
        if backend.device.type != "cpu":
            backend.device.set_device(rank % backend.device.device_count())
        backend.collective.init_process_group(
            rank=rank, world_size=world_size, init_method=f"file://{init_file}", timeout_s=120
        )
        value = _encode(fn(RankContext(rank, world_size, backend), *args))
        backend.collective.barrier()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    # Reported before the process groups close: in one CI run on torch 2.7.1 a rank never
    # reported although its peer had passed the closing barrier with it, so the close
    # (or the exit) hung. A finished rank must not become a timeout; the caller kills a
    # rank that has reported but does not exit.
    results.put((rank, True, value))
    backend.collective.destroy()


def _encode(value) -> bytes:
    # Tensors put on a multiprocessing queue are shared through the sender's memory,
    # which is gone once the rank exits; serialising makes any result safe to return.
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _decode(payload: bytes):
    import io

    import torch

    # Written a moment ago by our own child process: trusted, so full unpickling is fine.
    return torch.load(io.BytesIO(payload), weights_only=False)
