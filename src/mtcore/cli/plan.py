"""Predict memory and step time of a training layout: `mtcore plan CONFIG --gpus N --hardware NAME`.

CONFIG and `--section.key VALUE` overrides are read exactly as `mtcore train` reads
them, and the layout is checked by the same validators: a layout the trainer would
reject is rejected here with the same message. It prints per-rank memory (weights,
gradients, master weights, optimizer state under ZeRO-1 or not, the activations the
pipeline schedule keeps in flight, MoE experts) against the accelerator's memory, and
the predicted step time by cause (compute, recompute, exposed tp/cp/ep communication,
pipeline bubble, dp reduction as mtcore overlaps it), tokens/s, TFLOP/s per
accelerator and MFU. `--search` lists the fastest layouts that fit and pass the
checks; `--compare A B ...` prints layouts (`tp=2,pp=2,mb=2,sp,zero1`) or config
files side by side. `--backend NAME|auto` builds that backend (as `mtcore doctor
--backend` does) and takes what its capability table knows (the device name, its
memory, the dtypes it computes in and any peak figures) over the `--hardware`
description, which gives the rest. The software a layout is assumed to run on is
set by `--zero 0-3`, `--flash-attention on|off`, `--comm-overlap tp,pp`,
`--grad-reduce-dtype`, `--dp-overlap`, `--cross-node`, what the stack keeps for backward
(`--recompute-modules`, `--moe-dispatch`, `--moe-probs`), `--rank-order`, FSDP's
switches (`--fsdp-reshard`, `--fsdp-reduce`, `--fsdp-prefetch`), `--fp8-experts` and
`--moe-node-limit` (and per column in `--compare`:
`zero=3,flash=off,overlap=tp+pp,grad_dtype=bf16,reshard=off`); every report says what
it assumed. The model and its two fitted constants: docs/plan.md.
"""

from __future__ import annotations

import argparse
import json
import sys

