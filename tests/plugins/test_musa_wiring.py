"""Wiring of the mtcore-musa plugin, tested on CPU. No test here runs MUSA hardware.

torch_musa cannot be installed here, so ``TorchMusaCpuStandIn`` takes its place: a
module object (named ``torch_musa_cpu_standin``, flagged ``STANDIN = True``) that a
subprocess registers as ``sys.modules["torch_musa"]`` and as ``torch.musa`` after
renaming torch's PrivateUse1 backend to "musa", which cannot be undone, hence the
subprocess. It answers with configurable CPU facts (capability, name, count). The
torch_musa entry points the kernels use (``torch.ops.musa._fused_adamw_``, ``F.rope``,
``F.swish_glu``) are replaced by stand-ins written from torch_musa's documented
conventions, so what is checked is that the adapters convert to those conventions,
not what muDNN computes. One subprocess runs every check (``probe``) and reports JSON.

Needs ``pip install -e plugins/mtcore_musa --no-deps --no-build-isolation``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import types
from importlib import metadata

import pytest
import torch
from torch import Tensor

STANDIN_NAME = "torch_musa_cpu_standin"


class TorchMusaCpuStandIn(types.ModuleType):
    """Stands in for ``torch_musa`` / ``torch.musa`` with CPU facts. Not MUSA."""

    STANDIN = True

    def __init__(self, capability=(2, 2), name="MTT S4000 (CPU stand-in)", count=1):
        super().__init__(STANDIN_NAME)
        self.capability, self.device_name, self.count = capability, name, count
        self.mudnn_version = 2800  # what torch.backends.mudnn.version() reports

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def current_device(self):
        return 0

    def set_device(self, device):
        pass

    def synchronize(self, device=None):
        pass

    def get_device_capability(self, device=None):
        return self.capability

    def get_device_properties(self, device=None):
        return types.SimpleNamespace(name=self.device_name, total_memory=48 << 30)

    def is_bf16_supported(self, including_emulation=True):
        return tuple(self.capability) >= (2, 2)

    def memory_allocated(self, device=None):
        return 0

    def get_rng_state(self, device="musa"):
        return torch.get_rng_state()


def install_standin(**facts) -> TorchMusaCpuStandIn:
    standin = TorchMusaCpuStandIn(**facts)
    sys.modules[STANDIN_NAME] = sys.modules["torch_musa"] = standin
    torch.utils.rename_privateuse1_backend("musa")
    torch._register_device_module("musa", standin)
    torch.backends.mudnn = types.SimpleNamespace(version=lambda: standin.mudnn_version)
    return standin


def standin_fused_adamw(seen_steps: list[float]) -> None:
    """Register ``musa::_fused_adamw_`` with torch_musa's schema and a CPU body that
    counts steps as its kernel does (adds 1 to each CPU step tensor, FusedAdam.mu)."""

    @torch.library.custom_op(
        "musa::_fused_adamw_",
        mutates_args=(
            "params",
            "grads",
            "exp_avgs",
            "exp_avg_sqs",
            "max_exp_avg_sqs",
            "state_steps",
        ),
    )
    def _fused_adamw_(
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        max_exp_avg_sqs: list[Tensor],
        state_steps: list[Tensor],
        lr: float,
        capturable: bool = False,
        differentiable: bool = False,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
        has_complex: bool = False,
        *,
        amsgrad: bool,
        beta1: float,
        beta2: float,
        weight_decay: float,
        eps: float,
        maximize: bool,
    ) -> None:
        assert all(s.device.type == "cpu" and s.dtype == torch.float32 for s in state_steps)
        for p, g, m, v, s in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True):
            s += 1
            step = s.item()
            seen_steps.append(step)
            p.mul_(1 - lr * weight_decay)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))


def standin_fused_rms_norm(standin: TorchMusaCpuStandIn) -> None:
    """Register a PrivateUse1 kernel for ``aten::_fused_rms_norm``, as torch_musa does for
    muDNN's RMSNorm (RMSNorm.cpp); the library is kept on the stand-in so it stays alive."""

    def kernel(input, normalized_shape, weight=None, eps=None):
        dims = tuple(range(-len(normalized_shape), 0))
        xf = input.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + (eps or 1e-6))
        out = xf * rstd * (weight.float() if weight is not None else 1.0)
        return out.to(input.dtype), rstd

    standin.aten_impls = torch.library.Library("aten", "IMPL")
    standin.aten_impls.impl("_fused_rms_norm", kernel, "PrivateUse1")


def standin_rope(input, freq_cis, rotary_interleaved=False, batch_first=False):
    """torch_musa's F.rope as its test defines it: [seq, batch, heads, dim], angles [seq, dim]."""
    assert not rotary_interleaved and not batch_first, "adapter must use the tested layout"
    cos = freq_cis.cos()[:, None, None, :]
    sin = freq_cis.sin()[:, None, None, :]
    x1, x2 = input.chunk(2, dim=-1)
    return input * cos + torch.cat((-x2, x1), dim=-1) * sin


