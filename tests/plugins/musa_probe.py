"""The probe behind tests/plugins/test_musa_wiring.py, run as a script in a fresh
interpreter: installing ``TorchMusaCpuStandIn`` renames torch's PrivateUse1 backend,
which cannot be undone. Prints one JSON line of facts; the tests assert on them.
No check here runs MUSA hardware.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys

import torch


def names(backend, dtype) -> dict[str, list[str]]:
    return {op: [i.name for i in chain] for op, chain in backend.kernel_table(dtype).items()}


class TooOldTorchMusa(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports "torch_musa" as torch_musa v2.7.1's __init__ does on an older torch: it
    raises RuntimeError with its message in two arguments (a comma between them)."""

    def __init__(self, needed: str):
        self.needed = needed

    def find_spec(self, name, path=None, target=None):
        if name == "torch_musa":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise RuntimeError(
            f"torch version must not be less than v{self.needed} when using torch_musa,",
            " but now torch version is " + torch.__version__,
        )


def probe_discovery_and_absence(out: dict) -> None:
    attempts: list[str] = []

    class Spy:  # records import attempts of torch_musa without satisfying them
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] == "torch_musa":
                attempts.append(name)

    sys.meta_path.insert(0, Spy)
    triton_before = "triton" in sys.modules
    importlib.import_module("mtcore_musa.plugin")
    from mtcore.backend import BackendError, plugin_registry, select_backend

    found = plugin_registry(reload=True).backends()
    _, info = found.backends["musa"]
    out["discovery"] = {
        "plugin": info.name,
        "dist": info.dist,
        "torch_musa_imports": list(attempts),
        "triton_imported": "triton" in sys.modules and not triton_before,
    }
    try:
        select_backend("musa")
        out["absent_error"] = None
    except BackendError as exc:
        out["absent_error"] = str(exc)
    out["absent_auto"] = select_backend().name
    out["absent_tried_import"] = "torch_musa" in attempts
    sys.meta_path.remove(Spy)


def probe_torch_version(out: dict) -> None:
    """torch_musa 2.7.1 on torch 2.6 (caught before importing it), and a torch_musa whose
    own import-time check fails (its RuntimeError, translated)."""
    from mtcore_musa.devices import MUSA, MusaDevice

    real = torch.__version__
    finder = TooOldTorchMusa("2.7.1")
    sys.meta_path.insert(0, finder)
    try:
        torch.__version__ = "2.6.0+cpu"
        out["torch_2_6"] = MusaDevice(MUSA).availability().reason
        torch.__version__ = real
        finder.needed = "99.0.0"
        out["torch_older_than_torch_musa_wants"] = MusaDevice(MUSA).availability().reason
    finally:
        torch.__version__ = real
        sys.meta_path.remove(finder)
        sys.modules.pop("torch_musa", None)


def probe_collective_tables(out: dict, standin) -> None:
    """What MCCL is declared to carry, for builds of several archs (get_arch_list)."""
    from mtcore.backend import plugin_registry, select_backend

    tables = {}
    for label, archs in (("21", ["21"]), ("22", ["22"]), ("22+31", ["22", "31"]), ("none", [])):
        standin.arch_list = archs
        plugin_registry(reload=True)
        collective = select_backend("musa").collective
        calls_before = standin.arch_list_calls
        row = {}
        for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send_recv"):
            for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
                row[f"{op} {str(dtype).removeprefix('torch.')}"] = collective.support(
                    op, dtype
                ).value
        row["arch_list_reads"] = standin.arch_list_calls - calls_before
        tables[label] = row
    out["collective_tables"] = tables
    standin.arch_list = ["22"]


def probe_fp8(out: dict, standin) -> None:
    """FP8 at arch 3.1 with a MUSA 3.x and a MUSA 4.x build; the scaled_mm shape rule."""
    from mtcore.backend import plugin_registry, select_backend

    standin.capability = (3, 1)
    facts = {}
    for label, musa_version, musa_text in (("musa3", 3020, "3.2.0"), ("musa4", 4030, "4.3.0")):
        standin.musa_version = musa_version
        torch.version.musa = musa_text
        plugin_registry(reload=True)
        fp8 = select_backend("musa").fp8
        available = fp8.availability()
        facts[label] = {
            "available": bool(available),
            "reason": available.reason,
            "native": [fp8.is_native(g, g) for g in ("tensor", "row", "128x128")],
        }
    shape_ok = getattr(fp8, "shape_ok", None)
    shapes = {"M16 K32 N32": (16, 32, 32), "K48 N32": (16, 48, 32), "K32 N48": (16, 32, 48)}
    shapes["K64 N256"] = (64, 64, 256)
    rule = {}
    cpu_rule = {}
    cpu_fp8 = select_backend("cpu").fp8
    for label, (m, k, n) in shapes.items():
        a, b = torch.empty(m, k), torch.empty(n, k)
        rule[label] = None if shape_ok is None else shape_ok(a, b)
        cpu_rule[label] = getattr(cpu_fp8, "shape_ok", lambda a, b: None)(a, b)
    facts["musa_shape_rule"], facts["cpu_shape_rule"] = rule, cpu_rule
    out["fp8"] = facts
    standin.capability, standin.musa_version, torch.version.musa = (2, 2), 4030, None