HELP = "predict per-rank memory and step time of a layout; search or compare layouts"
_VALUED = (
    "--gpus",
    "--trace",
    "--plot",
    "--hardware",
    "--backend",
    "--top",
    "--dp-overlap",
    "--zero",
    "--flash-attention",
    "--comm-overlap",
    "--grad-reduce-dtype",
    "--recompute-modules",
    "--moe-dispatch",
    "--moe-probs",
    "--rank-order",
    "--fsdp-reshard",
    "--fsdp-reduce",
    "--fsdp-prefetch",
    "--moe-node-limit",
)
DEFAULT_HARDWARE = "H100-SXM"
DEFAULT_PLOT = "runs/plan/compare.png"
_FLAGS = ("--json", "--search", "--cross-node", "--fp8-experts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from mtcore.plan.hardware import describe_names

    parser.add_argument(
        "config", nargs="?", help="YAML or TOML training config (default: built-in)"
    )
    parser.add_argument("--gpus", metavar="N", required=True, help="accelerators in the job")
    parser.add_argument(
        "--hardware",
        metavar="NAME|FILE",
        default=None,
        help=f"a shipped description, by name or alias in any case: {describe_names()}; "
        f"or a .toml file (default {DEFAULT_HARDWARE}; required with --backend)",
    )
    parser.add_argument(
        "--backend",
        metavar="NAME|auto",
        default=None,
        help="fill device name, memory and peaks from this backend's capability table "
        "(auto: the one mtcore train selects); --hardware gives the rest",
    )
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="also write the planned step as a Chrome trace (.json or .json.gz), in the "
        "format and categories of logging.profile's, and print its summary per stage",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE|none",
        default=DEFAULT_PLOT,
        help="--compare: the picture of step time and memory per layout, a PNG and the SVG "
        f"beside it (default {DEFAULT_PLOT}; none: no picture; needs matplotlib, mtcore[plot])",
    )
    parser.add_argument("--search", action="store_true", help="list the fastest layouts that fit")
    parser.add_argument("--top", metavar="K", default="5", help="--search: how many (default 5)")
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="LAYOUT",
        help="layouts (tp=2,pp=2,mb=2,sp,zero1,recompute=full) or config files",
    )
    parser.add_argument(
        "--dp-overlap",
        default="mtcore",
        choices=("mtcore", "none", "full"),
        help="how the dp reduction meets backward (default: as mtcore does it)",
    )
    parser.add_argument(
        "--zero",
        metavar="0-3",
        default=None,
        help="ZeRO stage (default: parallel.zero); 3 is FSDP's FULL_SHARD",
    )
    parser.add_argument(
        "--flash-attention",
        metavar="on|off",
        default=None,
        help="a fused (flash) attention kernel (default: the hardware file's)",
    )
    parser.add_argument(
        "--comm-overlap",
        metavar="AXES",
        default="none",
        help="axes whose communication overlaps compute: tp,pp,cp,ep or none (default)",
    )
    parser.add_argument(
        "--grad-reduce-dtype",
        metavar="DTYPE",
        default="fp32",
        help="gradient buffers and their reduction: fp32 (mtcore, default), bf16, fp16",
    )
    parser.add_argument(
        "--recompute-modules",
        metavar="NAMES",
        default="none",
        help="sub-modules rebuilt in backward, Megatron-Core's names: core_attn, layernorm, "
        "mla_up_proj, moe_act (comma-separated; default none)",
    )
    parser.add_argument(
        "--moe-dispatch",
        metavar="compute|fp8",
        default="compute",
        help="dtype the experts' input is dispatched and kept in (default: the compute dtype)",
    )
    parser.add_argument(
        "--moe-probs",
        metavar="combine|expert",
        default="combine",
        help="where router probabilities weigh the experts' output: combine (mtcore, "
        "default: the output is kept) or expert (at the activation, as Megatron-Core)",
    )
    parser.add_argument(
        "--rank-order",
        metavar="ORDER",
        default="tp-cp-dp-pp",
        help="how ranks are numbered, fastest first: tp-cp-dp-pp (mtcore, default) or "
        "tp-cp-pp-dp (Llama 3's: each pipeline in a pod, dp across them)",
    )
    parser.add_argument(
        "--fsdp-reshard",
        metavar="on|off",
        default="on",
        help="ZeRO-3: reshard the parameters after forward (default on: FULL_SHARD)",
    )
    parser.add_argument(
        "--fsdp-reduce",
        metavar="microbatch|step",
        default="microbatch",
        help="ZeRO-3: reduce-scatter the gradients every micro-batch (default) or once a step",
    )
    parser.add_argument(
        "--fsdp-prefetch",
        metavar="N",
        default="1",
        help="ZeRO-3: units gathered ahead of the one in use (default 1; 0: none)",
    )
    parser.add_argument(
        "--moe-node-limit",
        metavar="M",
        default=None,
        help="each token's experts on at most M nodes, sent once per node (DeepSeek-V3: 4)",
    )
    parser.add_argument(
        "--fp8-experts",
        action="store_true",
        help="under precision.fp8, run the experts' products in FP8 too (DeepSeek-V3's recipe)",
    )
    parser.add_argument(
        "--cross-node",
        action="store_true",
        help="let tp (and ep x tp) groups span nodes, priced on the network",
    )
    parser.epilog = "overrides: --section.key VALUE, as in mtcore train\n" + (parser.epilog or "")
    parser.parse_known_args = lambda args=None, namespace=None: (_parse(parser, args), [])


