"""Router maths against closed forms: scores, top-k weights, losses, capacity, bias, errors."""

from __future__ import annotations

import math

import pytest
import torch

from mtcore.parallel.moe import (
    MoESpec,
    capacity_keep_mask,
    expert_capacity,
    load_balancing_loss,
    route,
    sequence_load_balancing_loss,
    update_bias,
    z_loss,
)
from mtcore.parallel.moe.router import AttachAuxLoss


def _logits(t=12, e=6, seed=0):
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed)) * 2


def test_softmax_topk_weights_and_renormalisation():
    logits = _logits()
    r = route(logits, MoESpec(num_experts=6, top_k=2, ffn_size=4, norm_topk=False))
    full = torch.softmax(logits, -1)
    assert torch.equal(r.experts, full.topk(2, -1).indices)
    assert torch.allclose(r.probs, full.topk(2, -1).values)
    r = route(logits, MoESpec(num_experts=6, top_k=2, ffn_size=4))
    assert torch.allclose(r.probs.sum(-1), torch.ones(12))
    want = full.topk(2, -1).values / full.topk(2, -1).values.sum(-1, keepdim=True)
    assert torch.allclose(r.probs, want)


def test_topk_then_softmax_is_softmax_over_chosen_logits():
    logits = _logits()
    r = route(logits, MoESpec(num_experts=6, top_k=3, ffn_size=4, topk_then_softmax=True))
    top = logits.topk(3, -1)
    assert torch.equal(r.experts, top.indices)
    assert torch.allclose(r.probs, torch.softmax(top.values, -1))


def test_sigmoid_scores_normalised_over_the_chosen_k():
    logits = _logits()
    spec = MoESpec(num_experts=6, top_k=2, ffn_size=4, score="sigmoid")
    r = route(logits, spec)
    s = torch.sigmoid(logits)
    top = s.topk(2, -1)
    assert torch.equal(r.experts, top.indices)
    assert torch.allclose(r.probs, top.values / top.values.sum(-1, keepdim=True))
    assert torch.allclose(r.scores.sum(-1), torch.ones(12))  # normalised for the aux loss
    raw = route(logits, spec.model_copy(update={"norm_topk": False}))
    assert torch.allclose(raw.probs, top.values)


def test_load_balancing_loss_closed_form():
    scores = torch.softmax(_logits(8, 4), -1)
    experts = scores.topk(2, -1).indices
    loss = load_balancing_loss(scores, experts, 4)
    want = 0.0
    for i in range(4):
        f_i = (experts == i).sum().item() / (8 * 2)
        p_i = scores[:, i].mean().item()
        want += f_i * p_i
    assert loss.item() == pytest.approx(4 * want, rel=1e-6)
    # perfectly balanced routing with uniform scores gives exactly 1
    uniform = torch.full((4, 4), 0.25)
    balanced = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])
    assert load_balancing_loss(uniform, balanced, 4).item() == pytest.approx(1.0)
    # all tokens on one expert with all the probability: E
    peaked = torch.zeros(4, 4)
    peaked[:, 0] = 1.0
    assert load_balancing_loss(peaked, torch.zeros(4, 1, dtype=torch.long), 4).item() == 4.0


def test_sequence_loss_is_mean_of_per_sequence_losses():
    scores = torch.softmax(_logits(12, 4), -1)
    experts = scores.topk(2, -1).indices
    per_seq = [load_balancing_loss(scores[i : i + 4], experts[i : i + 4], 4) for i in (0, 4, 8)]
    got = sequence_load_balancing_loss(scores, experts, 4, batch=3)
    assert got.item() == pytest.approx(torch.stack(per_seq).mean().item(), rel=1e-6)
    assert got.item() != pytest.approx(load_balancing_loss(scores, experts, 4).item(), rel=1e-3)


def test_z_loss_closed_form():
    logits = _logits(5, 3)
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 5
    assert z_loss(logits).item() == pytest.approx(want, rel=1e-6)


def test_bias_changes_the_choice_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    spec = MoESpec(num_experts=4, top_k=1, ffn_size=4, norm_topk=False, score="sigmoid")
    r = route(logits, spec, bias=torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert r.experts.tolist() == [[3]]
    assert r.probs.item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())


def test_bias_update_direction_and_effect():
    bias = torch.zeros(4)
    update_bias(bias, torch.tensor([10, 2, 2, 2]), rate=0.1)
    assert bias.tolist() == pytest.approx([-0.1, 0.1, 0.1, 0.1])
    # repeated updates balance a router that prefers expert 0 for every token
    logits = _logits(64, 4) * 0.1
    logits[:, 0] += 1.0
    spec = MoESpec(num_experts=4, top_k=1, ffn_size=4, score="sigmoid")
    bias = torch.zeros(4)
    loads = []
    for _ in range(40):
        load = torch.bincount(route(logits, spec, bias).experts.reshape(-1), minlength=4)
        loads.append(load.max().item())
        update_bias(bias, load, rate=0.02)
    assert loads[0] == 64 and max(loads[-10:]) <= 32  # the mean load is 16


