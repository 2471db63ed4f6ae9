"""Megatron-LM's own ``load_checkpoint`` reads what ``mtcore convert to-megatron`` wrote
(run by hand, like make_megatron_lm_checkpoint.py, whose docstring sets up the paths)::

    mtcore convert from-megatron tests/data/megatron/llama_tp1/checkpoint /tmp/ck
    mtcore convert to-megatron /tmp/ck /tmp/export        # legacy files, tp1
    mtcore convert to-megatron /tmp/ck /tmp/export_dist --format torch_dist
    PYTHONPATH=/tmp/mlm:/tmp/mlm-deps:tests/distributed \\
        .venv/bin/python tests/data/megatron/check_megatron_lm_loads_export.py /tmp/export
    PYTHONPATH=... .venv/bin/python tests/data/megatron/check_megatron_lm_loads_export.py \\
        /tmp/export_dist torch_dist

Megatron-LM core_v0.16.1 parses only the launch settings and ``--load EXPORT
--use-checkpoint-args --ckpt-format torch|torch_dist``: the model's arguments come from the
export's saved Namespace (``load_args_from_checkpoint``); ``--norm-epsilon``, which that
function does not carry, is passed as ``to-megatron`` prints it. The model built from
them loads the export (``load_checkpoint``, strict) and must give the logits in
``llama_tp1/reference.pt`` that Megatron-Core gave before Megatron-LM saved the original.
CPU shims: ``megatron_side.megatron_on_cpu``'s, and ``read_metadata`` reads the tracker
file without its all-reduce over a "cuda" tensor.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REFERENCE = Path(__file__).resolve().parent / "llama_tp1" / "reference.pt"
LAUNCH = ["--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "10",
          "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
          "--transformer-impl", "local", "--use-cpu-initialization",
          "--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
          "--no-rope-fusion", "--no-gradient-accumulation-fusion", "--norm-epsilon", "1e-6",
          "--use-checkpoint-args", "--no-load-optim", "--no-load-rng",
          "--attention-dropout", "0", "--hidden-dropout", "0"]  # fmt: skip


def main(export: str, ckpt_format: str) -> None:
    from megatron_side import forward_logits, megatron_on_cpu

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    megatron_on_cpu()
    torch.cuda.is_available = lambda: False

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import checkpointing
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        validate_args,
    )
    from megatron.training.checkpointing import load_args_from_checkpoint, load_checkpoint

    # read_metadata all-reduces the tracker file's iteration through a tensor it puts on
    # "cuda": read the file alone (one rank has nothing to agree with).
    checkpointing.read_metadata = lambda path: (int(Path(path).read_text().strip()), False)
    from megatron.training.global_vars import set_global_variables

    sys.argv = ["pretrain_gpt.py", *LAUNCH, "--ckpt-format", ckpt_format, "--load", export]
    args = parse_args()
    load_args_from_checkpoint(args)
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=True)
    parallel_state.initialize_model_parallel(1, 1)
    model = GPTModel(
        core_transformer_config_from_args(args),
        get_gpt_layer_local_spec(normalization=args.normalization),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )  # fmt: skip
    iteration, _ = load_checkpoint([model], None, None, strict=True)
    reference = torch.load(REFERENCE, weights_only=True)
    logits = forward_logits(model.eval(), reference["tokens"])
    difference = (logits - reference["logits"]).abs().max().item()
    print(f"Megatron-LM loaded {export} (iteration {iteration}): max |dlogit| {difference:.2e}")
    assert difference < 1e-5, difference
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "torch")
