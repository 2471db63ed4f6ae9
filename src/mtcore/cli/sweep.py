"""Measure layouts on this machine beside the plan: `mtcore sweep CONFIG --layouts A B ...`.

Each layout (`tp=2,pp=2`, as in `mtcore plan --compare`) trains for `--steps` steps
with `mtcore train` on `--nproc` local ranks; the measured step time and peak memory
(the maximum over ranks) print next to `mtcore plan`'s prediction for `--hardware`
(default cpu-host), with their ratios, and the two efficiency constants the
prediction used. The measured memory is the largest rank's peak of tensor bytes held
by torch's allocator (recorded by torch's profiler in every rank, mtcore.plan.sweep),
what the plan's per-rank peak predicts; not the process's resident set, which holds
the framework's own ~350 MB (docs/plan.md, "Calibrating with `mtcore sweep`").

The same numbers are drawn in `--output`/layouts.png and .svg (with matplotlib,
`mtcore[plot]`). `--trace` also traces each layout's last step (mtcore's named phases)
and writes `--output`/LAYOUT/measured.json.gz (the ranks' traces merged, as `mtcore
trace merge` does) and planned.json.gz (as `mtcore plan --trace` writes it), and prints
per category (compute, exposed comm, bubble, optimizer, data, other) measured / planned.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DEFAULT_OUTPUT = "runs/sweep"
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
    parser.add_argument(
        "--trace",
        action="store_true",
        help="trace each layout's last step; write its measured and planned traces and "
        "print where the step went, measured / planned",
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        default=DEFAULT_OUTPUT,
        help=f"where the picture (layouts.png, .svg) and the traces go (default {DEFAULT_OUTPUT})",
    )
    parser.epilog = "overrides: --section.key VALUE, as in mtcore train\n" + (parser.epilog or "")
    parser.parse_known_args = lambda args=None, namespace=None: (_parse(parser, args), [])


def _parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    argv = list(sys.argv[2:] if argv is None else argv)
    ns, _ = argparse.ArgumentParser.parse_known_args(parser, [])
    ns.overrides, ns.layouts, ns.trace = [], [], False
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
        elif arg == "--trace":
            ns.trace = True
        elif name in ("--nproc", "--steps", "--hardware", "--output"):
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
    from mtcore.plan.plot import MISSING, LayoutBars, write_picture
    from mtcore.plan.sweep import as_trained, measure, options_here, shared_host
    from mtcore.plan.trace import category_ms, format_categories, planned_trace, save
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config
    from mtcore.training.trace_merge import load as load_trace

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
    failed, bars, categories = 0, [], []
    for layout, predicted in zip(args.layouts, predictions, strict=True):
        folder = Path(args.output) / _folder_name(layout)
        trace_to = str(folder / "measured.json.gz") if args.trace else None
        m = measure(args.config, layout, args.nproc, args.steps, args.overrides, trace_to)
        t, mem = predicted.time.total, predicted.peak_memory
        if m.error:
            failed += 1
            bars.append(LayoutBars(layout, t, mem, note="failed"))
            print(f"{layout:24s} failed: {m.error}")
            continue
        bars.append(LayoutBars(layout, t, mem, m.step_s, m.peak_bytes))
        print(
            f"{layout:24s} {m.step_s:9.3f} {t:9.3f} {m.step_s / t:6.2f} "
            f"{m.peak_bytes / 1e6:9.1f} {mem / 1e6:9.1f} {m.peak_bytes / mem:6.2f}",
            flush=True,
        )
        if args.trace:
            planned = planned_trace(predicted)
            save(planned, folder / "planned.json.gz")
            categories.append((layout, category_ms(load_trace(m.trace)), category_ms(planned)))
    print(
        f"constants: GEMM_EFFICIENCY {constants.GEMM_EFFICIENCY}, LINK_EFFICIENCY "
        f"{constants.LINK_EFFICIENCY} (fitted on {', '.join(constants.FIT_ROWS)}); "
        f"hardware {hardware.name} ({hardware.path})"
    )
    if categories:
        print(
            f"traces: {args.output}/LAYOUT/measured.json.gz and planned.json.gz (the last "
            "step; open in https://ui.perfetto.dev)\nms per step, the mean over ranks, "
            "measured / planned:"
        )
        print(format_categories(categories))
    title = (
        f"{args.config or 'built-in config'}: {args.nproc} ranks here, measured beside "
        f"planned for {hardware.name}"
    )
    written = write_picture(Path(args.output) / "layouts.png", bars, title)
    print(f"picture: {', '.join(map(str, written))}" if written else MISSING)
    return 1 if failed else 0


def _folder_name(layout: str) -> str:
    """A layout as one folder's name: tp=2,pp=2 stays, anything but [A-Za-z0-9=,.+_-] is _."""
    return re.sub(r"[^A-Za-z0-9=,.+_-]", "_", layout) or "_"


def _check_data(config) -> None:
    """ConfigError for a data path or tokenizer that is not there: said before any layout
    trains, not as each layout's failed run."""
    from mtcore.training.config import ConfigError

    data = config.data
    for path in data.paths or []:
        given = Path(str(path)).expanduser()
        if not (given.exists() or given.with_name(given.name + ".idx").is_file()):  # or a prefix
            raise ConfigError(f"data path does not exist: {given}")
    if data.tokenizer is not None and not Path(data.tokenizer).expanduser().is_file():
        raise ConfigError(f"data.tokenizer does not exist: {data.tokenizer}")
