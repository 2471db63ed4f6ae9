"""Convert between mtcore checkpoints and HuggingFace Llama directories.

  mtcore convert to-hf CHECKPOINT OUT_DIR [--dtype bf16|fp16|fp32]
      CHECKPOINT (a step directory, or a checkpoint root: its latest step) written
      by `mtcore train`, under any layout, becomes a directory that transformers'
      LlamaForCausalLM.from_pretrained loads: config.json, model.safetensors and,
      when the checkpoint has one, tokenizer.json (+ tokenizer_config.json).

  mtcore convert from-hf HF_DIR OUT_CHECKPOINT_ROOT [--seq-len N]
      A HuggingFace Llama directory (config.json + model.safetensors or its
      shards) becomes a weights-only mtcore checkpoint under OUT_CHECKPOINT_ROOT
      that training starts from under any layout (see docs/hf-interop.md).

Only llama-style models map (RMSNorm, SwiGLU, RoPE, no biases); anything else is
refused with an error that names the setting. transformers is not needed.
"""

from __future__ import annotations

import argparse
import sys

HELP = "convert checkpoints to and from HuggingFace Llama format (to-hf, from-hf)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    directions = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_hf = directions.add_parser("to-hf", help="mtcore checkpoint -> HuggingFace Llama directory")
    to_hf.add_argument("checkpoint", help="checkpoint directory (step_N, or the root: latest)")
    to_hf.add_argument("out_dir", help="directory to write (created if missing)")
    to_hf.add_argument(
        "--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="weights (default bf16)"
    )
    from_hf = directions.add_parser(
        "from-hf", help="HuggingFace Llama directory -> mtcore checkpoint"
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


def run(args: argparse.Namespace) -> int:
    from mtcore.training.checkpoint import CheckpointError

    try:
        out = _to_hf(args) if args.direction == "to-hf" else _from_hf(args)
    except (FileNotFoundError, CheckpointError, ValueError) as e:  # HFInteropError too
        print(f"mtcore convert {args.direction}: error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def _to_hf(args: argparse.Namespace):
    from mtcore.models.hf import DTYPES, export_llama
    from mtcore.training.checkpoint import read_model_weights, resolve_checkpoint

    config, weights, _step = read_model_weights(args.checkpoint)
    tokenizer = resolve_checkpoint(args.checkpoint) / "tokenizer.json"
    return export_llama(
        config,
        weights,
        args.out_dir,
        DTYPES[args.dtype],
        tokenizer_json=tokenizer if tokenizer.is_file() else None,
    )


def _from_hf(args: argparse.Namespace):
    from pathlib import Path

    from mtcore.models.hf import TOKENIZER, import_llama
    from mtcore.training.checkpoint import has_checkpoint, write_model_weights
    from mtcore.training.data import DataError, load_tokenizer

    if args.seq_len is not None and args.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {args.seq_len}")
    if has_checkpoint(args.out_root):
        # The import would become the root's latest: a resumed run there would silently
        # restart from these weights at step 0.
        raise ValueError(f"{args.out_root} already holds checkpoints; convert into a new directory")
    config, weights = import_llama(args.hf_dir, seq_len=args.seq_len)
    tokenizer = None
    path = Path(args.hf_dir) / TOKENIZER
    if path.is_file():
        try:
            tokenizer = load_tokenizer(path)
        except DataError as e:  # the weights are still worth converting
            print(f"mtcore convert from-hf: warning: tokenizer not carried: {e}", file=sys.stderr)
    directory = write_model_weights(args.out_root, weights, config, step=0, tokenizer=tokenizer)
    print(_training_hint(config, directory, tokenizer is not None), file=sys.stderr)
    return directory


def _training_hint(config, directory, has_tokenizer: bool) -> str:
    """The config sections that train from the new checkpoint: the trainer builds the
    model its config describes, so it must be this one."""
    import yaml

    keys = (
        "style", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
        "ffn_hidden_size", "seq_len", "norm_eps", "rope_theta", "tie_embeddings",
    )  # fmt: skip
    model = {k: v for k, v in config.model_dump(mode="json").items() if k in keys}
    directory = directory.resolve()
    sections = {"model": model, "checkpoint": {"load": str(directory)}}
    if has_tokenizer:
        sections["data"] = {"tokenizer": str(directory / "tokenizer.json")}
    text = yaml.safe_dump(sections, sort_keys=False).rstrip()
    return f"To train from it, use these settings in the training config:\n{text}"
