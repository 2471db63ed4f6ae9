"""How the Triton pack reaches a backend: the one finder, the target table, the guards, doctor.

mtcore-triton offers the pack to whichever backend's torch device type an active
Triton driver targets. This machine has no GPU, so no real driver is active: the
finder's positive cases use a stand-in for ``triton.backends`` as a CUDA, ROCm or
MUSA build fills it (drivers reporting real ``GPUTarget`` objects). The pack's
dispatch is exercised for real on CPU tensors: a kernel table built from
``triton_kernel_impls("cpu")`` runs the interpreted kernels, so the guards are
checked on calls, not only on paper.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import types

import pytest
import torch

# triton.language, not triton: a namespace package named triton (a folder) must not pass.
pytest.importorskip("triton.language")
pytest.importorskip("mtcore_triton")

from triton.backends.compiler import GPUTarget

from mtcore import ops
from mtcore.backend import KernelQuery, KernelTable
from mtcore.backend.kernels import check_signature
from mtcore.backend.selection import plugin_registry
from mtcore.backend.spec import Backend
from mtcore.cli import render, report
from mtcore.ops import rope_tables
from mtcore_triton import plugin, registration, targets

PACK_OPS = {op for op, _, _ in registration._OPS}
FP8_OPS = {"fp8_quantize", "fp8_quantize_transpose"}


def _triton_ops(impls) -> set[str]:
    return {i.op for i in impls if i.name == registration.NAME}


def _driver(active: bool, target: GPUTarget | None):
    def get_current_target(self):
        if target is None:
            raise RuntimeError("this driver cannot read its device")
        return target

    return type(
        "Driver",
        (),
        {"is_active": staticmethod(lambda: active), "get_current_target": get_current_target},
    )


def _triton_backends(monkeypatch, **drivers):
    """Install a stand-in ``triton.backends`` whose registry holds ``name=(active, target)``."""
    registry = types.ModuleType("triton.backends")
    registry.backends = {
        name: types.SimpleNamespace(driver=_driver(active, target))
        for name, (active, target) in drivers.items()
    }
    monkeypatch.setitem(sys.modules, "triton.backends", registry)


def test_no_active_driver_here_so_no_backend_gets_the_pack():
    # The real registry: triton's nvidia and amd drivers, inactive without a GPU.
    for device_type in ("cuda", "musa"):
        assert targets.find_target(device_type) is None
        assert plugin.mtcore_kernels(backend=device_type, device_type=device_type) == []
    assert targets.describe_target("musa") == "none detected"


def test_the_cuda_plugin_no_longer_offers_the_pack_or_branches_on_musa():
    cuda_plugin = pytest.importorskip("mtcore_cuda.plugin")
    assert _triton_ops(cuda_plugin.mtcore_kernels(backend="cuda", device_type="cuda")) == set()
    assert cuda_plugin.mtcore_kernels(backend="musa", device_type="musa") == []
    source = inspect.getsource(cuda_plugin)
    assert "musa" not in source and "triton_kernels" not in source


@pytest.mark.parametrize(
    ("registered", "target", "device_type", "priority", "fp8"),
    [
        # NVIDIA H100 (arch 90): above torch-native (50), FP8 from arch 89.
        ("nvidia", GPUTarget("cuda", 90, 32), "cuda", 60, True),
        # NVIDIA A100 (arch 80): no float8e4nv, so the FP8 ops stay with the reference.
        ("nvidia", GPUTarget("cuda", 80, 32), "cuda", 60, False),
        # ROCm: torch calls the device "cuda"; FP8 in Triton unverified there.
        ("amd", GPUTarget("hip", "gfx942", 64), "cuda", 60, False),
        # Moore Threads' Triton names its backend mtgpu: below muDNN (50), never FP8.
        # (from arch 31 only: below, test_the_pack_is_not_offered_below_musa_arch_31)
        ("mtgpu", GPUTarget("musa", 31, 32), "musa", 40, False),
        ("mthreads", GPUTarget("musa", 31, 32), "musa", 40, False),
        # A target the table does not list: its own name as device type, low, no FP8.
        ("newvendor", GPUTarget("npu9", 1, 32), "npu9", 40, False),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_the_finder_matches_by_target_and_the_table_places_the_pack(
    monkeypatch, registered, target, device_type, priority, fp8
):
    _triton_backends(
        monkeypatch,
        idle=(False, GPUTarget(device_type, 0, 32)),  # inactive: never asked
        broken=(True, None),  # raises when asked: skipped
        **{registered: (True, target)},
    )
    found = targets.find_target(device_type)
    assert (found.name, found.backend, found.warp_size) == (
        registered,
        target.backend,
        target.warp_size,
    )
    assert found.describe() == (
        f"{registered} (target {target.backend}, arch {target.arch}, warp size {target.warp_size})"
    )
    # The backend's name plays no part; its device type does.
    impls = {i.op: i for i in plugin.mtcore_kernels(backend="any-name", device_type=device_type)}
    assert set(impls) == PACK_OPS
    for impl in impls.values():
        check_signature(impl)  # the reference op's parameter names, exactly
    assert impls["rms_norm"].priority == priority
    assert impls["adamw_step"].priority == priority - 20  # below torch's fused AdamW (50)
    assert impls["rms_norm"].accepts(KernelQuery(device_type, torch.bfloat16))
    assert not impls["rms_norm"].accepts(KernelQuery("cpu", torch.bfloat16))
    for op in FP8_OPS:
        assert impls[op].accepts(KernelQuery(device_type, torch.bfloat16)) is fp8
    other = "musa" if device_type != "musa" else "cuda"
    assert plugin.mtcore_kernels(backend=other, device_type=other) == []


@pytest.mark.parametrize("arch", [21, 22, 30])
def test_the_pack_is_not_offered_below_musa_arch_31(monkeypatch, arch):
    """torch_musa found Triton kernel launches failing on the S4000 (arch 22;
    torch_musa/distributed/loss.py:21): below arch 31 musa gets no Triton kernel, and
    the finder's line says why."""
    _triton_backends(monkeypatch, mtgpu=(True, GPUTarget("musa", arch, 128)))
    assert plugin.mtcore_kernels(backend="musa", device_type="musa") == []
    line = targets.describe_target("musa")
    assert line.startswith(f"mtgpu (target musa, arch {arch}, warp size 128); the pack is not")
    assert "below arch 31" in line and "loss.py:21" in line
    _triton_backends(monkeypatch, mtgpu=(True, GPUTarget("musa", 31, 32)))
    assert _triton_ops(plugin.mtcore_kernels(backend="musa", device_type="musa")) == PACK_OPS


