"""The B/W split in one process: inside ``deferring_weight_grads`` the linears' backward
gives no weight gradient and W's products are the ones an unsplit backward computes
(bitwise); the runner's ``zb_h1`` on one stage equals 1F1B's gradients bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mtcore.backend import select_backend
from mtcore.parallel.layout import ParallelLayout
from mtcore.parallel.pipeline import PipelineGroups, PipelineRunner, build_schedule, zb_h1
from mtcore.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TPGroup
from mtcore.parallel.tensor.weight_grad import WeightGradStore, deferring_weight_grads

BACKEND = select_backend("cpu")
TP = TPGroup.single(BACKEND)


def _block(seed: int = 0) -> nn.Sequential:
    g = torch.Generator().manual_seed(seed)
    return nn.Sequential(
        ColumnParallelLinear(8, 16, TP, generator=g),
        nn.LayerNorm(16),
        nn.GELU(),
        RowParallelLinear(16, 8, TP, generator=g, bias=True),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_defers_the_linears_weight_gradients_only(dtype):
    x = torch.randn(3, 5, 8, dtype=dtype, requires_grad=True)
    plain, split = _block().to(dtype), _block().to(dtype)
    plain(x).square().sum().backward()
    want_x, x.grad = x.grad, None

    store = WeightGradStore()
    with deferring_weight_grads(store):
        out = split(x)
    out.square().sum().backward()
    assert torch.equal(x.grad, want_x)
    linears = (split[0].weight, split[3].weight)
    assert all(w.grad is None for w in linears) and len(store) == 2
    # biases and the norm are not deferred: their gradients are there after B
    for name in ("0.bias", "1.weight", "1.bias", "3.bias"):
        got, want = split.get_parameter(name).grad, plain.get_parameter(name).grad
        assert torch.equal(got, want), name
    done = store.compute()
    assert len(store) == 0 and done[0][0] is split[3].weight and done[1][0] is split[0].weight
    for weight, grad in done:  # W: the same numbers as the unsplit backward's
        name = "0.weight" if weight is split[0].weight else "3.weight"
        assert torch.equal(grad, plain.get_parameter(name).grad), name


def test_outside_the_block_nothing_is_deferred():
    store, block = WeightGradStore(), _block()
    with deferring_weight_grads(store):
        pass
    block(torch.randn(2, 3, 8)).sum().backward()
    assert len(store) == 0 and block[0].weight.grad is not None


def _loss(out, target):
    return F.mse_loss(out, target)


@pytest.mark.parametrize("m", [1, 3])
def test_one_stage_zb_h1_equals_1f1b_bitwise(m):
    g = torch.Generator().manual_seed(2)
    inputs, targets = torch.randn(m, 2, 5, 8, generator=g), torch.randn(m, 2, 5, 8, generator=g)
    groups = PipelineGroups.build(ParallelLayout.single(), None)
    grads, stats = {}, {}
    for name in ("1f1b", "zb_h1"):
        model = _block()
        schedule = build_schedule(name, 1, m)
        runner = PipelineRunner([model], schedule, groups, BACKEND, (2, 5, 8), _loss, trace=True)
        stats[name] = runner.step(list(inputs), list(targets))
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    assert [str(a) for a, *_ in stats["zb_h1"].trace] == [
        str(a) for a in zb_h1(1, m).compute_order(0)
    ]
    assert stats["zb_h1"].loss == stats["1f1b"].loss
    for name, grad in grads["1f1b"].items():
        assert torch.equal(grads["zb_h1"][name], grad), name


def test_under_recompute_the_parameter_itself_gets_the_deferred_gradient():
    """Checkpointing hands backward an alias of a saved parameter; W must still reach the
    parameter (accumulating into the alias would lose the gradient)."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(2, 3, 8, requires_grad=True)
    plain, split = _block(), _block()
    checkpoint(plain, x, use_reentrant=False).square().sum().backward()
    store = WeightGradStore()
    with deferring_weight_grads(store):
        out = checkpoint(split, x, use_reentrant=False)
        torch.autograd.grad(out.square().sum(), list(split.parameters()), allow_unused=True)
    done = store.compute()
    assert done[0][0] is split[3].weight and done[1][0] is split[0].weight  # not aliases
    assert torch.equal(done[0][1], plain[3].weight.grad)
    assert torch.equal(done[1][1], plain[0].weight.grad)


def test_hand_over_accumulates_with_hooks_and_without_a_copy():
    from mtcore.parallel.tensor.weight_grad import hand_over

    weight, bias = nn.Parameter(torch.ones(4, 3)), nn.Parameter(torch.ones(4))
    seen = []
    for p in (weight, bias):
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    made = {}

    def grads():
        fresh = torch.full((4, 3), 2.0)
        made["address"] = fresh.data_ptr()  # a copy would be made while this one lives
        return [fresh, torch.full((4,), 3.0)]

    hand_over([weight, bias], grads)
    assert weight.grad.data_ptr() == made["address"]  # taken over, not copied
    assert torch.equal(bias.grad, torch.full((4,), 3.0)) and len(seen) == 2
    made.clear()
    hand_over([weight, bias], grads)  # a second micro-batch adds to it
    assert torch.equal(weight.grad, torch.full((4, 3), 4.0)) and len(seen) == 4
