"""``mtcore convert from-megatron / to-megatron``: Megatron-LM checkpoints (see
docs/migrating-from-megatron.md).

  mtcore convert from-megatron MEGATRON_DIR OUT_CHECKPOINT_ROOT
      A Megatron-LM / Megatron-Core GPT checkpoint (a root with
      latest_checkpointed_iteration.txt, or one iter_N directory), torch_dist or legacy
      mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt at any tp x pp (x ep), becomes a
      weights-only mtcore checkpoint that trains under any layout. The model comes from
      the arguments Megatron-LM saved with it.

  mtcore convert to-megatron CHECKPOINT OUT_DIR [--tp N] [--pp N] [--ep N] [--format F]
      An mtcore GPT checkpoint becomes a legacy Megatron checkpoint at tp x pp (x ep) under
      OUT_DIR, or (--format torch_dist) a torch_dist one that loads at any layout; the
      Megatron-LM arguments that build the model that loads it are printed.

  mtcore convert megatron-args SCRIPT_OR_ARGS
      A Megatron-LM launch script (or its pretrain_gpt.py arguments, quoted) becomes
      the equivalent mtcore training config, printed as YAML; each argument that maps
      to nothing is named on stderr, with why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(directions) -> None:
    source = directions.add_parser(
        "from-megatron", help="Megatron-LM checkpoint (torch_dist or legacy) -> mtcore checkpoint"
    )
    source.add_argument("megatron_dir", help="checkpoint root or iter_N directory")
    source.add_argument("out_root", help="checkpoint root to write the checkpoint under")
    target = directions.add_parser(
        "to-megatron", help="mtcore GPT checkpoint -> legacy Megatron checkpoint at --tp x --pp"
    )
    target.add_argument("checkpoint", help="checkpoint directory (step_N, or the root: latest)")
    target.add_argument("out_dir", help="Megatron checkpoint root to write (new or empty)")
    target.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    target.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    target.add_argument("--ep", type=int, default=1, help="expert-parallel size (default 1)")
    target.add_argument(
        "--format", choices=("legacy", "torch_dist"), default="legacy",
        help="legacy per-rank files (default), or torch_dist (Megatron-LM's default "
        "--ckpt-format; whole tensors, loadable at any tp x pp)",
    )  # fmt: skip
    script = directions.add_parser(
        "megatron-args", help="Megatron-LM launch script or arguments -> mtcore config (YAML)"
    )
    script.add_argument("source", help="a shell script, or the arguments in one quoted string")


def megatron_args(args: argparse.Namespace) -> str:
    import yaml

    from mtcore.training.config import TrainConfig
    from mtcore.training.megatron_args import parse_flags, read_launch_args, train_config_sections

    flags_found = parse_flags(read_launch_args(args.source))
    if not flags_found:
        raise ValueError(f"no --flags found in {args.source!r}")
    sections, notes = train_config_sections(flags_found)
    TrainConfig.model_validate(sections)  # what `mtcore train` will read back
    for note in notes:
        print(f"mtcore convert megatron-args: not mapped: {note}", file=sys.stderr)
    return yaml.safe_dump(sections, sort_keys=False).rstrip()


def from_megatron(args: argparse.Namespace) -> Path:
    from mtcore.cli.converted import check_finite, training_hint
    from mtcore.cli.output_dirs import undone_on_failure
    from mtcore.training.checkpoint import has_checkpoint, write_model_weights
    from mtcore.training.checkpoint.megatron import read_megatron
    from mtcore.training.writable import check_writable

    check_writable("OUT_ROOT", args.out_root)
    if has_checkpoint(args.out_root):
        raise ValueError(f"{args.out_root} already holds checkpoints; convert into a new directory")
    config, weights, iteration = read_megatron(args.megatron_dir)
    check_finite(weights, args.megatron_dir)
    with undone_on_failure(args.out_root):
        directory = write_model_weights(args.out_root, weights, config, step=iteration)
    print(training_hint(config, directory, has_tokenizer=False), file=sys.stderr)
    return directory


def to_megatron(args: argparse.Namespace) -> Path:
    from mtcore.cli.output_dirs import staged
    from mtcore.models import get_family
    from mtcore.parallel.layout import LayoutSpec
    from mtcore.training.checkpoint import read_model_weights
    from mtcore.training.checkpoint.megatron import (
        FAMILY,
        LATEST,
        write_megatron_legacy,
        write_megatron_torch_dist,
    )
    from mtcore.training.writable import check_writable

    for name in ("tp", "pp", "ep"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; choose a new one")
    check_writable("OUT_DIR", out)
    from mtcore.cli.converted import step_to_read

    source, said = step_to_read("convert to-megatron", args.checkpoint)
    config, weights, step = read_model_weights(source)
    if config.family != FAMILY:
        raise ValueError(
            f"{args.checkpoint} holds a {config.family} model; Megatron export is for gpt"
        )
    # What Megatron-Core splits over tp (heads, key/value heads, vocabulary, feed-forward)
    # must divide: refused before anything is written, naming the number.
    layout = dict(tp=args.tp, pp=args.pp, ep=args.ep)
    try:
        config.check_layout(LayoutSpec(**layout))
    except ValueError as e:
        given = " ".join(f"--{k} {v}" for k, v in layout.items() if v > 1)
        raise ValueError(f"{given or 'this layout'}: {e}") from None
    with staged(out) as staging:
        if args.format == "torch_dist":
            written = write_megatron_torch_dist(config, weights, staging, step)
        else:
            written = write_megatron_legacy(
                config, weights, staging, args.tp, args.pp, step, args.ep
            )
    directory = out / written.name
    how = f"--load {out} --ckpt-format {'torch_dist' if args.format == 'torch_dist' else 'torch'}"
    how += " --no-load-optim --no-load-rng"
    megatron_args = get_family(FAMILY).megatron.args_for(config, args.tp, args.pp)
    if args.ep > 1:
        megatron_args["expert_model_parallel_size"] = args.ep
    print(said, file=sys.stderr)
    print(
        f"Megatron-LM loads {out} ({LATEST}: {step}) with {how} and --use-checkpoint-args "
        f"(it does not carry --norm-epsilon), or with these model arguments:\n"
        f"{' '.join(flags(megatron_args))}",
        file=sys.stderr,
    )
    return directory


# Megatron-LM's switches whose flag says the opposite of the attribute (store_false).
_NEGATED = {"add_bias_linear": "--disable-bias-linear"}
# Derived by Megatron-LM, or its saved name of a flag printed under another name.
_NOT_FLAGS = {"padded_vocab_size", "layernorm_epsilon"}


def flags(megatron_args: dict) -> list[str]:
    """Megatron-LM command-line flags of attribute-named arguments."""
    out = []
    for name, value in megatron_args.items():
        if name in _NOT_FLAGS or value is None:
            continue
        if name in _NEGATED:
            out += [] if value else [_NEGATED[name]]
        elif isinstance(value, bool):
            out += [f"--{name.replace('_', '-')}"] if value else []
        else:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out
