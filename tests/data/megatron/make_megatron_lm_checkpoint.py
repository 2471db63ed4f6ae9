"""Write tests/data/megatron/llama_tp1/: a checkpoint saved by Megatron-LM's own
``save_checkpoint`` (tag core_v0.16.1, ``--ckpt-format torch_dist``), the logits
Megatron-Core's model gives for fixed tokens (``reference.pt``), and
``megatron_lm_flags.json``: every option of Megatron-LM's argument parser
(``add_megatron_arguments``) with its action, attribute (dest), type, nargs, choices and default, read off the
parser's own actions, which tests parse ``to-megatron``'s printed flags against.

Megatron-LM's training package is not on the package registry (megatron-core's wheel
holds ``megatron.core`` only), so this is run by hand, once, against its source tag;
the test suite reads what it wrote and never imports Megatron-LM::

    git clone --branch core_v0.16.1 --depth 1 https://github.com/NVIDIA/Megatron-LM /tmp/mlm
    pip install --target /tmp/mlm-deps six     # Megatron-LM's tokenizer module imports it
    rm -rf /tmp/mlm/megatron/core              # the installed megatron-core 0.16.1 serves it
    PYTHONPATH=/tmp/mlm:/tmp/mlm-deps:tests/distributed \\
        .venv/bin/python tests/data/megatron/make_megatron_lm_checkpoint.py

The arguments go through Megatron-LM's ``parse_args`` and ``validate_args`` and
``set_global_variables`` (as ``initialize_megatron`` does), the model is the one
``pretrain_gpt.py``'s provider builds for ``--transformer-impl local``, and the save
is ``megatron.training.checkpointing.save_checkpoint``: its ``common.pt`` holds the
whole argument Namespace, ``exit_signal=signal.SIGTERM`` and Megatron's enums included.
``--norm-epsilon 1e-6`` is not the default (Megatron-LM 0.16 saves it as
``layernorm_epsilon``). One process (tp1 pp1, gloo). The CPU shims are ``megatron_side.megatron_on_cpu``'s, and
``torch.cuda.get_rng_state`` answers the CPU generator's state (the saved rng entry
holds it where a GPU run holds the device's); none changes the saved weights or
arguments. There is no optimizer (``--no-save-optim``): mtcore imports weights only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

OUT = Path(__file__).resolve().parent / "llama_tp1"
ITERATION = 3
FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64",
    "--seq-length", "16", "--max-position-embeddings", "16",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--position-embedding-type", "rope",
    "--rotary-base", "10000", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--init-method-std", "0.05", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
    "--make-vocab-size-divisible-by", "128", "--micro-batch-size", "1",
    "--global-batch-size", "1", "--train-iters", "10", "--lr", "1e-4",
    "--transformer-impl", "local", "--use-cpu-initialization", "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
    "--save-interval", "3", "--ckpt-format", "torch_dist", "--no-save-optim",
    "--save", "PLACEHOLDER",
]  # fmt: skip


def _plain(value):
    """A default as JSON: numbers, strings, booleans, None and lists as they are, else repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, str)) for v in value):
        return list(value)
    return repr(value)


def parser_record() -> dict[str, dict]:
    """Megatron-LM's options: ``{"--rotary-base": {"action": "store", "type": "int", ...}}``."""
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    record = {}
    for action in parser._actions:
        kind = type(action).__name__.removeprefix("_").removesuffix("Action").lower()
        entry = {
            "action": kind,
            "dest": action.dest,
            "type": getattr(action.type, "__name__", None),
            "nargs": action.nargs,
            "choices": None if action.choices is None else [str(c) for c in action.choices],
            "default": _plain(action.default),
        }
        for option in action.option_strings:
            record[option] = entry
    return record


def main() -> None:
    from megatron_side import forward_logits, megatron_on_cpu

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    megatron_on_cpu()
    torch.cuda.is_available = lambda: False
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()  # the rng entry

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        validate_args,
    )
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import set_global_variables

    shutil.rmtree(OUT, ignore_errors=True)
    save = OUT / "checkpoint"
    sys.argv = ["pretrain_gpt.py", *FLAGS[:-1], str(save)]
    args = parse_args()
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=True)
    parallel_state.initialize_model_parallel(1, 1)
    config = core_transformer_config_from_args(args)
    torch.manual_seed(1234)
    model = GPTModel(
        config, get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )  # fmt: skip
    with torch.no_grad():  # norms not all ones: a norm mapped wrongly shows in the logits
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn(param.shape))
    model.eval()
    tokens = torch.randint(0, 127, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = forward_logits(model, tokens)
    save_checkpoint(ITERATION, [model], None, None, 0)
    torch.save({"tokens": tokens, "logits": logits}, OUT / "reference.pt")
    flags = parser_record()
    (OUT / "megatron_lm_flags.json").write_text(json.dumps(flags, indent=0, sort_keys=True))
    print(f"wrote {OUT}: padded vocab {args.padded_vocab_size}, exit_signal {args.exit_signal!r}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
