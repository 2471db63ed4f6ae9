"""Pipeline parallel equals one process (gloo, one 4-rank spawn for every case).

Cases, each a few optimizer steps on the same global batch:
  pp4_1f1b   PP=4, 1F1B, 4 micro-batches (tied embedding / output weight)
  pp2_1f1b   PP=2, 1F1B, 4 micro-batches (tied)
  pp2_vpp2   PP=2, interleaved 1F1B with 2 chunks per rank, 4 micro-batches (tied)
  pp2_gpipe  PP=2, GPipe, 4 micro-batches (tied)
  pp2_dp2    PP=2 x DP=2: DataParallel chunks, mtcore AdamW, 2 micro-batches per dp rank
  pp2_tp2    PP=2 x TP=2: the GPT's chunks (``build_gpt``) on 2 stages
  pp2_tp2_sp PP=2 (interleaved, 2 chunks) x TP=2 with sequence parallel:
             stages exchange [micro-batch, seq / tp, hidden] shards
The pure-PP cases run on both pipelines of a pp=2 x dp=2 layout (no gradient
reduction between them: two independent runs, both checked). The reference
runs in the test process. fp32, relative error ||a - b|| / ||b|| <= 1e-5 for
the loss, every gradient at every step and every parameter at the end.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtcore.models.gpt import GPTConfig, build_gpt
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.pipeline import (
    PipelineGroups,
    PipelineRunner,
    StageModule,
    allreduce_tied_grads,
    build_schedule,
    stage_plans,
    sync_tied_weights,
)
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks

V, H, FF, L, SEQ, BATCH, MB, STEPS, TOL = 32, 16, 32, 4, 8, 8, 2, 3, 1e-5
SGD = dict(lr=0.5, momentum=0.9)
ADAM = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CASES = {  # name: (spec, schedule, micro-batches, vpp)
    "pp4_1f1b": (dict(pp=4), "1f1b", 4, 1),
    "pp2_1f1b": (dict(pp=2), "1f1b", 4, 1),
    "pp2_vpp2": (dict(pp=2), "interleaved_1f1b", 4, 2),
    "pp2_gpipe": (dict(pp=2), "gpipe", 4, 1),
    "pp2_dp2": (dict(pp=2), "1f1b", 2, 1),
    "pp2_tp2": (dict(pp=2, tp=2), "1f1b", 4, 1),
    "pp2_tp2_sp": (dict(pp=2, tp=2, vpp=2, sequence_parallel=True), "interleaved_1f1b", 4, 2),
}
# The pp2_tp2 cases: the GPT family's model (untied embedding and output layer).
GPT_CONFIG = GPTConfig(
    vocab_size=V, hidden_size=32, num_layers=L, num_heads=4, num_kv_heads=2,
    ffn_hidden_size=48, seq_len=SEQ,
)  # fmt: skip


# -- the model: embedding, residual MLP blocks, output head tied to the embedding ------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Tiny(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, H)
        nn.init.normal_(self.embed.weight, std=0.3)
        self.layers = nn.ModuleList(Block() for _ in range(L))
        self.head = nn.Linear(H, V, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def ce(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, V, (STEPS, BATCH, SEQ), generator=g), torch.randint(
        0, V, (STEPS, BATCH, SEQ), generator=g
    )


# -- rank side ----------------------------------------------------------------------------
def _grad(p):
    return getattr(p, "main_grad", None) if hasattr(p, "main_grad") else p.grad


def _named(chunks):
    return {n: p for c in chunks for n, p in getattr(c, "module", c).named_parameters()}


def _tiny_pipeline(ctx, data, layout, groups, schedule, rows, ddp=False):
    from mtcore.parallel.data import DataParallel, DataParallelConfig
    from mtcore.parallel.optimizer import AdamW

    coll, model = ctx.backend.collective, Tiny()
    plans = stage_plans(L, layout.pp, groups.pp_rank, schedule.vpp)
    chunks = [
        StageModule(
            {i: model.layers[i] for i in p.layers},
            pre=model.embed if p.has_embedding else None,
            post=model.head if p.has_head else None,
            names=("embed", "head"),
        )
        for p in plans
    ]
    tied = [c.embed.weight for c in chunks if hasattr(c, "embed")]
    tied += [c.head.weight for c in chunks if hasattr(c, "head")]
    if any(p.has_head for p in plans) and layout.pp > 1:
        with torch.no_grad():
            chunks[-1].head.weight.zero_()  # the first stage's copy must win
    sync_tied_weights(tied, groups, coll)
    if ddp:
        chunks = [
            DataParallel(c, layout, ctx.backend, DataParallelConfig(bucket_size=500))
            for c in chunks
        ]
        (opt,) = [AdamW(c, **ADAM) for c in chunks]
    else:
        opt = _SGD([p for c in chunks for p in c.parameters()])
    runner = PipelineRunner(chunks, schedule, groups, ctx.backend, (MB, SEQ, H), ce)

    def finish():
        for c in chunks if ddp else ():
            c.finish_grad_sync()
        allreduce_tied_grads(tied, groups, coll)

    return _train(
        runner, opt, data, rows, finish,
        grads=lambda: {n: _grad(p).clone() for n, p in _named(chunks).items()},
        params=lambda: {n: p.detach().clone() for n, p in _named(chunks).items()},
    )  # fmt: skip


def _train(runner, opt, data, rows, finish, grads, params):
    """STEPS optimizer steps; ``finish()`` after each backward, then record."""
    tokens, targets = data
    out = {
        "loss": [],
        "grads": [],
        "peak": [],
        "held": [],
        "first": runner.has_first,
        "last": runner.has_last,
    }
    for step in range(STEPS):
        opt.zero_grad()
        stats = runner.step(tokens[step][rows].split(MB), targets[step][rows].split(MB))
        finish()
        out["loss"].append(stats.loss)
        out["peak"].append(stats.peak_in_flight)
        out["held"].append(stats.peak_undelivered)
        out["grads"].append(grads())
        opt.step()
    out["params"] = params()
    return out


def _gpt_pipeline(ctx, data, layout, groups, schedule):
    """This rank's ``build_gpt`` chunks (one per virtual stage) in the runner's tensor mode."""
    from mtcore.parallel.tensor import (
        allreduce_sequence_parallel_grads,
        full_tensors,
        vocab_parallel_cross_entropy,
    )

    chunks = build_gpt(GPT_CONFIG, layout, ctx.backend, seed=5)
    assert len(chunks) == schedule.vpp
    tp = chunks[0].tp

    def loss_fn(logits, tgt):
        return vocab_parallel_cross_entropy(logits.flatten(0, 1), tgt.flatten(), tp).mean()

    opt = _SGD([p for c in chunks for p in c.parameters()])
    sp = layout.spec.sequence_parallel
    shape = (MB, SEQ // layout.tp if sp else SEQ, GPT_CONFIG.hidden_size)
    runner = PipelineRunner(chunks, schedule, groups, ctx.backend, shape, loss_fn)

    def finish():
        for c in chunks:
            allreduce_sequence_parallel_grads(c, tp)

    def full(grads=False):
        return {k: v for c in chunks for k, v in full_tensors(c, tp, grads=grads).items()}

    return _train(runner, opt, data, slice(None), finish, lambda: full(grads=True), full)


class _SGD:
    """torch.optim.SGD's update (momentum, no dampening). Ranks avoid torch.optim:
    its first use imports torch._dynamo, seconds per rank on a small machine."""

    def __init__(self, params):
        self.params, self.bufs = list(params), {}

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is None:
                continue
            buf = self.bufs.get(p)
            if buf is None:
                buf = self.bufs[p] = p.grad.clone()
            else:
                buf.mul_(SGD["momentum"]).add_(p.grad)
            p.add_(buf, alpha=-SGD["lr"])


def _rank_main(ctx, tokens, targets):
    data, coll, results = (tokens, targets), ctx.backend.collective, {}
    layouts = {}
    for name, (spec, sched, m, vpp) in CASES.items():
        key = tuple(sorted(spec.items()))
        if key not in layouts:
            layout = ParallelLayout.build(LayoutSpec(**spec), coll, ctx.rank, 4)
            layouts[key] = (layout, PipelineGroups.build(layout, coll))
        layout, groups = layouts[key]
        schedule = build_schedule(sched, layout.pp, m, vpp)
        if name.startswith("pp2_tp2"):
            results[name] = _gpt_pipeline(ctx, data, layout, groups, schedule)
        elif name == "pp2_dp2":
            local = BATCH // layout.dp
            rows = slice(layout.dp_rank * local, (layout.dp_rank + 1) * local)
            results[name] = _tiny_pipeline(ctx, data, layout, groups, schedule, rows, ddp=True)
        else:
            results[name] = _tiny_pipeline(ctx, data, layout, groups, schedule, slice(None))
        results[name]["pp_rank"] = groups.pp_rank
    buf = io.BytesIO()
    torch.save(results, buf)
    return buf.getvalue()


# -- references -------------------------------------------------------------------------
def _reference(kind: str):
    tokens, targets = _batches()
    if kind == "gpt":
        from mtcore.backend import select_backend

        (model,) = build_gpt(GPT_CONFIG, ParallelLayout.single(), select_backend("cpu"), seed=5)
        opt = torch.optim.SGD(model.parameters(), **SGD)
    else:
        model = Tiny()
        if kind == "adam":
            ps = list(model.parameters())
            groups = [
                {"params": [p for p in ps if p.dim() >= 2], "weight_decay": ADAM["weight_decay"]},
                {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
            ]
            opt = torch.optim.AdamW(groups, lr=ADAM["lr"], betas=ADAM["betas"], eps=ADAM["eps"])
        else:
            opt = torch.optim.SGD(model.parameters(), **SGD)
    out = {"loss": [], "grads": []}
    for step in range(STEPS):
        opt.zero_grad()
        loss = (
            model(tokens[step], targets[step])
            if kind == "gpt"
            else ce(model(tokens[step]), targets[step])
        )
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _ref_name(name: str) -> str:
    return "embed.weight" if name == "head.weight" else name  # the tiny model's tied head


@pytest.fixture(scope="module")
def runs():
    tokens, targets = _batches()
    ranks = [
        torch.load(io.BytesIO(r), weights_only=False)
        for r in run_ranks(_rank_main, 4, tokens, targets)
    ]
    refs = {k: _reference(k) for k in ("sgd", "adam", "gpt")}
    return ranks, refs


@pytest.mark.parametrize("case", list(CASES))
def test_matches_one_process(runs, case):
    ranks, refs = runs
    ref = refs["gpt" if case.startswith("pp2_tp2") else "adam" if case == "pp2_dp2" else "sgd"]
    seen, losses = set(), []
    for rank, all_cases in enumerate(ranks):
        r = all_cases[case]
        if r["last"]:
            losses.append(r["loss"])
        for step in range(STEPS):
            for name, got in r["grads"][step].items():
                err = rel_error(got, ref["grads"][step][_ref_name(name)])
                assert err <= TOL, f"{case} rank {rank} step {step} grad {name}: rel err {err:.2e}"
                seen.add(_ref_name(name))
        for name, got in r["params"].items():
            err = rel_error(got, ref["params"][_ref_name(name)])
            assert err <= TOL, (
                f"{case} rank {rank} param {name} after {STEPS} steps: rel err {err:.2e}"
            )
    assert seen == set(ref["grads"][0]), (
        f"{case}: params never checked: {set(ref['grads'][0]) - seen}"
    )
    if case == "pp2_dp2":  # each dp rank's loss is the mean over its half of the batch
        losses = [[sum(x) / len(losses) for x in zip(*losses, strict=True)]]
    for loss in losses:
        for step in range(STEPS):
            err = abs(loss[step] - ref["loss"][step]) / abs(ref["loss"][step])
            assert err <= TOL, f"{case} step {step}: loss {loss[step]} vs {ref['loss'][step]}"


@pytest.mark.parametrize("case", ["pp4_1f1b", "pp2_1f1b", "pp2_dp2", "pp2_tp2"])
def test_1f1b_keeps_at_most_pp_microbatches_in_flight(runs, case):
    ranks, _ = runs
    spec, _, m, _ = CASES[case]
    pp = spec["pp"]
    for r in ranks:
        res = r[case]
        want = min(pp - res["pp_rank"], m)  # warmup + 1; pp on stage 0 once m >= pp
        assert res["peak"] == [want] * STEPS, (case, res["pp_rank"], res["peak"])
        # Delivered sends are let go of as the step goes: a stage's forward sends are
        # received before the backward that needs them comes back, so at most its
        # warm-up's worth and one more (plus one gradient) are held, not one per micro-batch.
        assert max(res["held"]) <= min(pp - res["pp_rank"] + 1, m), (case, res["held"])


def test_interleaved_and_gpipe_peaks_match_their_action_lists(runs):
    ranks, _ = runs
    for case in ("pp2_vpp2", "pp2_gpipe", "pp2_tp2_sp"):
        _, sched, m, vpp = CASES[case]
        schedule = build_schedule(sched, 2, m, vpp)
        for r in ranks:
            res = r[case]
            assert res["peak"] == [schedule.max_in_flight(res["pp_rank"])] * STEPS
