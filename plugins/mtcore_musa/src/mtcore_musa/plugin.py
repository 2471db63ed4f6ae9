"""The mtcore-musa plugin: hook implementations for the 'musa' backend.

Nothing here imports torch_musa. The device imports it when its availability is
first asked for; the kernel probes run only when the backend is built.
"""

from __future__ import annotations

from mtcore.backend import (
    FP8,
    Availability,
    BackendSpec,
    Collective,
    CollectiveCapabilities,
    hookimpl,
)
from mtcore.backend.fp8 import k_n_multiple_of
from mtcore_musa.collectives import mccl_fallback_dtypes
from mtcore_musa.devices import (
    FP8_MIN_CAPABILITY,
    MUSA,
    MusaDevice,
    float8_on_device,
    mixed_formats_on_device,
)
from mtcore_musa.environment import MUSA_ENVIRONMENT, launch_environment
from mtcore_musa.kernels import musa_kernels

BACKEND = "musa"

# torch._scaled_mm reaches muDNN's scaled matmul with scalar or per-row (a) /
# per-column (b) scales on arch >= 3.1; 1x128/128x128 blocks take the fallback matmul.
_NATIVE_FP8 = frozenset({("tensor", "tensor"), ("row", "row")})
# torch_musa's ScaledMatmulOut (csrc/aten/ops/Matmul.cpp) says "Only works if matrices
# sizes are divisible by 32" (a comment it shares with PyTorch's Blas.cpp, where the
# check enforced is 16) and checks no size itself; its test_scaled_mm runs K and N in
# {32, 64, 128, 256} (M down to 16). Only those shapes are sent to muDNN.
MUSA_SCALED_MM_SHAPES = k_n_multiple_of(32)

NOTES = (
    "Written against the torch_musa API; not exercised on MUSA hardware in this "
    "project's CI (no MUSA GPU available).",
    "Verify on a Moore Threads machine with the conformance kit: "
    "pytest --pyargs mtcore.testing.conformance --mtcore-backend musa",
    "bf16 and FP8 collectives follow the arch torch_musa was built for "
    "(torch.musa.get_arch_list()): MCCL maps bf16 from arch 2.2 and FP8 from 3.1 "
    "(ProcessGroupMCCL.h); in older builds they move as bytes and reduce in float32.",
    "FP8 needs arch >= 3.1 and a torch_musa built with MUSA >= 4.0 (probed once: float8 "
    "tensors and a 32x32 torch._scaled_mm on the device); torch._scaled_mm is used for K "
    "and N multiples of 32.",
    "Hybrid FP8 (e5m2 x e4m3, the hybrid recipe's gradient GEMMs) is unverified on MUSA: "
    "torch_musa's own tests multiply same-format operands only, so mixed operands go to "
    "torch._scaled_mm only after a 32x32 product of small integers came out exact, once; "
    "otherwise they dequantize.",
    "SDPA's scale: torch_musa < MUSA 4.2 refuses a scale that is not 1/sqrt(head dim) and "
    "builds without a MUSA version ignore it (SDP.cpp); attention runs another scale "
    "(T5's 1.0, MLA's mscale) only where a one-time probe found it honoured, else the "
    "reference; attention_lse serves the default scale only.",
    "attention_lse (context parallelism) runs muDNN flash attention, whose forward returns "
    "the log-sum-exp; its gradient rides 8 extra head-dim columns in backward (head dim "
    "<= 120); not run on a MUSA device.",
    "rope uses torch_musa's F.rope for float32/float16/bfloat16 inputs with float32 "
    "angles; torch_musa's own tests cover float32 only.",
    "Triton on MUSA arch < 3.1 (the S4000 is 2.2) compiles with warp size 128, not 32 "
    "(torch_musa csrc/extension/common/utils.muh): num_warps=4 is 512 threads there. The "
    "mtcore-triton pack is not offered below 3.1: torch_musa found Triton kernel launches "
    "failing on the S4000 (torch_musa/distributed/loss.py:21).",
    "Data-parallel overlap: torch_musa runs FSDP2 without collective/compute overlap below "
    "arch 3.1 (distributed/_composable/fsdp/patch.py:215-219) and MT-MegatronLM's MUSA "
    "scripts leave --overlap-grad-reduce off; below 3.1 mtcore reduces the dp gradient "
    "buckets after backward (MTCORE_DP_OVERLAP=1 overlaps them anyway), from 3.1 during "
    "it. ZeRO-2/3 reduce from backward on every arch.",
)

