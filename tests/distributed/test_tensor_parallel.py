"""Tensor and sequence parallelism equal one process (gloo, 2 ranks, one spawn).

Every check runs inside one ``run_ranks`` call (a spawn costs seconds); each
rank also computes the one-process reference locally, with a tp=1 model built
from the same seed. Ranks return numbers; the tests below assert on them.
Tolerance: fp32, relative error ``||a - b|| / ||b|| <= 1e-5``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtcore.models.gpt import GPTConfig, build_gpt
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
    copy_to_tp,
    full_tensors,
    gather_from_sp,
    gather_from_tp,
    load_full_tensors,
    model_parallel_seed,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
    vocab_parallel_cross_entropy,
)
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks

RTOL = 1e-5
SEED = 1234
SIZES = dict(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    ffn_hidden_size=48, seq_len=16, bias=True, init_std=0.1,
)  # fmt: skip
BASE = GPTConfig(**SIZES)
# name: (config overrides, sequence parallel, dtype); float64 shows the code is exact, not close
CASES = {
    "tp2": ({}, False, torch.float32),
    "tp2_full": ({"recompute": "full"}, False, torch.float32),
    "tp2_sp": ({}, True, torch.float32),
    "tp2_sp_full": ({"recompute": "full"}, True, torch.float32),
    "tp2_sp_selective": ({"recompute": "selective"}, True, torch.float32),
    "tp2_sp_float64": ({}, True, torch.float64),
    # Attention-probability dropout: each head's mask is hashed from its global index,
    # so tp (and sp, and full recompute) draw one process's masks.
    "tp2_attention_dropout": ({"attention_dropout": 0.3}, False, torch.float32),
    "tp2_sp_full_attention_dropout": (
        {"attention_dropout": 0.3, "recompute": "full"}, True, torch.float32,
    ),
}
RTOL_OF = {torch.float32: RTOL, torch.float64: 1e-12}
STEPS = 3
LR = 0.1


# -- rank side ---------------------------------------------------------------------------
def _config(**overrides) -> GPTConfig:
    return GPTConfig(**{**SIZES, **overrides})


def _model(cfg: GPTConfig, layout, backend):
    (model,) = build_gpt(cfg, layout, backend, seed=SEED)
    return model


def _full(model, grads: bool = False) -> dict:
    return full_tensors(model, model.tp, grads=grads)


def _sum_sequence_parallel_grads(model) -> None:
    allreduce_sequence_parallel_grads(model, model.tp)


def _batches(cfg: GPTConfig, steps: int):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
        targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
        targets[0, :3] = -100  # ignored positions count in neither loss nor grads
        out.append((tokens, targets))
    return out


def _train(cfg, layout, backend, dtype=torch.float32):
    model = _model(cfg, layout, backend).to(dtype)
    init = _full(model)
    # SGD keeps param errors linear in grad errors; AdamW would blow a 1e-7
    # rounding difference in a near-zero grad element up to a full ``lr`` step.
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    losses, grads = [], []
    for tokens, targets in _batches(cfg, STEPS):
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        _sum_sequence_parallel_grads(model)
        losses.append(loss.detach())
        grads.append(_full(model, grads=True))
        opt.step()
    return init, losses, grads, _full(model)


def _equivalence(layouts, backend):
    """Max relative error per case: init, loss, every grad (each step), final params."""
    out = {}
    for name, (overrides, sp, dtype) in CASES.items():
        cfg = _config(**overrides)
        ref_init, ref_losses, ref_grads, ref_params = _train(
            cfg, ParallelLayout.single(), backend, dtype
        )
        init, losses, grads, params = _train(cfg, layouts[sp], backend, dtype)
        worst_grad = max(
            (
                (rel_error(g[k], rg[k]), f"step {i} {k}")
                for i, (g, rg) in enumerate(zip(grads, ref_grads, strict=True))
                for k in rg
            ),
        )
        out[name] = {
            "init": max(rel_error(init[k], ref_init[k]) for k in ref_init),
            "loss": max(rel_error(a, b) for a, b in zip(losses, ref_losses, strict=True)),
            "grad": worst_grad,
            "params": max(rel_error(params[k], ref_params[k]) for k in ref_params),
            "grad_names": sorted(ref_grads[0]) == sorted(grads[0]),
        }
    return out


def _mappings(tp: TPGroup):
    """Forward and backward of each mapping against its closed form."""
    g = torch.Generator().manual_seed(3)
    x_all = torch.randn(tp.size, 2, 4, 6, generator=g)  # one input per rank
    grad_all = torch.randn(tp.size, 2, 4, 6, generator=g)
    r, errs = tp.rank, {}

    def run(fn, x, grad):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(grad)
        return y.detach(), x.grad

    # copy: fwd identity, bwd sum of every rank's grad
    y, gx = run(lambda x: copy_to_tp(x, tp), x_all[r], grad_all[r])
    errs["copy_to_tp"] = max(rel_error(y, x_all[r]), rel_error(gx, grad_all.sum(0)))
    # reduce: fwd sum, bwd identity
    y, gx = run(lambda x: reduce_from_tp(x, tp), x_all[r], grad_all[0])
    errs["reduce_from_tp"] = max(rel_error(y, x_all.sum(0)), rel_error(gx, grad_all[0]))
    # scatter last dim: fwd slice of a replicated tensor, bwd gather
    grad_full = torch.cat(list(grad_all[:, :, :, :3]), dim=-1)  # what the gather builds
    y, gx = run(lambda x: scatter_to_tp(x, tp), x_all[0], grad_all[r, :, :, :3])
    errs["scatter_to_tp"] = max(rel_error(y, x_all[0].chunk(tp.size, -1)[r]), rel_error(gx, grad_full))
    # gather last dim: fwd concat, bwd slice
    y, gx = run(lambda x: gather_from_tp(x, tp), x_all[r], torch.cat([grad_all[0]] * tp.size, -1))
    errs["gather_from_tp"] = max(rel_error(y, torch.cat(list(x_all), -1)), rel_error(gx, grad_all[0]))
    # sp scatter: fwd seq shard, bwd all-gather on seq
    y, gx = run(lambda x: scatter_to_sp(x, tp), x_all[0], grad_all[r, :, :2])
    seq_full = torch.cat(list(grad_all[:, :, :2]), dim=1)
    errs["scatter_to_sp"] = max(rel_error(y, x_all[0].chunk(tp.size, 1)[r]), rel_error(gx, seq_full))
    # sp gather: fwd concat on seq, bwd reduce-scatter (sum of grads, this rank's shard)
    y, gx = run(lambda x: gather_from_sp(x, tp), x_all[r], torch.cat([grad_all[r]] * tp.size, 1))
    expect = torch.cat([grad_all.sum(0)] * tp.size, 1).chunk(tp.size, 1)[r]
    errs["gather_from_sp"] = max(rel_error(y, torch.cat(list(x_all), 1)), rel_error(gx, expect))
    # sp gather without grad reduction: bwd keeps this rank's shard
    y, gx = run(
        lambda x: gather_from_sp(x, tp, reduce_grad=False), x_all[r], torch.cat(list(grad_all), 1)
    )
    errs["gather_from_sp(no reduce)"] = rel_error(gx, grad_all[r])
    # sp reduce-scatter: fwd sum then shard, bwd all-gather
    y, gx = run(lambda x: reduce_scatter_to_sp(x, tp), x_all[r], grad_all[r, :, :2])
    errs["reduce_scatter_to_sp"] = max(rel_error(y, x_all.sum(0).chunk(tp.size, 1)[r]), rel_error(gx, seq_full))
    return errs


def _cross_entropy(tp: TPGroup):
    g = torch.Generator().manual_seed(5)
    n, v = 24, 40
    full = (3 * torch.randn(n, v, generator=g)).requires_grad_(True)
    target = torch.randint(0, v, (n,), generator=g)
    target[::5] = -100
    weights = torch.randn(n, generator=g)
    ref = F.cross_entropy(full, target, ignore_index=-100, reduction="none")
    (ref * weights).sum().backward()
    shard = full.detach().chunk(tp.size, 1)[tp.rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, tp)
    (loss * weights).sum().backward()
    ignored = target == -100
    return {
        "loss": rel_error(loss, ref),
        "grad": rel_error(shard.grad, full.grad.chunk(tp.size, 1)[tp.rank]),
        "ignored_zero": bool((loss[ignored] == 0).all() and (shard.grad[ignored] == 0).all()),
        "dtype": str(loss.dtype),
    }


def _layers(tp: TPGroup, single: TPGroup, layout):
    """gather_output / input_is_parallel=False paths and loading shards from full weights."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 4, 8, generator=g)
    errs = {}
    for name, make in (
        (
            "column_gather",
            lambda t, gen: ColumnParallelLinear(8, 6, t, gather_output=True, generator=gen),
        ),
        (
            "row_split_input",
            lambda t, gen: RowParallelLinear(8, 6, t, input_is_parallel=False, generator=gen),
        ),
    ):
        ref, par = (
            make(single, torch.Generator().manual_seed(1)),
            make(tp, torch.Generator().manual_seed(1)),
        )
        outs = []
        for m in (ref, par):
            xi = x.clone().requires_grad_(True)
            y = m(xi)
            (y * torch.arange(y.numel()).view_as(y)).sum().backward()
            outs.append((y.detach(), xi.grad, full_tensors(m, m.tp, grads=True)))
        (y0, gx0, gw0), (y1, gx1, gw1) = outs
        errs[name] = max([rel_error(y1, y0), rel_error(gx1, gx0)] + [rel_error(gw1[k], gw0[k]) for k in gw0])
    # Resharding: a model built from another seed takes the reference's full weights.
    (ref,) = build_gpt(BASE, ParallelLayout.single(), single.backend, seed=1)
    (other,) = build_gpt(BASE, layout, tp.backend, seed=2)
    load_full_tensors(other, _full(ref), tp)
    loaded, want = _full(other), _full(ref)
    errs["load_full_tensors"] = max(rel_error(loaded[k], want[k]) for k in want)
    return errs


