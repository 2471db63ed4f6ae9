"""Learning-rate schedules: linear warmup to ``lr``, then one of five shapes.

Every schedule warms up linearly over ``warmup_steps`` (step ``s`` of warmup runs at
``lr * s / warmup_steps``), then, over the schedule's length ``decay_steps``:

* ``cosine``: half a cosine from ``lr`` down to ``min_lr`` at ``decay_steps`` (the
  default, and the only shape before schedules were configurable: its numbers are
  unchanged to the last bit);
* ``linear``: a straight line from ``lr`` down to ``min_lr`` at ``decay_steps``;
* ``wsd`` (warmup-stable-decay): ``lr`` held, then a linear cooldown to ``min_lr``
  over the last ``wsd_decay_steps`` of ``decay_steps``. A stable phase can be cut
  short or extended and the cooldown run from any checkpoint, which is why it is
  used for runs whose length is not known in advance;
* ``constant``: ``lr`` from the end of warmup on;
* ``inverse_sqrt``: ``lr * sqrt(warmup_steps / step)`` (``lr / sqrt(step)``
  without warmup), never below ``min_lr``; it has no end, so ``decay_steps`` plays
  no part.

Past ``decay_steps`` the decaying shapes stay at ``min_lr``. The length is a number
of the schedule, not of the job: when ``decay_steps`` is unset the trainer fixes it
at the first run's ``training.steps`` and a resumed run keeps it, so raising
``training.steps`` to train on does not reshape the schedule behind the steps
already taken.
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["cosine", "wsd", "linear", "constant", "inverse_sqrt"]
SCHEDULES: tuple[str, ...] = ("cosine", "wsd", "linear", "constant", "inverse_sqrt")
WSD_DECAY_FRACTION = 0.2  # wsd_decay_steps unset: the last fifth of the schedule cools down


def lr_at(
    step: int,
    *,
    schedule: str = "cosine",
    lr: float,
    min_lr: float,
    warmup_steps: int,
    decay_steps: int,
    wsd_decay_steps: int | None = None,
) -> float:
    """The learning rate of optimizer step ``step`` (1-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "inverse_sqrt":
        return max(min_lr, lr * math.sqrt(max(warmup_steps, 1) / step))
    if schedule == "wsd":
        cooldown = wsd_decay_steps
        if cooldown is None:
            cooldown = max(1, round(WSD_DECAY_FRACTION * (decay_steps - warmup_steps)))
        start = decay_steps - cooldown
        if step <= start:
            return lr
        progress = min(1.0, (step - start) / cooldown)
        return lr + (min_lr - lr) * progress
    decay = decay_steps - warmup_steps
    progress = min(1.0, (step - warmup_steps) / decay) if decay > 0 else 1.0
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
