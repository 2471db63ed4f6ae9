"""Checkpoints across ranks: exact resume under tp=2 x pp=2 and tp=2 x dp=2 with ZeRO-1,
and resharding: a checkpoint saved under one layout continues under another.

Each job is the real trainer loop (``trainer._Loop``) on gloo ranks. Exact resume:
``steps`` in one go == ``k`` steps, stop, resume, the rest; bitwise (fp32, with
dropout under the same layout, so RNG streams matter). Resharding: the resumed
losses equal the unbroken run's within ``RESHARD_RTOL`` (reduction order differs
across layouts, so bitwise is not expected; measured differences are ~1e-7).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from mtcore.parallel.layout import ParallelLayout
from mtcore.testing.distributed import run_ranks
from mtcore.training.overrides import validate
from mtcore.training.trainer import _Loop, prepare, train

RESHARD_RTOL = 1e-5
MODEL = dict(
    hidden_size=32, num_layers=4, num_heads=8, num_kv_heads=4, ffn_hidden_size=64, seq_len=16
)
BERT = dict(family="bert", hidden_size=32, num_layers=4, num_heads=8, ffn_hidden_size=64, seq_len=16)


WORDS = ("alpha", "beta", "gamma", "delta", "token", "layer", "rank", "shard")


def _run_jobs(ctx, jobs: list[dict]) -> list[tuple[list[float], int, str]]:
    """Train each config in turn on these ranks: (losses, start step, rank 0's log)."""
    out = []
    for data in jobs:
        config = validate(data)
        prep = prepare(config, ctx.world_size)
        layout = ParallelLayout.build(prep.spec, ctx.backend.collective, ctx.rank, ctx.world_size)
        stream = io.StringIO()
        result = _Loop(config, prep, layout, ctx.backend, ctx.rank == 0, stream).run()
        out.append((result.losses, result.start_step, stream.getvalue()))
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory, write_code_corpus):
    root = tmp_path_factory.mktemp("ckpt")
    corpus = write_code_corpus(root / "docs", n_docs=16, n_lines=30, words=WORDS)

    def make(name: str, parallel: dict, dropout=0.0, style="llama", **checkpoint) -> dict:
        model = {**MODEL, "dropout": dropout, "style": style}
        if style == "gpt2":  # tied embedding: a copy of it on the last pipeline stage
            model.pop("ffn_hidden_size")
        if style == "bert":  # the tied MLM decoder: a copy on the last pipeline stage
            model = {**BERT, "dropout": dropout}
        return {
            "model": model,
            "parallel": parallel,
            "precision": {"dtype": "fp32"},
            "data": dict(paths=[str(corpus)], vocab_size=300, cache_dir=str(root / "cache"),
                         valid_fraction=0.2),
            "optimizer": dict(lr=1e-2, min_lr=1e-3, warmup_steps=2),
            "training": dict(steps=6, global_batch_size=8, micro_batch_size=2, eval_interval=0,
                             sample_prompt=None),
            "checkpoint": {"dir": str(root / name / "checkpoints"), "interval": 3, **checkpoint},
            "logging": dict(interval=1, tensorboard_dir=None, progress="lines"),
        }

    prepare(validate(make("warm", {})), 4)  # builds the data cache once, before ranks map it
    prepare(validate(make("warm_bert", {}, style="bert")), 4)  # and the BERT tokenizer
    return root, make


def _resume(make, name: str, parallel: dict, source: Path, **extra) -> dict:
    return make(name, parallel, load=str(source / "step_000003"), **extra)


def _check_reshard(whole: list[float], resumed: tuple, what: str) -> None:
    losses, start, log = resumed
    assert start == 3 and "reseeded (the layout changed)" in log, what
    for a, b in zip(whole[3:], losses, strict=True):
        assert abs(a - b) <= RESHARD_RTOL * abs(a), (what, whole[3:], losses)