def _rng(layouts, backend, tp: TPGroup):
    """Which dropout masks agree over tp and which differ (see tensor/random.py).

    Values go back as lists: tensors would travel as shared memory that dies with the rank.
    """
    layout = layouts[False]
    tracker = model_parallel_seed(SEED, layout, backend)
    default_a = torch.rand(64)
    with tracker.fork():
        tp_a = torch.rand(64)
    default_b = torch.rand(64)  # the fork must not advance the default stream
    model_parallel_seed(SEED, layout, backend)
    unforked = torch.rand(128)
    out = {
        "default_continues": bool(torch.equal(torch.cat([default_a, default_b]), unforked)),
        "default": tp.all_gather(default_a[None], 0).tolist(),
        "tp_stream": tp.all_gather(tp_a[None], 0).tolist(),
    }
    # The GPT's hidden dropout follows the rule: sp -> tp stream, else default.
    for sp in (False, True):
        cfg = _config(dropout=0.5)
        model = _model(cfg, layouts[sp], backend)
        mask = model.c.dropout(torch.ones(1, 4, 32), training=True) != 0
        out[f"mask_sp={sp}"] = tp.all_gather(mask[None].float(), 0).tolist()
        # Replicated parameters stay identical over tp while training with dropout.
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for tokens, targets in _batches(cfg, 2):
            opt.zero_grad()
            model(tokens, targets).backward()
            _sum_sequence_parallel_grads(model)
            opt.step()
        replicated = torch.cat(
            [p.detach().reshape(-1) for n, p in model.named_parameters() if "norm" in n]
        )
        out[f"replicas_sp={sp}"] = tp.all_gather(replicated[None], 0).tolist()
    return out