# One device object for the process: the backend's device and the kernel predicates
# (which read its capability when an op first resolves) see the same torch.musa.
_DEVICE = MusaDevice(MUSA)


def _fp8_gate(device: MusaDevice):
    """FP8's availability: the arch first, then (once) whether float8 tensors exist."""
    probed: list[Availability] = []

    def gate() -> Availability:
        arch = device.capability_at_least(FP8_MIN_CAPABILITY)
        if not arch:
            return arch
        if not probed:
            probed.append(float8_on_device(device))
        return probed[0]

    return gate


def _mixed_formats(device: MusaDevice, gate):
    """Whether e5m2 x e4m3 runs natively: only where FP8 runs and the probe passed."""
    return lambda: bool(gate()) and mixed_formats_on_device(device)


# torch_musa v2.7.1 runs FSDP2 with no collective/compute overlap below arch 3.1
# (torch_musa/distributed/_composable/fsdp/patch.py:215-219, "The overlapping of FSDP2
# was disabled on musa arch older than mp_31"; no reason given), and MT-MegatronLM's
# MUSA scripts never pass --overlap-grad-reduce. So below 3.1 the dp buckets reduce
# after backward; MTCORE_DP_OVERLAP=1 overrides. Not measured on a MUSA device.
DP_OVERLAP_MIN_CAPABILITY = (3, 1)


def _dp_overlap(device: MusaDevice):
    def advised() -> Availability:
        found = device.capability_at_least(DP_OVERLAP_MIN_CAPABILITY)
        if found:
            return found
        return Availability(
            False,
            "torch_musa disables FSDP2's collective/compute overlap below arch 3.1 "
            f"(distributed/_composable/fsdp/patch.py:215-219); {found.reason}",
        )

    return advised


def _diagnostics() -> dict[str, str]:
    advised = _dp_overlap(_DEVICE)()
    overlap = "during backward" if advised else f"after backward: {advised.reason}"
    return {
        **_triton_target(),
        "dp gradient reduction (advised)": f"{overlap} (MTCORE_DP_OVERLAP=0/1 decides instead)",
        **launch_environment(),
    }


def _triton_target() -> dict[str, str]:
    # The Triton pack's own finder (mtcore-musa[triton]), imported only when doctor asks.
    try:
        from mtcore_triton.targets import describe_target
    except ImportError:
        return {"triton backend for musa": "not installed (mtcore-triton)"}
    return {"triton backend for musa": describe_target(MUSA.device_type)}


@hookimpl
def mtcore_backends():
    # MCCL maps ReduceOp.AVG to mcclAvg (csrc/distributed/ProcessGroupMCCL.cpp). The
    # dtype table is read on first use: it asks torch_musa, never imported at discovery.
    gate = _fp8_gate(_DEVICE)  # probed once per backend built
    capabilities = CollectiveCapabilities(lambda: mccl_fallback_dtypes(_DEVICE), avg_supported=True)
    musa = BackendSpec(
        name=BACKEND,
        device=_DEVICE,
        # libmccl (not torch_musa's Python) reads MCCL_SOCKET_IFNAME, assumed from NCCL's
        # NCCL_SOCKET_IFNAME (MT-MegatronLM's scripts set neither); not checked on hardware.
        collective=Collective(
            "mccl", capabilities, interface_variables=("MCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
        ),
        fp8=FP8.gated(
            _NATIVE_FP8,
            gate,
            shape_ok=MUSA_SCALED_MM_SHAPES,
            mixed_formats=_mixed_formats(_DEVICE, gate),
        ),
        priority=100,
        description="Moore Threads GPUs: MCCL collectives, muDNN attention, RMSNorm and "
        "LayerNorm, torch_musa fused AdamW",
        notes=NOTES,
        diagnostics=_diagnostics,
        dp_overlap=_dp_overlap(_DEVICE),
    )
    return [musa]


@hookimpl
def mtcore_kernels(backend: str, device_type: str):
    if backend != BACKEND:
        return []
    return musa_kernels(_DEVICE)


@hookimpl
def mtcore_environment(backend: str):
    # MCCL_CHECK_POINTERS=0 only (mtcore_musa.environment says why the others are not set).
    return dict(MUSA_ENVIRONMENT) if backend == BACKEND else {}
