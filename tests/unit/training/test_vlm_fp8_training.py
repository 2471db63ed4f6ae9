"""The trainer trains LLaVA with ``precision.fp8`` (its language model's block linears in
FP8, tests/unit/models/test_vlm_fp8.py), as it trains a GPT."""

from __future__ import annotations

import io
import math

from mtcore.training.overrides import validate
from mtcore.training.trainer import train

LLAVA = dict(
    family="llava", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32,
    vision=dict(image_size=16, patch_size=8, hidden_size=32, num_layers=1, num_heads=2),
    images=dict(embedded_train=32, embedded_valid=8),
)  # fmt: skip


def test_the_trainer_trains_llava_in_fp8(tiny):
    config = tiny(
        precision={"dtype": "bf16", "fp8": "hybrid", "fp8_recipe": "delayed"},
        optimizer={"lr": 3e-3, "warmup_steps": 1},
        training={"steps": 6, "eval_interval": 0, "sample_prompt": None},
        checkpoint={"dir": None},
    )  # fmt: skip
    config["model"] = LLAVA
    config["data"] = {"cache_dir": config["data"]["cache_dir"]}
    stream = io.StringIO()
    result = train(validate(config), stream=stream)
    assert all(math.isfinite(x) for x in result.losses) and result.losses[-1] < result.losses[0]
    assert "fp8 (hybrid): delayed scaling" in stream.getvalue()