def _recompute_with_dropout(layout_sp, backend):
    """Under tp=2 + sp, dropout draws from the per-rank stream inside checkpointed
    blocks: recompute must reproduce those masks exactly (max |diff| == 0)."""
    runs = {}
    for mode in ("none", "full", "selective"):
        cfg = _config(dropout=0.2, recompute=mode)
        model = _model(cfg, layout_sp, backend)
        tokens, targets = _batches(cfg, 1)[0]
        loss = model(tokens, targets)
        loss.backward()
        _sum_sequence_parallel_grads(model)
        runs[mode] = (loss.detach(), _full(model, grads=True))
    loss0, grads0 = runs["none"]
    return {
        mode: max(
            [(loss - loss0).abs().item()] + [(g[k] - grads0[k]).abs().max().item() for k in g]
        )
        for mode, (loss, g) in runs.items()
        if mode != "none"
    }


def _out_of_vocab(layouts, backend):
    """An id outside the vocabulary raises on every rank (it used to embed to zeros),
    and valid ids still embed bitwise as the full table does."""
    out = {}
    for sp, layout in layouts.items():
        tp = TPGroup.from_layout(layout, backend)
        emb = VocabParallelEmbedding(64, 8, tp, sequence_parallel=sp,
                                     generator=torch.Generator().manual_seed(3))  # fmt: skip
        full = full_tensors(emb, tp)["weight"]
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
        y, want = emb(tokens), F.embedding(tokens, full)
        out[f"valid_bitwise_sp={sp}"] = bool(
            torch.equal(y, want.chunk(tp.size, 1)[tp.rank] if sp else want)
        )
        for bad in (64, -1):
            tokens[1, 5] = bad
            try:
                emb(tokens)
                out[f"id={bad}_sp={sp}"] = "no error"
            except IndexError as e:
                out[f"id={bad}_sp={sp}"] = str(e)
    tp = TPGroup.from_layout(layouts[False], backend)
    try:
        vocab_parallel_cross_entropy(torch.randn(3, 32), torch.tensor([1, -100, 64]), tp)
        out["label=64"] = "no error"
    except IndexError as e:
        out["label=64"] = str(e)
    return out


