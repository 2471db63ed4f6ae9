"""Measure layouts on this machine beside the plan: `mtcore sweep CONFIG --layouts A B ...`.

Each layout (`tp=2,pp=2`, as in `mtcore plan --compare`) trains for `--steps` steps
with `mtcore train` on `--nproc` local ranks; the measured step time and peak memory
(the maximum over ranks) print next to `mtcore plan`'s prediction for `--hardware`
(default cpu-host), with their ratios, and the two efficiency constants the
prediction used. The measured memory is the largest rank's peak of tensor bytes held
by torch's allocator (recorded by torch's profiler in every rank, mtcore.plan.sweep),
what the plan's per-rank peak predicts; not the process's resident set, which holds
the framework's own ~350 MB (docs/plan.md, "Calibrating with `mtcore sweep`").
"""

from __future__ import annotations

import argparse
import re
import sys

HELP = "train layouts for a few steps here and print measured vs predicted step time and memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", help="YAML or TOML training config (default: built-in)"
    )
    parser.add_argument("--layouts", nargs="+", metavar="LAYOUT", help="e.g. tp=2 pp=2 tp=2,pp=2")
    parser.add_argument("--nproc", metavar="N", default="4", help="local ranks (default 4)")
    parser.add_argument("--steps", metavar="S", default="4", help="steps per layout (default 4)")
    parser.add_argument(
        "--hardware",
        default="cpu-host",
        help="description to predict for: a name or alias as mtcore plan --help lists them, "
        "or a .toml file (default cpu-host)",
    )
    parser.epilog = "overrides: --section.key VALUE, as in mtcore train\n" + (parser.epilog or "")
    parser.parse_known_args = lambda args=None, namespace=None: (_parse(parser, args), [])


def _parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    argv = list(sys.argv[2:] if argv is None else argv)
    ns, _ = argparse.ArgumentParser.parse_known_args(parser, [])
    ns.overrides, ns.layouts = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if arg in ("-h", "--help"):
            parser.print_help()
            parser.exit()
        if arg == "--layouts":
            while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                ns.layouts.append(argv[i + 1])
                i += 1
        elif name in ("--nproc", "--steps", "--hardware"):
            if not eq:
                if i + 1 >= len(argv):
                    parser.error(f"{name} needs a value")
                inline, i = argv[i + 1], i + 1
            setattr(ns, name[2:], inline)
        elif arg.startswith("--"):
            ns.overrides.append(arg)
            if not eq and i + 1 < len(argv):
                ns.overrides.append(argv[i + 1])
                i += 1
        elif ns.config is None:
            ns.config = arg
        else:
            parser.error(f"unexpected argument {arg!r}")
        i += 1
    if not ns.layouts:
        parser.error("--layouts needs one or more layouts (e.g. tp=2 pp=2)")
    for name in ("nproc", "steps"):
        value = getattr(ns, name)
        if not re.fullmatch(r"[0-9]+", str(value)) or int(value) < 1:  # not "²": isdigit's
            parser.error(f"--{name} needs a positive number, got {value!r}")
        setattr(ns, name, int(value))
    return ns


def run(args: argparse.Namespace) -> int:
    from mtcore.backend import BackendError
    from mtcore.plan import HardwareError, NotModelled, constants, load_hardware, plan
    from mtcore.plan.layouts import LayoutStringError, layout_overrides
    from mtcore.plan.sweep import as_trained, measure, options_here, shared_host
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config

    bad_input = (ConfigError, BackendError, HardwareError, NotModelled, LayoutStringError)
    try:
        hardware, shared = shared_host(load_hardware(args.hardware), args.nproc)
        predictions = []
        for layout in args.layouts:  # every layout is checked before any is trained
            config = load_config(args.config, [*args.overrides, *layout_overrides(layout)])
            _check_data(config)
            config = as_trained(config, args.nproc)
            predictions.append(plan(config, args.nproc, hardware, options_here(config)))
    except (*bad_input, ValueError) as e:
        print(f"mtcore sweep: error: {e}", file=sys.stderr)
        return 2
    if shared:
        print(shared)
    print(
        f"{'layout':24s} {'step s':>9s} {'planned':>9s} {'ratio':>6s} "
        f"{'peak MB':>9s} {'planned':>9s} {'ratio':>6s}",
        flush=True,
    )
    failed = 0
    for layout, predicted in zip(args.layouts, predictions, strict=True):
        m = measure(args.config, layout, args.nproc, args.steps, args.overrides)
        if m.error:
            failed += 1
            print(f"{layout:24s} failed: {m.error}")
            continue
        t, mem = predicted.time.total, predicted.peak_memory
        print(
            f"{layout:24s} {m.step_s:9.3f} {t:9.3f} {m.step_s / t:6.2f} "
            f"{m.peak_bytes / 1e6:9.1f} {mem / 1e6:9.1f} {m.peak_bytes / mem:6.2f}",
            flush=True,
        )
    print(
        f"constants: GEMM_EFFICIENCY {constants.GEMM_EFFICIENCY}, LINK_EFFICIENCY "
        f"{constants.LINK_EFFICIENCY} (fitted on {', '.join(constants.FIT_ROWS)}); "
        f"hardware {hardware.name} ({hardware.path})"
    )
    return 1 if failed else 0


def _check_data(config) -> None:
    """ConfigError for a data path or tokenizer that is not there: said before any layout
    trains, not as each layout's failed run."""
    from pathlib import Path

    from mtcore.training.config import ConfigError

    data = config.data
    for path in data.paths or []:
        given = Path(str(path)).expanduser()
        if not (given.exists() or given.with_name(given.name + ".idx").is_file()):  # or a prefix
            raise ConfigError(f"data path does not exist: {given}")
    if data.tokenizer is not None and not Path(data.tokenizer).expanduser().is_file():
        raise ConfigError(f"data.tokenizer does not exist: {data.tokenizer}")
