"""Convert between mtcore checkpoints and HuggingFace directories (Llama, Mistral,
Qwen2, Mixtral, BERT, T5, LLaVA: every family's ``hf`` adapter).

  mtcore convert to-hf CHECKPOINT OUT_DIR [--dtype bf16|fp16|fp32] [--force]
                       [--max-shard-size SIZE]
      CHECKPOINT (a step directory, or a checkpoint root: its latest step) written
      by `mtcore train`, under any layout, becomes a directory that transformers
      loads (LlamaForCausalLM for a gpt checkpoint, BertForPreTraining for a bert
      one): config.json, model.safetensors and, when the checkpoint has one,
      tokenizer.json (+ tokenizer_config.json). An OUT_DIR that already holds a
      model (config.json or safetensors) is refused unless --force, which replaces
      its model files (other files stay) once the new ones are written. Weights
      larger than --max-shard-size (default 5GB; gpt checkpoints) are written as
      shards with a model.safetensors.index.json.

  mtcore convert from-hf HF_DIR OUT_CHECKPOINT_ROOT [--seq-len N]
      A HuggingFace directory (config.json + model.safetensors or its shards)
      becomes a weights-only mtcore checkpoint under OUT_CHECKPOINT_ROOT that
      training starts from under any layout (see docs/hf-interop.md). config.json's
      model_type picks the family whose adapter imports it (llama, mistral, qwen2,
      mixtral: gpt; bert: bert).
      A NaN or inf weight is refused, naming the tensor.

  A LoRA checkpoint (finetune.lora) exports as the merged model, or with --adapter as
  a PEFT adapter; from-hf --adapter PEFT_DIR imports one (``mtcore.cli.convert_lora``).

  mtcore convert from-megatron / to-megatron: Megatron-LM checkpoints
      (``mtcore.cli.convert_megatron``).

What a family's adapter cannot map is refused with an error that names the
setting. transformers is not needed.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import sys
from pathlib import Path

from mtcore.cli import convert_lora, convert_megatron
from mtcore.cli.converted import check_finite, step_to_read, training_hint

DEFAULT_SHARD_SIZE = "5GB"  # the hub's Llama, Mistral and Qwen releases use 5 GB shards
HELP = (
    "convert checkpoints to and from HuggingFace (to-hf, from-hf) and Megatron-LM "
    "(from-megatron, to-megatron)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    directions = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_hf = directions.add_parser("to-hf", help="mtcore checkpoint -> HuggingFace directory")
    to_hf.add_argument("checkpoint", help="checkpoint directory (step_N, or the root: latest)")
    to_hf.add_argument("out_dir", help="directory to write (created if missing)")
    to_hf.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="weights (default bf16)"
    )
    to_hf.add_argument(
        "--force", action="store_true", help="replace the model files of an existing OUT_DIR"
    )
    to_hf.add_argument(
        "--max-shard-size",
        default=DEFAULT_SHARD_SIZE,
        metavar="SIZE",
        help="largest safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB); more weights "
        "are written as shards with an index",
    )
    to_hf.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA checkpoint: write its adapter in PEFT's format (adapter_config.json, "
        "adapter_model.safetensors) instead of the merged model",
    )
    from_hf = directions.add_parser(
        "from-hf", help="HuggingFace directory (Llama, BERT) -> mtcore checkpoint"
    )
    from_hf.add_argument("hf_dir", help="directory with config.json and model.safetensors")
    from_hf.add_argument("out_root", help="checkpoint root to write the checkpoint under")
    from_hf.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="N",
        help="model.seq_len of the checkpoint (default: max_position_embeddings)",
    )
    from_hf.add_argument(
        "--adapter",
        metavar="PEFT_DIR",
        default=None,
        help="also import this PEFT LoRA adapter of HF_DIR: the base goes to OUT_ROOT/base, "
        "the adapter to OUT_ROOT/lora (a LoRA checkpoint naming that base)",
    )
    convert_megatron.add_arguments(directions)


def run(args: argparse.Namespace) -> int:
    from mtcore.training.checkpoint import CheckpointError

    try:
        with _write_failure_as_os_error():
            out = DIRECTIONS[args.direction](args)
    except (FileNotFoundError, CheckpointError, ValueError) as e:  # HFInteropError too
        print(f"mtcore convert {args.direction}: error: {e}", file=sys.stderr)
        return 2  # bad input: nothing was written
    except OSError as e:  # writing failed (a full disk): what was written is removed
        asked = getattr(args, "out_dir", None) or getattr(args, "out_root", args.direction)
        print(
            f"mtcore convert {args.direction}: error: cannot write {asked}: {e.strerror or e}; "
            "nothing was written (it is as it was before the command)",
            file=sys.stderr,
        )
        return 1
    print(out)
    return 0


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TOKENIZER = "tokenizer.json"
# What an export writes, and what --force replaces: a stale shard or index left beside
# the new model.safetensors, or an old tokenizer beside a model without one, would be
# read with it.
MODEL_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*.json",
               "adapter_config.json")  # fmt: skip


def _adapter(family):
    if family.hf is None:
        raise ValueError(f"the {family.name} family has no HuggingFace adapter")
    return family.hf


def _to_hf(args: argparse.Namespace):
    import functools

    import torch

    from mtcore.models import family_of
    from mtcore.training.checkpoint import read_model_weights, resolve_checkpoint

    max_shard = parse_size(args.max_shard_size)
    out = Path(args.out_dir)
    _check_out_dir(out, args.force)
    # Read from one directory even if the root's latest moves; which step, said once done.
    directory, said = step_to_read("convert to-hf", args.checkpoint)
    args.checkpoint = str(directory)
    lora = convert_lora.is_lora_checkpoint(args.checkpoint)
    dtype = getattr(torch, DTYPES[args.dtype])
    if getattr(args, "adapter", False):
        if not lora:
            raise ValueError(
                f"--adapter: {args.checkpoint} is not a LoRA checkpoint (finetune.lora)"
            )
        export = functools.partial(convert_lora.export_adapter, args.checkpoint, dtype=dtype)
        written = _replace_model_files(out, export)
        print(said, file=sys.stderr)
        return written
    config, weights, _step = read_model_weights(args.checkpoint)  # LoRA: merged
    tokenizer = resolve_checkpoint(args.checkpoint) / TOKENIZER
    adapter = _adapter(family_of(config))
    shard_option = _shard_option(adapter, family_of(config).name, max_shard, args.max_shard_size)
    tokenizer_json = tokenizer if tokenizer.is_file() else None

    def export(staging: str) -> None:
        adapter.export_dir(
            config, weights, staging, dtype, tokenizer_json=tokenizer_json, **shard_option
        )

    written = _replace_model_files(out, export)
    print(said, file=sys.stderr)
    return written


def _replace_model_files(out: Path, write) -> Path:
    """``write(staging)`` into a directory beside ``out``, then its files replace ``out``'s
    model files: a refused or failed export leaves OUT_DIR as it was."""
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as staging:
        write(staging)
        out.mkdir(exist_ok=True)
        for old in _model_files(out):
            old.unlink()
        for new in Path(staging).iterdir():
            new.replace(out / new.name)
    return out


@contextlib.contextmanager
def _write_failure_as_os_error():
    """A write that failed is an OSError whatever reported it: safetensors and torch.save
    report a full disk as their own error types, DCP wraps the OSError of each rank."""
    try:
        yield
    except (OSError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        from torch.distributed.checkpoint.api import CheckpointException

        from mtcore.training.checkpoint.checkpointer import disk_full

        what = disk_full(e)
        if what is not None:
            raise OSError(errno.ENOSPC, what) from e
        if isinstance(e, CheckpointException):
            failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
            written = next((f for f in failures if isinstance(f, OSError)), None)
            if written is not None:
                raise written from e
        raise


def parse_size(text: str) -> int:
    """Bytes of a size such as ``5GB``, ``500MB``, ``2GiB`` or ``1000000``."""
    import re

    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(
            f"--max-shard-size {text!r} is not a number of bytes or a size like 5GB, 500MB, 2GiB"
        )
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    power = "BKMGT".index(unit[0])
    size = int(number * (1024 if "I" in unit else 1000) ** power)
    if size < 1:
        raise ValueError(f"--max-shard-size {text!r} must be at least one byte")
    return size


def _shard_option(adapter, family: str, max_shard: int, text: str) -> dict:
    """``{"max_shard_bytes": max_shard}`` for an adapter whose export takes a shard size
    (the GPT family's); any other exports at its default (5GB, or one file), so an
    explicit other size is refused rather than ignored."""
    import inspect

    if "max_shard_bytes" in inspect.signature(adapter.export_dir).parameters:
        return {"max_shard_bytes": max_shard}
    if text != DEFAULT_SHARD_SIZE:
        raise ValueError(f"the {family} family's export does not take --max-shard-size {text}")
    return {}


def _model_files(directory: Path) -> list[Path]:
    return sorted({p for pattern in MODEL_FILES for p in directory.glob(pattern) if p.is_file()})


def _check_out_dir(out: Path, force: bool) -> None:
    """Refuse an OUT_DIR that is a file, that cannot be written (a read-only mount, a path
    under a file), or that holds a model and ``force`` is off."""
    from mtcore.training.writable import check_writable

    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file, not a directory")
    check_writable("OUT_DIR", out)  # a ConfigError (a ValueError) names it
    found = [p.name for p in _model_files(out)] if out.is_dir() else []
    if found and not force:
        raise ValueError(
            f"{out} already holds a model ({', '.join(found[:3])}); pass --force to replace "
            "it, or choose a new directory"
        )


def _hf_family(hf_dir: str):
    """The family whose adapter imports the transformers ``model_type`` in ``hf_dir``."""
    import json

    from mtcore.models import family_names, get_family

    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a HuggingFace model directory")
    try:
        model_type = json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path} is not a JSON object: {e}") from None
    families = [get_family(name) for name in family_names()]
    for family in families:
        if family.hf is not None and model_type in family.hf.model_types:
            return family
    known = sorted(t for f in families if f.hf is not None for t in f.hf.model_types)
    raise ValueError(
        f"{path}: model_type {model_type!r} is not importable; mtcore imports {', '.join(known)}"
    )


def _from_hf(args: argparse.Namespace):
    from mtcore.cli.output_dirs import undone_on_failure
    from mtcore.data import DataError, load_tokenizer
    from mtcore.training.checkpoint import has_checkpoint, write_model_weights

    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {args.seq_len}")
    from mtcore.training.writable import check_writable

    check_writable("OUT_ROOT", args.out_root)  # before the model is read
    if has_checkpoint(args.out_root):
        # The import would become the root's latest: a resumed run there would silently
        # restart from these weights at step 0.
        raise ValueError(f"{args.out_root} already holds checkpoints; convert into a new directory")
    family = _hf_family(args.hf_dir)
    config, weights = _adapter(family).import_dir(args.hf_dir, seq_len=args.seq_len)
    check_finite(weights, args.hf_dir)
    tokenizer = None
    path = Path(args.hf_dir) / TOKENIZER
    if path.is_file():
        try:
            # Loaded as the family's training loads it (a BERT tokenizer.json has no
            # end-of-document token; its [SEP] is one when BERT's tokens are required).
            tokenizer = load_tokenizer(path, _adapter(family).tokenizer_tokens)
        except DataError as e:  # the weights are still worth converting
            print(f"mtcore convert from-hf: warning: tokenizer not carried: {e}", file=sys.stderr)
    with undone_on_failure(args.out_root):
        if getattr(args, "adapter", None) is not None:
            return convert_lora.import_with_adapter(args, config, weights, tokenizer, args.adapter)
        directory = write_model_weights(
            args.out_root, weights, config, step=0, tokenizer=tokenizer
        )
    print(training_hint(config, directory, tokenizer is not None), file=sys.stderr)
    return directory


DIRECTIONS = {
    "to-hf": _to_hf,
    "from-hf": _from_hf,
    "from-megatron": convert_megatron.from_megatron,
    "to-megatron": convert_megatron.to_megatron,
    "megatron-args": convert_megatron.megatron_args,
}
