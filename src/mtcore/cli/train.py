"""Train a model: `mtcore train [CONFIG] [--nproc N] [--section.key VALUE ...]`.

CONFIG is a YAML or TOML file (none: the built-in defaults); each
`--section.key VALUE` (or `--section.key=VALUE`) overrides one setting, for
example `--parallel.tp 2 --training.steps 50`. Everything that can be checked
is checked here, before any rank starts: unknown keys, the layout against N
processes, the batch sizes, the data paths and the tokenizer's vocabulary.
The data is prepared once here (tokenizer, token index: cached), then N local
ranks start through torch.distributed.run (the elastic launcher behind
torchrun), each with OMP_NUM_THREADS=1 unless set. `--nproc 1` trains in this
process. On a cluster, run `torchrun ... -m mtcore.train CONFIG` on every node
(docs/training.md).
"""

from __future__ import annotations

import argparse
import os
import sys

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
    parser.add_argument("config", nargs="?", help="YAML or TOML config file (default: built-in)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N", help="local ranks (default 1)")
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
        if arg == "--nproc" or arg.startswith("--nproc="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in arg else 1
            if not value.isdigit() or int(value) < 1:
                parser.error(f"--nproc needs a positive number, got {value!r}")
            ns.nproc = int(value)
        elif arg.startswith("--"):
            ns.overrides.append(arg)
            if "=" not in arg and i + 1 < len(argv):
                ns.overrides.append(argv[i + 1])
                i += 1
        elif ns.config is None:
            ns.config = arg
        else:
            parser.error(f"unexpected argument {arg!r} (one CONFIG; overrides are --section.key VALUE)")
        i += 1
    return ns


def run(args: argparse.Namespace) -> int:
    from mtcore.backend import BackendError, select_backend
    from mtcore.training.checkpoint import CheckpointError
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config, read_file
    from mtcore.training.trainer import TrainingError, prepare, train

    try:
        config = load_config(args.config, args.overrides)
        if args.config and not read_file(args.config):  # an empty file: say what runs
            note = f"{args.config} holds no settings; training with the defaults"
            print(f"mtcore train: note: {note}", file=sys.stderr)
        select_backend(config.training.backend)
        prepare(config, args.nproc)
    except (ConfigError, BackendError) as e:
        print(f"mtcore train: error: {e}", file=sys.stderr)
        return 2
    if args.nproc == 1:
        try:
            train(config)
        except CheckpointError as e:  # the checkpoint to start from is unusable
            print(f"mtcore train: error: {e}", file=sys.stderr)
            return 2
        except TrainingError as e:
            print(f"mtcore train: error: {e}", file=sys.stderr)
            return 1
        return 0
    return launch(args.nproc, args.config, args.overrides)


def launch(nproc: int, config: str | None, overrides: list[str]) -> int:
    """Start ``nproc`` local ranks of ``python -m mtcore.train`` through the elastic launcher."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as elastic_run

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: ranks share the cores
    # The ranks' parent is this process (the elastic agent runs in it): each rank arms a
    # parent-death signal and checks this pid, so no rank outlives a killed launcher.
    os.environ["MTCORE_LAUNCHER_PID"] = str(os.getpid())
    argv = ["--standalone", f"--nproc-per-node={nproc}", "-m", "mtcore.train"]
    argv += ([config] if config else []) + list(overrides)
    try:
        elastic_run(get_args_parser().parse_args(argv))
    except ChildFailedError as e:
        failed = ", ".join(f"rank {r} (exit {f.exitcode})" for r, f in sorted(e.failures.items()))
        print(f"mtcore train: error: {failed} failed; the rank's message is above", file=sys.stderr)
        return 1
    return 0
