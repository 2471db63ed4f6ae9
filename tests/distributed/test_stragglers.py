"""``logging.straggler_factor``: under tp2 x pp2 (4 ranks, one spawn) rank 1 is slowed on
purpose (its pipeline forward spins the CPU for 60 ms before computing, as a slow kernel
would), and the log names rank 1, and only it, as slow in compute; ``find`` on numbers."""

from __future__ import annotations

import io
import os
import re
import time

import pytest

from mtcore.testing.distributed import run_ranks
from mtcore.training.overrides import validate
from mtcore.training.stragglers import find
from mtcore.training.trainer import train

SLOW_RANK, SPIN_S = 1, 0.06


def _config(corpus, cache) -> dict:
    return {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32),
        "parallel": dict(tp=2, pp=2),
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(cache)),
        "training": dict(steps=4, global_batch_size=8, micro_batch_size=2, eval_interval=0,
                         sample_prompt=None),
        "checkpoint": {"dir": None},
        "logging": dict(interval=2, tensorboard_dir=None, progress="lines"),
    }  # fmt: skip


def _rank_main(ctx, config: dict, rejoin: str):
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
    if ctx.rank == SLOW_RANK:
        from mtcore.parallel.pipeline.runner import PipelineRunner

        forward = PipelineRunner._forward

        def slow_forward(self, *args, **kwargs):
            end = time.process_time() + SPIN_S
            while time.process_time() < end:  # CPU work, as a slow kernel's
                pass
            return forward(self, *args, **kwargs)

        PipelineRunner._forward = slow_forward
    stream = io.StringIO()
    train(validate(config), stream=stream)
    ctx.backend.collective.init_process_group(
        rank=ctx.rank, world_size=ctx.world_size, init_method=f"file://{rejoin}"
    )
    return stream.getvalue()


@pytest.mark.extended
def test_the_slowed_rank_and_only_it_is_named(tmp_path, write_code_corpus):
    corpus = write_code_corpus(tmp_path / "corpus", 12, 40)
    out = run_ranks(_rank_main, 4, _config(corpus, tmp_path / "cache"), str(tmp_path / "rejoin"))
    named = re.findall(r"straggler: rank (\d+) on \S+ computes", out[0])
    assert named and set(named) == {str(SLOW_RANK)}, out[0]
    assert "slow in compute, not waiting" in out[0]


def test_find_compares_each_rank_with_its_stage():
    hosts = ["a", "a", "b", "b"]
    # stage 1 computes more (the head) than stage 0: no one is slow for that alone
    assert find([1.0, 1.0, 1.6, 1.6], [0.0] * 4, [0, 0, 1, 1], hosts, 1.2) == []
    slow = find([1.0, 1.6, 1.6, 1.6], [0.5, 0.1, 0.0, 0.0], [0, 0, 1, 1], hosts, 1.2)
    assert [s.rank for s in slow] == [1] and slow[0].host == "a"
    assert slow[0].ratio == pytest.approx(1.6 / 1.3)
    assert "rank 1 on a computes 1600 ms/step" in slow[0].line(10)
    # a stage of one rank: compared with every rank's median
    assert [s.rank for s in find([1.0, 1.0, 3.0], [0.0] * 3, [0, 1, 2], hosts, 1.2)] == [2]
