"""Where `mtcore train`'s ranks run: this host alone, or one of several nodes.

`mtcore train` runs torch's elastic agent (``torch.distributed.run``, the launcher
behind ``torchrun``) in its own process, with the options ``torchrun`` takes; the
agent forks the ranks from a server that loaded torch and mtcore once
(``mtcore.training.rank_server``) instead of starting an interpreter for each. Alone, the
agent's rendezvous is local (``--standalone``); with ``--nnodes`` or
``--rdzv-endpoint`` it is the c10d rendezvous every node's agent joins, as
``torchrun`` does on a cluster, and the same environment variables set the same
options when a flag is absent (``PET_NNODES``, ``PET_RDZV_ENDPOINT``, ...: what
Kubeflow's training operator sets for an elastic PyTorchJob).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass

from mtcore.cli.stop_note import StopNote

DEFAULT_PORT = 29400  # torchrun's for the c10d rendezvous
# Flag -> torchrun's environment variable for it (torch.distributed.run reads PET_<NAME>).
ENVIRONMENT = {
    "--nproc": "PET_NPROC_PER_NODE",
    "--nnodes": "PET_NNODES",
    "--rdzv-backend": "PET_RDZV_BACKEND",
    "--rdzv-endpoint": "PET_RDZV_ENDPOINT",
    "--rdzv-id": "PET_RDZV_ID",
    "--rdzv-conf": "PET_RDZV_CONF",
    "--max-restarts": "PET_MAX_RESTARTS",
}
_COUNT = re.compile(r"[0-9]+")
_NNODES = re.compile(r"([0-9]+)(?::([0-9]+))?")
_CONF = re.compile(r"[A-Za-z_]+=[^,=]+(,[A-Za-z_]+=[^,=]+)*")
# What torch's rendezvous handlers read as numbers and booleans (dynamic_rendezvous.py's
# create_handler, c10d_rendezvous_backend.py, etcd_rendezvous.py): a bad value there
# fails inside the agent with a traceback. Other keys (etcd's protocol, ssl_cert, ...)
# are the backend's own and pass as they are.
_CONF_SECONDS = ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout",
                 "timeout", "read_timeout", "keep_alive_interval")  # fmt: skip
_CONF_COUNTS = ("keep_alive_max_attempt",)
_CONF_BOOLEANS = ("is_host",)
_TRUTH = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")  # torch's get_as_bool
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")
RENDEZVOUS_BACKENDS = ("c10d", "etcd", "etcd-v2", "static")


# torch's C++ side (c10d's TCPStore client) logs each failed connection to the rendezvous
# and each closed socket with its C++ frames: 50-250 lines before the launcher's one line.
# Read once, when torch is imported; the ranks keep the level the user gave.
_CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"
_quieted_here = False


def quiet_agent_logs() -> None:
    """Before torch is imported in the launcher: its C++ logs off (``FATAL`` only), unless
    the user set ``TORCH_CPP_LOG_LEVEL``; ``launch`` gives the ranks the user's setting."""
    global _quieted_here
    if _CPP_LOG_LEVEL not in os.environ and "torch" not in sys.modules:
        os.environ[_CPP_LOG_LEVEL] = "FATAL"
        _quieted_here = True


class LaunchError(ValueError):
    """A launch option that cannot work; the message names the option and the value."""


@dataclass(frozen=True)
class Launch:
    """How the ranks start: ``nproc`` per node on ``min_nodes``..``max_nodes`` nodes."""

    nproc: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    endpoint: str | None = None  # HOST:PORT of the rendezvous; None: this host alone
    run_id: str | None = None
    backend: str = "c10d"  # the rendezvous backend (torchrun's --rdzv-backend)
    rdzv_conf: str | None = None
    max_restarts: int = 0

    @property
    def multi_node(self) -> bool:
        return self.endpoint is not None

    @property
    def in_process(self) -> bool:
        """One rank, no restarts, no other node: the job runs in the `mtcore` process."""
        return self.nproc == 1 and not self.max_restarts and not self.multi_node

    def world_sizes(self) -> list[int]:
        return [nodes * self.nproc for nodes in range(self.min_nodes, self.max_nodes + 1)]

    def describe(self) -> str:
        nodes = (
            str(self.min_nodes)
            if self.min_nodes == self.max_nodes
            else f"{self.min_nodes}:{self.max_nodes}"
        )
        return f"--nnodes {nodes} --nproc {self.nproc}"

    def torchrun_arguments(self) -> list[str]:
        argv = [f"--nproc-per-node={self.nproc}", f"--max-restarts={self.max_restarts}"]
        if not self.multi_node:
            return ["--standalone", *argv]
        argv += [
            f"--nnodes={self.min_nodes}:{self.max_nodes}",
            f"--rdzv-backend={self.backend}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
        ]
        return argv + ([f"--rdzv-conf={self.rdzv_conf}"] if self.rdzv_conf else [])