def test_capacity_math_and_priority():
    assert expert_capacity(10, 4, 2, 1.0) == 5
    assert expert_capacity(10, 4, 2, 1.1) == 6  # ceil(5.5)
    assert expert_capacity(10, 4, 2, None) is None
    assert MoESpec(num_experts=4, ffn_size=4, capacity_factor=0.5).capacity(8) == 2
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    keep = capacity_keep_mask(experts, 3, capacity=2)
    # expert 0: first choices of tokens 0, 1, 2 -> 0 and 1 fit, 2 dropped; token 3's second too
    # expert 1: second choices of 0, 1 come after token 3's first choice -> token 1's dropped
    assert keep.tolist() == [[True, True], [True, False], [False, True], [True, False]]
    big = torch.randint(0, 5, (50, 3), generator=torch.Generator().manual_seed(1))
    keep = capacity_keep_mask(big, 5, capacity=20)
    taken, want = [0] * 5, torch.zeros(50, 3, dtype=torch.bool)
    for j in range(3):  # the rule, by hand: choice rank first, then token order
        for t in range(50):
            e = big[t, j].item()
            want[t, j] = taken[e] < 20
            taken[e] += 1
    assert torch.equal(keep, want) and not keep.all()


def test_attach_aux_loss_injects_scaled_gradient():
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    aux = (w**2).sum()
    y = AttachAuxLoss.apply(x * 2, aux, 0.25)
    assert torch.equal(y, x * 2)
    y.sum().backward()
    assert torch.allclose(w.grad, 0.25 * 2 * w)
    assert torch.allclose(x.grad, torch.full((3,), 2.0))


def test_bad_input_names_the_numbers():
    with pytest.raises(ValueError, match="top_k=5 is larger than num_experts=4"):
        MoESpec(num_experts=4, top_k=5, ffn_size=8)
    spec = MoESpec(num_experts=6, top_k=2, ffn_size=10, shared_ffn_size=6)
    with pytest.raises(ValueError, match=r"num_experts=6 is not divisible by .*ep=4"):
        spec.check(4, 1)
    with pytest.raises(ValueError, match="ffn_size=10 is not divisible by tp=4"):
        spec.check(2, 4)
    with pytest.raises(ValueError, match="shared_ffn_size=6 is not divisible by tp=4"):
        MoESpec(num_experts=6, ffn_size=8, shared_ffn_size=6).check(1, 4)
    spec.check(3, 2)
    with pytest.raises(ValueError, match="topk_then_softmax"):
        MoESpec(num_experts=4, ffn_size=8, score="sigmoid", topk_then_softmax=True)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoESpec(num_experts=4, ffn_size=8, capacity_factor=0.0)
    with pytest.raises(ValueError, match="extra"):
        MoESpec(num_experts=4, ffn_size=8, experts=3)


def test_top1_weight_is_the_probability_so_the_router_learns_from_the_loss():
    """Switch-style top-1: rescaling one weight to 1 (norm_topk) would cut the router off
    from the language-model loss; the weight stays the router's probability."""
    for score in ("softmax", "sigmoid"):
        logits = _logits(8, 4).requires_grad_()
        r = route(logits, MoESpec(num_experts=4, top_k=1, ffn_size=4, score=score))
        assert (r.probs < 1).all(), score
        r.probs.sum().backward()
        assert logits.grad.abs().sum() > 0, score


def test_group_limited_routing_chooses_inside_the_best_groups_and_scales():
    """DeepSeek-V3's choice: groups scored by their two best (biased) sigmoid scores; a
    token's experts come from its best groups only; weights unbiased, then scaled."""
    logits, bias = _logits(t=64, e=8, seed=3), 0.3 * torch.randn(8)
    spec = MoESpec(num_experts=8, top_k=3, ffn_size=4, score="sigmoid", expert_groups=4,
                   top_groups=2, routed_scale=2.5)  # fmt: skip
    r = route(logits, spec, bias)
    chooser = (torch.sigmoid(logits) + bias).view(64, 4, 2)
    best_groups = chooser.sum(-1).topk(2, dim=-1).indices  # groups of 2: both entries
    for token in range(64):
        groups = set((r.experts[token] // 2).tolist())
        assert groups <= set(best_groups[token].tolist()), token
    raw = torch.sigmoid(logits).gather(-1, r.experts)
    torch.testing.assert_close(r.probs, 2.5 * raw / raw.sum(-1, keepdim=True))
    free = route(logits, spec.model_copy(update={"top_groups": None}), bias)
    assert not torch.equal(free.experts.sort(-1).values, r.experts.sort(-1).values)


def test_group_limited_routing_refuses_impossible_groups():
    with pytest.raises(ValueError, match="not divisible by expert_groups=3"):
        MoESpec(num_experts=8, ffn_size=4, expert_groups=3)
    with pytest.raises(ValueError, match="hold fewer than top_k=4"):
        MoESpec(num_experts=8, ffn_size=4, top_k=4, expert_groups=4, top_groups=1)
