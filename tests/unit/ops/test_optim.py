"""adamw_step against torch.optim.AdamW, bit for bit over several steps."""

import pytest
import torch

from mtcore.ops import adamw_step

SHAPES = [(7, 5), (13,), (2, 3, 4), ()]
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _init():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


@pytest.mark.parametrize("foreach", [False, True])
def test_matches_torch_adamw_bitwise(foreach):
    ref_params = [torch.nn.Parameter(p.clone()) for p in _init()]
    opt = torch.optim.AdamW(ref_params, foreach=foreach, **HP)
    params = _init()
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    for step in range(1, 6):
        grads = _grads(step)
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        adamw_step(
            params,
            grads,
            m,
            v,
            step=step,
            lr=HP["lr"],
            beta1=HP["betas"][0],
            beta2=HP["betas"][1],
            eps=HP["eps"],
            weight_decay=HP["weight_decay"],
        )
        for i, (ours, ref) in enumerate(zip(params, ref_params, strict=True)):
            # Same fp32 ops in the same order: exact for the single-tensor path. The
            # foreach kernels compute identical expressions; allow 1 ulp there anyway.
            if foreach:
                torch.testing.assert_close(ours, ref.detach(), rtol=2e-7, atol=0)
            else:
                assert torch.equal(ours, ref.detach()), (step, i)
            st = opt.state[ref_params[i]]
            torch.testing.assert_close(m[i], st["exp_avg"], rtol=0, atol=0)
            torch.testing.assert_close(v[i], st["exp_avg_sq"], rtol=0, atol=0)


def test_bf16_params_are_updated_in_fp32_and_rounded_once():
    master = _init()
    low = [p.to(torch.bfloat16) for p in master]
    master = [p.float() for p in low]  # same starting values
    state = [[torch.zeros_like(p) for p in master] for _ in range(4)]
    grads = _grads(1)
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    adamw_step(master, grads, state[0], state[1], **kw)
    adamw_step(low, [g.to(torch.bfloat16) for g in grads], state[2], state[3], **kw)
    for a, b in zip(low, master, strict=True):
        # Grads were rounded to bf16 first; at step 1 the update is ~lr*sign(g), so the
        # only difference left is the final rounding of p: within 1 bf16 ulp.
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)


def test_validates_inputs():
    p = [torch.zeros(3)]
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="lengths"):
        adamw_step(p, [], [torch.zeros(3)], [torch.zeros(3)], step=1, **kw)
    with pytest.raises(ValueError, match="1-based"):
        adamw_step(p, [torch.zeros(3)], [torch.zeros(3)], [torch.zeros(3)], step=0, **kw)
    with pytest.raises(ValueError, match="float32"):
        bf = torch.zeros(3, dtype=torch.bfloat16)
        adamw_step(p, [torch.zeros(3)], [bf], [bf.clone()], step=1, **kw)
    with pytest.raises(ValueError, match="shapes"):
        adamw_step(p, [torch.zeros(4)], [torch.zeros(3)], [torch.zeros(3)], step=1, **kw)
