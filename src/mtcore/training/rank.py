"""One training rank: ``torchrun --nproc-per-node N -m mtcore.train [CONFIG] [--section.key VALUE ...]``.

``mtcore train`` (``mtcore.cli.train``, ``mtcore.cli.launch``) starts these ranks
itself; ``python -m mtcore.train`` (``mtcore/train.py``: this module's ``main``) runs
one directly under ``torchrun`` (or Slurm's ``srun`` + ``torchrun``) for several nodes. Every rank
validates the config; only rank 0 prints a problem with it. Exit status: 0 done,
1 training failed, 2 bad input (nothing was trained), 130 interrupted (Ctrl-C),
143 preempted: a SIGTERM stopped the ranks at an agreed step, which they committed
(``mtcore.training.preemption``); the same command continues from it.

A rank ends when the process that started it dies (Linux: a parent-death signal;
under `mtcore train` that is the rank server, which ends with the launcher), so
killing the launcher never leaves ranks training, and writing checkpoints, on
their own; the last committed checkpoint stays intact (commits are atomic). A
collective that a peer does not answer within ``training.collective_timeout_s``
ends the rank with one line naming the call and its ranks.

`mtcore train` does not start ``python -m mtcore.train`` for each rank: it forks its
ranks from a server that imported torch and this package once (``mtcore.training.rank_server``),
and each one runs ``forked_rank``; the exit statuses are the same.
"""

from __future__ import annotations

import os
import signal
import sys
import time

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


def end_with_parent(parent: int | None) -> None:
    """Have the kernel kill this process when its parent (the launcher, torchrun's agent,
    or the rank server) dies; exit at once if ``parent``, the pid the parent had, is no
    longer this process's parent (it died before the signal was armed). Linux only;
    elsewhere a no-op."""
    pr_set_pdeathsig = 1
    if not _prctl(pr_set_pdeathsig, int(signal.SIGKILL)):
        return  # nothing armed: nothing to check
    if parent is not None and os.getppid() != parent:
        sys.exit(1)  # the parent died before the signal was armed: do not train as an orphan


# What each rank calls itself (``name_this_rank``): at most 15 bytes (Linux's limit).
RANK_PROCESS_NAME = "mtcore-rank-{rank}"


def name_this_rank() -> None:
    """Name this process ``mtcore-rank-<RANK>``: what ``ps``, ``top`` and ``/proc/PID/comm``
    show, and how tools and tests tell the ranks apart (a forked rank's command line is
    its server's). Linux only; elsewhere a no-op."""
    name = RANK_PROCESS_NAME.format(rank=os.environ.get("RANK", "0"))
    pr_set_name = 15
    _prctl(pr_set_name, name.encode()[:15])


def _prctl(option: int, argument) -> bool:
    """Linux's ``prctl(option, argument)``; False where there is none, or it failed."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, argument, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tell_launcher_bad_input() -> None:
    """Create the launcher's bad-input file, if it watches one (``BAD_INPUT_FILE_ENV``)."""
    path = os.environ.get(BAD_INPUT_FILE_ENV)
    if path:
        try:
            with open(path, "a"):
                pass
        except OSError:  # the launcher is gone, or its directory: nothing to tell
            pass


def nodes_disagree(environ) -> str | None:
    """What is wrong when the nodes of a job started different numbers of ranks (``--nproc``
    differs): torch's agent numbers them all the same, so each node finds it alone from
    the sizes it sets (``WORLD_SIZE`` against ``LOCAL_WORLD_SIZE`` x ``GROUP_WORLD_SIZE``),
    before any process group; None when they agree, or outside an agent."""
    try:
        world, local, nodes = (int(environ[k]) for k in
                               ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"))  # fmt: skip
    except (KeyError, ValueError):
        return None
    if local * nodes == world:
        return None
    import socket

    return (
        f"--nproc differs across the nodes: this node ({socket.gethostname()}) starts {local} "
        f"rank(s), but the {nodes} nodes start {world} in all; give every node the same "
        "--nproc (torchrun's --nproc-per-node)"
    )


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
    from mtcore.training.preemption import PREEMPTED_EXIT, Preempted, tell_launcher_stopped
    from mtcore.training.trainer import TrainingError, train

    rank = int(os.environ.get("RANK", "0"))
    loud = rank == 0
    unequal = nodes_disagree(os.environ)
    if unequal is not None:  # every node finds it: each node's first rank says it
        if os.environ.get("LOCAL_RANK", "0") != "0":
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing to save: end when told
            time.sleep(BAD_INPUT_GRACE_S)
            return 2
        print(f"mtcore train: error: {unequal}", file=sys.stderr, flush=True)
        tell_launcher_bad_input()
        return 2
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
        # The launcher stops its agent next (below), and the agent passes a SIGTERM on to
        # the ranks: the commit is done, but rank 0's line must still come out.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if loud:
            print(f"mtcore train: {e}", file=sys.stderr, flush=True)
        # Else the agent restarts ranks that exit 143 (another node's, or one rank's,
        # SIGTERM) into a new round, using up --max-restarts: the job ends everywhere.
        tell_launcher_stopped(e.step, signalled_here=e.seconds is not None)
        return PREEMPTED_EXIT
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the launcher says it, once
        return 130
    return 0


def forked_rank(*argv: str) -> None:
    """A rank that `mtcore train`'s launcher forked from its rank server, with ``argv`` as
    ``main`` takes it. Ends the process with ``main``'s exit status, as ``python -m
    mtcore.train`` does; an unexpected error prints its traceback (the fork server's
    worker wrapper would only hand it to the agent)."""
    import traceback

    # The signals a new interpreter started by the agent has: the server ignores SIGTERM,
    # and SIGINT too where the launcher started with it ignored (a script's `cmd &`).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    server = sys.modules.get("mtcore.training.rank_server")  # absent: forked by another fork server
    end_with_parent(server.SERVER_PID if server is not None else None)
    name_this_rank()
    try:
        code = main(list(argv))
    except KeyboardInterrupt:
        code = 130
    except Exception:
        traceback.print_exc()
        code = 1
    sys.exit(code)


def torchrun_rank() -> None:
    """A rank started as ``python -m mtcore.train`` (torchrun's agent is its parent, a
    restarted rank's too): ends the process with ``main``'s exit status."""
    end_with_parent(None)
    name_this_rank()
    sys.exit(main(sys.argv[1:]))
