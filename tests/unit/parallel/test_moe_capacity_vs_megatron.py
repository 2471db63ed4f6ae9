"""``--moe-expert-capacity-factor`` is mapped, not bit for bit: checked against
Megatron-Core 0.16.1's own ``apply_router_token_dropping`` (moe_utils.py). The capacity
is the same number; which assignments overflow differs: Megatron keeps each expert's
highest-probability tokens (``--moe-token-drop-policy probs``, its default), mtcore's
``capacity_keep_mask`` all first choices before any second, then earlier tokens (GShard)."""

from __future__ import annotations

import pytest
import torch

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

from mtcore.parallel.moe.router import capacity_keep_mask  # noqa: E402
from mtcore.parallel.moe.spec import expert_capacity  # noqa: E402

TOKENS, EXPERTS, TOP_K = 8, 4, 2


def _routing(experts: torch.Tensor, probs: torch.Tensor):
    """Megatron's [T, E] routing map and probabilities from top-k choices."""
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, experts, True)
    routing_probs = torch.zeros(TOKENS, EXPERTS).scatter(1, experts, probs)
    return routing_map, routing_probs


def _kept(keep: torch.Tensor, experts: torch.Tensor) -> set[tuple[int, int]]:
    return {(t, int(experts[t, j])) for t in range(TOKENS) for j in range(TOP_K) if keep[t, j]}


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_the_capacity_is_megatrons(factor):
    ours = expert_capacity(TOKENS, EXPERTS, TOP_K, factor)
    assert ours == moe_utils.get_capacity(TOKENS * TOP_K, EXPERTS, factor)


def test_which_tokens_overflow_differs_and_nothing_differs_without_overflow():
    # Every token's first choice is expert 0, second expert 1 + t % 3: expert 0 overflows
    # (8 assignments, capacity 4). Later tokens hold expert 0 with higher probability.
    experts = torch.stack([torch.zeros(TOKENS, dtype=torch.long), 1 + torch.arange(TOKENS) % 3], 1)
    first = torch.linspace(0.55, 0.9, TOKENS)
    probs = torch.stack([first, 1 - first], 1)
    capacity = expert_capacity(TOKENS, EXPERTS, TOP_K, 1.0)
    ours = _kept(capacity_keep_mask(experts, EXPERTS, capacity), experts)
    routing_map, routing_probs = _routing(experts, probs)
    _, final_map = moe_utils.apply_router_token_dropping(routing_probs, routing_map, TOP_K, 1.0)
    theirs = {(int(t), int(e)) for t, e in final_map.nonzero()}
    on_zero = lambda kept: {t for t, e in kept if e == 0}  # noqa: E731
    assert on_zero(ours) == {0, 1, 2, 3}  # GShard: the earlier tokens
    assert on_zero(theirs) == {4, 5, 6, 7}  # Megatron: the higher probabilities
    assert {k for k in ours if k[1] != 0} == {k for k in theirs if k[1] != 0}  # no overflow there

    spread = torch.stack([torch.arange(TOKENS) % EXPERTS, (torch.arange(TOKENS) + 1) % EXPERTS], 1)
    routing_map, routing_probs = _routing(spread, probs)
    _, final_map = moe_utils.apply_router_token_dropping(routing_probs, routing_map, TOP_K, 1.0)
    kept = _kept(capacity_keep_mask(spread, EXPERTS, capacity), spread)
    assert kept == {(int(t), int(e)) for t, e in final_map.nonzero()} and len(kept) == 16
