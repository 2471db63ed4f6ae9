"""DataParallel, its buffers and the optimizers in one process (dp=1, no collectives)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mtcore.backend import select_backend
from mtcore.parallel.data import DataParallel, DataParallelConfig, GradBuffer
from mtcore.parallel.layout import ParallelLayout
from mtcore.parallel.optimizer import AdamW, DistributedAdamW
from mtcore.precision import DynamicLossScaler

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4)).to(dtype)


def _wrap(model, **cfg):
    return DataParallel(
        model, ParallelLayout.single(), select_backend("cpu"), DataParallelConfig(**cfg)
    )


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 6, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().square().mean()


def test_buckets_follow_reverse_registration_order_and_share_storage():
    model = _mlp()
    values = [p.detach().clone() for p in model.parameters()]
    ddp = _wrap(model, bucket_size=40)
    buf = ddp.grad_buffers[0]
    # w0 (48), b0, ln.w, ln.b (8 each), w2 (32), b2 (4). Reversed, a bucket closes at
    # >= 40 elements: {b2, w2, ln.b} and {ln.w, b0, w0}; within each, matrices first.
    assert [[p.numel() for p in b.params] for b in ddp.buckets] == [[32, 4, 8], [48, 8, 8]]
    assert [b.params[0].dim() for b in ddp.buckets] == [2, 2]  # matrices first within a bucket
    assert buf.numel == sum(v.numel() for v in values)
    for p, v in zip(model.parameters(), values, strict=True):
        start, end = buf.range_of(p)
        assert torch.equal(p, v)
        assert p.data_ptr() == buf.param_data[start:end].data_ptr()
        assert p.main_grad.data_ptr() == buf.grad[start:end].data_ptr()
        assert p.main_grad.dtype == torch.float32


def test_buckets_pad_to_a_multiple_for_sharding():
    params = [nn.Parameter(torch.ones(n)) for n in (3, 5, 2)]
    buf = GradBuffer(params, bucket_size=6, pad_to=4)
    assert [(b.start, b.end) for b in buf.buckets] == [(0, 8), (8, 12)]
    assert buf.buckets[0].shard(1, 4) == (2, 4)
    with pytest.raises(ValueError):
        buf.buckets[0].shard(0, 3)
    with pytest.raises(ValueError):
        GradBuffer(
            [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float16))], 10
        )


def test_one_buffer_per_dtype():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3).to(torch.bfloat16))
    ddp = _wrap(model)
    assert [b.dtype for b in ddp.grad_buffers] == [torch.float32, torch.bfloat16]
    assert [b.index for b in ddp.buckets] == [0, 1]
    assert all(b.grad.dtype == torch.float32 for b in ddp.grad_buffers)


def test_hooks_accumulate_into_main_grad_and_no_sync_defers_launches():
    model, ref = _mlp(), _mlp()
    ddp = _wrap(model, bucket_size=40)
    with ddp.no_sync():
        _loss(ddp, 1).backward()
    assert ddp.launch_log == []
    _loss(ddp, 2).backward()
    assert [r.bucket for r in ddp.launch_log] == [0, 1]
    assert ddp.launch_log[0].pending_grads > 0 and ddp.launch_log[-1].pending_grads == 0
    (_loss(ref, 1) + _loss(ref, 2)).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is None
        torch.testing.assert_close(p.main_grad, q.grad, rtol=1e-6, atol=1e-7)
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    assert all(b.grad.abs().sum() == 0 for b in ddp.grad_buffers) and ddp.launch_log == []


def test_without_overlap_everything_launches_at_finish():
    ddp = _wrap(_mlp(), bucket_size=40, overlap_grad_reduce=False)
    _loss(ddp, 1).backward()
    assert ddp.launch_log == []
    ddp.finish_grad_sync()
    assert [(r.bucket, r.from_backward) for r in ddp.launch_log] == [(0, False), (1, False)]


@pytest.mark.parametrize("cls", [AdamW, DistributedAdamW])
def test_adamw_is_torch_adamw_bit_for_bit(cls, monkeypatch):
    # Bit-for-bit holds for the reference kernel (torch's fused CPU kernel differs in
    # the last bit where its vector tails fall); the conformance kit bounds the fused one.
    monkeypatch.setenv("MTCORE_KERNELS", "reference")
    model, ref = _mlp(), _mlp()
    ddp = _wrap(model, bucket_size=40, shard_optimizer=cls.sharded)
    opt = cls(ddp, **HP)
    params = list(ref.parameters())
    torch_opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": HP["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=HP["lr"],
        betas=HP["betas"],
        eps=HP["eps"],
        foreach=False,
    )
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    for step in range(3):
        opt.zero_grad()
        torch_opt.zero_grad()
        _loss(ddp, step).backward()
        _loss(ref, step).backward()
        assert opt.step().stepped
        torch_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt.state_tensors()["master"] == []  # fp32 params are their own master


def test_low_precision_params_get_fp32_master_weights():
    model = _mlp(dtype=torch.bfloat16)
    opt = AdamW(_wrap(model), lr=1e-3)
    _loss(model, 0).backward()
    opt.step()
    (master,) = opt.state_tensors()["master"]
    assert master.dtype == torch.float32
    buf = opt.ddp.grad_buffers[0]
    for seg in opt.segments:
        assert torch.equal(buf.param_data[seg.start : seg.end], seg.master.to(torch.bfloat16))
    assert not torch.equal(master.to(torch.bfloat16).float(), master)  # fp32 keeps more bits


def test_optimizer_must_match_the_gradient_reduction():
    with pytest.raises(ValueError, match="shard_optimizer=True"):
        DistributedAdamW(_wrap(_mlp()))
    with pytest.raises(ValueError, match="shard_optimizer=False"):
        AdamW(_wrap(_mlp(), shard_optimizer=True))


def test_overflow_skips_the_step_and_backs_off():
    model = _mlp(dtype=torch.float16)
    scaler = DynamicLossScaler(initial_scale=2.0**8)
    opt = AdamW(_wrap(model), lr=1e-2, loss_scaler=scaler, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    opt.scale_loss(_loss(model, 0)).backward()
    next(model.parameters()).main_grad[0, 0] = math.inf
    result = opt.step()
    assert (result.stepped, result.loss_scale, scaler.scale, opt.step_count) == (
        False,
        256.0,
        128.0,
        0,
    )
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    opt.zero_grad()
    opt.scale_loss(_loss(model, 0)).backward()
    result = opt.step()
    assert result.stepped and result.grad_norm is not None and opt.step_count == 1


def test_state_dict_round_trip():
    model, twin = _mlp(), _mlp()
    opt = AdamW(_wrap(model), **HP)
    _loss(model, 0).backward()
    opt.step()
    state = opt.state_dict()
    twin.load_state_dict(model.state_dict())  # fp32 params are their own master weights
    other = AdamW(_wrap(twin), **HP)
    other.load_state_dict(state)
    for opt_ in (opt, other):
        opt_.zero_grad()
        _loss(opt_.ddp, 1).backward()
        opt_.step()
    assert other.step_count == 2
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
