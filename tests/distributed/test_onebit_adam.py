"""1-bit Adam at dp=2 and dp=4 against a single-process simulation, bitwise in fp32.

The gradients are chosen so the warm-up's full-precision all-reduce is exact in any
summation order (multiples of 1/8 in [-1, 1], divided by a power-of-two dp), so the
whole run (warm-up AdamW, then compressed momentum with error feedback) can be
compared bit for bit with a plain loop that holds every rank's state in one process.
The simulation is written independently of ``OneBitReducer`` (bools instead of
packed bits, explicit per-rank lists), so a mix-up in the chunk routing, the packing
or the error bookkeeping shows. The same runs count the bytes of every dp collective.
"""

from __future__ import annotations

import math

import pytest
import torch
from counting import CountingCollective
from torch import nn

from mtcore.ops.optim import adamw_step
from mtcore.parallel.data import DataParallel, DataParallelConfig
from mtcore.parallel.layout import LayoutSpec, ParallelLayout
from mtcore.parallel.optimizer import OneBitAdam
from mtcore.testing.distributed import run_ranks

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)
FREEZE, STEPS = 2, 6
BLOCK = 256  # elements per scale: several blocks per chunk, the last one partial
REFERENCE = {"MTCORE_KERNELS": "reference"}  # the simulation calls the reference AdamW


