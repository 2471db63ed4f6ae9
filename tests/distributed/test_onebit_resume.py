"""1-bit Adam resumes exactly through the trainer at dp=2: the compression stage's worker
and server error buffers travel in the checkpoint under each rank's own keys
(``optim.rank{r}.*``). Restoring them is what makes the resumed losses equal: with the
restore step disabled, the second resumed loss differs in its 5th digit."""

from __future__ import annotations

import io
import os

import torch.distributed.checkpoint as dcp

from mtcore.testing.distributed import run_ranks
from mtcore.training.overrides import validate
from mtcore.training.trainer import train


def _config(corpus, cache, ckpt, **checkpoint) -> dict:
    return {
        "model": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=32),
        "parallel": {"dp": 2},
        "precision": {"dtype": "fp32"},
        "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(cache)),
        "optimizer": dict(name="onebit_adam", freeze_step=2, lr=1e-2, min_lr=1e-3, warmup_steps=1),
        "training": dict(steps=6, global_batch_size=8, micro_batch_size=2, eval_interval=0,
                         eval_batches=1, sample_prompt=None, seed=3),
        "checkpoint": {"dir": str(ckpt), "interval": 4, **checkpoint},
        "logging": dict(interval=1, tensorboard_dir=None, progress="lines"),
    }  # fmt: skip


def _rank_main(ctx, configs: list[dict], rejoin: str):
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
    losses = []
    for i, config in enumerate(configs):
        losses.append(train(validate(config), stream=io.StringIO()).losses)
        # train() ends by destroying the group: a fresh one for the next run and the barrier.
        ctx.backend.collective.init_process_group(
            rank=ctx.rank, world_size=ctx.world_size, init_method=f"file://{rejoin}{i}"
        )
    return losses


def test_onebit_adam_resumes_bitwise_at_dp2(tmp_path, write_code_corpus):
    corpus = write_code_corpus(tmp_path / "corpus", 12, 40)
    cache, first = tmp_path / "cache", tmp_path / "first"
    step4 = first / "step_000004"
    configs = [
        _config(corpus, cache, first),
        _config(corpus, cache, tmp_path / "again", load=str(step4)),
    ]
    (whole, resumed), _ = run_ranks(_rank_main, 2, configs, str(tmp_path / "rejoin"))
    assert len(whole) == 6 and len(resumed) == 2
    assert resumed == whole[4:]  # bitwise: the error feedback came back

    keys = dcp.FileSystemReader(str(step4)).read_metadata().state_dict_metadata
    for rank in (0, 1):
        mine = [k for k in keys if k.startswith(f"optim.rank{rank}.")]
        assert any("worker_error" in k for k in mine) and any("server_error" in k for k in mine)