def test_exact_resume_tp2_pp2_and_zero1_then_reshard_to_pp4_and_one_process(job):
    root, make = job
    tp_pp, zero = {"tp": 2, "pp": 2}, {"tp": 2, "dp": 2, "zero1": True}
    source = root / "zero" / "checkpoints"
    jobs = [
        make("tp_pp", tp_pp, dropout=0.1, style="gpt2"),
        _resume(
            make, "tp_pp_resumed", tp_pp, root / "tp_pp" / "checkpoints", dropout=0.1, style="gpt2"
        ),
        make("zero", zero, async_save=True),  # the step-3 save is written in the background
        _resume(make, "zero_resumed", zero, source),
        _resume(make, "to_pp4", {"pp": 4}, source),
    ]
    results = run_ranks(_run_jobs, 4, jobs)[0]
    (tp_pp_whole, _, _), tp_pp_resumed, (zero_whole, _, _), zero_resumed, pp4 = results

    assert tp_pp_resumed[1] == 3 and "RNG streams restored" in tp_pp_resumed[2]
    assert tp_pp_resumed[0] == tp_pp_whole[3:]  # bitwise, dropout included
    assert zero_resumed[1] == 3 and zero_resumed[0] == zero_whole[3:]  # bitwise
    _check_reshard(zero_whole, pp4, "tp2 x dp2 zero1 -> pp4")

    stream = io.StringIO()
    one = train(validate(_resume(make, "to_one", {}, source)), stream=stream)
    _check_reshard(zero_whole, (one.losses, one.start_step, stream.getvalue()), "-> one process")


# slow: the GPT twin above (tp2 x pp2 + ZeRO-1 -> pp4 and one process) stays in the
# default suite; BERT's checkpoints reshard through the same layout-neutral code.
@pytest.mark.slow
def test_bert_exact_resume_then_reshard_to_pp4_and_one_process(job):
    """BERT (padding, masks, the tied MLM decoder split over the pipeline) resumes bitwise
    under tp2 x pp2 with dropout and under tp2 x dp2 with ZeRO-1, and continues under
    pp4 and in one process."""
    root, make = job
    tp_pp, zero = {"tp": 2, "pp": 2}, {"tp": 2, "dp": 2, "zero1": True}
    source = root / "b_zero" / "checkpoints"
    jobs = [
        make("b_tp_pp", tp_pp, dropout=0.1, style="bert"),
        _resume(make, "b_tp_pp_again", tp_pp, root / "b_tp_pp" / "checkpoints", dropout=0.1, style="bert"),
        make("b_zero", zero, style="bert"),
        _resume(make, "b_zero_again", zero, source, style="bert"),
        _resume(make, "b_pp4", {"pp": 4}, source, style="bert"),
    ]
    (tp_pp_whole, _, log), tp_pp_again, (zero_whole, _, _), zero_again, pp4 = run_ranks(
        _run_jobs, 4, jobs
    )[0]
    assert "BERT" in log and "pair task nsp" in log
    assert tp_pp_again[1] == 3 and tp_pp_again[0] == tp_pp_whole[3:]  # bitwise, dropout included
    assert zero_again[1] == 3 and zero_again[0] == zero_whole[3:]
    _check_reshard(zero_whole, pp4, "bert tp2 x dp2 zero1 -> pp4")
    stream = io.StringIO()
    one = train(validate(_resume(make, "b_one", {}, source, style="bert")), stream=stream)
    _check_reshard(zero_whole, (one.losses, one.start_step, stream.getvalue()), "bert -> one process")


def test_zb_h1_resumes_bitwise_and_trains_as_1f1b(job):
    """GPT-2 (tied copy on the last stage) with dropout under pp2 and the zero-bubble
    schedule: 3 steps, stop, resume gives the unbroken run's losses bitwise, and those
    are 1F1B's (the forwards, and so the dropout draws, come in the same order)."""
    root, make = job
    zb = {"pp": 2, "schedule": "zb_h1"}
    jobs = [
        make("zb", zb, dropout=0.1, style="gpt2"),
        _resume(make, "zb_again", zb, root / "zb" / "checkpoints", dropout=0.1, style="gpt2"),
        make("zb_twin", {"pp": 2}, dropout=0.1, style="gpt2"),
    ]
    (whole, _, _), again, (twin, _, _) = run_ranks(_run_jobs, 2, jobs)[0]
    assert again[1] == 3 and again[0] == whole[3:]  # bitwise
    assert whole == twin and len(whole) == 6


