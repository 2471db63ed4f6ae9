"""ZeRO-1 under TP=2 x DP=2 (4 ranks, sequence parallel on), with clipping and loss scaling.

Equivalence is against one process on the global batch (torch.optim.AdamW,
torch.nn.utils.clip_grad_norm_), fp32, relative 1e-5 on ||a - b|| / ||b||.
"""

from __future__ import annotations

import math

import pytest
import torch

from mtcore.models.gpt import GPTConfig, build_gpt
from mtcore.parallel.clip import clip_grad_norm_
from mtcore.parallel.data import DataParallel, DataParallelConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.optimizer import DistributedAdamW
from mtcore.parallel.tensor import full_tensors
from mtcore.precision import DynamicLossScaler
from mtcore.testing.compare import rel_error
from mtcore.testing.distributed import run_ranks

TP_CONFIG = GPTConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
    ffn_hidden_size=48, seq_len=16,
)  # fmt: skip
BATCH, STEPS, TOL = 8, 3, 1e-5
# eps=1e-3 (as in test_gpt_equivalence.py): with 1e-8, Adam turns the rounding noise of
# near-zero gradient elements, which differs between layouts, into whole ``lr`` steps.
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)
MAX_NORM = 0.5  # below the model's gradient norm (~1): clipping acts every step
SCALE = 1024.0  # a power of two: scaling is exact in fp32, the reference needs none
BUCKET = 2000


def _batches(config, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shape = (STEPS, BATCH, config.seq_len)
    return torch.randint(0, config.vocab_size, shape, generator=g), torch.randint(
        0, config.vocab_size, shape, generator=g
    )


def _torch_reference(config):
    """One process, full batch: torch.optim.AdamW (no decay for rank<2) + clip_grad_norm_."""
    from mtcore.backend import select_backend

    (model,) = build_gpt(config, ParallelLayout.single(), select_backend("cpu"), seed=0)
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": HP["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=HP["lr"], betas=HP["betas"], eps=HP["eps"])
    tokens, targets = _batches(config)
    out = {"loss": [], "grads": [], "norm": []}
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(tokens[step], targets[step])
        loss.backward()
        out["loss"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["norm"].append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def _gather_shards(ddp) -> None:
    """Test helper: all-gather ZeRO's reduced-gradient shards so main_grad is whole."""
    for bucket in ddp.buckets:
        lo, hi = bucket.shard(ddp.dp_cp_rank, ddp.dp_cp_size)
        full = torch.empty_like(bucket.grad)
        ddp.collective.all_gather(full, bucket.buffer.grad[lo:hi].clone(), group=ddp.group)
        bucket.grad.copy_(full)


def _rows(layout, step_batch):
    local = BATCH // layout.dp
    return step_batch[layout.dp_rank * local : (layout.dp_rank + 1) * local]


def _inject_inf(opt) -> None:
    """Put an inf into this rank's own shard of the reduced gradients."""
    opt.ddp.finish_grad_sync()
    opt.segments[0].grad[0] = math.inf


# -- TP=2 x DP=2 with ZeRO-1 (4 ranks) ------------------------------------------------
def _tp_dp_rank_main(ctx, tokens, targets):
    layout = ParallelLayout.build(
        LayoutSpec(tp=2, sequence_parallel=True), ctx.backend.collective, ctx.rank, ctx.world_size
    )
    (model,) = build_gpt(TP_CONFIG, layout, ctx.backend, seed=0)
    ddp = DataParallel(
        model, layout, ctx.backend, DataParallelConfig(bucket_size=BUCKET, shard_optimizer=True)
    )
    scaler = DynamicLossScaler(initial_scale=SCALE, growth_interval=1000)
    opt = DistributedAdamW(ddp, max_grad_norm=MAX_NORM, loss_scaler=scaler, **HP)
    out = {"loss": [], "grads": [], "norm": [], "clip_fn_norm": []}
    for step in range(STEPS):
        opt.zero_grad()
        loss = ddp(_rows(layout, tokens[step]), _rows(layout, targets[step]))
        opt.scale_loss(loss).backward()
        ddp.finish_grad_sync()
        _gather_shards(ddp)
        for p in model.parameters():
            p.grad = p.main_grad / SCALE
        out["grads"].append(full_tensors(model, model.tp, grads=True))
        for p in model.parameters():
            p.grad = None
        # The standalone clip function on whole (replicated over dp) gradients.
        norm = clip_grad_norm_(model.parameters(), 1e30, layout, ctx.backend.collective)
        out["clip_fn_norm"].append(norm / SCALE)
        result = opt.step()
        assert result.stepped and result.loss_scale == SCALE
        out["loss"].append(loss.item())
        out["norm"].append(result.grad_norm)  # after unscaling
    out["params"] = full_tensors(model, model.tp)
    # One more step with an inf on one rank only (tp rank 1, dp rank 0): all skip.
    opt.zero_grad()
    opt.scale_loss(ddp(_rows(layout, tokens[0]), _rows(layout, targets[0]))).backward()
    if ctx.rank == 1:
        _inject_inf(opt)
    before = [b.param_data.clone() for b in ddp.grad_buffers]
    result = opt.step()
    unchanged = all(
        torch.equal(a, b.param_data) for a, b in zip(before, ddp.grad_buffers, strict=True)
    )
    out["skip"] = (result.stepped, scaler.scale, opt.step_count, unchanged)
    return out


@pytest.fixture(scope="module")
def tp_dp():
    tokens, targets = _batches(TP_CONFIG)
    ranks = run_ranks(_tp_dp_rank_main, 4, tokens, targets)
    return ranks, _torch_reference(TP_CONFIG)


def test_tp2_dp2_zero_matches_one_process(tp_dp):
    """Loss, every gradient, the clipping norm and the trained params, on all 4 ranks."""
    ranks, ref = tp_dp
    for step in range(STEPS):
        loss = (ranks[0]["loss"][step] + ranks[2]["loss"][step]) / 2  # dp ranks 0 and 1
        assert abs(loss - ref["loss"][step]) <= TOL * ref["loss"][step]
        for rank, r in enumerate(ranks):
            assert abs(r["norm"][step] - ref["norm"][step]) <= TOL * ref["norm"][step], (rank, step)
            assert abs(r["clip_fn_norm"][step] - ref["norm"][step]) <= TOL * ref["norm"][step]
            for name, want in ref["grads"][step].items():
                err = rel_error(r["grads"][step][name], want)
                assert err < TOL, f"step {step} rank {rank} grad {name}: rel err {err:.2e}"
    for rank, r in enumerate(ranks):
        for name, want in ref["params"].items():
            err = rel_error(r["params"][name], want)
            assert err < TOL, f"rank {rank} param {name}: rel err {err:.2e}"


def test_inf_on_one_rank_skips_the_step_on_every_rank(tp_dp):
    ranks, _ = tp_dp
    for r in ranks:
        assert r["skip"] == (False, SCALE / 2, STEPS, True)