def read_launch(flags: dict[str, str], environ: dict[str, str] | None = None) -> Launch:
    """The launch that ``flags`` (option -> text, as typed) and torchrun's environment
    variables describe; a LaunchError names the first option that cannot work."""
    environ = os.environ if environ is None else environ

    def value(option: str) -> tuple[str | None, str]:
        if option in flags:
            return flags[option], option
        name = ENVIRONMENT[option]
        return environ.get(name), f"{name} (for {option})"

    nproc_text, where = value("--nproc")
    nproc = 1
    if nproc_text == "auto":  # torchrun's: one rank per accelerator, else per CPU core
        nproc = _local_devices()
    elif nproc_text is not None:
        nproc = _count(nproc_text, where, least=1)
    restarts_text, where = value("--max-restarts")
    restarts = _count(restarts_text, where, least=0) if restarts_text is not None else 0
    nnodes_text, nnodes_where = value("--nnodes")
    low, high = _nnodes(nnodes_text, nnodes_where) if nnodes_text is not None else (1, 1)
    endpoint, where = value("--rdzv-endpoint")
    run_id, run_id_where = value("--rdzv-id")
    conf, conf_where = value("--rdzv-conf")
    backend, backend_where = value("--rdzv-backend")
    if endpoint is None:
        if high > 1:
            raise LaunchError(
                f"{nnodes_where} {nnodes_text} needs --rdzv-endpoint HOST[:PORT] (the host of one "
                "node, where every node's agent meets), and the same --rdzv-id on every node"
            )
        for given, where_given in (
            (run_id, run_id_where),
            (conf, conf_where),
            (backend, backend_where),
        ):
            if given is not None:
                raise LaunchError(f"{where_given} needs --rdzv-endpoint")
        return Launch(nproc=nproc, max_restarts=restarts)
    endpoint = parse_endpoint(endpoint, where)
    if not run_id:
        raise LaunchError(
            f"--rdzv-endpoint {endpoint} needs --rdzv-id ID, the same on every node (a job "
            "name, or $SLURM_JOB_ID); it also tells a restarted node which checkpoints are its job's"
        )
    if conf is not None:
        _check_conf(conf, conf_where)
    if backend is not None and backend not in RENDEZVOUS_BACKENDS:
        known = ", ".join(RENDEZVOUS_BACKENDS)
        raise LaunchError(f"{backend_where} needs one of {known}, got {backend!r}")
    return Launch(
        nproc=nproc,
        min_nodes=low,
        max_nodes=high,
        endpoint=endpoint,
        run_id=run_id,
        backend=backend or "c10d",
        rdzv_conf=conf,
        max_restarts=restarts,
    )


def _local_devices() -> int:
    """``--nproc auto``: the selected backend's accelerators, else this host's CPU cores."""
    from mtcore.backend import select_backend

    backend = select_backend()
    if backend.device.type != "cpu":
        return max(1, backend.device.device_count())
    return os.cpu_count() or 1


def _count(text: str, where: str, least: int) -> int:
    if not _COUNT.fullmatch(text) or int(text) < least:
        kind = "a positive" if least else "a non-negative"
        raise LaunchError(f"{where} needs {kind} number, got {text!r}")
    return int(text)