@pytest.mark.slow
def test_resharding_matrix(job):
    """Saved under tp2 x dp2 (ZeRO-1), tp2 x pp2 and (GPT-2, tied) pp2 x vpp2 x dp2; loaded
    under tp4, dp4 (with and without ZeRO-1), pp4, tp2 x pp2 and one process."""
    root, make = job
    vpp = {"pp": 2, "vpp": 2, "schedule": "interleaved_1f1b", "dp": 2}
    zero_src, tp_pp_src = root / "m_zero" / "checkpoints", root / "m_tp_pp" / "checkpoints"
    jobs = [
        make("m_zero", {"tp": 2, "dp": 2, "zero1": True}),
        make("m_tp_pp", {"tp": 2, "pp": 2}),
        _resume(make, "m_zero_tp4", {"tp": 4}, zero_src),
        _resume(make, "m_zero_dp4", {"dp": 4}, zero_src),
        _resume(make, "m_tp_pp_dp4z", {"dp": 4, "zero1": True}, tp_pp_src),
        _resume(make, "m_tp_pp_tp4", {"tp": 4}, tp_pp_src),
        _resume(make, "m_tp_pp_pp4", {"pp": 4}, tp_pp_src),
        _resume(make, "m_zero_tp_pp", {"tp": 2, "pp": 2}, zero_src),
        make("m_vpp", vpp, style="gpt2"),
        _resume(make, "m_vpp_tp4", {"tp": 4}, root / "m_vpp" / "checkpoints", style="gpt2"),
    ]
    results = run_ranks(_run_jobs, 4, jobs)[0]
    (zero_whole, _, _), (tp_pp_whole, _, _), *resumed, (vpp_whole, _, _), vpp_tp4 = results
    wholes = [zero_whole, zero_whole, tp_pp_whole, tp_pp_whole, tp_pp_whole, zero_whole]
    for data, whole, got in zip(jobs[2:8], wholes, resumed, strict=True):
        _check_reshard(whole, got, data["checkpoint"]["dir"])
    _check_reshard(vpp_whole, vpp_tp4, "gpt2 pp2 x vpp2 (tied copy) -> tp4")
    stream = io.StringIO()
    one = train(validate(_resume(make, "m_one", {}, tp_pp_src)), stream=stream)
    _check_reshard(tp_pp_whole, (one.losses, one.start_step, stream.getvalue()), "tp2 x pp2 -> one")


@pytest.mark.slow
def test_issue_example_tp2_pp2_zero1_dp2_on_8_ranks_to_tp4_pp4_dp4_and_one(job):
    """The issue's example: saved under tp=2 x pp=2 with ZeRO-1 over dp=2 (8 ranks), then
    continued in one process and under tp=4, pp=4 and dp=4 (4 ranks)."""
    root, make = job
    source = root / "e8" / "checkpoints"
    ((whole, _, _),) = run_ranks(_run_jobs, 8, [make("e8", {"tp": 2, "pp": 2, "zero1": True})])[0]
    targets = {"tp4": {"tp": 4}, "pp4": {"pp": 4}, "dp4": {"dp": 4, "zero1": True}}
    jobs = [_resume(make, f"e8_{name}", parallel, source) for name, parallel in targets.items()]
    for name, got in zip(targets, run_ranks(_run_jobs, 4, jobs)[0], strict=True):
        _check_reshard(whole, got, f"tp2 x pp2 x dp2 zero1 -> {name}")
    stream = io.StringIO()
    one = train(validate(_resume(make, "e8_one", {}, source)), stream=stream)
    _check_reshard(whole, (one.losses, one.start_step, stream.getvalue()), "-> one process")
