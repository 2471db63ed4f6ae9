"""How the Triton pack reaches a backend: the hook, the guards, MTCORE_KERNELS, doctor.

The pack is offered to "cuda" (and to "musa" only where a Triton backend drives
MUSA devices, which this machine has not). Its dispatch is exercised for real on
CPU tensors: a kernel table built from ``triton_kernel_impls("cpu")`` runs the
interpreted kernels, so the guards are checked on calls, not only on paper.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

pytest.importorskip("triton")

from mtcore import ops
from mtcore.backend import KernelQuery, KernelTable
from mtcore.backend.kernels import check_signature
from mtcore.backend.selection import plugin_registry
from mtcore.backend.spec import Backend
from mtcore.cli import render, report
from mtcore.ops import rope_tables
from mtcore_cuda import plugin
from mtcore_cuda.triton_kernels import registration

PACK_OPS = {op for op, _, _ in registration._OPS}


def _triton_ops(impls) -> set[str]:
    return {i.op for i in impls if i.name == registration.NAME}


def test_hook_offers_the_pack_to_cuda_only():
    cuda = plugin.mtcore_kernels(backend="cuda", device_type="cuda")
    assert _triton_ops(cuda) == PACK_OPS
    for impl in cuda:
        check_signature(impl)  # the reference op's parameter names, exactly
    assert _triton_ops(plugin.mtcore_kernels(backend="cpu", device_type="cpu")) == set()
    # No Triton backend here targets MUSA, so the musa backend gets nothing from this plugin.
    assert registration.triton_backend_for("musa") is None
    assert plugin.mtcore_kernels(backend="musa", device_type="musa") == []


def _driver(active: bool, target: str):
    return type(
        "Driver",
        (),
        {
            "is_active": staticmethod(lambda: active),
            "get_current_target": lambda self: types.SimpleNamespace(backend=target),
        },
    )


def test_musa_gets_the_pack_when_a_triton_backend_targets_musa(monkeypatch):
    # A stand-in for triton's backend registry as a MUSA build fills it: the backend's
    # name is arbitrary, the driver's target says "musa". No MUSA device runs here.
    registry = types.ModuleType("triton.backends")
    registry.backends = {
        "nvidia": types.SimpleNamespace(driver=_driver(False, "cuda")),
        "some_vendor_name": types.SimpleNamespace(driver=_driver(True, "musa")),
    }
    monkeypatch.setitem(sys.modules, "triton.backends", registry)
    assert registration.triton_backend_for("musa") == "some_vendor_name"
    impls = {i.op: i for i in plugin.mtcore_kernels(backend="musa", device_type="musa")}
    assert set(impls) == PACK_OPS
    # Below muDNN's kernels (priority 50), above the reference; FP8 stays off on MUSA.
    assert impls["rms_norm"].priority == plugin.MUSA_TRITON_PRIORITY < 50
    assert impls["rms_norm"].accepts(KernelQuery("musa", torch.bfloat16))
    assert not impls["rms_norm"].accepts(KernelQuery("cuda", torch.bfloat16))
    assert not impls["fp8_quantize"].accepts(KernelQuery("musa", torch.bfloat16))


def test_predicates_admit_the_backend_device_and_float_dtypes_only():
    impls = {i.op: i for i in registration.triton_kernel_impls("cuda")}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert impls["rms_norm"].accepts(KernelQuery("cuda", dtype))
    assert not impls["rms_norm"].accepts(KernelQuery("cpu", torch.float32))
    assert not impls["rms_norm"].accepts(KernelQuery("cuda", torch.float64))


def _cuda_backend(monkeypatch, force: str | None) -> Backend:
    if force is None:
        monkeypatch.delenv("MTCORE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("MTCORE_KERNELS", force)
    registry = plugin_registry()
    spec, info = registry.backends().backends["cuda"]
    # Built directly: selection would refuse cuda here (no GPU), doctor would skip it.
    return Backend(spec, info.name, registry.kernels_for("cuda", "cuda"))


def test_doctor_kernel_table_shows_the_pack_and_the_forced_reference(monkeypatch):
    facts = report.kernel_facts(_cuda_backend(monkeypatch, None))
    rows = facts["dtypes"]["bfloat16"]
    for op in PACK_OPS - {"adamw_step", "fp8_quantize", "fp8_quantize_transpose"}:
        assert [c["name"] for c in rows[op]["chosen"]] == ["triton", "reference"], op
    # FP8 in Triton needs capability 8.9; with no GPU here the gate says no.
    for op in ("fp8_quantize", "fp8_quantize_transpose"):
        assert [c["name"] for c in rows[op]["chosen"]] == ["reference"], op
        assert [(o["name"], o["accepts"]) for o in rows[op]["others"]] == [("triton", False)]
    # fp32 AdamW: torch's multi-tensor kernel first, the pack for what it declines.
    chain = [c["name"] for c in facts["dtypes"]["float32"]["adamw_step"]["chosen"]]
    assert chain == ["torch-fused", "triton", "reference"]
    text = "\n".join(render._kernels(facts))
    assert "rms_norm" in text and "triton [mtcore_cuda] -> reference [mtcore]" in text

    forced = report.kernel_facts(_cuda_backend(monkeypatch, "reference"))
    assert forced["forced_reference"]
    for rows in forced["dtypes"].values():
        assert all([c["name"] for c in r["chosen"]] == ["reference"] for r in rows.values())
    assert "forces the reference" in "\n".join(render._kernels(forced))


def test_dispatch_runs_the_pack_and_guards_route_the_rest(monkeypatch):
    monkeypatch.delenv("MTCORE_KERNELS", raising=False)
    table = KernelTable("interpreted", registration.triton_kernel_impls("cpu"))
    q = KernelQuery("cpu", torch.float32)
    assert [i.name for i in table.rms_norm.select(q)] == ["triton", "reference"]
    x, w = torch.randn(3, 40), torch.randn(40)
    torch.testing.assert_close(table.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6))
    # With no FP8 gate (an interpreter table), the fused quantize-transpose is the pack's.
    assert [i.name for i in table.fp8_quantize_transpose.select(q)] == ["triton", "reference"]
    (d, _, _), (dt, _, _) = table.fp8_quantize_transpose(x, torch.float8_e4m3fn, "1x128")
    assert dt.shape == (40, 3) and d.dtype == dt.dtype == torch.float8_e4m3fn
    # Guards: a strided last dim and a hidden size beyond one block go to the reference.
    assert registration.rms_norm_ok(x, w)
    assert not registration.rms_norm_ok(torch.randn(40, 3).t(), w)
    big = torch.randn(1, registration.MAX_HIDDEN + 1)
    assert not registration.rms_norm_ok(big, torch.ones(big.shape[1]))
    torch.testing.assert_close(
        table.rms_norm(big, torch.ones(big.shape[1])), ops.rms_norm(big, torch.ones(big.shape[1]))
    )
    # RoPE tables that need gradients: only the reference differentiates them.
    cos, sin = rope_tables(4, 8)
    cos.requires_grad_()
    xr = torch.randn(1, 4, 2, 8)
    assert not registration.rope_ok(xr, cos, sin)
    table.rope(xr, cos, sin).sum().backward()
    assert cos.grad is not None
    # AdamW: bf16 moments are not the contract; the reference raises its error.
    p = [torch.zeros(3)]
    with pytest.raises(ValueError, match="float32"):
        table.adamw_step(
            p,
            [torch.ones(3)],
            [torch.zeros(3, dtype=torch.bfloat16)],
            [torch.zeros(3)],
            step=1,
            lr=0.1,
            beta1=0.9,
            beta2=0.99,
            eps=1e-8,
            weight_decay=0.0,
        )


def test_mtcore_kernels_reference_forces_the_reference(monkeypatch):
    monkeypatch.setenv("MTCORE_KERNELS", "reference")
    table = KernelTable("interpreted", registration.triton_kernel_impls("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        assert all(
            [i.name for i in chain] == ["reference"]
            for chain in table.table(KernelQuery("cpu", dtype)).values()
        )