def _nnodes(text: str, where: str) -> tuple[int, int]:
    match = _NNODES.fullmatch(text)
    low = int(match.group(1)) if match else 0
    high = int(match.group(2) or low) if match else 0
    if not match or low < 1 or high < low:
        raise LaunchError(
            f"{where} needs N or MIN:MAX (node counts, 1 <= MIN <= MAX), got {text!r}"
        )
    return low, high


def parse_endpoint(text: str, where: str) -> str:
    """``HOST:PORT`` of a rendezvous endpoint given as ``HOST`` or ``HOST:PORT`` (an IPv6
    address in brackets), or a LaunchError naming ``where``: no URL scheme (torch would
    read ``tcp`` as the host), a host name or address of the usual characters, a port in
    1-65535."""
    scheme, separator, _ = text.partition("://")
    if separator:
        raise LaunchError(
            f"{where} takes HOST or HOST:PORT without a scheme: drop '{scheme}://' from {text!r}"
        )
    if text.endswith("]") or ":" not in text:
        host, port = text, str(DEFAULT_PORT)
    else:
        host, _, port = text.rpartition(":")
    if not _HOST.fullmatch(host) or not _COUNT.fullmatch(port) or not 0 < int(port) < 65536:
        raise LaunchError(
            f"{where} needs HOST or HOST:PORT (a port in 1-65535; an IPv6 address in "
            f"brackets), got {text!r}"
        )
    return f"{host}:{port}"


def _check_conf(conf: str, where: str) -> None:
    """A LaunchError for a ``--rdzv-conf`` torch's agent would fail on: not KEY=VALUE
    pairs, a key twice, a timeout that is not a whole number of seconds (>= 1), a count
    that is not a whole number, a boolean that is not one."""
    if not _CONF.fullmatch(conf):
        raise LaunchError(f"{where} needs KEY=VALUE[,KEY=VALUE...], got {conf!r}")
    seen = set()
    for pair in conf.split(","):
        key, _, value = pair.partition("=")
        if key in seen:
            raise LaunchError(f"{where}: {key} is given twice in {conf!r}")
        seen.add(key)
        if key in _CONF_SECONDS and not (_COUNT.fullmatch(value) and int(value) >= 1):
            raise LaunchError(f"{where}: {key} needs whole seconds (>= 1), got {value!r}")
        if key in _CONF_COUNTS and not _COUNT.fullmatch(value):
            raise LaunchError(f"{where}: {key} needs a whole number, got {value!r}")
        if key in _CONF_BOOLEANS and value.lower() not in _TRUTH:
            raise LaunchError(f"{where}: {key} needs true or false, got {value!r}")


class RendezvousWatch:
    """Ends this launcher when the rendezvous endpoint stays unreachable for ``limit_s``.

    torch's agent talks to the c10d store over one TCP connection; on a node cut off from
    the network it waits on that connection until TCP gives up (about 15 minutes), long
    after its ranks stopped (their collectives time out). A fresh connection to the
    endpoint every ``every_s`` tells whether the store's node can still be reached; the
    watch starts counting only after one succeeded (before that, the agent's join timeout
    applies). Firing prints one line and ends the process (its ranks end with it: they
    armed a parent-death signal) with ``PREEMPTED_EXIT``: nothing committed is lost, and
    the same command continues once the node is back."""

    def __init__(self, endpoint: str, limit_s: float, every_s: float = 2.0):
        import threading

        host, _, port = endpoint.rpartition(":")
        self.address, self.limit_s, self.every_s = (host, int(port)), limit_s, every_s
        self.reached = False  # whether a connection to the endpoint ever succeeded
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mtcore-rdzv-watch", daemon=True)

    def __enter__(self) -> RendezvousWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def reachable(self) -> bool:
        import socket

        try:
            socket.create_connection(self.address, timeout=self.every_s).close()
        except OSError:
            return False
        return True

    def _watch(self) -> None:
        import multiprocessing.util
        import time

        from mtcore.training.preemption import PREEMPTED_EXIT

        last_seen = None
        while not self._stop.wait(self.every_s):
            if self.reachable():
                last_seen = time.monotonic()
                self.reached = True
            elif last_seen is not None and time.monotonic() - last_seen > self.limit_s:
                host, port = self.address
                print(
                    f"mtcore train: stopped: lost the rendezvous at {host}:{port} (unreachable "
                    f"for {self.limit_s:g} s: this node is cut off, or that one is down); the "
                    "last commit is intact, and the same command continues from it",
                    file=sys.stderr,
                    flush=True,
                )
                # As a normal exit would: unlink the agent's queue semaphores, which the
                # resource tracker would otherwise report as leaked, one misleading line.
                multiprocessing.util._run_finalizers(0)
                os._exit(PREEMPTED_EXIT)