def test_the_host_is_not_offered_the_pack_even_with_a_cpu_driver(monkeypatch):
    _triton_backends(monkeypatch, cpu=(True, GPUTarget("cpu", "x86", 1)))
    assert targets.find_target("cpu") is not None
    assert plugin.mtcore_kernels(backend="cpu", device_type="cpu") == []


def test_musa_diagnostics_use_the_finder_and_name_the_warp_size(monkeypatch):
    musa_plugin = pytest.importorskip("mtcore_musa.plugin")
    key = "triton backend for musa"
    assert musa_plugin._diagnostics()[key] == "none detected"
    _triton_backends(monkeypatch, mtgpu=(True, GPUTarget("musa", 31, 32)))
    assert musa_plugin._diagnostics()[key] == "mtgpu (target musa, arch 31, warp size 32)"
    _triton_backends(monkeypatch, mtgpu=(True, GPUTarget("musa", 22, 128)))
    assert musa_plugin._diagnostics()[key].startswith(
        "mtgpu (target musa, arch 22, warp size 128); the pack is not offered below arch 31"
    )
    monkeypatch.setitem(sys.modules, "mtcore_triton.targets", None)  # as if not installed
    assert musa_plugin._diagnostics()[key] == "not installed (mtcore-triton)"


def test_discovery_and_the_cpu_backend_import_no_triton():
    code = (
        "import sys\n"
        "from mtcore.backend import plugin_registry, select_backend\n"
        "found = plugin_registry().backends()\n"
        "assert 'mtcore_triton' in found.plugins, sorted(found.plugins)\n"
        "select_backend('cpu')\n"
        "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def _cuda_backend(monkeypatch, force: str | None) -> Backend:
    if force is None:
        monkeypatch.delenv("MTCORE_KERNELS", raising=False)
    else:
        monkeypatch.setenv("MTCORE_KERNELS", force)
    registry = plugin_registry()
    spec, info = registry.backends().backends["cuda"]
    # Built directly: selection would refuse cuda here (no GPU), doctor would skip it.
    return Backend(spec, info.name, registry.kernels_for("cuda", "cuda"))


@pytest.mark.parametrize("arch", [86, 90])
def test_doctor_kernel_table_shows_the_pack_and_the_forced_reference(monkeypatch, arch):
    _triton_backends(monkeypatch, nvidia=(True, GPUTarget("cuda", arch, 32)))
    facts = report.kernel_facts(_cuda_backend(monkeypatch, None))
    rows = facts["dtypes"]["bfloat16"]
    for op in PACK_OPS - {"adamw_step"} - FP8_OPS:
        assert [c["name"] for c in rows[op]["chosen"]] == ["triton", "reference"], op
    # FP8 in Triton needs arch 89 (float8e4nv); below, the gate says no.
    for op in FP8_OPS:
        if arch >= 89:
            assert [c["name"] for c in rows[op]["chosen"]] == ["triton", "reference"], op
        else:
            assert [c["name"] for c in rows[op]["chosen"]] == ["reference"], op
            assert [(o["name"], o["accepts"]) for o in rows[op]["others"]] == [("triton", False)]
    # fp32 AdamW: torch's multi-tensor kernel first, the pack for what it declines.
    chain = [c["name"] for c in facts["dtypes"]["float32"]["adamw_step"]["chosen"]]
    assert chain == ["torch-fused", "triton", "reference"]
    text = "\n".join(render._kernels(facts))
    assert "rms_norm" in text and "triton [mtcore_triton] -> reference [mtcore]" in text

    forced = report.kernel_facts(_cuda_backend(monkeypatch, "reference"))
    assert forced["forced_reference"]
    for rows in forced["dtypes"].values():
        assert all([c["name"] for c in r["chosen"]] == ["reference"] for r in rows.values())
    assert "forces the reference" in "\n".join(render._kernels(forced))


@pytest.mark.triton_interpreter
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