def _tp_rank_main(ctx):
    layouts = {  # sequence parallel -> layout
        sp: ParallelLayout.build(
            LayoutSpec(tp=2, sequence_parallel=sp), ctx.backend.collective, ctx.rank, ctx.world_size
        )
        for sp in (False, True)
    }
    tp, single = TPGroup.from_layout(layouts[False], ctx.backend), TPGroup.single(ctx.backend)
    return {
        "mappings": _mappings(tp),
        "cross_entropy": _cross_entropy(tp),
        "layers": _layers(tp, single, layouts[False]),
        "rng": _rng(layouts, ctx.backend, tp),
        "recompute_dropout": _recompute_with_dropout(layouts[True], ctx.backend),
        "equivalence": _equivalence(layouts, ctx.backend),
        "out_of_vocab": _out_of_vocab(layouts, ctx.backend),
    }


# -- test side ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_tp_rank_main, 2)


def test_mappings_forward_and_backward(ranks):
    for r, res in enumerate(ranks):
        bad = {k: v for k, v in res["mappings"].items() if not v <= RTOL}
        assert not bad, f"rank {r}: mappings off: {bad}"


def test_vocab_parallel_cross_entropy_matches_torch(ranks):
    for r, res in enumerate(ranks):
        ce = res["cross_entropy"]
        assert ce["loss"] <= RTOL and ce["grad"] <= RTOL, f"rank {r}: {ce}"
        assert ce["ignored_zero"] and ce["dtype"] == "torch.float32", f"rank {r}: {ce}"


def test_layers_and_resharding(ranks):
    for r, res in enumerate(ranks):
        bad = {k: v for k, v in res["layers"].items() if not v <= RTOL}
        assert not bad, f"rank {r}: {bad}"


@pytest.mark.parametrize("case", list(CASES))
def test_tp_equals_one_process(ranks, case):
    rtol = RTOL_OF[CASES[case][2]]
    for r, res in enumerate(ranks):
        e = res["equivalence"][case]
        assert e["grad_names"], f"rank {r} {case}: parameter names differ from one process"
        assert e["init"] == 0.0, f"rank {r} {case}: init differs from one process: {e}"
        assert e["loss"] <= rtol, f"rank {r} {case}: loss rel error {e['loss']:.2e}"
        assert e["grad"][0] <= rtol, (
            f"rank {r} {case}: grad rel error {e['grad'][0]:.2e} at {e['grad'][1]}"
        )
        assert e["params"] <= rtol, (
            f"rank {r} {case}: params after {STEPS} SGD steps {e['params']:.2e}"
        )


def test_recompute_reproduces_dropout_under_sequence_parallel(ranks):
    for r, res in enumerate(ranks):
        assert all(v == 0.0 for v in res["recompute_dropout"].values()), (
            f"rank {r}: {res['recompute_dropout']}"
        )


def test_out_of_vocab_ids_raise_on_every_rank(ranks):
    for r, res in enumerate(ranks):
        got = res["out_of_vocab"]
        for sp in (False, True):
            assert got[f"valid_bitwise_sp={sp}"], f"rank {r}: valid ids changed (sp={sp})"
            for bad in (64, -1):
                msg = got[f"id={bad}_sp={sp}"]
                assert f"token id {bad} is outside the vocabulary [0, 64)" in msg, (r, msg)
        assert "label 64 is outside the vocabulary [0, 64)" in got["label=64"], (r, got)


def test_rng_streams_agree_and_differ_as_documented(ranks):
    rng = ranks[0]["rng"]
    assert all(res["rng"]["default_continues"] for res in ranks), "fork advanced the default stream"
    assert rng["default"][0] == rng["default"][1], "default stream differs over tp"
    assert rng["tp_stream"][0] != rng["tp_stream"][1], "tp stream equal over tp"
    no_sp, sp = rng["mask_sp=False"], rng["mask_sp=True"]
    assert no_sp[0] == no_sp[1], "dropout on replicated activations differs over tp"
    assert sp[0] != sp[1], "dropout on sequence shards is the same on every tp rank"
    for sp_on in (False, True):
        reps = rng[f"replicas_sp={sp_on}"]
        assert reps[0] == reps[1], f"replicated params diverged over tp (sp={sp_on})"
