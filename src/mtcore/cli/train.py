"""Train a model: `mtcore train [CONFIG] [--nproc N] [--max-restarts N] [--section.key VALUE ...]`.

CONFIG is a YAML or TOML file (an empty one trains the built-in defaults); each
`--section.key VALUE` (or `--section.key=VALUE`) overrides one setting, for
example `--parallel.tp 2 --training.steps 50`. Everything that can be checked
is checked here, before any rank starts: unknown keys, the layout against the
number of ranks (at every node count `--nnodes MIN:MAX` allows), the batch
sizes, the data paths and the tokenizer's vocabulary. The data is prepared once
here (tokenizer, token index: cached), then N local ranks start through
torch.distributed.run (the elastic launcher behind torchrun), each with
OMP_NUM_THREADS=1 unless set. `--nproc 1` trains in this process.
`--max-restarts N` has the agent restart all ranks, up to N times, when one
dies; they resume from checkpoint.dir's latest commit. On a cluster, run the
same `mtcore train ... --nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID` on
every node (or `torchrun ... -m mtcore.train CONFIG`; docs/training.md).
"""

from __future__ import annotations

import argparse
import re
import sys
import warnings

from mtcore.cli.launch import DEFAULT_PORT, ENVIRONMENT, LaunchError, read_launch

