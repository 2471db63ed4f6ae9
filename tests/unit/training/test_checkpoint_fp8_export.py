"""A checkpoint of an FP8 run exports to HuggingFace Llama and loads in one process.

An FP8 run's checkpoint also holds the linears' amax histories (``model.<...>`` buffers,
needed for an exact resume). They are training state, not weights: ``mtcore convert
to-hf`` and ``load_model`` (``mtcore generate``) must leave them out rather than refuse
them as unexpected tensors.
"""

from __future__ import annotations

import io

import pytest

from mtcore.cli.convert import DEFAULT_SHARD_SIZE, _to_hf
from mtcore.training.checkpoint import load_model
from mtcore.training.overrides import validate
from mtcore.training.trainer import train


def test_fp8_checkpoint_exports_to_hf(tiny, tmp_path):
    pytest.importorskip("safetensors")
    config = tiny(
        precision={"dtype": "bf16", "fp8": "hybrid"},
        training={"steps": 1, "eval_interval": 0, "sample_prompt": None},
        logging={"tensorboard_dir": None},
    )
    trained = train(validate(config), stream=io.StringIO())

    class Args:
        checkpoint, out_dir, dtype = str(trained.checkpoint), str(tmp_path / "hf"), "fp32"
        force = False
        max_shard_size = DEFAULT_SHARD_SIZE

    out = _to_hf(Args)
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    model, step, _ = load_model(trained.checkpoint)
    assert step == 1 and not model.training
