"""Train a model: `mtcore train [CONFIG] [--nproc N] [--max-restarts N] [--section.key VALUE ...]`.

CONFIG is a YAML or TOML file (an empty one trains the built-in defaults); each
`--section.key VALUE` (or `--section.key=VALUE`) overrides one setting, for
example `--parallel.tp 2 --training.steps 50`. Everything that can be checked
is checked here, before any rank starts: unknown keys, the layout against N
processes, the batch sizes, the data paths and the tokenizer's vocabulary.
The data is prepared once here (tokenizer, token index: cached), then N local
ranks start through torch.distributed.run (the elastic launcher behind
torchrun), each with OMP_NUM_THREADS=1 unless set. `--nproc 1` trains in this
process. `--max-restarts N` has the agent restart all ranks, up to N times, when
one dies; they resume from checkpoint.dir's latest commit. On a cluster, run
`torchrun ... -m mtcore.train CONFIG` on every node (docs/training.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import warnings

HELP = "train a model (any family: gpt, bert, ...) from a YAML/TOML config on local ranks"
EPILOG = """\
overrides:
  --section.key VALUE    set one config value, e.g. --parallel.tp 2 --precision.dtype fp32
                         (sections: model parallel precision data optimizer training
                         checkpoint logging; values are YAML: 2, true, null, [a, b])
checkpoints (docs/checkpoints.md):
  --checkpoint.resume true         continue from checkpoint.dir's latest save (restarts)
  --checkpoint.load PATH           start from a checkpoint saved under any layout
  --checkpoint.finetune true       with load: the weights only (fresh optimizer, step 0)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", help="YAML or TOML config file, e.g. configs/default.yaml"
    )
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="local ranks (default 1)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart all ranks up to N times when one dies; they resume from "
        "checkpoint.dir's latest commit (default 0)",
    )
    parser.epilog = EPILOG + "\n" + (parser.epilog or "")
    # Overrides are free-form (--any.config.key VALUE), which argparse cannot declare;
    # this subcommand reads its own arguments (argparse still prints its --help).
    parser.parse_known_args = lambda args=None, namespace=None: (_parse(parser, args), [])


def _parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    argv = list(sys.argv[2:] if argv is None else argv)
    ns, _ = argparse.ArgumentParser.parse_known_args(parser, [])  # the defaults (and run=)
    ns.overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            parser.print_help()
            parser.exit()
        name = arg.partition("=")[0]
        if name in ("--nproc", "--max-restarts"):
            value = (
                arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            )
            i += 0 if "=" in arg else 1
            least = 1 if name == "--nproc" else 0
            if not value.isdigit() or int(value) < least:
                kind = "a positive" if least else "a non-negative"
                parser.error(f"{name} needs {kind} number, got {value!r}")
            setattr(ns, name[2:].replace("-", "_"), int(value))
        elif arg.startswith("--"):
            ns.overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                ns.overrides.append(argv[i + 1])
                i += 1
        elif ns.config is None:
            ns.config = arg
        else:
            parser.error(
                f"unexpected argument {arg!r} (one CONFIG; overrides are --section.key VALUE)"
            )
        i += 1
    return ns


