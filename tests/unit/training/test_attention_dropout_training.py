"""Attention-probability dropout through the trainer (one process, fp32): a resumed run
is bitwise the uninterrupted one (the attention-dropout stream is checkpointed with the
other RNG streams), and the losses differ from the same job without it."""

from __future__ import annotations

import io

from mtcore.training.overrides import validate
from mtcore.training.trainer import train


def _config(tiny, tmp_path, attention_dropout: float, **checkpoint):
    return tiny(
        model={"attention_dropout": attention_dropout},
        training={"steps": 4, "eval_interval": 0, "sample_prompt": None},
        checkpoint={"interval": 2, **checkpoint},
        logging={"tensorboard_dir": None},
    )


def test_attention_dropout_resumes_bitwise_and_changes_the_loss(tiny, tmp_path):
    whole = train(validate(_config(tiny, tmp_path, 0.3)), stream=io.StringIO())
    resumed = train(
        validate(
            _config(
                tiny, tmp_path, 0.3, dir=str(tmp_path / "again"),
                load=str(tmp_path / "checkpoints" / "step_000002"),
            )
        ),
        stream=io.StringIO(),
    )  # fmt: skip
    assert resumed.start_step == 2 and resumed.losses == whole.losses[2:]  # bitwise
    plain = train(
        validate(_config(tiny, tmp_path, 0.0, dir=str(tmp_path / "plain"))), stream=io.StringIO()
    )
    assert plain.losses[0] != whole.losses[0]
    assert all(a != b for a, b in zip(plain.losses, whole.losses, strict=True))