def standin_swish_glu(input):
    """torch_musa's F.swish_glu as its test defines it: silu(first half) * second half."""
    a, b = input.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(a) * b).to(input.dtype)


def names(backend, dtype) -> dict[str, list[str]]:
    return {op: [i.name for i in chain] for op, chain in backend.kernel_table(dtype).items()}


def probe() -> dict:
    """Every check, in one fresh interpreter; returns facts for the tests to assert."""
    out: dict = {}
    attempts: list[str] = []

    class Spy:  # records import attempts of torch_musa without satisfying them
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] == "torch_musa":
                attempts.append(name)

    sys.meta_path.insert(0, Spy)
    triton_before = "triton" in sys.modules
    importlib.import_module("mtcore_musa.plugin")
    from mtcore.backend import BackendError, KernelQuery, plugin_registry, select_backend
    from mtcore_musa import kernels
    from mtcore_musa.triton_backend import musa_triton_backend

    found = plugin_registry(reload=True).backends()
    _, info = found.backends["musa"]
    out["discovery"] = {
        "plugin": info.name,
        "dist": info.dist,
        "torch_musa_imports": list(attempts),
        "triton_imported": "triton" in sys.modules and not triton_before,
    }

    # -- without torch_musa --------------------------------------------------------
    try:
        select_backend("musa")
        out["absent_error"] = None
    except BackendError as exc:
        out["absent_error"] = str(exc)
    out["absent_auto"] = select_backend().name
    out["absent_tried_import"] = "torch_musa" in attempts
    sys.meta_path.remove(Spy)

    # -- Triton detection: the real registry, then a fake one --------------------------
    out["triton_real"] = musa_triton_backend()

    def driver(active, target):
        return type(
            "Driver",
            (),
            {
                "is_active": staticmethod(lambda: active),
                "get_current_target": lambda self: types.SimpleNamespace(backend=target),
            },
        )

    fake = types.ModuleType("triton.backends")
    fake.backends = {
        "nvidia": types.SimpleNamespace(driver=driver(False, "cuda")),
        "other": types.SimpleNamespace(driver=driver(True, "hip")),
        "vendor_gpu_x": types.SimpleNamespace(driver=driver(True, "musa")),
    }
    saved = sys.modules.get("triton.backends")
    sys.modules["triton.backends"] = fake
    out["triton_fake"] = musa_triton_backend()
    if saved is not None:
        sys.modules["triton.backends"] = saved
    else:
        del sys.modules["triton.backends"]

    # -- the stand-in at capability 2.2 -----------------------------------------------
    standin = install_standin(capability=(2, 2))
    musa_mod = importlib.import_module("torch_musa")
    out["standin"] = {
        "type": type(musa_mod).__name__,
        "flag": getattr(musa_mod, "STANDIN", False),
        "torch_musa_is_standin": torch.get_device_module("musa") is standin,
    }
    out["rms_norm_probe"] = [kernels.mudnn_rms_norm_registered()]
    no_fused_rms = select_backend("musa")
    out["rms_norm_unfused"] = names(no_fused_rms, torch.bfloat16)["rms_norm"]
    standin_fused_rms_norm(standin)
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

    standin.device_name = "MTT X999 (CPU stand-in)"
    out["peak_unknown"] = dict(backend.device.capabilities().peak_tflops)
    standin.capability = (2, 1)
    out["s21_bf16_attention"] = names(backend, torch.bfloat16)["attention"]

    # -- capability 3.1: FP8 GEMM native ----------------------------------------------
    standin.capability = (3, 1)
    plugin_registry(reload=True)
    backend31 = select_backend("musa")
    out["s31_fp8"] = backend31.fp8.describe()
    out["s31_fp8_native"] = [backend31.fp8.is_native(g, g) for g in ("tensor", "row", "128x128")]

    # -- AdamW: torch_musa's op, once registered --------------------------------------
    seen: list[float] = []
    standin_fused_adamw(seen)
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
    torch.nn.functional.rope = standin_rope
    torch.nn.functional.swish_glu = standin_swish_glu
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
    out["rope_guard_odd_table"] = kernels.rope_inputs_ok(x, cos[:5], sin[:5])
    h = torch.randn(4, 10, dtype=torch.bfloat16, generator=gen)
    out["swiglu_max_diff"] = (kernels.musa_swiglu(h).float() - swiglu(h).float()).abs().max().item()
    return out