HELP = "train a model (any family: gpt, bert, ...) from a YAML/TOML config on local ranks"
EPILOG = """\
overrides:
  --section.key VALUE    set one config value, e.g. --parallel.tp 2 --precision.dtype fp32
                         (sections: model parallel precision data optimizer training
                         checkpoint logging; values are YAML: 2, true, null, [a, b])
profiling (docs/training.md, "Profiling"):
  --profile [FROM:TO]              trace steps FROM-TO (default 2:3) on every rank:
                                   logging.profile; then mtcore trace merge runs/<run_name>
checkpoints (docs/checkpoints.md):
  --checkpoint.resume true         continue from checkpoint.dir's latest save (restarts)
  --checkpoint.load PATH           start from a checkpoint saved under any layout
  --checkpoint.finetune true       with load: the weights only (fresh optimizer, step 0)
  --checkpoint.overwrite true      start afresh over another run's checkpoints in dir
                                   (refused otherwise; the same config's unfinished run
                                   is continued without any flag)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", help="YAML or TOML config file, e.g. configs/default.yaml"
    )
    parser.add_argument(
        "--nproc",
        metavar="N",
        help="ranks on this node (default 1; auto: one per accelerator, else per CPU core; "
        "PET_NPROC_PER_NODE)",
    )
    parser.add_argument(
        "--max-restarts",
        metavar="N",
        help="restart all ranks up to N times when one dies; they resume from "
        "checkpoint.dir's latest commit (default 0; PET_MAX_RESTARTS)",
    )
    parser.add_argument(
        "--nnodes",
        metavar="N|MIN:MAX",
        help="nodes in the job (default 1); MIN:MAX: elastic, the job goes on with fewer "
        "nodes (dp shrinks) when one is lost (PET_NNODES)",
    )
    parser.add_argument(
        "--rdzv-endpoint",
        metavar="HOST[:PORT]",
        help=f"the c10d rendezvous every node's agent joins (port {DEFAULT_PORT} by default; "
        "PET_RDZV_ENDPOINT)",
    )
    parser.add_argument(
        "--rdzv-id", metavar="ID", help="the job's id, the same on every node (PET_RDZV_ID)"
    )
    parser.add_argument(
        "--rdzv-backend",
        metavar="NAME",
        help="the rendezvous: c10d (default; hosted by the endpoint's node), etcd, etcd-v2 or "
        "static (PET_RDZV_BACKEND)",
    )
    parser.add_argument(
        "--rdzv-conf",
        metavar="KEY=VALUE,...",
        help="rendezvous settings, e.g. last_call_timeout=10,join_timeout=600 (PET_RDZV_CONF)",
    )
    parser.epilog = EPILOG + "\n" + (parser.epilog or "")
    # Overrides are free-form (--any.config.key VALUE), which argparse cannot declare;
    # this subcommand reads its own arguments (argparse still prints its --help).
    parser.parse_known_args = lambda args=None, namespace=None: (_parse(parser, args), [])


def _parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    argv = list(sys.argv[2:] if argv is None else argv)
    ns, _ = argparse.ArgumentParser.parse_known_args(parser, [])  # the defaults (and run=)
    ns.overrides, flags = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            parser.print_help()
            parser.exit()
        name = arg.partition("=")[0]
        if name == "--profile":  # the shorthand of logging.profile.steps
            value = arg.partition("=")[2] if "=" in arg else None
            if value is None and i + 1 < len(argv) and re.fullmatch(r"\d+(:\d+)?", argv[i + 1]):
                value, i = argv[i + 1], i + 1
            ns.overrides += ["--logging.profile.steps", _profile_steps(parser, value)]
        elif name in ENVIRONMENT:
            if "=" not in arg and i + 1 >= len(argv):
                parser.error(f"{name} needs a value")
            flags[name] = arg.partition("=")[2] if "=" in arg else argv[i + 1]
            i += 0 if "=" in arg else 1
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
    try:
        ns.launch = read_launch(flags)
    except LaunchError as e:
        parser.error(str(e))
    return ns


def _profile_steps(parser: argparse.ArgumentParser, value: str | None) -> str:
    """``--profile`` (steps 2-3: the first pays one-time costs), ``--profile N`` or
    ``--profile FROM:TO`` as the value of ``logging.profile.steps``."""
    if value is None:
        return "[2, 3]"
    if not re.fullmatch(r"\d+(:\d+)?", value):
        parser.error(f"--profile {value!r}: give steps as N or FROM:TO (e.g. --profile 10:12)")
    first, _, last = value.partition(":")
    return f"[{first}, {last or first}]"


def run(args: argparse.Namespace) -> int:
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config, read_file

    if args.config is None:
        # The built-in defaults are a long job (1000 steps, bf16); the README's is a file.
        print(
            "mtcore train: error: no CONFIG given: pass one, e.g. `mtcore train "
            "configs/default.yaml --nproc 4` (the README's job; an empty .yaml file trains "
            "the built-in defaults)",
            file=sys.stderr,
        )
        return 2
    try:  # a config the trainer would refuse is refused before torch is imported
        config = load_config(args.config, args.overrides)
        plan = args.launch
        if plan.max_restarts and config.checkpoint.dir is None:
            raise ConfigError("--max-restarts needs a checkpoint.dir to resume from")
        check_layouts(config, plan)  # before torch, the backend and the data: a second
    except ConfigError as e:
        print(f"mtcore train: error: {e}", file=sys.stderr)
        return 2
    if not plan.in_process:  # the elastic agent runs here: its C++ logs stay out
        from mtcore.cli.launch import quiet_agent_logs

        quiet_agent_logs()
    from mtcore.backend import BackendError, PluginWarning, select_backend
    from mtcore.data.progress import report_to
    from mtcore.plan.memory_fit import check_memory
    from mtcore.training.backend_check import local_device_index
    from mtcore.training.trainer import prepare

    try:
        if args.config and not read_file(args.config):  # an empty file: say what runs
            note = f"{args.config} holds no settings; training with the defaults"
            print(f"mtcore train: note: {note}", file=sys.stderr)
        with warnings.catch_warnings():  # the trainer's first lines say it, once
            warnings.simplefilter("ignore", PluginWarning)
            backend = select_backend(config.training.backend)
        if backend.device.type != "cpu":  # before the data: no device, no job
            local_device_index(backend, 0)
        report_to(sys.stderr)  # a first run tokenizes the corpus: show how far it is
        try:
            prep = prepare(config, max(plan.world_sizes()))
        finally:
            report_to(None)
        check_node_counts(config, prep.model, plan)
        resumes = check_start(config, plan)
        check_checkpoint_model(config, prep.model, resumes)
        # The fewest nodes an elastic job may run on hold the most per rank.
        sized = config.model_copy(update={"model": prep.model})
        check_memory(sized, min(plan.world_sizes()), plan.nproc, backend)
    except (ConfigError, BackendError) as e:
        print(f"mtcore train: error: {e}", file=sys.stderr)
        return 2
    if plan.in_process:  # restarts and other nodes need the elastic agent
        from mtcore.training.rank import run_rank

        return run_rank(lambda: config)  # the same exit statuses and messages as a rank's
    from mtcore.cli.launch import launch

    # A node cut off from the rest stops once its ranks would have (their collectives
    # time out): its agent alone would wait on a dead connection for TCP's own limit.
    return launch(plan, args.config, args.overrides, config.training.collective_timeout_s)


def check_layouts(config, plan) -> None:
    """ConfigError unless the config's layout divides every world size ``plan`` allows,
    checked on the config alone (no torch): a wrong ``--nproc`` is said in a second, not
    after the data is prepared. ``check_node_counts`` checks again with the data's model."""
    from mtcore.parallel.layout import LayoutError
    from mtcore.parallel.pipeline import SplitError
    from mtcore.training.config import ConfigError

    largest = max(plan.world_sizes())
    for world in plan.world_sizes():
        try:
            config.check(world)
        except (ConfigError, LayoutError, SplitError, ValueError) as e:
            if world == largest:
                raise ConfigError(str(e)) from None
            nodes = world // plan.nproc
            fixed = " (leave parallel.dp unset so dp can shrink)" if config.parallel.dp else ""
            raise ConfigError(
                f"{plan.describe()}: the job cannot run on {nodes} node(s), {world} ranks{fixed}: {e}"
            ) from None


