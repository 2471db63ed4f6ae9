"""The MoE layer in one process against a per-token loop written from the definition.

``y_t = sum_j p_tj * expert_{e_tj}(x_t)`` over the kept choices of token t (+ the
shared expert), with the layer's own weights in plain matmuls: this pins the
sort / dispatch / combine bookkeeping that the multi-rank tests only compare
with itself. Also: the aux/z-loss gradient injection and the statistics.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtcore.backend import select_backend
from mtcore.parallel.layout import ParallelLayout
from mtcore.parallel.moe import MoELayer, MoESpec, load_balancing_loss, route, z_loss
from mtcore.parallel.tensor import TPGroup

BACKEND = select_backend("cpu")
H = 12


def _layer(**kw):
    spec = MoESpec(**{"num_experts": 5, "top_k": 2, "ffn_size": 6, **kw})
    return MoELayer(
        H,
        spec,
        tp=TPGroup.single(BACKEND),
        layout=ParallelLayout.single(),
        backend=BACKEND,
        sequence_parallel=False,
        generator=torch.Generator().manual_seed(3),
        init_std=0.3,
        out_std=0.3,
        bias=True,
    )


def _naive(layer, x):
    """Per-token loop from the definition (same parameters, autograd through them)."""
    spec = layer.spec
    tokens = x.reshape(-1, H)
    logits = tokens @ layer.router.weight.t()
    r = route(logits, spec)
    keep = layer.last_keep
    rows = []
    for t in range(tokens.shape[0]):
        acc = torch.zeros(H)
        for j in range(spec.top_k):
            if keep is not None and not keep[t, j]:
                continue
            e = r.experts[t, j]
            h = tokens[t] @ layer.experts.fc1[e]
            if spec.activation == "swiglu":
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            else:
                h = F.gelu(h, approximate="tanh")
            acc = acc + r.probs[t, j] * (h @ layer.experts.fc2[e])
        rows.append(acc)
    y = torch.stack(rows).view_as(x)
    if layer.shared is not None:
        y = y + layer.shared(x)
    return y


CASES = {
    "softmax": {},
    "allgather_gelu": {"dispatcher": "allgather", "activation": "gelu"},
    "sigmoid_shared": {"score": "sigmoid", "shared_ffn_size": 4},
    "capacity": {"capacity_factor": 0.6, "top_k": 3},
}


@pytest.mark.parametrize("case", CASES)
def test_layer_equals_per_token_definition(case):
    layer = _layer(aux_loss="none", **CASES[case])
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(2))
    outs = []
    for fn in (layer, lambda t: _naive(layer, t)):
        layer.zero_grad()
        xi = x.clone().requires_grad_(True)
        y = fn(xi)
        (y * grad).sum().backward()
        outs.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (y0, gx0, gp0), (y1, gx1, gp1) = outs
    torch.testing.assert_close(y0, y1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx0, gx1, rtol=1e-5, atol=1e-6)
    for name in gp1:
        torch.testing.assert_close(gp0[name], gp1[name], rtol=1e-5, atol=1e-6, msg=name)
    if case == "capacity":
        dropped = layer.pop_stats().dropped
        assert dropped > 0 and dropped == int((~layer.last_keep).sum())  # the layer ran once


def test_aux_and_z_loss_gradients_are_injected_with_the_scale():
    x = torch.randn(3, 4, H, generator=torch.Generator().manual_seed(4))
    plain = _layer(aux_loss="none")
    plain(x).sum().backward()
    lossy = _layer(aux_loss="batch", aux_loss_coeff=0.3, z_loss_coeff=0.2)
    lossy.aux_loss_scale = 0.5
    y = lossy(x)
    torch.testing.assert_close(y, plain(x))  # the losses do not touch the activations
    y.sum().backward()
    w = lossy.router.weight.detach().clone().requires_grad_(True)
    logits = x.reshape(-1, H) @ w.t()
    r = route(logits, lossy.spec)
    extra = 0.5 * (0.3 * load_balancing_loss(r.scores, r.experts, 5) + 0.2 * z_loss(logits))
    extra.backward()
    torch.testing.assert_close(lossy.router.weight.grad, plain.router.weight.grad + w.grad)
    stats = lossy.pop_stats()
    assert stats.forwards == 1
    assert stats.aux_loss == pytest.approx(load_balancing_loss(r.scores, r.experts, 5).item())
    assert stats.z_loss == pytest.approx(z_loss(logits).item())
    assert stats.tokens_per_expert.sum().item() == 12 * 2
    assert lossy.pop_stats().forwards == 0  # reset by the previous call


def test_expert_bias_update_and_parameter_flags():
    layer = _layer(bias_update_rate=0.01, score="sigmoid")
    assert "router.expert_bias" in layer.state_dict()
    layer.update_expert_bias(torch.tensor([9, 1, 1, 1, 3]))
    assert layer.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01, 0.0])
    flagged = {n for n, p in layer.named_parameters() if getattr(p, "expert_parallel", False)}
    assert flagged == {"experts.fc1", "experts.fc2"}
    assert layer.experts.fc1.expert_partition == (0, 5)
    off = _layer()
    off.update_expert_bias(torch.tensor([9, 1, 1, 1, 3]))
    assert off.expert_bias.abs().sum() == 0


def test_recompute_gives_the_same_grads_and_counts_once():
    from mtcore.parallel.recompute import checkpoint

    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(6))
    grads, stats = [], []
    for recompute in (False, True):
        layer = _layer(z_loss_coeff=0.1, capacity_factor=0.8)
        xi = x.clone().requires_grad_(True)
        y = checkpoint(layer, xi, backend=BACKEND) if recompute else layer(xi)
        y.sum().backward()
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
        stats.append(layer.pop_stats())
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
    assert stats[1].forwards == 1 and stats[1].z_loss == stats[0].z_loss
    assert torch.equal(stats[1].tokens_per_expert, stats[0].tokens_per_expert)
    assert stats[1].dropped == stats[0].dropped > 0


def test_bfloat16_layer_keeps_a_float32_expert_bias():
    layer = _layer(bias_update_rate=1e-3, score="sigmoid").to(torch.bfloat16)
    assert layer.experts.fc1.dtype == torch.bfloat16
    assert layer.expert_bias.dtype == torch.float32
    x = torch.randn(2, 3, H, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    y.float().sum().backward()
    assert y.dtype == x.grad.dtype == torch.bfloat16
    layer.update_expert_bias(torch.tensor([5, 1, 1, 1, 2]))
    assert layer.expert_bias[1].item() == pytest.approx(1e-3)