def probe_norms(out: dict, standin) -> None:
    """RMSNorm under torch_musa's op name only; LayerNorm once native_layer_norm has a
    MUSA kernel."""
    import musa_standin as st

    from mtcore.backend import plugin_registry, select_backend
    from mtcore_musa import kernels

    facts = {"op_name": getattr(kernels, "FUSED_RMSNORM_OP", None)}
    plugin_registry(reload=True)
    facts["layer_norm_before"] = names(select_backend("musa"), torch.bfloat16)["layer_norm"]
    st.register_torch_fused_rms_norm(standin)
    facts["after_torch_op"] = kernels.mudnn_rms_norm_registered()
    st.register_fused_rmsnorm_forward(standin)
    facts["after_torch_musa_op"] = kernels.mudnn_rms_norm_registered()
    st.register_native_layer_norm(standin)
    plugin_registry(reload=True)
    backend = select_backend("musa")
    facts["layer_norm_bf16"] = names(backend, torch.bfloat16)["layer_norm"]
    facts["layer_norm_fp32"] = names(backend, torch.float32)["layer_norm"]
    guard = getattr(kernels, "layer_norm_affine_ok", None)
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8)
    if guard is not None:
        facts["layer_norm_guard"] = [
            guard(x, w.bfloat16(), w.bfloat16()),
            guard(x, w.bfloat16(), None),
            guard(x, w, w.bfloat16()),
            guard(x, w.bfloat16(), w),
        ]
    out["norms"] = facts