def _parse(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Known options, then free-form overrides (argparse cannot declare --any.key)."""
    argv = list(sys.argv[2:] if argv is None else argv)
    ns, _ = argparse.ArgumentParser.parse_known_args(parser, ["--gpus", "0"])
    ns.gpus, ns.overrides, ns.compare = None, [], None
    ns.cross_node = ns.fp8_experts = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if arg in ("-h", "--help"):
            parser.print_help()
            parser.exit()
        if name in _VALUED:
            if eq:
                value = inline
            elif i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            else:
                parser.error(f"{name} needs a value")
            setattr(ns, name[2:].replace("-", "_"), value)
        elif arg in _FLAGS:
            setattr(ns, arg[2:].replace("-", "_"), True)
        elif arg == "--compare":
            ns.compare = []
            while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                ns.compare.append(argv[i + 1])
                i += 1
            if not ns.compare:
                parser.error("--compare needs one or more layouts or config files")
        elif arg.startswith("--"):
            ns.overrides.append(arg)
            if not eq and i + 1 < len(argv):
                ns.overrides.append(argv[i + 1])
                i += 1
        elif ns.config is None:
            ns.config = arg
        else:
            parser.error(
                f"unexpected argument {arg!r} (one CONFIG; overrides are --section.key VALUE)"
            )
        i += 1
    for name in ("gpus", "top"):
        value = getattr(ns, name)
        if value is None:
            parser.error(f"--{name} N is required")
        if not (str(value).isascii() and str(value).isdigit()) or int(value) < 1:
            parser.exit(
                2, f"mtcore plan: error: --{name} needs a whole number >= 1, got {value!r}\n"
            )
        setattr(ns, name, int(value))
    return ns


def options_from(args: argparse.Namespace):
    """The planner ``Options`` the command line asks for (``OptionsError`` or
    ``LayoutStringError`` naming a bad value)."""
    from mtcore.plan import Options
    from mtcore.plan.layouts import option_value
    from mtcore.plan.options import DP_OVERLAP, GRAD_DTYPES, OptionsError

    for flag, value, choices in (
        ("--dp-overlap", args.dp_overlap, DP_OVERLAP),
        ("--grad-reduce-dtype", args.grad_reduce_dtype, GRAD_DTYPES),
    ):
        if value not in choices:  # named by the flag, not by the planner's field
            raise OptionsError(f"{flag} needs one of {', '.join(choices)}, got {value!r}")
    fields = {"dp_overlap": args.dp_overlap, "cross_node": args.cross_node}
    fields["fp8_experts"] = args.fp8_experts
    fields["grad_reduce_dtype"] = args.grad_reduce_dtype
    fields["overlapped"] = option_value("overlap", args.comm_overlap)
    if args.zero is not None:
        fields["zero"] = option_value("zero", args.zero)
    if args.flash_attention is not None:
        fields["fused_attention"] = option_value("flash", args.flash_attention)
    fields["recompute_modules"] = option_value("recompute_modules", args.recompute_modules)
    fields["moe_dispatch"] = option_value("moe_dispatch", args.moe_dispatch)
    fields["moe_probs"] = option_value("moe_probs", args.moe_probs)
    fields["rank_order"] = option_value("order", args.rank_order)
    fields["fsdp_reshard"] = option_value("reshard", args.fsdp_reshard)
    fields["fsdp_reduce"] = option_value("reduce", args.fsdp_reduce)
    fields["fsdp_prefetch"] = option_value("prefetch", args.fsdp_prefetch)
    if args.moe_node_limit is not None:
        fields["moe_node_limit"] = option_value("node_limit", args.moe_node_limit)
    return Options(**fields)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from mtcore.plan import HardwareError, NotModelled, plan
    from mtcore.plan.layouts import LayoutStringError, parse_layout
    from mtcore.plan.options import OptionsError
    from mtcore.plan.render import describe, side_by_side, size
    from mtcore.plan.search import search
    from mtcore.training.config import ConfigError
    from mtcore.training.overrides import load_config

    try:
        options = options_from(args)
        hardware, fill = _hardware(args.hardware, args.backend)
        if fill is not None:  # on stderr under --json: stdout stays one JSON document
            print(fill.summary(), file=sys.stderr if args.json else sys.stdout)
        if args.compare:
            names, plans = [], []
            for item in args.compare:
                is_file = item.endswith((".yaml", ".yml", ".toml"))
                path = item if is_file else args.config
                extra, updates = ([], {}) if is_file else parse_layout(item)
                config = load_config(path, [*args.overrides, *extra])
                names.append(item)
                column = replace(options, **updates)
                try:
                    plans.append(plan(config, args.gpus, hardware, column))
                except NotModelled:
                    raise
                except ValueError as e:  # the trainer's refusal, in its words
                    plans.append(str(e))
            if args.json:
                out = [p.to_dict() if not isinstance(p, str) else {"rejected": p} for p in plans]
                print(json.dumps(dict(zip(names, out, strict=True)), indent=2))
            else:
                print(side_by_side(names, plans))
            if args.plot != "none":
                _write_picture(args, names, plans, hardware)
            return 0
        config = load_config(args.config, args.overrides)
        if args.search:
            ranked, fitting = search(config, args.gpus, hardware, options, top=args.top)
            if args.json:
                print(json.dumps([{**r.plan.to_dict(), "why": r.why} for r in ranked], indent=2))
                return 0 if ranked else 1
            if not ranked:
                print(
                    f"mtcore plan: no layout of {args.gpus} x {hardware.name} passes the checks "
                    "and fits memory",
                    file=sys.stderr,
                )
                return 1
            print(
                f"{fitting} layouts fit and pass the trainer's checks; the fastest {len(ranked)}:"
            )
            for i, r in enumerate(ranked, 1):
                p = r.plan
                print(
                    f"{i}. {_short(p)}  {p.tokens_per_s:,.0f} tokens/s, MFU {p.mfu:.1%}, "
                    f"peak {size(p.peak_memory).strip()}\n   why: {r.why}"
                )
            return 0
        result = plan(config, args.gpus, hardware, options)
    except (ConfigError, HardwareError, NotModelled, LayoutStringError, OptionsError) as e:
        print(f"mtcore plan: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # LayoutError / SplitError: the message `mtcore train` prints
        print(f"mtcore plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        out = result.to_dict()
        if fill is not None:
            out["hardware_from_backend"] = fill.to_dict()
        print(json.dumps(out, indent=2))
    else:
        print(describe(result))
    if args.trace:
        _write_trace(result, args.trace, quiet=args.json)
    return 0


def _write_trace(result, path: str, quiet: bool) -> None:
    """The planned step as a trace at ``path``, and (unless ``quiet``: stdout is JSON)
    the summary ``mtcore trace merge`` prints, per pipeline stage."""
    from mtcore.plan.trace import planned_trace, save
    from mtcore.training.trace_merge import format_summary, summarize

    trace = planned_trace(result)
    save(trace, path)
    if not quiet:
        stages = range(result.layout["pp"])
        print(f"planned trace: {path} (one row per pipeline stage; ms per step, share of the step)")
        print(format_summary([summarize(trace, pid=stage) for stage in stages], row="stage"))


def _write_picture(args: argparse.Namespace, names: list[str], plans: list, hardware) -> None:
    """--compare's picture at ``args.plot`` (and its .svg); the line that says where goes
    to stderr under --json, where stdout is one JSON document."""
    from mtcore.plan.plot import MISSING, LayoutBars, write_picture

    bars = [
        LayoutBars(name, None, None, note="rejected") if isinstance(p, str)
        else LayoutBars(name, p.time.total, p.peak_memory)
        for name, p in zip(names, plans, strict=True)
    ]  # fmt: skip
    png = args.plot if args.plot.endswith(".png") else f"{args.plot}.png"
    title = f"{args.config or 'built-in config'}: planned on {args.gpus} x {hardware.name}"
    written = write_picture(png, bars, title)
    line = f"picture: {', '.join(map(str, written))}" if written else MISSING
    print(line, file=sys.stderr if args.json else sys.stdout)


def _hardware(name: str | None, backend: str | None):
    """(the hardware description, the ``BackendFill`` or None): ``name`` loaded, with
    what ``backend`` knows filled in when one is named."""
    from mtcore.plan import HardwareError, load_hardware
    from mtcore.plan.hardware import NOT_FROM_BACKEND, describe_names, fill_from_backend

    if backend is None:
        return load_hardware(name or DEFAULT_HARDWARE), None
    if name is None:
        raise HardwareError(
            f"--backend {backend} gives the device name, memory and peaks, but no backend "
            f"knows {', '.join(NOT_FROM_BACKEND)}: name a description for them with "
            f"--hardware NAME|FILE (shipped: {describe_names()})"
        )
    hardware, built = load_hardware(name), _build_backend(backend)
    try:
        return fill_from_backend(hardware, built)
    except Exception as e:  # the plugin's capability table raised
        raise HardwareError(
            f"--backend {backend}: its capabilities could not be read: {e!r}"
        ) from e


def _build_backend(name: str):
    """The backend ``name`` (``auto``: the automatic choice), built as doctor builds it;
    a failure is a ``HardwareError`` naming it."""
    from mtcore.backend import BackendError, select_backend
    from mtcore.plan import HardwareError

    try:
        return select_backend(None if name == "auto" else name)
    except BackendError as e:
        raise HardwareError(f"--backend {name}: {e}") from e
    except Exception as e:  # a plugin raised while building: say which backend
        raise HardwareError(f"--backend {name}: the backend failed to build: {e!r}") from e


def _short(p) -> str:
    from mtcore.plan.render import _layout_line

    return _layout_line(p)
