"""The planner's ZB-H1: the drain filled by W passes, (p - 1)(F + B - W) for equal
stages, and every stage holding stage 0's micro-batches."""

from __future__ import annotations

import pytest

from mtcore.plan import load_hardware, model_shape, plan, timing
from mtcore.plan.planner import pipeline_bubble
from mtcore.plan.stage import Stage, microbatch_time, rank_blocks, weight_grad_seconds
from mtcore.training.config import TrainConfig

A100 = load_hardware("A100-80GB")


def config(schedule: str, pp: int = 4):
    return TrainConfig.model_validate(
        {
            "model": {"family": "gpt", "style": "llama", "hidden_size": 1024, "num_layers": 8,
                      "num_heads": 16, "seq_len": 1024, "vocab_size": 32768},
            "parallel": {"pp": pp, "schedule": schedule},
            "precision": {"dtype": "bf16"},
            "training": {"global_batch_size": 16, "micro_batch_size": 1},
        }
    )  # fmt: skip


def test_zb_h1_bubble_is_f_plus_b_minus_w_per_stage():
    one_f_one_b, zero_bubble = plan(config("1f1b"), 4, A100), plan(config("zb_h1"), 4, A100)
    cfg = config("zb_h1")
    spec, _ = cfg.check(4)
    shape = model_shape(cfg.model)
    products = timing.Products(A100, "bf16")
    per_stage, weights = [], []
    for rank in range(4):
        stage = Stage(rank_blocks(shape, [2, 2, 2, 2], 4, 1, rank), rank == 0, rank == 3)
        times = microbatch_time(shape, stage, 1, spec, A100, "none", True, 2, products)
        per_stage.append(sum(times.values()))
        weights.append(weight_grad_seconds(shape, stage, 1, spec, products))
        # W is one of the trained products' three passes: under a third of the compute
        assert 0 < weights[-1] < times["compute"] / 3 * 1.0001
    slow = max(range(4), key=lambda r: per_stage[r])
    filled = [t - 2 * w for t, w in zip(per_stage, weights, strict=True)]
    assert zero_bubble.time.bubble == pytest.approx(sum(filled) - filled[slow])
    assert one_f_one_b.time.bubble == pytest.approx(sum(per_stage) - per_stage[slow])
    # elementwise (memory-bound) work and communication stay in B: not a third saved
    assert 0 < zero_bubble.time.bubble < 0.7 * one_f_one_b.time.bubble
    # the same work, less idle: the step is shorter by the bubble's difference
    saved = one_f_one_b.time.bubble - zero_bubble.time.bubble
    assert one_f_one_b.time.total - zero_bubble.time.total == pytest.approx(saved)
    # every stage holds pp micro-batches (1F1B: pp - r)
    assert [r.in_flight for r in zero_bubble.ranks] == [4, 4, 4, 4]
    assert [r.in_flight for r in one_f_one_b.ranks] == [4, 3, 2, 1]


def test_pipeline_bubble_by_hand():
    # equal stages, F = 1, B = W = 1 (t = 3): 1F1B (p - 1) 3, ZB-H1 (p - 1) 1
    assert pipeline_bubble("1f1b", [3.0] * 4, [1.0] * 4, 0, 1) == 9.0
    assert pipeline_bubble("zb_h1", [3.0] * 4, [1.0] * 4, 0, 1) == 3.0
    assert pipeline_bubble("1f1b", [3.0] * 4, [1.0] * 4, 0, 2) == 4.5  # interleaved: / v
    assert pipeline_bubble("zb_h1", [3.0], [1.0], 0, 1) == 0.0
    assert pipeline_bubble("zb_h1", [3.0, 1.0], [1.0, 1.0], 0, 1) == 0.0  # W fills it all
    assert pipeline_bubble("interleaved_zb", [3.0] * 4, [1.0] * 4, 0, 2) == 1.5


def test_interleaved_zb_holds_interleavings_stage0_count_on_every_stage():
    from mtcore.plan.memory import in_flight

    stage0 = in_flight("interleaved_1f1b", 4, 2, 0, 8)
    assert [in_flight("interleaved_zb", 4, 2, r, 8) for r in range(4)] == [stage0] * 4
    assert in_flight("interleaved_1f1b", 4, 2, 3, 8) < stage0