def probe() -> dict:
    """Every check, in one fresh interpreter; returns facts for the tests to assert."""
    out: dict = {}
    probe_discovery_and_absence(out)
    probe_torch_version(out)

    import musa_standin as st
    from musa_probe_attention import probe_attention, probe_hybrid
    from musa_probe_loss import probe_cross_entropy

    from mtcore.backend import KernelQuery, plugin_registry, select_backend
    from mtcore_musa import kernels

    # -- the stand-in at capability 2.2 -----------------------------------------------
    standin = st.install_standin(capability=(2, 2))
    musa_mod = importlib.import_module("torch_musa")
    out["standin"] = {
        "type": type(musa_mod).__name__,
        "flag": getattr(musa_mod, "STANDIN", False),
        "torch_musa_is_standin": torch.get_device_module("musa") is standin,
    }
    out["rms_norm_probe"] = [kernels.mudnn_rms_norm_registered()]
    out["rms_norm_unfused"] = names(select_backend("musa"), torch.bfloat16)["rms_norm"]
    probe_norms(out, standin)
    out["rms_norm_probe"].append(kernels.mudnn_rms_norm_registered())
    plugin_registry(reload=True)
    backend = select_backend("musa")
    caps = backend.device.capabilities()
    out["s22"] = {
        "plugin": backend.plugin,
        "notes": list(backend.spec.notes),
        "bf16": names(backend, torch.bfloat16),
        "fp32": names(backend, torch.float32),
        "fp8": backend.fp8.describe(),
        "fp8_available": backend.fp8.availability().reason,
        "dtypes": [str(d) for d in caps.dtypes],
        "peak": dict(caps.peak_tflops),
        "c10d": backend.collective.c10d_backend,
        "fp8_all_gather": backend.collective.support("all_gather", torch.float8_e4m3fn).value,
        "bf16_all_reduce": backend.collective.support("all_reduce", torch.bfloat16).value,
        "avg": backend.collective.capabilities.avg_supported,
    }
    from mtcore_musa.environment import launch_environment

    out["environment"] = {
        "set": os.environ.get("MCCL_CHECK_POINTERS"),
        "doctor": launch_environment()["env MCCL_CHECK_POINTERS"],
        "doctor_unset": launch_environment({})["env MCCL_CHECK_POINTERS"],
        "doctor_user": launch_environment({"MCCL_CHECK_POINTERS": "1"})["env MCCL_CHECK_POINTERS"],
        "others": {
            name: os.environ.get(name)
            for name in ("MUSA_KERNEL_TIMEOUT", "MCCL_PROTOS", "CUDA_DEVICE_MAX_CONNECTIONS")
        },
    }
    chain = backend.kernels["attention"].select(KernelQuery("musa", torch.bfloat16))
    served = {}
    for d in (64, 128, 160, 256):
        q = torch.randn(1, 2, 4, d, dtype=torch.bfloat16)
        served[d] = next(i.name for i in chain if i.fallback_ok is None or i.fallback_ok(q, q, q))
    out["attention_served_by_head_dim"] = served
    x16, w32 = torch.randn(2, 8, dtype=torch.bfloat16), torch.ones(8)
    out["rms_norm_guard"] = [
        kernels.rms_norm_weight_ok(x16, w32.bfloat16()),
        kernels.rms_norm_weight_ok(x16, w32),
    ]

    from mtcore.parallel.data import dp_overlap

    out["dp_overlap"] = {"22": list(dp_overlap(backend))}
    out["dp_overlap_doctor_22"] = backend.spec.diagnostics()["dp gradient reduction (advised)"]
    standin.capability = (3, 1)
    out["dp_overlap"]["31"] = list(dp_overlap(backend))
    standin.capability = (2, 2)
    standin.device_name = "MTT X999 (CPU stand-in)"
    out["peak_unknown"] = dict(backend.device.capabilities().peak_tflops)
    standin.capability = (2, 1)
    out["s21_bf16_attention"] = names(backend, torch.bfloat16)["attention"]
    standin.capability = (2, 2)

    probe_collective_tables(out, standin)
    probe_fp8(out, standin)
    probe_hybrid(out, standin)
    probe_attention(out, standin)
    probe_cross_entropy(out, standin)

    # -- AdamW: torch_musa's op, once registered --------------------------------------
    seen: list[float] = []
    st.standin_fused_adamw(seen)
    plugin_registry(reload=True)
    backend_op = select_backend("musa")
    out["adamw_with_op"] = names(backend_op, torch.float32)["adamw_step"]
    from mtcore.ops import adamw_step, rope, rope_tables, swiglu

    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    ref = [p.clone() for p in params]
    m, v = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    rm, rv = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in (1, 2, 3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        kernels.musa_fused_adamw_step(params, grads, m, v, step=step, **hp)
        adamw_step(ref, grads, rm, rv, step=step, **hp)
    out["adamw_steps_seen"] = seen
    out["adamw_max_diff"] = max(
        (a - b).abs().max().item() for a, b in zip(params, ref, strict=True)
    )
    bf = [torch.zeros(3, dtype=torch.bfloat16)]
    out["adamw_guard_bf16"] = kernels.adamw_fast_path_ok(
        bf, bf, [torch.zeros(3)], [torch.zeros(3)], step=1, **hp
    )

    # -- RoPE and SwiGLU: torch_musa's functionals, once present ------------------------
    out["rope_before"] = names(backend_op, torch.float32)["rope"]
    standin_rope = st.StandinRope()
    torch.nn.functional.rope = standin_rope
    torch.nn.functional.swish_glu = st.standin_swish_glu
    standin.mudnn_version = 2700
    plugin_registry(reload=True)
    old = select_backend("musa")
    out["old_mudnn"] = [names(old, torch.float32)[op] for op in ("rope", "swiglu")]
    standin.mudnn_version = 2800
    plugin_registry(reload=True)
    backend_f = select_backend("musa")
    out["rope_fp32"] = names(backend_f, torch.float32)["rope"]
    out["rope_bf16"] = names(backend_f, torch.bfloat16)["rope"]
    out["swiglu_bf16"] = names(backend_f, torch.bfloat16)["swiglu"]
    x = torch.randn(2, 6, 3, 8, generator=gen)
    cos, sin = rope_tables(6, 8, offset=1000)
    got = kernels.musa_rope(x, cos, sin)
    out["rope_max_diff"] = (got - rope(x, cos, sin)).abs().max().item()
    out["rope_contiguous_shape"] = [got.is_contiguous(), list(got.shape)]
    xb = x.bfloat16()
    got_b = kernels.musa_rope(xb, cos, sin)
    out["rope_bf16_max_diff"] = (got_b.float() - rope(xb, cos, sin).float()).abs().max().item()
    out["rope_bf16_dtype"] = str(got_b.dtype)
    out["rope_calls"] = standin_rope.calls
    out["rope_guard_odd_table"] = kernels.rope_inputs_ok(x, cos[:5], sin[:5])
    h = torch.randn(4, 10, dtype=torch.bfloat16, generator=gen)
    out["swiglu_max_diff"] = (kernels.musa_swiglu(h).float() - swiglu(h).float()).abs().max().item()
    return out


if __name__ == "__main__":
    print(json.dumps(probe()))
