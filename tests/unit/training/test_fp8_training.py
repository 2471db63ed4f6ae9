"""FP8 training through the trainer: a tiny GPT on the default corpus (a 300 kB slice of
the standard library's source, as configs/default.yaml trains on) ends within 2% of
the bf16 run's loss with each recipe; FP8 config errors stop the job before it starts.

The loss compared is the mean training loss of the last 10 of 50 steps (every run
sees the same batches); the final validation loss is printed alongside it.
"""

from __future__ import annotations

import io
import types
from pathlib import Path

import pytest

from mtcore.backend import select_backend
from mtcore.backend.device import Availability
from mtcore.backend.fp8 import FP8
from mtcore.training.config import ConfigError
from mtcore.training.overrides import load_config, validate
from mtcore.training.trainer import train

STEPS, TAIL, TOLERANCE = 50, 10, 0.02
DEFAULT_YAML = Path(__file__).parents[3] / "configs" / "default.yaml"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    cache = tmp_path_factory.mktemp("fp8-data")

    def config(**precision) -> dict:
        return {
            "model": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=64),
            "precision": {"dtype": "bf16", **precision},
            "data": dict(vocab_size=512, default_corpus_bytes=300_000, cache_dir=str(cache)),
            "optimizer": dict(lr=5e-3, min_lr=5e-4, warmup_steps=5),
            "training": dict(steps=STEPS, global_batch_size=8, micro_batch_size=4,
                             eval_interval=0, eval_batches=2, sample_prompt=None),
            "checkpoint": {"dir": None},
            "logging": {"tensorboard_dir": None, "progress": "lines"},
        }  # fmt: skip

    return config


def _run(config: dict) -> tuple[float, float]:
    result = train(validate(config), stream=io.StringIO())
    assert not result.skipped_steps, result.skipped_steps
    return sum(result.losses[-TAIL:]) / TAIL, result.val_losses[-1][1]


@pytest.fixture(scope="module")
def bf16_loss(job):
    return _run(job())


@pytest.mark.parametrize(
    "fmt,recipe",
    [
        pytest.param("hybrid", "delayed", marks=pytest.mark.extended),
        pytest.param("hybrid", "current", marks=pytest.mark.slow),
        pytest.param("hybrid", "blockwise", marks=pytest.mark.slow),
    ],
)
def test_fp8_run_ends_within_two_percent_of_bf16(job, bf16_loss, fmt, recipe):
    loss, val = _run(job(fp8=fmt, fp8_recipe=recipe))
    ref, ref_val = bf16_loss
    print(f"bf16 {ref:.4f} (val {ref_val:.4f}) | fp8 {fmt} {recipe} {loss:.4f} (val {val:.4f})")
    assert loss < 6.0  # learned: the first step's loss is ln(512) = 6.24
    assert abs(loss - ref) <= TOLERANCE * ref, (loss, ref)


def test_fp8_from_the_command_line_and_its_errors():
    config = load_config(
        DEFAULT_YAML, ["--precision.fp8", "hybrid", "--precision.fp8_recipe", "delayed"]
    )
    recipe = config.precision.mixed_precision().fp8
    assert (recipe.format, recipe.scaling, recipe.amax_history_len) == ("hybrid", "delayed", 16)
    with pytest.raises(ConfigError, match="fp16"):
        load_config(None, ["--precision.dtype", "fp16", "--precision.fp8", "e4m3"])
    with pytest.raises(ConfigError, match="fp8_recipe"):
        load_config(None, ["--precision.fp8", "e4m3", "--precision.fp8_recipe", "rowwise"])
    # A backend whose FP8 interface is unavailable (the rule a GPU below sm_89 gets).
    lacking = FP8.gated(frozenset(), lambda: Availability(False, "compute capability 8.0 < 8.9"))
    backend = types.SimpleNamespace(name="old-gpu", fp8=lacking)
    with pytest.raises(ConfigError, match=r"compute capability 8\.0 < 8\.9.*old-gpu"):
        config.precision.check_backend(backend)
    config.precision.check_backend(select_backend("cpu"))


def test_trainer_says_fp8_is_on(job):
    config = job(fp8="hybrid", fp8_recipe="blockwise")
    config["training"].update(steps=1)
    stream = io.StringIO()
    train(validate(config), stream=stream)
    assert (
        "fp8 (hybrid): blockwise scaling, E4M3 forward, E5M2 gradients | block linear GEMMs: "
        "fallback (matmul in higher precision)"
    ) in stream.getvalue()