def _model() -> nn.Module:
    """2970 matrix elements (one param group; not a multiple of 8 x dp: padding)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 33, bias=False), nn.Linear(33, 50, bias=False))


def _grad(step: int, rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s gradient at ``step``, in flat-buffer order (exactly representable)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(-8, 9, (numel,), generator=g).float() / 8


def _backward(ddp, flat_grad: torch.Tensor) -> None:
    """A backward whose gradient is ``flat_grad`` exactly (d/dp sum(p * G) = G)."""
    loss = 0
    for p in ddp.module.parameters():
        lo, hi = ddp.buffer_of(p).range_of(p)
        loss = loss + (p * flat_grad[lo:hi].view_as(p)).sum()
    loss.backward()


def _setup(ctx, freeze=FREEZE, max_grad_norm=None):
    layout = ParallelLayout.build(LayoutSpec(), ctx.backend.collective, ctx.rank, ctx.world_size)
    ddp = DataParallel(_model(), layout, ctx.backend, DataParallelConfig())
    counter = CountingCollective(ddp.collective)
    ddp.collective = counter
    opt = OneBitAdam(ddp, freeze_step=freeze, block_size=BLOCK, max_grad_norm=max_grad_norm, **HP)
    return layout, ddp, opt, counter


def _train(ddp, opt, steps, rank, first_step=1):
    (buf,) = ddp.grad_buffers
    for step in range(first_step, first_step + steps):
        opt.zero_grad()
        _backward(ddp, _grad(step, rank, buf.numel))
        assert opt.step().stepped


def _rank_main(ctx):
    layout, ddp, opt, counter = _setup(ctx)
    (buf,) = ddp.grad_buffers
    out = {"initial": buf.param_data.clone(), "params": [], "bytes": [], "ops": []}
    for step in range(1, STEPS + 1):
        counter.clear()
        opt.zero_grad()
        _backward(ddp, _grad(step, ctx.rank, buf.numel))
        assert opt.step().stepped
        dp_calls = counter.on(layout.dp_cp.group)
        out["bytes"].append(sum(c.nbytes for c in dp_calls))
        out["ops"].append(sorted(c.op for c in dp_calls))
        out["params"].append(buf.param_data.clone())
    (reducer,) = opt.reducers
    out["worker_error"], out["server_error"] = reducer.worker_error, reducer.server_error
    out["exp_avg"] = opt.state_tensors()["exp_avg"][0]
    return out


def _scales(x: torch.Tensor, n: int) -> torch.Tensor:
    """Mean |x| of each BLOCK-element block of ``x`` over its real (first ``n``) elements."""
    starts = torch.arange(0, x.numel(), BLOCK, dtype=torch.float32)
    real = (n - starts).clamp(0, BLOCK).clamp(min=1)
    return x.view(-1, BLOCK).abs().sum(dim=1) / real


def _decode(signs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    s = scales.view(-1, 1)
    return torch.where(signs.view(-1, BLOCK), s, -s).reshape(-1)


def simulate(initial: torch.Tensor, dp: int, steps: int, freeze: int) -> list[torch.Tensor]:
    """The params after each step of 1-bit Adam on ``dp`` simulated ranks."""
    lr, (b1, b2), eps, wd = HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"]
    n = initial.numel()
    c = math.ceil(math.ceil(n / dp) / BLOCK) * BLOCK  # chunk: whole blocks
    p, m, v = initial.clone(), torch.zeros(n), torch.zeros(n)
    worker_err = [torch.zeros(dp * c) for _ in range(dp)]
    server_err = [torch.zeros(c) for _ in range(dp)]
    history = []
    for t in range(1, steps + 1):
        grads = [_grad(t, r, n) / dp for r in range(dp)]  # what each rank's buffer holds
        if t <= freeze:
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            adamw_step([p], [total], [m], [v], step=t, lr=lr, beta1=b1, beta2=b2, eps=eps,
                       weight_decay=wd)  # fmt: skip
            history.append(p.clone())
            continue
        # Workers: local momentum plus the error they owe, signs and a scale per block.
        sent = []  # sent[r] = (signs, scales) of rank r's whole padded momentum
        for r in range(dp):
            local = m.clone().mul_(b1).add_(grads[r], alpha=(1 - b1) * dp)
            x = torch.zeros(dp * c)
            x[:n] = local
            x += worker_err[r]
            signs, scales = x >= 0, _scales(x, n)
            worker_err[r] = x - _decode(signs, scales)
            worker_err[r][n:] = 0
            sent.append((signs, scales))
        # Servers: rank j averages chunk j over the workers, plus its own error.
        result = torch.empty(dp * c)
        per_chunk = c // BLOCK
        for j in range(dp):
            lo, hi = j * c, (j + 1) * c
            acc = torch.zeros(c)
            for signs, scales in sent:
                acc += _decode(signs[lo:hi], scales[j * per_chunk : (j + 1) * per_chunk])
            acc /= dp
            acc[max(0, min(c, n - lo)) :] = 0
            served = acc + server_err[j]
            scales = _scales(served, n - lo)
            decoded = _decode(served >= 0, scales)
            server_err[j] = served - decoded
            server_err[j][max(0, min(c, n - lo)) :] = 0
            result[lo:hi] = decoded
        m = result[:n].clone()
        denom = v.sqrt().div_(math.sqrt(1 - b2**freeze)).add_(eps)
        p.mul_(1 - lr * wd)
        p.addcdiv_(m, denom, value=-lr / (1 - b1**t))
        history.append(p.clone())
    return history


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def run(request):
    dp = request.param
    return dp, run_ranks(_rank_main, dp, env=REFERENCE)


def test_params_equal_the_simulation_bitwise(run):
    dp, ranks = run
    want = simulate(ranks[0]["initial"], dp, STEPS, FREEZE)
    for rank, r in enumerate(ranks):
        assert torch.equal(r["initial"], ranks[0]["initial"])
        for step, (got, expected) in enumerate(zip(r["params"], want, strict=True), 1):
            diff = (got - expected).abs().max().item()
            assert torch.equal(got, expected), f"dp={dp} rank {rank} step {step}: max diff {diff}"


def test_momentum_stays_replicated_and_errors_are_fed_back(run):
    _, ranks = run
    for r in ranks[1:]:
        assert torch.equal(r["exp_avg"], ranks[0]["exp_avg"])
    for r in ranks:  # compression lost something, and it is carried to the next step
        assert r["worker_error"].abs().sum() > 0 and r["server_error"].abs().sum() > 0
    # each rank serves a different chunk, and their workers compressed different momenta
    assert not torch.equal(ranks[0]["worker_error"], ranks[1]["worker_error"])


def test_compressed_steps_send_at_most_a_sixteenth_of_adam(run):
    _, ranks = run
    numel = ranks[0]["initial"].numel()
    for r in ranks:
        for step in range(FREEZE):  # warm-up: one fp32 all-reduce of the whole buffer
            assert r["ops"][step] == ["all_reduce"] and r["bytes"][step] == 4 * numel
        for step in range(FREEZE, STEPS):
            assert r["ops"][step] == ["all_gather", "all_to_all"]
            assert r["bytes"][step] * 16 <= 4 * numel, (step, r["bytes"][step], 4 * numel)


# -- resume, clipping ------------------------------------------------------------------
def _resume_main(ctx):
    _, ddp, opt, _ = _setup(ctx)
    _train(ddp, opt, STEPS, ctx.rank)
    straight = ddp.grad_buffers[0].param_data.clone()

    _, ddp, opt, _ = _setup(ctx)
    _train(ddp, opt, 4, ctx.rank)
    saved = opt.state_dict()
    params = ddp.grad_buffers[0].param_data.clone()

    _, ddp, opt, _ = _setup(ctx)  # a fresh process's optimizer, loaded
    ddp.grad_buffers[0].param_data.copy_(params)
    opt.load_state_dict(saved)
    _train(ddp, opt, STEPS - 4, ctx.rank, first_step=5)
    resumed = ddp.grad_buffers[0].param_data.clone()

    _, ddp, opt, _ = _setup(ctx)  # the same, but the error-feedback buffers lost
    ddp.grad_buffers[0].param_data.copy_(params)
    opt.load_state_dict({k: v for k, v in saved.items() if k != "onebit"})
    _train(ddp, opt, STEPS - 4, ctx.rank, first_step=5)
    without_errors = ddp.grad_buffers[0].param_data.clone()
    return straight, resumed, without_errors, sorted(saved["onebit"])


def test_resume_from_state_dict_is_exact():
    for straight, resumed, without_errors, keys in run_ranks(_resume_main, 2):
        assert torch.equal(resumed, straight)
        assert not torch.equal(without_errors, straight)  # the errors are what made it exact
        assert keys == ["freeze_step", "server_error.0", "worker_error.0"]


def _clip_main(ctx):
    _, ddp, opt, _ = _setup(ctx, freeze=1, max_grad_norm=1e30)
    (buf,) = ddp.grad_buffers
    _train(ddp, opt, 1, ctx.rank)
    opt.zero_grad()
    grad = _grad(2, ctx.rank, buf.numel)
    _backward(ddp, grad)
    result = opt.step()
    local = torch.linalg.vector_norm(grad).item()
    return result.grad_norm, local, ddp.reduce_gradients


def test_compression_stage_norm_is_the_rms_of_local_norms():
    ranks = run_ranks(_clip_main, 2)
    norms = [r[0] for r in ranks]
    rms = math.sqrt(sum(r[1] ** 2 for r in ranks) / len(ranks))
    assert norms[0] == norms[1]
    assert abs(norms[0] - rms) <= 1e-5 * rms
    assert all(r[2] is False for r in ranks)  # DataParallel left the reduction out


def _zero_main(ctx):
    layout = ParallelLayout.build(LayoutSpec(), ctx.backend.collective, ctx.rank, ctx.world_size)
    ddp = DataParallel(_model(), layout, ctx.backend, DataParallelConfig(shard_optimizer=True))
    with pytest.raises(ValueError, match="ZeRO-1"):
        OneBitAdam(ddp, freeze_step=1)
    return True


def test_zero1_is_refused():
    assert run_ranks(_zero_main, 2) == [True, True]