def check_node_counts(config, model, plan) -> None:
    """ConfigError unless the job can run at every world size ``plan`` allows (an elastic
    job that loses a node continues with fewer ranks: dp shrinks, tp/pp/cp stay)."""
    from mtcore.parallel.layout import LayoutError
    from mtcore.parallel.pipeline import SplitError
    from mtcore.training.config import ConfigError

    for world in plan.world_sizes()[:-1]:  # the largest was prepared already
        try:
            spec, _ = config.check(world)
            model.check_layout(spec)
        except (ConfigError, LayoutError, SplitError, ValueError) as e:
            nodes = world // plan.nproc
            fixed = " (leave parallel.dp unset so dp can shrink)" if config.parallel.dp else ""
            raise ConfigError(
                f"{plan.describe()}: the job cannot run on {nodes} node(s), {world} ranks{fixed}: {e}"
            ) from None


def check_start(config, plan) -> bool:
    """ConfigError when the run would start afresh over another run's checkpoints in its
    checkpoint.dir (``lineage.decide``, which every rank applies again): said here, before
    any rank starts. True when it resumes checkpoint.dir's latest commit."""
    from mtcore.training.checkpoint import CheckpointError
    from mtcore.training.checkpoint.lineage import decide, fingerprint, latest_commit
    from mtcore.training.config import ConfigError

    if config.checkpoint.dir is None:
        return False
    try:
        latest = latest_commit(config.checkpoint.dir)
        return decide(config, latest, plan.run_id, fingerprint(config)).resume
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def check_checkpoint_model(config, model, resumes: bool | None = None) -> None:
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
    if resumes is None:
        resumes = ck.resume
    if resumes and ck.dir is not None and has_checkpoint(ck.dir):
        path = ck.dir  # resume wins over load (TrainerCheckpoints.restore)
    if path is None:
        return
    try:
        directory = resolve_checkpoint(path)
        check_model_matches(read_manifest(directory).get("model_config"), model, directory)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
