"""The training loop in one process: loss falls, outputs are written, metrics are right."""

from __future__ import annotations

import gc
import io
import json

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.gpt import GPTConfig
from mtcore.training.checkpoint import load_model, resolve_checkpoint
from mtcore.training.metrics import Progress, format_mfu, peak_tflops
from mtcore.training.overrides import validate
from mtcore.training.trainer import train


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_process_job_learns_and_writes_everything(tiny, tmp_path):
    stream = io.StringIO()
    result = train(validate(tiny()), stream=stream)
    text = stream.getvalue()
    assert result.losses[-1] < result.losses[0] - 0.5, result.losses
    assert [s for s, _ in result.val_losses] == [4, 8]
    assert "step 8/8 | loss" in text and "tokens/s" in text and "MFU n/a" in text
    assert "eval step 8 | val loss" in text and "val ppl" in text

    directory = resolve_checkpoint(tmp_path / "checkpoints")
    assert directory == result.checkpoint and directory.name == "step_000008"
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["step"] == 8 and manifest["model_config"]["vocab_size"] == 384
    assert {"tokenizer.json", "config.yaml"} <= {p.name for p in directory.iterdir()}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))

    model, step, _ = load_model(tmp_path / "checkpoints", select_backend("cpu"))
    assert step == 8 and model.config.vocab_size == 384
    assert result.sample is not None and result.sample.startswith("def ")


def test_no_checkpoint_no_tensorboard_no_sample(tiny, tmp_path):
    config = tiny(
        checkpoint={"dir": None},
        logging={"tensorboard_dir": None},
        training={"steps": 4, "sample_prompt": None, "eval_interval": 0, "gc_interval": 2},
    )
    collections = []  # (generation, automatic collection on) of each collection
    record = lambda phase, info: phase == "start" and collections.append(  # noqa: E731
        (info["generation"], gc.isenabled())
    )
    gc.callbacks.append(record)
    try:
        result = train(validate(config), stream=io.StringIO())
    finally:
        gc.callbacks.remove(record)
    assert result.checkpoint is None and result.sample is None
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "checkpoints").exists()
    # gc_interval 2 over 4 steps: a full collection before the loop, then with automatic
    # collection off the loop's own at steps 2 and 4; Python's collection back afterwards
    loop = collections.index((2, True))
    assert [g for g, automatic in collections if not automatic] == [1, 1], collections
    assert collections[loop + 1 : loop + 3] == [(1, False), (1, False)], collections
    assert gc.isenabled()


def test_progress_bar_on_a_terminal_plain_lines_otherwise():
    tty = _Tty()
    bar = Progress(10, "auto", tty)
    bar.update(3, "loss 1.0")
    bar.line("step 3 | loss 1.0")
    bar.close()
    assert "\r" in tty.getvalue() and "[#######" in tty.getvalue() and "3/10" in tty.getvalue()
    plain = io.StringIO()
    lines = Progress(10, "auto", plain)
    lines.update(3, "loss 1.0")
    lines.line("step 3 | loss 1.0")
    assert plain.getvalue() == "step 3 | loss 1.0\n"


def test_model_flops_is_the_paper_formula():
    config = GPTConfig(vocab_size=51200, hidden_size=2304, num_layers=24, num_heads=24, seq_len=2048)
    b, s, layers, h, v = 512, 2048, 24, 2304, 51200
    want = 72 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (12 * layers * h))
    assert config.flops_per_step(512) == pytest.approx(want)
    # Narayanan et al. table: 1.7B model at 137 TFLOP/s per GPU is 44% of an A100's 312.
    assert format_mfu(137.0, 312.0) == "43.9%"
    assert format_mfu(1.0, None) == "n/a"
    assert peak_tflops(select_backend("cpu"), torch.float32) is None
