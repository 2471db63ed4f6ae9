"""Checkpoints of mixture-of-experts GPTs under expert parallelism (ep > 1).

Expert weights are split over ep (experts dim) and tp; the checkpoint stores
each one whole (``[E, ...]`` per section), so it must resume exactly under the
layout that saved it and continue under any other. Each job is the real trainer
loop on gloo ranks, fp32, every layer MoE, auxiliary-loss-free expert biases (a
buffer that must come back too), the batch aux loss and z-loss.

* exact resume: ``6`` steps in one go == ``3`` steps, stop, resume, ``3``
  (bitwise), at ep2 over dp4 with ZeRO-1 (expert optimizer state sharded over
  the ``edp`` pairs) and, in the slow run, ep2 x tp2 with dropout 0.1;
* resharding, exactly: a checkpoint loaded under another layout and saved again
  at once holds the same logical tensors bit for bit (weights, AdamW moments,
  expert biases): ep2 x tp2 -> ep2 x dp4 (ZeRO-1 over edp) and one process,
  ep2 x dp4 -> ep4;
* resharding, training on: ep2 x tp2 continues at ep4, ep2 x dp4 in one process,
  with the unbroken run's losses within ``RESHARD_RTOL``; ``read_model_weights``
  gives the one-process names, every expert, equal to ``Engine.full_state_dict``;
* ep1 in one process: a MoE resume is bitwise too (with dropout).

Dropout only where the layout stays: under another layout the RNG streams are
reseeded. AdamW ``eps`` is 1e-3 (as in test_moe_equivalence.py): with the
default 1e-8, Adam turns the rounding noise of near-zero gradients, which
differs between layouts, into whole ``lr`` steps, and routing amplifies it;
unbroken runs of this model under ep2 x tp2, ep4 and one process then differ
by up to 4e-4 after 6 steps (about 5e-6 with eps 1e-3).
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.gpt import GPT, single_context
from mtcore.parallel.layout import ParallelLayout
from mtcore.testing.distributed import run_ranks
from mtcore.training.checkpoint import read_model_weights, write_model_weights
from mtcore.training.checkpoint.safe_reader import dcp_load, tensor_shapes
from mtcore.training.overrides import validate
from mtcore.training.trainer import _Loop, prepare

RESHARD_RTOL = 1e-5
MODEL = dict(
    hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16,
    moe=dict(num_experts=4, top_k=2, ffn_size=32, bias_update_rate=1e-2, z_loss_coeff=1e-3),
)  # fmt: skip
STEP3 = "step_000003"


WORDS = ("alpha", "beta", "gamma", "delta", "token", "layer", "rank", "expert")


def _run_jobs(ctx, jobs: list[tuple[dict, str]]) -> list[tuple]:
    """Each config in turn on these ranks: (losses, start step, rank 0's log, weights).

    mode ``train``; ``weights``: train, then ``Engine.full_state_dict`` (on rank 0);
    ``resave``: load the configured checkpoint and save it again at once, no step.
    """
    out = []
    for data, mode in jobs:
        config = validate(data)
        prep = prepare(config, ctx.world_size)
        layout = ParallelLayout.build(prep.spec, ctx.backend.collective, ctx.rank, ctx.world_size)
        stream = io.StringIO()
        loop = _Loop(config, prep, layout, ctx.backend, ctx.rank == 0, stream)
        if mode == "resave":
            loop.checkpoints.save(loop.result.start_step, loop.train_loader, final=True)
            out.append(([], loop.result.start_step, stream.getvalue(), None))
            continue
        result = loop.run()
        weights = loop.engine.full_state_dict() if mode == "weights" else None  # collective
        out.append((result.losses, result.start_step, stream.getvalue(), weights))
    return out


def _in_one_process(jobs: list[tuple[dict, str]]) -> list[tuple]:
    ctx = SimpleNamespace(rank=0, world_size=1, backend=select_backend("cpu"))
    return _run_jobs(ctx, jobs)


@pytest.fixture(scope="module")
def job(tmp_path_factory, write_code_corpus):
    root = tmp_path_factory.mktemp("moe_ckpt")
    corpus = write_code_corpus(root / "docs", n_docs=12, n_lines=30, words=WORDS)

    def make(name: str, parallel: dict, dropout=0.0, **checkpoint) -> dict:
        return {
            "model": {**MODEL, "dropout": dropout},
            "parallel": parallel,
            "precision": {"dtype": "fp32"},
            "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(root / "cache")),
            "optimizer": dict(lr=1e-2, min_lr=1e-3, warmup_steps=2, eps=1e-3),
            "training": dict(steps=6, global_batch_size=8, micro_batch_size=2, eval_interval=0,
                             sample_prompt=None),
            "checkpoint": {"dir": str(root / name), "interval": 3, **checkpoint},
            "logging": dict(interval=1, tensorboard_dir=None, progress="lines"),
        }  # fmt: skip

    def resume(name: str, parallel: dict, source: str, dropout=0.0) -> dict:
        return make(name, parallel, dropout, load=str(root / source / STEP3))

    prepare(validate(make("warm", {})), 4)  # builds the data cache once, before ranks map it
    return root, make, resume


def _check_reshard(whole: list[float], got: tuple, what: str) -> None:
    losses, start, log, _ = got
    assert start == 3 and "reseeded (the layout changed)" in log, (what, log)
    assert len(losses) == 3, what
    worst = max(abs(a - b) / abs(a) for a, b in zip(whole[3:], losses, strict=True))
    print(f"{what}: largest relative loss difference {worst:.1e}")  # for docs (pytest -s)
    for a, b in zip(whole[3:], losses, strict=True):
        assert abs(a - b) <= RESHARD_RTOL * abs(a), (what, whole[3:], losses)


def _logical_tensors(directory: Path, kinds=("model.", "optim.")) -> dict[str, torch.Tensor]:
    """Every model (and optimizer) tensor of a checkpoint, read whole in one process."""
    shapes = tensor_shapes(directory)
    targets = {
        k: torch.empty(shape, dtype=dtype)
        for k, (shape, dtype) in shapes.items()
        if k.startswith(kinds)
    }
    dcp_load(targets, directory, world=1)
    return targets


def _check_same_tensors(source: Path, resaved: Path, kinds=("model.", "optim.")) -> None:
    a, b = _logical_tensors(source, kinds), _logical_tensors(resaved, kinds)
    assert set(a) == set(b), set(a) ^ set(b)
    assert any(".experts.fc1.section1" in k for k in a) and any("expert_bias" in k for k in a)
    if "optim." in kinds:
        assert any(k.startswith("optim.exp_avg_sq.") and "experts.fc2" in k for k in a)
    for key, value in a.items():
        assert torch.equal(value, b[key]), (key, source, resaved)


def _check_weights(checkpoint: Path, full: dict[str, torch.Tensor]) -> None:
    """The checkpoint read in one process == the engine's gathered weights, under the
    names of the one-process model (every expert of every layer)."""
    config, weights, step = read_model_weights(checkpoint)
    assert step == 6
    reference = GPT(config, single_context(config, select_backend("cpu"))).state_dict()
    assert set(weights) == set(reference) == set(full)
    for name, value in weights.items():
        assert value.shape == reference[name].shape, name
        assert torch.equal(value, full[name]), name
    fc1 = [n for n in weights if n.endswith("experts.fc1")]
    assert fc1 and all(weights[n].shape[0] == MODEL["moe"]["num_experts"] for n in fc1)


def test_ep2_resumes_exactly_and_reshards_to_ep4_and_one_process(job):
    root, make, resume = job
    ep2, ep2_tp2 = {"ep": 2, "zero1": True}, {"ep": 2, "tp": 2, "zero1": True}
    jobs = [
        (make("ep2", ep2), "weights"),  # dp4: experts' ZeRO-1 state over edp pairs
        (resume("ep2_resumed", ep2, "ep2"), "train"),
        (make("ep2_tp2", ep2_tp2, async_save=True), "weights"),  # ep x tp mesh, in background
        (resume("ep2_tp2_to_ep4", {"ep": 4}, "ep2_tp2"), "train"),
        (resume("re_tp_to_ep2", ep2, "ep2_tp2"), "resave"),
        (resume("re_ep2_to_ep4", {"ep": 4}, "ep2"), "resave"),
    ]
    results = run_ranks(_run_jobs, 4, jobs)[0]
    (whole, _, log, full), resumed, (tp_whole, _, _, tp_full), ep4, *_ = results

    assert "ep=2" in log and f"checkpoint: {root / 'ep2' / STEP3}" in log
    assert resumed[1] == 3 and "RNG streams restored" in resumed[2], resumed[2]
    assert resumed[0] == whole[3:]  # bitwise: weights, moments, expert biases, data position
    _check_reshard(tp_whole, ep4, "ep2 x tp2 -> ep4")
    _check_weights(root / "ep2", full)
    _check_weights(root / "ep2_tp2", tp_full)
    _check_same_tensors(root / "ep2_tp2" / STEP3, root / "re_tp_to_ep2" / STEP3)
    _check_same_tensors(root / "ep2" / STEP3, root / "re_ep2_to_ep4" / STEP3)

    one, _ = _in_one_process(
        [(resume("ep2_to_one", {}, "ep2"), "train"), (resume("re_one", {}, "ep2_tp2"), "resave")]
    )
    _check_reshard(whole, one, "ep2 x dp4 zero1 -> one process")
    _check_same_tensors(root / "ep2_tp2" / STEP3, root / "re_one" / STEP3)


def test_ep1_moe_resume_in_one_process_is_bitwise(job):
    _, make, resume = job
    whole, resumed = _in_one_process(
        [(make("one", {}, dropout=0.1), "train"), (resume("one_again", {}, "one", 0.1), "train")]
    )
    assert resumed[1] == 3 and "RNG streams restored" in resumed[2]
    assert resumed[0] == whole[0][3:]


@pytest.mark.slow
def test_ep2_tp2_resume_and_reshard_matrix(job):
    """ep2 x tp2 with dropout resumes bitwise; ep2 x tp2 -> ep2 x dp4 (ZeRO-1), tp2 x ep1,
    ep2 x pp2; ep2 x pp2 -> ep4 (ZeRO-1) and one process; re-saved under tp2 x ep1,
    ep2 x pp2 and ep4 x tp1 from ep2 x tp2 and ep2 x pp2: the same tensors; a weights-only
    MoE checkpoint (``write_model_weights``) loaded under ep2 x tp2 and saved: the same."""
    root, make, resume = job
    ep2_tp2 = {"ep": 2, "tp": 2, "zero1": True}
    config = prepare(validate(make("m_fresh", {})), 1).model
    fresh = GPT(config, single_context(config, select_backend("cpu"))).state_dict()
    imported = write_model_weights(root / "imported", fresh, config)
    jobs = [
        (make("m_drop", ep2_tp2, dropout=0.1), "train"),
        (resume("m_drop_resumed", ep2_tp2, "m_drop", dropout=0.1), "train"),
        (make("m_tp", ep2_tp2), "train"),
        (resume("m_tp_ep2", {"ep": 2, "zero1": True}, "m_tp"), "train"),
        (resume("m_tp_tp2", {"tp": 2}, "m_tp"), "train"),
        (resume("m_tp_pp2", {"ep": 2, "pp": 2}, "m_tp"), "train"),
        (make("m_pp", {"ep": 2, "pp": 2}), "train"),
        (resume("m_pp_ep4", {"ep": 4, "zero1": True}, "m_pp"), "train"),
        (resume("m_re_tp2", {"tp": 2}, "m_tp"), "resave"),
        (resume("m_re_pp2", {"ep": 2, "pp": 2}, "m_tp"), "resave"),
        (resume("m_re_ep4", {"ep": 4}, "m_pp"), "resave"),
        (make("m_w", ep2_tp2, load=str(imported)), "resave"),
    ]
    results = run_ranks(_run_jobs, 4, jobs)[0]
    (drop_whole, *_), resumed, (whole, *_), *moved = results[:6]
    (pp_whole, *_), pp_ep4 = results[6:8]
    assert results[-1][1] == 0 and "fresh optimizer, step 0" in results[-1][2]
    _check_same_tensors(imported, root / "m_w" / "step_000000", kinds=("model.",))
    assert resumed[1] == 3 and "RNG streams restored" in resumed[2]
    assert resumed[0] == drop_whole[3:]
    for (data, _), got in zip(jobs[3:6], moved, strict=True):
        _check_reshard(whole, got, data["checkpoint"]["dir"])
    _check_reshard(pp_whole, pp_ep4, "ep2 x pp2 -> ep4 zero1")
    for name, source in (("m_re_tp2", "m_tp"), ("m_re_pp2", "m_tp"), ("m_re_ep4", "m_pp")):
        _check_same_tensors(root / source / STEP3, root / name / STEP3)
    (one,) = _in_one_process([(resume("m_pp_one", {}, "m_pp"), "train")])
    _check_reshard(pp_whole, one, "ep2 x pp2 -> one process")