@pytest.fixture(scope="module")
def facts():
    if importlib.util.find_spec("torch_musa") is not None:
        pytest.skip("a real torch_musa is installed: run the conformance kit instead")
    if not metadata.entry_points(group="mtcore.plugins", name="mtcore_musa"):
        pytest.fail(
            "mtcore-musa is not installed: pip install -e plugins/mtcore_musa --no-deps --no-build-isolation"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTCORE_")}
    run = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_entry_point_is_the_plugin_module():
    (ep,) = metadata.entry_points(group="mtcore.plugins", name="mtcore_musa")
    assert (ep.value, ep.dist.name) == ("mtcore_musa.plugin", "mtcore-musa")


def test_discovery_finds_musa_and_imports_neither_torch_musa_nor_triton(facts):
    d = facts["discovery"]
    assert (d["plugin"], d["dist"]) == ("mtcore_musa", "mtcore-musa")
    assert d["torch_musa_imports"] == []
    assert not d["triton_imported"]


def test_without_torch_musa_asking_is_an_error_and_auto_picks_cpu(facts):
    error = facts["absent_error"]
    assert error is not None and "torch_musa is not installed" in error
    assert "'musa'" in error and "mtcore-musa" in error
    assert facts["absent_tried_import"]
    assert facts["absent_auto"] == "cpu"


def test_standin_is_what_the_plugin_imported(facts):
    assert facts["standin"] == {
        "type": "TorchMusaCpuStandIn",
        "flag": True,
        "torch_musa_is_standin": True,
    }


def test_capability_2_2_kernel_table(facts):
    s = facts["s22"]
    assert s["plugin"] == "mtcore_musa"
    assert s["bf16"]["attention"] == ["sdpa", "reference"]
    assert s["bf16"]["rms_norm"] == ["F.rms_norm", "reference"]
    assert facts["rms_norm_guard"] == [True, False]  # fp32 weight with bf16 x: reference
    # F.rms_norm is muDNN only once torch_musa registered its fused op for PrivateUse1.
    assert facts["rms_norm_probe"] == [False, True]
    assert facts["rms_norm_unfused"] == ["reference"]
    assert s["fp32"]["attention"] == ["reference"]  # flash is fp16/bf16 only
    # torch's own _fused_adamw_ raises on musa; without torch_musa's op, the reference.
    assert s["fp32"]["adamw_step"] == ["reference"]
    assert s["bf16"]["fp8_quantize"] == ["reference"]
    assert facts["s21_bf16_attention"] == ["reference"]  # arch 2.1 has no muDNN flash


def test_flash_head_size_guard_falls_through_to_reference(facts):
    assert facts["attention_served_by_head_dim"] == {
        "64": "sdpa",
        "128": "sdpa",
        "160": "sdpa",
        "256": "reference",
    }


def test_fp8_native_only_from_capability_3_1(facts):
    s = facts["s22"]
    assert set(s["fp8"].values()) == {"fallback (dequantize + matmul)"}
    assert "(3, 1)" in s["fp8_available"]
    assert facts["s31_fp8_native"] == [True, True, False]


def test_device_and_collective_facts(facts):
    s = facts["s22"]
    assert "torch.bfloat16" in s["dtypes"]
    assert s["peak"] == {"bfloat16": 100.0, "float16": 100.0, "float32": 25.0}
    assert facts["peak_unknown"] == {}
    assert (s["c10d"], s["fp8_all_gather"], s["bf16_all_reduce"], s["avg"]) == (
        "mccl",
        "fallback",
        "native",
        True,
    )


def test_notes_say_musa_hardware_was_not_exercised(facts):
    assert any("not exercised on MUSA hardware" in note for note in facts["s22"]["notes"])


def test_fused_adamw_uses_torch_musa_op_when_registered(facts):
    assert facts["adamw_with_op"] == ["musa-fused", "reference"]
    assert facts["adamw_steps_seen"] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert facts["adamw_max_diff"] < 1e-6
    assert facts["adamw_guard_bf16"] is False


def test_rope_and_swiglu_adapters_match_reference_conventions(facts):
    assert facts["rope_before"] == ["reference"]
    assert facts["old_mudnn"] == [["reference"], ["reference"]]  # muDNN < 2800 lacks both
    assert facts["rope_fp32"] == ["F.rope", "reference"]
    assert facts["rope_bf16"] == ["reference"]
    assert facts["swiglu_bf16"] == ["F.swish_glu", "reference"]
    assert facts["rope_max_diff"] < 1e-5
    assert facts["rope_contiguous_shape"] == [True, [2, 6, 3, 8]]
    assert facts["rope_guard_odd_table"] is False
    assert facts["swiglu_max_diff"] < 1e-2


def test_triton_backend_found_by_target_not_name(facts):
    assert facts["triton_real"] is None
    assert facts["triton_fake"] == "vendor_gpu_x"


if __name__ == "__main__":
    print(json.dumps(probe()))
