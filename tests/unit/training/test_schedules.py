"""The lr schedules: shapes, the default's numbers unchanged, a length kept on resume."""

from __future__ import annotations

import io
import math
import re

import pytest

from mtcore.training.config import OptimizerConfig, TrainConfig
from mtcore.training.schedules import SCHEDULES, lr_at
from mtcore.training.trainer import train


def old_cosine(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """The formula mtcore used before schedules were configurable, verbatim."""
    if warmup and step <= warmup:
        return lr * step / warmup
    decay = total - warmup
    progress = min(1.0, (step - warmup) / decay) if decay > 0 else 1.0
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def test_default_is_the_old_cosine_to_the_bit():
    opt = OptimizerConfig()
    assert opt.schedule == "cosine"
    for total in (1, 50, 200, 1000):
        for step in range(1, total + 30):
            assert opt.lr_at(step, total) == old_cosine(step, 3e-4, 3e-5, 100, total)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_warms_up_linearly(schedule):
    for step in (1, 5, 10):
        got = lr_at(step, schedule=schedule, lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)
        assert got == pytest.approx(step / 10)


def test_shapes_after_warmup():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)
    assert lr_at(60, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_at(110, schedule="linear", **kw) == pytest.approx(0.1)
    assert lr_at(500, schedule="linear", **kw) == pytest.approx(0.1)
    assert lr_at(500, schedule="constant", **kw) == 1.0
    assert lr_at(40, schedule="inverse_sqrt", **kw) == pytest.approx(math.sqrt(10 / 40))
    assert lr_at(10**6, schedule="inverse_sqrt", **kw) == 0.1  # floored at min_lr
    # wsd: stable until the last fifth of the 100 post-warmup steps, then linear down.
    assert lr_at(90, schedule="wsd", **kw) == 1.0
    assert lr_at(100, schedule="wsd", **kw) == pytest.approx(0.55)
    assert lr_at(110, schedule="wsd", **kw) == pytest.approx(0.1)
    assert lr_at(70, schedule="wsd", wsd_decay_steps=50, **kw) == pytest.approx(0.82)
    with pytest.raises(ValueError, match="unknown lr schedule 'step'"):
        lr_at(1, schedule="step", **kw)


def test_unknown_schedule_is_a_config_error():
    with pytest.raises(ValueError, match="schedule"):
        OptimizerConfig(schedule="exponential")


def _lrs(text: str) -> dict[int, float]:
    return {
        int(s): float(v) for s, v in re.findall(r"step (\d+)/\d+ \| loss \S+ \| lr (\S+)", text)
    }


def test_resume_with_more_steps_keeps_the_schedule_length(tiny):
    opt = dict(schedule="linear", lr=1e-2, min_lr=1e-3, warmup_steps=1)
    log = dict(interval=1)
    first = tiny(optimizer=opt, training=dict(steps=4, eval_interval=0, sample_tokens=0),
                 logging=log)  # fmt: skip
    train(TrainConfig.model_validate(first), stream=io.StringIO())
    more = tiny(optimizer=opt, training=dict(steps=6, eval_interval=0, sample_tokens=0),
                checkpoint=dict(resume=True), logging=log)  # fmt: skip
    stream = io.StringIO()
    train(TrainConfig.model_validate(more), stream=stream)
    out = stream.getvalue()
    assert "lr schedule: linear over 4 steps as in the checkpoint's run" in out
    lrs = _lrs(out)
    assert sorted(lrs) == [5, 6]
    assert all(v == pytest.approx(1e-3, rel=1e-2) for v in lrs.values())  # at min_lr: ended
