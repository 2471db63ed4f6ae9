"""How a launcher learns that its ranks stopped on a preemption, so that it ends too.

A SIGTERM anywhere in a job (one node's launcher, one rank) stops every rank at the
same step, after a commit, with exit 143. torch's elastic agent treats a rank that
exits 143 like one that failed: it starts a new rendezvous round and counts a
restart, so the nodes that did not get the signal would go on, and each preemption
would use up every surviving agent's ``--max-restarts`` (a PyTorchJob's
``PET_MAX_RESTARTS``: after three, exit 1, which ``restartPolicy: ExitCode`` does not
retry). Instead the job ends on every node with 143: local rank 0 writes the step into
this file and sends its launcher SIGTERM (``training.preemption.tell_launcher_stopped``),
the agent stops its ranks as for any signal, and the launcher exits 143, which Slurm's
script requeues and Kubernetes' policies retry. The next start resumes the commit.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import suppress


class StopNote:
    """The file the ranks write on a preemption, named in their environment together with
    this process's pid (``LAUNCHER_PID_ENV``, ``STOPPED_FILE_ENV``)."""

    def __init__(self):
        from mtcore.training.preemption import LAUNCHER_PID_ENV, STOPPED_FILE_ENV

        handle, self.path = tempfile.mkstemp(prefix="mtcore-stopped-")
        os.close(handle)
        os.unlink(self.path)  # it appears when a rank writes it
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
        os.environ[STOPPED_FILE_ENV] = self.path

    def read(self) -> dict | None:
        """``{"step": N, "signalled_here": bool}`` once local rank 0 wrote it, else None."""
        try:
            with open(self.path) as f:
                note = json.load(f)
        except (OSError, ValueError):
            return None
        return note if isinstance(note, dict) else None

    def describe(self, note: dict) -> str:
        """The launcher's line for a node whose ranks stopped on a SIGTERM they did not get."""
        return (
            f"mtcore train: stopped: a SIGTERM to another node or rank of this job stopped it "
            f"after step {note.get('step', '?')}, which rank 0 committed; this node ends "
            "too (exit 143, no restart counted), and the same command continues from it"
        )

    def __enter__(self) -> StopNote:
        return self

    def __exit__(self, *exc) -> None:
        with suppress(FileNotFoundError):
            os.unlink(self.path)
