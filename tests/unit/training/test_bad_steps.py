"""NaN/inf losses and gradients: the step is skipped and reported; too many in a row stop the job."""

from __future__ import annotations

import io
import math

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.data import lm_batches
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import ParallelLayout
from mtcore.precision import DynamicLossScaler, LossScaler
from mtcore.training import trainer as trainer_module
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine, StepOutcome
from mtcore.training.overrides import validate
from mtcore.training.trainer import BadStepGuard, TrainingError, train

MODEL = GPTConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=16)


def _engine() -> Engine:
    return Engine(
        MODEL,
        ParallelLayout.single(),
        select_backend("cpu"),
        micro_batch_size=2,
        num_microbatches=2,
        optimizer=OptimizerConfig(lr=1e-2, warmup_steps=0),
    )


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (4, 16), generator=g)
    return lm_batches(x.split(2), x.roll(-1, 1).split(2))


def _weights(engine):
    return {n: p.detach().clone() for n, p in engine.chunks[0].named_parameters()}


def test_nan_gradient_skips_the_step_and_leaves_the_weights():
    engine = _engine()
    assert not engine.train_step(_batch(0)).skipped
    before = _weights(engine)
    weight = engine.chunks[0].layers["0"].mlp.fc2.weight
    hook = weight.register_hook(lambda g: g * math.nan)
    out = engine.train_step(_batch(1))
    hook.remove()
    assert out.skipped == "grad" and math.isfinite(out.loss)
    assert all(torch.equal(p, before[n]) for n, p in _weights(engine).items())
    assert not engine.train_step(_batch(2)).skipped  # training goes on
    assert not torch.equal(_weights(engine)["norm.weight"], before["norm.weight"])


def test_nan_loss_skips_the_step():
    engine = _engine()
    with torch.no_grad():
        engine.chunks[0].norm.weight[0] = math.inf
    out = engine.train_step(_batch(0))
    assert out.skipped == "loss" and not math.isfinite(out.loss)


def test_guard_counts_consecutive_bad_steps_only():
    guard = BadStepGuard(3, LossScaler(1.0))
    ok, bad = StepOutcome(2.0, "", 1.0, 1.0), StepOutcome(math.nan, "loss", None, 1.0)
    assert guard.observe(1, bad) == "step 1: non-finite loss (loss nan), step skipped (1 in a row)"
    assert guard.observe(2, bad).endswith("(2 in a row)")
    assert guard.observe(3, ok) is None
    guard.observe(4, bad)
    guard.observe(5, bad)
    with pytest.raises(TrainingError, match=r"step 6: non-finite gradients .*stopping after 3 consecutive"):
        guard.observe(6, StepOutcome(2.0, "grad", None, 1.0))


def test_fp16_overflow_backs_off_and_is_not_a_bad_step():
    scaler = DynamicLossScaler(initial_scale=2.0**10)
    scaler.update(True)  # what the optimizer did on the overflowing step
    guard = BadStepGuard(1, scaler)
    message = guard.observe(7, StepOutcome(3.0, "grad", None, 2.0**10))
    assert message == "step 7: fp16 gradient overflow, loss scale 1024 -> 512, step skipped"
    with pytest.raises(TrainingError):  # at the minimum scale an overflow is a bad step
        guard.observe(8, StepOutcome(3.0, "grad", None, scaler.min_scale))


def test_trainer_reports_skipped_steps_and_stops(tiny, monkeypatch):
    real_step = Engine.train_step

    def flaky(self, batches, stop=False):
        out = real_step(self, batches, stop)
        step = len(seen) + 1
        seen.append(step)
        if step == 2 or step >= 4:
            return StepOutcome(math.nan, "loss", None, out.loss_scale)
        return out

    seen: list[int] = []
    monkeypatch.setattr(trainer_module.Engine, "train_step", flaky)
    config = validate(tiny(training={"steps": 10, "max_bad_steps": 3, "eval_interval": 0}))
    stream = io.StringIO()
    with pytest.raises(TrainingError, match=r"step 6: non-finite loss .*stopping after 3 consecutive"):
        train(config, stream=stream)
    text = stream.getvalue()
    assert "step 2: non-finite loss (loss nan), step skipped (1 in a row)" in text
    assert "step 5: non-finite loss (loss nan), step skipped (2 in a row)" in text
    assert seen == [1, 2, 3, 4, 5, 6]