def run(args: argparse.Namespace) -> int:
    from mtcore.backend import BackendError, PluginWarning, select_backend
    from mtcore.data.progress import report_to
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config, read_file
    from mtcore.training.trainer import prepare

    if args.config is None:
        # The built-in defaults are a long job (1000 steps, bf16); the README's is a file.
        print(
            "mtcore train: error: no CONFIG given: pass one, e.g. `mtcore train "
            "configs/default.yaml --nproc 4` (the README's job; an empty .yaml file trains "
            "the built-in defaults)",
            file=sys.stderr,
        )
        return 2
    try:
        config = load_config(args.config, args.overrides)
        if args.max_restarts and config.checkpoint.dir is None:
            raise ConfigError("--max-restarts needs a checkpoint.dir to resume from")
        if args.config and not read_file(args.config):  # an empty file: say what runs
            note = f"{args.config} holds no settings; training with the defaults"
            print(f"mtcore train: note: {note}", file=sys.stderr)
        with warnings.catch_warnings():  # the trainer's first lines say it, once
            warnings.simplefilter("ignore", PluginWarning)
            select_backend(config.training.backend)
        report_to(sys.stderr)  # a first run tokenizes the corpus: show how far it is
        try:
            prep = prepare(config, args.nproc)
        finally:
            report_to(None)
        check_checkpoint_model(config, prep.model)
    except (ConfigError, BackendError) as e:
        print(f"mtcore train: error: {e}", file=sys.stderr)
        return 2
    if args.nproc == 1 and not args.max_restarts:  # restarts need the elastic agent
        from mtcore.train import run_rank

        return run_rank(lambda: config)  # the same exit statuses and messages as a rank's
    return launch(args.nproc, args.config, args.overrides, args.max_restarts)


def check_checkpoint_model(config, model) -> None:
    """ConfigError when the checkpoint the job will load holds another architecture:
    said here, in one line, instead of by every rank once they have started."""
    from mtcore.training.checkpoint import CheckpointError
    from mtcore.training.checkpoint.compat import check_model_matches
    from mtcore.training.checkpoint.manifest import (
        has_checkpoint,
        read_manifest,
        resolve_checkpoint,
    )
    from mtcore.training.config import ConfigError

    ck = config.checkpoint
    path = ck.load
    if ck.resume and ck.dir is not None and has_checkpoint(ck.dir):
        path = ck.dir  # resume wins over load (TrainerCheckpoints.restore)
    if path is None:
        return
    try:
        directory = resolve_checkpoint(path)
        check_model_matches(read_manifest(directory).get("model_config"), model, directory)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def launch(nproc: int, config: str | None, overrides: list[str], max_restarts: int = 0) -> int:
    """Start ``nproc`` local ranks of ``python -m mtcore.train`` through the elastic launcher;
    when one dies, it restarts all of them up to ``max_restarts`` times (they resume)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: ranks share the cores
    # The ranks' parent is this process (the elastic agent runs in it): each rank arms a
    # parent-death signal and checks this pid, so no rank outlives a killed launcher.
    os.environ["MTCORE_LAUNCHER_PID"] = str(os.getpid())
    argv = ["--standalone", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    argv += ["-m", "mtcore.train"]
    if max_restarts:
        # The agent's shared store outlives a restart, and restarted gloo ranks would read
        # the dead ranks' addresses from it: a fresh store for every round instead.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv += ([config] if config else []) + list(overrides)
    # The agent logs a failed rank, a signal, each rank it stops; one line says it instead
    # (the rank's own, or the one below). Only the agent logs in this process.
    quiet = logging.root.manager.disable
    logging.disable(logging.ERROR)
    try:
        elastic_run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        return _failed(e.failures)
    except SignalException as e:  # Ctrl-C (or a kill) of the launcher: the ranks got it too
        if e.sigval == signal.SIGINT:
            print("mtcore train: interrupted", file=sys.stderr)
            return 128 + signal.SIGINT
        print(f"mtcore train: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + e.sigval
    finally:
        logging.disable(quiet)
    return 0


def _failed(failures: dict) -> int:
    """The exit status for ranks that failed: 2 when they stopped on bad input (exit 2,
    its line printed by the rank; the others only stopped by the agent), else 1 and a line."""
    codes = {rank: failure.exitcode for rank, failure in sorted(failures.items())}
    if 2 in codes.values() and all(code == 2 or code < 0 for code in codes.values()):
        return 2
    failed = ", ".join(f"rank {rank} (exit {code})" for rank, code in codes.items())
    print(f"mtcore train: error: {failed} failed; the rank's message is above", file=sys.stderr)
    return 1
