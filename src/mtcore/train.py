"""One training rank: ``torchrun --nproc-per-node N -m mtcore.train [CONFIG] [--section.key VALUE ...]``.

``mtcore train`` starts these ranks itself; run this module directly under
``torchrun`` (or Slurm's ``srun`` + ``torchrun``) for several nodes. Every rank
validates the config; only rank 0 prints a problem with it. Exit status: 0 done,
1 training failed, 2 bad input (nothing was trained), 130 interrupted (Ctrl-C),
143 preempted: a SIGTERM stopped the ranks at an agreed step, which they committed
(``mtcore.training.preemption``); the same command continues from it.

A rank ends when the process that started it dies (Linux: a parent-death signal),
so killing the launcher never leaves ranks training, and writing checkpoints, on
their own; the last committed checkpoint stays intact (commits are atomic). A
collective that a peer does not answer within ``training.collective_timeout_s``
ends the rank with one line naming the call and its ranks.
"""

from __future__ import annotations

import os
import signal
import sys
import time

LAUNCHER_PID_ENV = "MTCORE_LAUNCHER_PID"
# A file `mtcore train`'s launcher watches: a rank that stops on bad input creates it, so
# the launcher ends the job at once instead of having the agent restart ranks that would
# find the same problem (``--max-restarts``).
BAD_INPUT_FILE_ENV = "MTCORE_BAD_INPUT_FILE"
# How long a rank other than 0 that found bad input waits before it says so itself: every
# rank finds the same problem, and rank 0's line (its exit ends the others) is the one.
# Long enough for a rank 0 that started late on a loaded machine (5 s was not: at load 15
# on 2 cores, under plain torchrun, rank 1 spoke first); a problem only this rank has is
# said this much later.
BAD_INPUT_GRACE_S = 15.0


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
    if launcher and launcher.isascii() and launcher.isdigit() and os.getppid() != int(launcher):
        # The launcher died before the signal was armed: do not train as an orphan.
        sys.exit(1)


def tell_launcher_bad_input() -> None:
    """Create the launcher's bad-input file, if it watches one (``BAD_INPUT_FILE_ENV``)."""
    path = os.environ.get(BAD_INPUT_FILE_ENV)
    if path:
        try:
            with open(path, "a"):
                pass
        except OSError:  # the launcher is gone, or its directory: nothing to tell
            pass


def main(argv: list[str] | None = None) -> int:
    from mtcore.training.overrides import load_config

    argv = sys.argv[1:] if argv is None else argv
    config_path = argv[0] if argv and not argv[0].startswith("--") else None
    overrides = argv[1:] if config_path is not None else argv
    return run_rank(lambda: load_config(config_path, overrides))


def run_rank(make_config) -> int:
    """Train this rank with the config ``make_config()`` returns; the exit status, with any
    problem said in one line (rank 0 for what every rank finds)."""
    from mtcore.backend import BackendError
    from mtcore.backend.collective import CollectiveTimeout
    from mtcore.data.loader import SamplesLost
    from mtcore.training.checkpoint import CheckpointError, CheckpointWriteError
    from mtcore.training.config import ConfigError
    from mtcore.training.preemption import PREEMPTED_EXIT, Preempted
    from mtcore.training.trainer import TrainingError, train

    rank = int(os.environ.get("RANK", "0"))
    loud = rank == 0
    try:
        train(make_config())
    except CheckpointWriteError as e:  # a save failed (disk full): training ran, the input was fine
        if loud:
            print(f"mtcore train: error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, CheckpointError, BackendError) as e:  # bad input: nothing was trained
        if not loud:  # rank 0 says it, and its exit ends this rank, unless it did not find it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing to save: end when told
            time.sleep(BAD_INPUT_GRACE_S)
        print(
            f"mtcore train: error: {'' if loud else f'rank {rank}: '}{e}",
            file=sys.stderr,
            flush=True,
        )
        # Only once the line is out: the launcher stops every rank when told, and a rank 1
        # that told it first (rank 0 started late) had its rank 0 stopped before rank 0 spoke.
        tell_launcher_bad_input()
        return 2
    except SamplesLost as e:  # one model replica's ranks found it; one of them says it
        if e.said:
            print(f"mtcore train: error: {e}", file=sys.stderr)
        return 1
    except TrainingError as e:
        if loud:
            print(f"mtcore train: error: {e}", file=sys.stderr)
        return 1
    except CollectiveTimeout as e:  # every rank that waited says what it waited for
        print(f"mtcore train: error: {e}", file=sys.stderr)
        return 1
    except Preempted as e:  # every rank stopped at the same step; rank 0 committed it
        if loud:
            print(f"mtcore train: {e}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher says it, once
        return 130
    return 0


if __name__ == "__main__":
    end_with_parent()  # a restarted rank's parent is still the launcher (the agent)
    sys.exit(main(sys.argv[1:]))