class BadInputWatch:
    """Ends the agent's restarts when a rank stopped on bad input (exit 2): the ranks create
    a file this launcher watches (``mtcore.training.rank.BAD_INPUT_FILE_ENV``), and the launcher
    then signals itself, so the agent stops its ranks and returns (``SignalException``)
    instead of restarting ranks that would find the same problem."""

    def __init__(self, every_s: float = 0.1):
        import tempfile
        import threading

        from mtcore.training.rank import BAD_INPUT_FILE_ENV

        handle, path = tempfile.mkstemp(prefix="mtcore-bad-input-")
        os.close(handle)
        os.unlink(path)  # it appears when a rank reports
        self.path, self.every_s = path, every_s
        os.environ[BAD_INPUT_FILE_ENV] = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="mtcore-bad-input", daemon=True)

    @property
    def fired(self) -> bool:
        return os.path.exists(self.path)

    def __enter__(self) -> BadInputWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        with suppress(FileNotFoundError):
            os.unlink(self.path)

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.fired:
                os.kill(os.getpid(), signal.SIGTERM)  # the agent's handler ends the run
                return


def launch(
    plan: Launch, config: str | None, overrides: list[str], unreachable_s: float = 600.0
) -> int:
    """Start this node's ranks (``mtcore.training.rank.forked_rank``, forked from the rank server)
    through the elastic agent; when one dies, it restarts all of them up to
    ``max_restarts`` times (they resume). A multi-node launch ends when the rendezvous
    stays unreachable for ``unreachable_s`` (``RendezvousWatch``)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: ranks share the cores
    if plan.max_restarts or plan.multi_node:
        # The agent's shared store outlives a restart, and restarted gloo ranks would read
        # the dead ranks' addresses from it: a fresh store for every round instead.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    bad_input = BadInputWatch()  # sets the file's name in the ranks' environment
    stopped = StopNote()  # likewise: where local rank 0 says the job was preempted
    if _quieted_here:  # the launcher's own C++ logs only
        os.environ.pop(_CPP_LOG_LEVEL, None)
    # The ranks' environment is complete; the server loads torch while this process does.
    stop_rank_server = start_rank_server()
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser

    from mtcore.training.preemption import PREEMPTED_EXIT

    # torchrun's options; its script (required) names what `torchrun` would run instead
    agent_args = get_args_parser().parse_args([*plan.torchrun_arguments(), "-m", "mtcore.train"])
    rank_argv = ([config] if config else []) + list(overrides)
    # The agent logs a failed rank, a signal, each rank it stops; one line says it instead
    # (the rank's own, or the one below). Only the agent logs in this process.
    quiet = logging.root.manager.disable
    logging.disable(logging.ERROR)
    watch = RendezvousWatch(plan.endpoint, unreachable_s) if plan.multi_node else nullcontext()
    if plan.multi_node:
        import socket

        print(
            f"mtcore train: node {socket.gethostname()} joins the {plan.backend} rendezvous at "
            f"{plan.endpoint} (job {plan.run_id}, {plan.describe()} "
            f"--max-restarts {plan.max_restarts})",
            file=sys.stderr,
            flush=True,
        )
    try:
        with watch, bad_input, stopped:
            try:
                run_agent(agent_args, rank_argv)
            except SignalException:
                if bad_input.fired:  # the ranks said what was wrong; no restart repeats it
                    return 2
                note = stopped.read()
                if note is not None and not note.get("signalled_here"):
                    print(stopped.describe(note), file=sys.stderr)
                    return PREEMPTED_EXIT
                raise
    except ChildFailedError as e:
        return 2 if bad_input.fired else failed(e.failures)
    except (RendezvousError, DistNetworkError, DistStoreError) as e:
        if bad_input.fired:  # the ranks said what was wrong; the other node left with it
            return 2
        # The node hosting the rendezvous is gone or cut off: this node cannot go on, and
        # nothing is lost (the last commit stands); the job continues when it is back.
        where = plan.endpoint or "this host"
        lost = "lost" if getattr(watch, "reached", True) else "cannot reach"
        print(
            f"mtcore train: stopped: {lost} the rendezvous at {where} ({_network_cause(e)}); "
            "the last commit is intact, and the same command continues from it once that "
            "node is back",
            file=sys.stderr,
        )
        return PREEMPTED_EXIT
    except SignalException as e:  # Ctrl-C (or a kill) of the launcher: the ranks got it too
        if e.sigval == signal.SIGINT:
            print("mtcore train: interrupted", file=sys.stderr)
            return 128 + signal.SIGINT
        print(f"mtcore train: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + e.sigval
    finally:
        logging.disable(quiet)
        stop_rank_server()
    return 0


def _network_cause(error: BaseException) -> str:
    """What the socket said (``errno: 101 - Network is unreachable``) somewhere in the
    chain of ``error`` (torch's outer message only says to see the inner one), else the
    first line of the outermost message."""
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found = re.search(r"errno: \d+ - [^)]+", str(e))
        if found:
            return found.group(0)
        todo += [e.__cause__, e.__context__]
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def start_rank_server() -> Callable[[], None]:
    """Start the fork server the ranks come from (``mtcore.training.rank_server``), in the
    background, and return what ends it. Call it from the main thread (the server ends
    when the thread that started it does), once the environment the ranks need is set:
    a rank gets the server's environment, which is this process's now, and on top of it
    only the variables the agent sets for each rank (``RANK``, ``WORLD_SIZE``, ...). The
    ranks' output is unbuffered, as under ``python -u``.

    A process that already runs a fork server (a program that calls `mtcore train`'s
    ``main`` in its own process) keeps its own, and the ranks come from it; ours is
    ended once the job is (it ignores SIGTERM, which later users of the process's fork
    server must not inherit)."""
    import multiprocessing
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the process's one fork server (multiprocessing's)
    if getattr(server, "_forkserver_pid", None) is not None:
        return lambda: None
    preload = list(getattr(server, "_preload_modules", ["__main__"]))

    def stop() -> None:
        with suppress(AttributeError, OSError, TypeError):
            os.kill(server._forkserver_pid, signal.SIGKILL)  # its ranks have ended
            server._stop()  # reaps it and forgets it: the next user starts a new one
        multiprocessing.set_forkserver_preload(preload)

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    multiprocessing.set_forkserver_preload(["mtcore.training.rank_server"])
    forkserver.ensure_running()
    return stop


def run_agent(args, rank_argv: list[str]) -> None:
    """What ``torchrun`` does with ``args`` (``torch.distributed.run.run``), except that
    each rank is ``mtcore.training.rank.forked_rank(*rank_argv)`` forked from the rank server
    rather than a new ``python -m mtcore.train`` process."""
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    from mtcore.training.rank import forked_rank

    if args.standalone:  # as torchrun: a local c10d rendezvous on a free port
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    elastic_launch(config, entrypoint=forked_rank)(*rank_argv)


def failed(failures: dict) -> int:
    """The exit status for ranks that failed: 2 when they stopped on bad input (exit 2,
    its line printed by the rank; the others only stopped by the agent), 143 when a signal
    stopped them after a commit (rank 0 printed where), else 1 and a line."""
    from mtcore.training.preemption import PREEMPTED_EXIT

    codes = {rank: failure.exitcode for rank, failure in sorted(failures.items())}
    if 2 in codes.values() and all(code == 2 or code < 0 for code in codes.values()):
        return 2
    if PREEMPTED_EXIT in codes.values() and all(
        code == PREEMPTED_EXIT or code < 0 for code in codes.values()
    ):
        return PREEMPTED_EXIT  # rank 0 said where it saved
    failed_ranks = ", ".join(f"rank {rank} (exit {code})" for rank, code in codes.items())
    print(
        f"mtcore train: error: {failed_ranks} failed; the rank's message is above", file=sys.stderr
    )
    return 1
