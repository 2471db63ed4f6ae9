"""One training rank: ``torchrun --nproc-per-node N -m mtcore.train [CONFIG] [--section.key VALUE ...]``.

``mtcore train`` starts these ranks itself; run this module directly under
``torchrun`` (or Slurm's ``srun`` + ``torchrun``) for several nodes. Every rank
validates the config; only rank 0 prints a problem with it. Exit status: 0 done,
1 training failed, 2 bad input (nothing was trained).

A rank ends when the process that started it dies (Linux: a parent-death signal),
so killing the launcher never leaves ranks training, and writing checkpoints, on
their own; the last committed checkpoint stays intact (commits are atomic). A
collective that a peer does not answer within ``training.collective_timeout_s``
ends the rank with one line naming the call and its ranks.
"""

from __future__ import annotations

import os
import sys

LAUNCHER_PID_ENV = "MTCORE_LAUNCHER_PID"


def end_with_parent() -> None:
    """Have the kernel kill this process when its parent (the launcher, or torchrun's
    agent) dies; exit at once if it died already. Linux only; elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: nothing to arm
        return
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher and launcher.isdigit() and os.getppid() != int(launcher):
        # The launcher died before the signal was armed: do not train as an orphan.
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    from mtcore.backend.collective import CollectiveTimeout
    from mtcore.training.checkpoint import CheckpointError
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config
    from mtcore.training.trainer import TrainingError, train

    argv = sys.argv[1:] if argv is None else argv
    config_path = argv[0] if argv and not argv[0].startswith("--") else None
    overrides = argv[1:] if config_path is not None else argv
    loud = int(os.environ.get("RANK", "0")) == 0
    try:
        train(load_config(config_path, overrides))
    except (ConfigError, CheckpointError) as e:  # bad input: nothing was trained
        if loud:
            print(f"mtcore train: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:
        if loud:
            print(f"mtcore train: error: {e}", file=sys.stderr)
        return 1
    except CollectiveTimeout as e:  # every rank that waited says what it waited for
        print(f"mtcore train: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    end_with_parent()
    sys.exit(main())
