"""`mtcore train`'s rank server: the fork server (``multiprocessing``'s) that imports
torch and mtcore's training code once, then forks every rank of the job, restarted
ones included (``mtcore.cli.launch``). A rank started as ``python -m mtcore.train``
spends several CPU seconds importing the same modules; a forked one starts at once and
shares their memory.

Only the fork server imports this module: it is the one module the server preloads,
and importing it changes the process:

* the server ends when the launcher does, the moment it does (a parent-death signal:
  the launcher's main thread starts it), and its ranks, which arm the same signal,
  end with it; it does not wait for its pipe to the launcher to close and for its own
  interpreter to wind down;
* the server ignores SIGTERM: a scheduler that stops a job signals every process of
  it (Slurm's ``scancel``, a time limit), and the ranks must outlive the signal long
  enough to commit their checkpoint (``mtcore.training.preemption``). Each rank puts
  SIGTERM back to its default first (``mtcore.training.rank.forked_rank``).
"""

from __future__ import annotations

import importlib
import os
import signal

from mtcore.training.rank import end_with_parent

signal.signal(signal.SIGTERM, signal.SIG_IGN)
# A launcher that died before this line closed the server's pipe, which ends the server too.
end_with_parent(None)

SERVER_PID = os.getpid()  # every rank's parent: a rank checks it after arming its death signal

# What every rank imports, loaded once here (a family's own model code loads on first use).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.utils.tensorboard",
    "tokenizers",
    "mtcore.training.rank",
    "mtcore.training.trainer",
    "mtcore.models.common.decoder.model",
    "mtcore.data.tokenizer",
)
for _name in PRELOAD:
    importlib.import_module(_name)
