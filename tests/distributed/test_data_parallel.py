"""Data parallel (DP=2) and ZeRO-1 (DP=2) equal one process on the global batch.

One 2-rank spawn runs every check; the single-process reference (torch.optim.AdamW
on a one-process GPT, full batch) runs in the test process. fp32 tolerance:
relative 1e-5 on ||a - b|| / ||b|| for the loss, every gradient and every
parameter after the last step.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from mtcore.models.gpt import GPTConfig, build_gpt
from mtcore.parallel.data import DataParallel, DataParallelConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.optimizer import AdamW, DistributedAdamW
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks

CONFIG = GPTConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    ffn_hidden_size=48, seq_len=16,
)  # fmt: skip
DP, BATCH, STEPS, TOL = 2, 8, 3, 1e-5
# eps=1e-3 (as in test_gpt_equivalence.py): with 1e-8, Adam turns the rounding noise of
# near-zero gradient elements, which differs between the dp and one-process sums, into
# whole ``lr`` steps (rel err up to 2e-5 after 3 steps; about 4e-7 with 1e-3).
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)
BUCKET = 2000  # elements: several buckets for the model's ~20k params


def _batches(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shape = (STEPS, BATCH, CONFIG.seq_len)
    return torch.randint(0, CONFIG.vocab_size, shape, generator=g), torch.randint(
        0, CONFIG.vocab_size, shape, generator=g
    )


def _reference(backend_name: str = "cpu"):
    """One process, full global batch, torch.optim.AdamW (no decay for rank<2 tensors)."""
    from mtcore.backend import select_backend

    (model,) = build_gpt(CONFIG, ParallelLayout.single(), select_backend(backend_name), seed=0)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": HP["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"])
    tokens, targets = _batches()
    losses, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(tokens[step], targets[step])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {
        "loss": losses,
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _full_grads(ddp) -> dict[str, torch.Tensor]:
    """Every param's reduced fp32 gradient; under ZeRO-1 the shards are all-gathered first."""
    if ddp.config.shard_optimizer and ddp.dp_cp_size > 1:
        for bucket in ddp.buckets:
            lo, hi = bucket.shard(ddp.dp_cp_rank, ddp.dp_cp_size)
            full = torch.empty_like(bucket.grad)
            ddp.collective.all_gather(full, bucket.buffer.grad[lo:hi].clone(), group=ddp.group)
            bucket.grad.copy_(full)
    return {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}


def _train(ctx, layout, tokens, targets, *, shard: bool, micro_batches: int = 1):
    (model,) = build_gpt(CONFIG, layout, ctx.backend, seed=0)
    ddp = DataParallel(
        model, layout, ctx.backend, DataParallelConfig(bucket_size=BUCKET, shard_optimizer=shard)
    )
    opt = (DistributedAdamW if shard else AdamW)(ddp, **HP)
    local = BATCH // DP
    rows = slice(layout.dp_rank * local, (layout.dp_rank + 1) * local)
    out = {"loss": [], "grads": [], "logs": [], "log_after_no_sync": []}
    for step in range(STEPS):
        opt.zero_grad()
        tok, tgt = tokens[step][rows].chunk(micro_batches), targets[step][rows].chunk(micro_batches)
        loss_sum = 0.0
        for i in range(micro_batches):
            last = i == micro_batches - 1
            with ddp.no_sync() if not last else contextlib.nullcontext():
                loss = ddp(tok[i], tgt[i]) / micro_batches
                loss.backward()
            loss_sum += loss.item()
            if not last:
                out["log_after_no_sync"].append(list(ddp.launch_log))
        out["logs"].append(list(ddp.launch_log))
        ddp.finish_grad_sync()
        out["loss"].append(loss_sum)
        out["grads"].append(_full_grads(ddp))
        assert opt.step().stepped
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _rank_main(ctx, tokens, targets):
    layout = ParallelLayout.build(LayoutSpec(), ctx.backend.collective, ctx.rank, ctx.world_size)
    out = {
        "dp": _train(ctx, layout, tokens, targets, shard=False),
        "zero": _train(ctx, layout, tokens, targets, shard=True),
        "accum": _train(ctx, layout, tokens, targets, shard=False, micro_batches=2),
    }
    return out


@pytest.fixture(scope="module")
def runs():
    tokens, targets = _batches()
    ranks = run_ranks(_rank_main, DP, tokens, targets)
    return ranks, _reference()


def _check_equal_to_reference(ranks, ref):
    for step in range(STEPS):
        loss = sum(r["loss"][step] for r in ranks) / len(ranks)
        assert abs(loss - ref["loss"][step]) <= TOL * abs(ref["loss"][step]), (
            step,
            loss,
            ref["loss"][step],
        )
        for rank, r in enumerate(ranks):
            for name, want in ref["grads"][step].items():
                err = rel_error(r["grads"][step][name], want)
                assert err < TOL, f"step {step} rank {rank} grad {name}: rel err {err:.2e}"
    for rank, r in enumerate(ranks):
        for name, want in ref["params"].items():
            err = rel_error(r["params"][name], want)
            assert err < TOL, f"rank {rank} param {name} after {STEPS} steps: rel err {err:.2e}"


@pytest.mark.parametrize("run", ["dp", "zero", "accum"])
def test_matches_one_process(runs, run):
    """DP=2, DP=2 with ZeRO-1, and DP=2 with 2 accumulated micro-batches each."""
    ranks, ref = runs
    _check_equal_to_reference([r[run] for r in ranks], ref)


def test_accumulation_reduces_once_at_the_last_micro_batch(runs):
    ranks, _ = runs
    for r in ranks:
        assert all(log == [] for log in r["accum"]["log_after_no_sync"])
        for log in r["accum"]["logs"]:
            assert sorted(rec.bucket for rec in log) == list(range(len(log)))


def test_bucket_reduction_overlaps_backward(runs):
    """Some bucket's all-reduce started while later param grads were still pending."""
    ranks, _ = runs
    for r in ranks:
        for run in ("dp", "zero"):
            log = r[run]["logs"][0]
            assert len(log) > 2, "expected several buckets"
            assert log[0].bucket == 0 and log[0].from_backward
            assert any(rec.from_backward and rec.pending_grads > 0 for rec in log), log
            assert [rec.bucket for rec in log] == sorted(rec.bucket for rec in log)
