"""Data-parallel reduction overlapped with the pipeline's backward, pp2 x dp2 (4 ranks).

Each model chunk's buckets are launched by that chunk's last backward (the launch
log says so: from backward, stamped with ``time.perf_counter()``, which every
process of the machine shares), while the earlier stages are still computing
theirs; the halves of a tied embedding/output weight wait for their sum over the
stages and are reduced by ``finish_grad_sync``. The trained weights still equal one
process's (the trainer's ``Engine`` in the test process), with and without ZeRO-1,
with tied embeddings, with two chunks per rank (interleaved 1F1B) and under the
zero-bubble schedule (buckets launched by each chunk's last W).
"""

from __future__ import annotations

import io
import time

import pytest
import torch

from mtcore.data import lm_batches
from mtcore.models.gpt import GPTConfig
from mtcore.parallel.layout import Axis, LayoutSpec, ParallelLayout
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

RTOL = 1e-5
STEPS, BATCH, MB = 2, 8, 2
SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
MODELS = {
    "llama": GPTConfig(style="llama", init_std=0.1, **SIZES),
    "gpt2": GPTConfig(style="gpt2", init_std=0.1, **SIZES),  # tied output
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
# name: (model, extra layout, zero1)
CASES = {
    "pp2_dp2": ("llama", {}, False),
    "pp2_dp2_tied": ("gpt2", {}, False),
    "pp2_dp2_tied_zero1": ("gpt2", {}, True),
    "pp2_dp2_vpp2_zero1": ("llama", {"vpp": 2}, True),
    "pp2_dp2_zb_h1": ("llama", {}, False),
    "pp2_dp2_tied_zero1_zb_h1": ("gpt2", {}, True),
}
# Zero bubble: the weight gradients accumulate in W, so each chunk's last W launches them.
SCHEDULES = {"pp2_dp2_zb_h1": "zb_h1", "pp2_dp2_tied_zero1_zb_h1": "zb_h1"}


def _batches():
    g = torch.Generator().manual_seed(11)
    shape = (STEPS, BATCH, SIZES["seq_len"])
    return torch.randint(0, 64, shape, generator=g), torch.randint(0, 64, shape, generator=g)


def _run(engine: Engine, tokens, targets, rows: slice):
    out = {"loss": []}
    for step in range(STEPS):
        x, y = tokens[step][rows].split(MB), targets[step][rows].split(MB)
        result = engine.train_step(lm_batches(x, y))
        assert not result.skipped, result
        out["loss"].append(result.loss)
    out["weights"] = engine.full_state_dict()
    return out


def _timed(runner, stamps: list[float]):
    """Wrap ``runner.step`` to note when this rank's pipeline work (its last backward) ended."""
    step = runner.step

    def wrapped(*args, **kwargs):
        stats = step(*args, **kwargs)
        stamps.append(time.perf_counter())
        return stats

    runner.step = wrapped


def _rank_main(ctx, tokens, targets):
    results = {}
    for name, (model, extra, zero1) in CASES.items():
        spec = LayoutSpec(pp=2, dp=2, **extra)
        layout = ParallelLayout.build(spec, ctx.backend.collective, ctx.rank, ctx.world_size)
        dp_rank, local = layout.dp_cp.rank, BATCH // 2
        engine = Engine(
            MODELS[model], layout, ctx.backend, micro_batch_size=MB, num_microbatches=local // MB,
            optimizer=OPT, seed=3, zero=int(zero1), bucket_size=300,
            schedule=SCHEDULES.get(name, "1f1b"),
        )  # fmt: skip
        stamps: list[float] = []
        _timed(engine.runner, stamps)
        out = _run(engine, tokens, targets, slice(dp_rank * local, (dp_rank + 1) * local))
        ddp = engine.ddp
        out["log"] = list(ddp.launch_log)  # the last step's launches
        out["deferred"] = {b.index for b in ddp.buckets if b.buffer.deferred}
        out["chunks"] = {b.index: b.buffer.chunk for b in ddp.buckets}
        out["pipeline_done"] = stamps[-1]
        out["pp_rank"], out["dp_rank"] = layout.coordinate(Axis.PP), dp_rank
        results[name] = out
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


def _reference(name, tokens, targets):
    from mtcore.backend import select_backend

    model, _, _ = CASES[name]
    engine = Engine(
        MODELS[model], ParallelLayout.single(), select_backend("cpu"), micro_batch_size=MB,
        num_microbatches=BATCH // MB, optimizer=OPT, seed=3,
    )  # fmt: skip
    return _run(engine, tokens, targets, slice(None))


@pytest.fixture(scope="module")
def runs():
    tokens, targets = _batches()
    ranks = run_ranks(_rank_main, 4, tokens, targets)
    ranks = [torch.load(io.BytesIO(r), weights_only=False) for r in ranks]
    return {name: [r[name] for r in ranks] for name in CASES}, tokens, targets


@pytest.mark.parametrize("case", list(CASES))
def test_matches_one_process(runs, case):
    by_case, tokens, targets = runs
    ranks, ref = by_case[case], _reference(case, tokens, targets)
    for rank, got in enumerate(ranks):
        for step in range(STEPS):
            err = abs(got["loss"][step] - ref["loss"][step]) / abs(ref["loss"][step])
            assert err <= RTOL, (
                f"{case} rank {rank} step {step}: {got['loss'][step]} vs {ref['loss'][step]}"
            )
    weights = ranks[0]["weights"]
    assert set(weights) == set(ref["weights"]), case
    for name, want in ref["weights"].items():
        err = rel_error(weights[name], want)
        assert err <= RTOL, f"{case}: {name}: rel err {err:.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_each_chunk_is_reduced_from_its_last_backward(runs, case):
    ranks = runs[0][case]
    tied = MODELS[CASES[case][0]].tie_embeddings
    for r in ranks:
        log = r["log"]
        assert sorted(rec.bucket for rec in log) == sorted(r["chunks"]), "every bucket once"
        for rec in log:  # tied halves wait for their sum over the stages; the rest does not
            assert rec.from_backward == (rec.bucket not in r["deferred"]), rec
        assert bool(r["deferred"]) == tied, r["deferred"]
    if case in SCHEDULES:  # the last stage's W passes end beside stage 0's: no order
        return
    first_stage = {r["dp_rank"]: r for r in ranks if r["pp_rank"] == 0}
    for r in ranks:
        if r["pp_rank"] != 1:
            continue
        # The last stage's buckets went out while stage 0 was still in its backward.
        done = first_stage[r["dp_rank"]]["pipeline_done"]
        launched = [rec.time_s for rec in r["log"] if rec.from_backward]
        assert launched and max(launched) < done, (max(launched), done)
        # ... and before the last stage's own pipeline work ended (sends, waits).
        assert max(launched) < r["pipeline_done"]


def test_interleaved_chunk_one_goes_before_chunk_zero_finishes(runs):
    for r in runs[0]["pp2_dp2_vpp2_zero1"]:
        by_chunk: dict[int, list[float]] = {}
        for rec in r["log"]:
            by_chunk.setdefault(rec.chunk, []).append(rec.time_s)
        assert sorted(by_chunk) == [0, 1]
        # chunk 1 (the later virtual stage) finishes its backward first on every rank
        assert max(by_chunk[1]) < min(by_chunk[0]) < r["pipeline_done"]
