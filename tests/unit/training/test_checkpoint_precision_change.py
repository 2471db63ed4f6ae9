"""A checkpoint resumed under another parameter precision keeps its fp32 weights.

A bf16 run's checkpoint holds bf16 params and their fp32 masters; an fp32 run's holds
fp32 params that are their own masters. Resuming a bf16 checkpoint in fp32 must take the
masters (the params are their rounded copies); resuming an fp32 checkpoint in bf16 must
make its params the masters (there is no ``optim.master`` to find).
"""

from __future__ import annotations

import torch

from mtcore.backend import select_backend
from mtcore.data import lm_batches
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.precision import MixedPrecision
from mtcore.training.checkpoint import Checkpointer, read_model_weights
from mtcore.training.engine import Engine

MODEL = GPTConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16
)


def _engine(dtype: str, seed: int) -> Engine:
    backend = select_backend("cpu")
    layout = ParallelLayout.build(LayoutSpec(), backend.collective, 0, 1)
    return Engine(
        MODEL,
        layout,
        backend,
        micro_batch_size=1,
        num_microbatches=1,
        precision=MixedPrecision(dtype),
        seed=seed,
    )


def _trained(dtype: str, root) -> dict[str, torch.Tensor]:
    engine = _engine(dtype, seed=0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x, y = (torch.randint(0, 64, (1, 16), generator=gen) for _ in range(2))
        engine.train_step(lm_batches([x], [y]))
    Checkpointer(engine).save(root, 2, {}, model_config=MODEL)
    return read_model_weights(root)[1]  # fp32: the masters of a low-precision run


def test_precision_change_on_resume_keeps_the_fp32_weights(tmp_path):
    masters = _trained("bf16", tmp_path / "bf16")
    fp32 = _engine("fp32", seed=1)
    loaded = Checkpointer(fp32).load(tmp_path / "bf16")
    assert loaded.step == 2
    params = dict(fp32.chunks[0].named_parameters())
    assert all(torch.equal(params[k], masters[k]) for k in masters)

    weights = _trained("fp32", tmp_path / "fp32")
    bf16 = _engine("bf16", seed=1)
    Checkpointer(bf16).load(tmp_path / "fp32")
    params = dict(bf16.chunks[0].named_parameters())
    assert all(torch.equal(params[k], weights[k].bfloat16()) for k in weights)
    Checkpointer(bf16).save(tmp_path / "again", 2, {}, model_config=MODEL)
    again = read_model_weights(tmp_path / "again")[1]  # the bf16 run's masters
    assert all(torch.equal(again[k], weights[k]) for k in weights)


def test_a_save_without_model_config_loads(tmp_path):
    """``Checkpointer.save``'s ``model_config`` defaults to None, and ``load`` refuses a
    manifest without one: the default must record the engine's model."""
    engine = _engine("fp32", seed=0)
    Checkpointer(engine).save(tmp_path / "ck", 1, {})
    assert Checkpointer(_engine("fp32", seed=1)).load(tmp_path / "ck").step == 1
    assert read_model_weights(tmp_path / "ck")[0] == MODEL
