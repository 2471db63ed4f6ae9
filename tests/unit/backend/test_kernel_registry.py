"""Kernel resolution: priority, predicates, shape guards, forcing the reference, caching."""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import REFERENCE, KernelImpl, KernelQuery, KernelRegistrationError, KernelTable
from mtcore.ops import REFERENCE_OPS, swiglu


def tagged(tag):
    def impl(x):
        calls.append(tag)
        return swiglu(x)

    return impl


calls: list[str] = []


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    calls.clear()
    monkeypatch.delenv("MTCORE_KERNELS", raising=False)


def test_every_op_has_a_reference_and_dispatch_matches_it():
    table = KernelTable("cpu", [])
    assert set(table.ops()) == set(REFERENCE_OPS)
    x = torch.randn(3, 8)
    torch.testing.assert_close(table.swiglu(x), swiglu(x), rtol=0, atol=0)


def test_highest_priority_accepting_implementation_wins_per_dtype():
    table = KernelTable(
        "cpu",
        [
            KernelImpl("swiglu", tagged("bf16-only"), "bf16", priority=20,
                       predicate=lambda q: q.dtype == torch.bfloat16),
            KernelImpl("swiglu", tagged("any"), "any", priority=10),
        ],
    )
    table.swiglu(torch.randn(2, 4))
    table.swiglu(torch.randn(2, 4, dtype=torch.bfloat16))
    assert calls == ["any", "bf16-only"]
    names = [k.name for k in table.table(KernelQuery("cpu", torch.float32))["swiglu"]]
    assert names == ["any"]


def test_shape_guard_falls_through_to_next_implementation():
    table = KernelTable(
        "cpu",
        [
            KernelImpl("swiglu", tagged("small"), "small", priority=20,
                       fallback_ok=lambda x: x.shape[-1] <= 8),
            KernelImpl("swiglu", tagged("big"), "big", priority=10),
        ],
    )
    table.swiglu(torch.randn(2, 8))
    table.swiglu(torch.randn(2, 16))
    assert calls == ["small", "big"]


def test_forced_reference_ignores_plugins(monkeypatch):
    monkeypatch.setenv("MTCORE_KERNELS", "reference")
    table = KernelTable("cpu", [KernelImpl("swiglu", tagged("fast"), "fast", priority=99)])
    table.swiglu(torch.randn(2, 4))
    assert calls == []
    assert [k.name for k in table.table(KernelQuery("cpu", torch.float32))["swiglu"]] == [REFERENCE]


def test_bad_env_value_is_an_error(monkeypatch):
    monkeypatch.setenv("MTCORE_KERNELS", "fastest")
    with pytest.raises(ValueError, match="MTCORE_KERNELS='fastest'"):
        KernelTable("cpu", [])


def test_resolution_is_cached_per_device_and_dtype():
    predicate_calls = []

    def predicate(q):
        predicate_calls.append(q)
        return True

    table = KernelTable("cpu", [KernelImpl("swiglu", tagged("p"), "p", predicate=predicate)])
    for _ in range(5):
        table.swiglu(torch.randn(2, 4))
    assert predicate_calls == [KernelQuery("cpu", torch.float32)]


def test_unknown_op_and_keyword_only_mismatch_are_rejected():
    with pytest.raises(KernelRegistrationError, match="unknown op 'gelu'"):
        KernelTable("cpu", [KernelImpl("gelu", lambda x: x, "g", plugin="p")])

    def adamw(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps):
        pass

    with pytest.raises(KernelRegistrationError, match="adamw_step"):
        KernelTable("cpu", [KernelImpl("adamw_step", adamw, "a", plugin="p")])


def test_adamw_dispatch_keys_on_the_first_parameter():
    p = [torch.ones(3)]
    g = [torch.ones(3)]
    m, v = [torch.zeros(3)], [torch.zeros(3)]
    KernelTable("cpu", []).adamw_step(
        p, g, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0
    )
    assert p[0][0].item() == pytest.approx(0.9, abs=1e-6)
