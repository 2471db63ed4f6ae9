"""T5 trains the same under any layout as in one process (gloo, two spawns).

Every case runs the trainer's ``Engine`` for three optimizer steps on the same global
batches (fp32, clipping active), in micro-batches of 2, and is compared with a
one-process ``Engine`` that takes each global batch as one micro-batch (the plain
token-weighted mean): the loss at every step, the gradient norm, every gradient of the
first step (gathered whole), the evaluation metrics and the weights after the last
step, relative error <= 1e-5.

The pipeline cases put the encoder/decoder boundary at a stage boundary
(2 + 2 layers over pp2) and inside the second stage's run (2 + 4 layers: stage 0 holds
the encoder and the decoder's first layer), a tied head whose copy lives on the last
stage, and interleaved virtual stages (the encoder on rank 0 and rank 1's first chunks). Encoder inputs and targets are padded to a different length per sequence
and the two dp halves hold different numbers of target tokens, so a mean of
micro-batch means would not match one process.
"""

from __future__ import annotations

import io

import pytest
import torch

from mtcore.distributed import LayoutSpec, ParallelLayout
from mtcore.models.t5 import T5Config
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks
from mtcore.training.config import OptimizerConfig
from mtcore.training.engine import Engine

RTOL = 1e-5
STEPS, BATCH, MB, SEQ, DEC, VOCAB, PAD = 3, 8, 2, 16, 8, 64, 0
SIZES = dict(
    vocab_size=VOCAB, hidden_size=32, num_heads=4, ffn_hidden_size=64, seq_len=SEQ,
    decoder_seq_len=DEC, relative_buckets=8, relative_max_distance=12, dropout=0.0,
)  # fmt: skip
MODELS = {
    "base": T5Config(**SIZES),
    "deep_decoder": T5Config(decoder_layers=4, **SIZES),
    "tied": T5Config(tie_embeddings=True, **SIZES),
    "full": T5Config(recompute="full", **SIZES),
    "selective": T5Config(recompute="selective", **SIZES),
}
OPT = OptimizerConfig(lr=1e-2, eps=1e-3, warmup_steps=0, max_grad_norm=0.5)
# name: (world, model, layout, zero1)
CASES = {
    "tp2": (2, "base", dict(tp=2), False),
    "tp2_sp": (2, "base", dict(tp=2, sequence_parallel=True), False),
    "pp2_at_boundary": (2, "base", dict(pp=2), False),
    "pp2_inside_decoder": (2, "deep_decoder", dict(pp=2), False),
    "pp2_tied": (2, "tied", dict(pp=2), False),
    "pp2_vpp2": (2, "base", dict(pp=2, vpp=2), False),
    "dp2_zero1": (2, "base", dict(dp=2), True),
    "dp2_selective": (2, "selective", dict(dp=2), False),
    "tp2_pp2": (4, "deep_decoder", dict(tp=2, pp=2), False),
    "tp2_dp2_full": (4, "full", dict(tp=2, dp=2), False),
    "tp2_pp2_sp_tied": (4, "tied", dict(tp=2, pp=2, sequence_parallel=True), False),
}


def _batches() -> list[dict[str, torch.Tensor]]:
    """STEPS global batches of BATCH padded pairs (input, target), shortest first."""
    g = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(STEPS):
        enc_len = torch.sort(torch.randint(3, SEQ + 1, (BATCH,), generator=g)).values
        dec_len = torch.sort(torch.randint(2, DEC + 1, (BATCH,), generator=g)).values
        enc_len[: BATCH // 2] = torch.clamp(enc_len[: BATCH // 2] // 2, min=3)
        dec_len[: BATCH // 2] = torch.clamp(dec_len[: BATCH // 2] // 2, min=2)
        enc_real = torch.arange(SEQ)[None, :] < enc_len[:, None]
        dec_real = torch.arange(DEC)[None, :] < dec_len[:, None]
        tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g).masked_fill(~enc_real, PAD)
        target = torch.randint(1, VOCAB, (BATCH, DEC), generator=g)
        decoder = torch.cat([torch.full((BATCH, 1), PAD), target[:, :-1]], 1).masked_fill(
            ~dec_real, PAD
        )
        labels = target.masked_fill(~dec_real, -100)
        steps.append(
            dict(tokens=tokens, padding_mask=enc_real, decoder_tokens=decoder, labels=labels)
        )
    return steps


def _micro(
    batch: dict[str, torch.Tensor], rows: slice, size: int = MB
) -> list[dict[str, torch.Tensor]]:
    local = {name: t[rows] for name, t in batch.items()}
    count = next(iter(local.values())).shape[0]
    return [{n: t[i : i + size] for n, t in local.items()} for i in range(0, count, size)]


def _full_grads(engine: Engine) -> dict[str, torch.Tensor] | None:
    """The reduced (and clipped) gradients, gathered whole like the weights."""
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
    out = {"loss": [], "norm": []}
    for step, batch in enumerate(batches):
        result = engine.train_step(_micro(batch, rows, size))
        assert not result.skipped, result
        out["loss"].append(result.loss)
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
        layout = ParallelLayout.build(
            LayoutSpec(**layout_kw), ctx.backend.collective, ctx.rank, world
        )
        local = BATCH // layout.size("dp")
        engine = _engine(name, layout, ctx.backend, local)
        rows = slice(layout.coordinate("dp") * local, (layout.coordinate("dp") + 1) * local)
        results[name] = _run(engine, batches, rows, grads=not zero1)
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


def _reference(name: str, batches):
    from mtcore.backend import select_backend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
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
def test_t5_layout_matches_one_process(runs, case):
    ranks, ref = runs[case]
    for rank, got in enumerate(ranks):
        for step in range(STEPS):
            assert _close(got["loss"][step], ref["loss"][step]), (
                case,
                rank,
                step,
                got["loss"],
                ref["loss"],
            )
            assert _close(got["norm"][step], ref["norm"][step]), (
                case,
                rank,
                step,
                got["norm"],
                ref["norm"],
            )
        assert set(got["eval"]) == set(ref["eval"]) == {"loss", "lm", "accuracy"}
        for metric, value in ref["eval"].items():
            assert _close(got["eval"][metric], value), (
                case,
                rank,
                metric,
                got["eval"][metric],
                value,
            )
    for what in ("weights", "grads"):
        if what == "grads" and CASES[case][3]:
            continue  # a ZeRO-1 rank holds only its shard of the reduced gradients
        gathered = ranks[0][what]
        assert gathered is not None and set(gathered) == set(ref[what]), (case, what)
        for name, want in ref[what].items():
            err = rel_error(gathered[name], want)
            assert err <= RTOL, f"{case}: {what} {name}: rel err {err:.2e}"


def test_the_batches_weight_ranks_unequally(runs):
    """The dp halves hold different numbers of target tokens (the weighting matters),
    and clipping was active (the clipped path is what matched)."""
    batches = _batches()
    halves = [
        (b["labels"][rows] != -100).sum().item()
        for b in batches
        for rows in (slice(0, 4), slice(4, 8))
    ]
    assert any(halves[i] != halves[i + 1] for i in range(0, len(halves), 2)), halves
    _, ref = runs["tp2"]
    assert min(ref["norm"]) > OPT.max_grad_norm, ref["norm"]
