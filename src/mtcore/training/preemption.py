"""Preemption: a SIGTERM stops the job at an agreed step, after a checkpoint of it.

Slurm (``scancel``, ``scontrol requeue``, a preempting job) and Kubernetes (a
pod being evicted) say "stop" with SIGTERM, then SIGKILL a grace period later;
torch's elastic agent passes a SIGTERM it gets on to its ranks. A rank only
notes the signal (``StopSignal``). The note travels with the step's loss
reduction, which every rank makes anyway (``Engine.train_step(stop=...)``), so
all ranks learn it at the same step without a collective of its own; they then
commit a checkpoint of that step and exit with ``PREEMPTED_EXIT`` (143, 128 +
SIGTERM, what a process killed by SIGTERM reports), which Kubeflow's
``restartPolicy: ExitCode`` and JobSet's failure policies treat as retryable.
The next run of the same job resumes from that commit.
"""

from __future__ import annotations

import signal
import threading
import time

PREEMPTED_EXIT = 128 + signal.SIGTERM


class Preempted(Exception):
    """The ranks stopped after ``step`` on a signal and committed ``checkpoint`` (rank 0's
    view; None elsewhere, or without a checkpoint.dir). ``seconds``: from the signal to the
    commit, on a rank that received the signal itself (None on the others)."""

    def __init__(self, step: int, signal_name: str, checkpoint, seconds: float | None):
        self.step, self.signal_name = step, signal_name
        self.checkpoint, self.seconds = checkpoint, seconds
        if checkpoint is None:
            saved = "no checkpoint.dir, nothing saved"
        else:
            after = f" {seconds:.1f} s after the signal" if seconds is not None else ""
            saved = f"committed {checkpoint}{after}; the same command continues from it"
        super().__init__(f"preempted: {signal_name} stopped the job after step {step}: {saved}")


class StopSignal:
    """Notes SIGTERM while installed (the main thread only: Python runs handlers there).

    ``requested``: whether a signal came; ``received_at``: its ``time.monotonic()``."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self.received_at: float | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _note(self, signum, frame) -> None:
        if self.received is None:
            self.received, self.received_at = signal.Signals(signum), time.monotonic()

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def since(self) -> float:
        """Seconds since the signal arrived (0 without one)."""
        return time.monotonic() - self.received_at if self.received_at is not None else 0.0


# Set by `mtcore train`'s launcher for its ranks: its pid, and a file a rank writes before
# signalling it. torch's agent restarts ranks that exit 143 like any failed ones (and
# counts it against --max-restarts), so a node whose ranks stopped on another node's
# SIGTERM, or on one rank's, would start a new round instead of ending: local rank 0
# tells its launcher, which then ends the agent as if it had been signalled itself.
LAUNCHER_PID_ENV = "MTCORE_LAUNCHER_PID"
STOPPED_FILE_ENV = "MTCORE_STOPPED_FILE"


def tell_launcher_stopped(step: int, signalled_here: bool, environ=None) -> bool:
    """Local rank 0, once a preemption's checkpoint is committed: write ``step`` (and whether
    this rank got the signal itself) to the launcher's file, then SIGTERM the launcher. The
    commit is complete on every rank by then (``Preempted`` comes after it), so the agent
    stopping the ranks cannot cut a save short. False when no `mtcore train` launcher
    watches (plain torchrun, one process)."""
    import json
    import os

    environ = os.environ if environ is None else environ
    pid, path = environ.get(LAUNCHER_PID_ENV), environ.get(STOPPED_FILE_ENV)
    if not pid or not path or environ.get("LOCAL_RANK", "0") != "0":
        return False
    try:
        with open(path, "w") as f:
            json.dump({"step": step, "signalled_here": signalled_here}, f)
        os.kill(int(pid), signal.SIGTERM)
    except (OSError, ValueError):  # the launcher is gone: nothing to tell
        return False
    return True
