"""BERT trains the same under any layout as in one process (gloo, two spawns).

Every case runs the trainer's ``Engine`` for three optimizer steps on the same
global batches (fp32, clipping active), in micro-batches of 2, and is compared
with a one-process ``Engine`` that takes each global batch as one micro-batch
(the plain token-weighted mean): the loss and its terms (MLM, pair) at every step, the gradient norm,
every gradient of the first step (gathered whole), the evaluation metrics and
the weights after the last step, relative error <= 1e-5.

The batches pad every sequence to a different length and the two halves of the
global batch differ a lot (short sequences first), so the ranks of a dp2 run hold
different numbers of masked tokens: a mean of micro-batch means (over
micro-batches or dp) would not match one process.
"""

from __future__ import annotations

import io

import pytest
import torch

from mtcore.distributed import LayoutSpec, ParallelLayout
from mtcore.models.bert import BertConfig
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

RTOL = 1e-5
STEPS, BATCH, MB, SEQ, VOCAB, PAD = 3, 8, 2, 16, 64, 4
SIZES = dict(vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4, seq_len=SEQ)
MODELS = {
    "nsp": BertConfig(dropout=0.0, init_std=0.1, pair_task="nsp", **SIZES),
    "nsp_full": BertConfig(dropout=0.0, init_std=0.1, pair_task="nsp", recompute="full", **SIZES),
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
# name: (world, model, layout, zero1)
CASES = {
    "tp2": (2, "nsp", dict(tp=2), False),
    "tp2_sp": (2, "nsp", dict(tp=2, sequence_parallel=True), False),
    "pp2": (2, "nsp", dict(pp=2), False),
    "pp2_vpp2": (2, "nsp", dict(pp=2, vpp=2), False),
    "dp2_zero1": (2, "nsp", dict(dp=2), True),
    "tp2_pp2": (4, "nsp", dict(tp=2, pp=2), False),
    "tp2_dp2_full": (4, "nsp_full", dict(tp=2, dp=2), False),
}


def _batches() -> list[list[dict[str, torch.Tensor]]]:
    """STEPS global batches of BATCH padded sentence pairs, shortest first."""
    g = torch.Generator().manual_seed(11)
    steps = []
    for _ in range(STEPS):
        lengths = torch.sort(torch.randint(5, SEQ + 1, (BATCH,), generator=g)).values
        lengths[: BATCH // 2] = torch.clamp(lengths[: BATCH // 2] // 2, min=5)
        positions = torch.arange(SEQ)[None, :]
        real = positions < lengths[:, None]
        tokens = torch.randint(PAD + 1, VOCAB, (BATCH, SEQ), generator=g).masked_fill(~real, PAD)
        split = (lengths // 2)[:, None]
        token_types = ((positions >= split) & real).long()
        masked = (torch.rand(BATCH, SEQ, generator=g) < 0.3) & real
        masked[:, 1] = True  # at least one masked token per sequence
        labels = torch.randint(PAD + 1, VOCAB, (BATCH, SEQ), generator=g).masked_fill(~masked, -100)
        pair = torch.randint(0, 2, (BATCH,), generator=g)
        full = dict(tokens=tokens, token_types=token_types, padding_mask=real, labels=labels, pair_labels=pair)
        steps.append(full)
    return steps


def _micro(batch: dict[str, torch.Tensor], rows: slice, size: int = MB) -> list[dict[str, torch.Tensor]]:
    local = {name: t[rows] for name, t in batch.items()}
    count = next(iter(local.values())).shape[0]
    return [{n: t[i : i + size] for n, t in local.items()} for i in range(0, count, size)]


def _full_grads(engine: Engine) -> dict[str, torch.Tensor] | None:
    """The reduced (and clipped) gradients, gathered whole like the weights: the
    parameters are pointed at their gradient buffers for one ``full_state_dict``."""
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.view_as(p)
    try:
        return engine.full_state_dict()
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data


def _run(engine: Engine, batches, rows: slice, grads: bool = True, size: int = MB) -> dict:
    out = {"loss": [], "terms": [], "norm": []}
    for step, batch in enumerate(batches):
        result = engine.train_step(_micro(batch, rows, size))
        assert not result.skipped, result
        out["loss"].append(result.loss)
        out["terms"].append(result.terms)
        out["norm"].append(result.grad_norm)
        if step == 0 and grads:
            out["grads"] = _full_grads(engine)
    out["eval"] = engine.evaluate(_micro(batches[0], rows, size))
    out["weights"] = engine.full_state_dict()
    return out


def _engine(name: str, layout, backend, local: int, size: int = MB) -> Engine:
    _, model, _, zero1 = CASES[name]
    return Engine(
        MODELS[model],
        layout,
        backend,
        micro_batch_size=size,
        num_microbatches=local // size,
        optimizer=OPT,
        seed=5,
        zero1=zero1,
        bucket_size=700,
    )


def _rank_main(ctx, names, batches):
    results = {}
    for name in names:
        world, _, layout_kw, zero1 = CASES[name]
        layout = ParallelLayout.build(LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, world)
        dp, dp_rank = layout.size("dp"), layout.coordinate("dp")
        local = BATCH // dp
        engine = _engine(name, layout, ctx.backend, local)
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        results[name] = _run(engine, batches, rows, grads=not zero1)
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


def _reference(name: str, batches):
    from mtcore.backend import select_backend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # The whole global batch in one micro-batch: the plain token-weighted mean.
        engine = _engine(name, ParallelLayout.single(), select_backend("cpu"), BATCH, BATCH)
        return _run(engine, batches, slice(None), size=BATCH)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs():
    batches = _batches()
    out, references = {}, {}
    for world in (2, 4):
        names = [n for n, case in CASES.items() if case[0] == world]
        ranks = run_ranks(_rank_main, world, names, batches)
        ranks = [torch.load(io.BytesIO(r), weights_only=False) for r in ranks]
        for name in names:
            model = CASES[name][1]
            if model not in references:
                references[model] = _reference(name, batches)
            out[name] = ([r[name] for r in ranks], references[model])
    return out


def _close(got: float, want: float) -> bool:
    return abs(got - want) <= RTOL * max(abs(want), 1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_bert_layout_matches_one_process(runs, case):
    ranks, ref = runs[case]
    for rank, got in enumerate(ranks):
        for step in range(STEPS):
            assert _close(got["loss"][step], ref["loss"][step]), (case, rank, step, got["loss"], ref["loss"])
            for term, value in ref["terms"][step].items():
                assert _close(got["terms"][step][term], value), (case, rank, step, term)
            assert _close(got["norm"][step], ref["norm"][step]), (case, rank, step, got["norm"], ref["norm"])
        assert set(got["eval"]) == set(ref["eval"]) == {"loss", "mlm", "pair", "mlm_accuracy", "pair_accuracy"}
        for metric, value in ref["eval"].items():
            assert _close(got["eval"][metric], value), (case, rank, metric, got["eval"][metric], value)
    for what in ("weights", "grads"):
        if what == "grads" and CASES[case][3]:
            continue  # a ZeRO-1 rank holds only its shard of the reduced gradients
        gathered = ranks[0][what]
        assert gathered is not None and set(gathered) == set(ref[what]), (case, what)
        for name, want in ref[what].items():
            err = rel_error(gathered[name], want)
            assert err <= RTOL, f"{case}: {what} {name}: rel err {err:.2e}"


def test_the_batches_weight_ranks_unequally(runs):
    """The two dp halves hold different numbers of masked tokens (the weighting matters),
    and clipping was active (the clipped path is what matched)."""
    batches = _batches()
    halves = [(b["labels"][rows] != -100).sum().item() for b in batches for rows in (slice(0, 4), slice(4, 8))]
    assert any(halves[i] != halves[i + 1] for i in range(0, len(halves), 2)), halves
    _, ref = runs["tp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]
