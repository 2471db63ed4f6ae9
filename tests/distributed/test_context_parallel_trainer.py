"""The trainer under context parallelism: ``train()`` at cp2 x dp2 (4 ranks, one spawn) gives
the losses of one process on the same config.

The engine tests (test_context_parallel.py) hand each rank its batch; this one checks
the trainer's own part: samples split over dp (as the config's micro-batch arithmetic
counts them), each cp rank keeping its share of every sequence, evaluation on the same
sharded batches.
"""

from __future__ import annotations

import io
import os

import torch

from mtcore.testing.distributed import run_ranks
from mtcore.training.overrides import validate
from mtcore.training.trainer import train

RTOL = 1e-5


def _config(corpus, cache, **parallel) -> dict:
    return {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32),
        "parallel": parallel,
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(cache)),
        "optimizer": dict(lr=1e-2, min_lr=1e-3, warmup_steps=2),
        "training": dict(steps=4, global_batch_size=8, micro_batch_size=2, eval_interval=2,
                         eval_batches=1, sample_prompt=None, seed=3),
        "checkpoint": {"dir": None},
        "logging": dict(interval=1, tensorboard_dir=None, progress="lines"),
    }  # fmt: skip


def _rank_main(ctx, config: dict, rejoin: str):
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
    stream = io.StringIO()
    result = train(validate(config), stream=stream)  # ends by destroying the process group
    # run_ranks ends with a barrier: a fresh group (a new file store) to answer it.
    ctx.backend.collective.init_process_group(
        rank=ctx.rank, world_size=ctx.world_size, init_method=f"file://{rejoin}"
    )
    return result.losses, result.val_losses, stream.getvalue()


def test_trainer_at_cp2_dp2_matches_one_process(tmp_path, write_code_corpus):
    corpus = write_code_corpus(tmp_path / "corpus", 12, 40)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # one process first: it also writes the data cache the ranks then map
        ref = train(validate(_config(corpus, tmp_path / "cache")), stream=io.StringIO())
    finally:
        torch.set_num_threads(threads)
    config = _config(corpus, tmp_path / "cache", cp=2, dp=2, cp_method="ring")
    ranks = run_ranks(_rank_main, 4, config, str(tmp_path / "rejoin"))
    losses, val_losses, text = ranks[0]
    assert "dp=2 cp=2 (ring)" in text, text
    assert len(losses) == len(ref.losses) == 4
    for step, (got, want) in enumerate(zip(losses, ref.losses, strict=True), 1):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: {got} vs {want}"
    for (step, got), (_, want) in zip(val_losses, ref.val_losses, strict=True):
        assert abs(got - want) <= RTOL * abs(want), f"eval at step {step}: {got} vs {want}"
    assert all(r[0] == losses for r in ranks), "every rank holds the agreed losses"
