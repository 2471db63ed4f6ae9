"""Data that describes Moore Threads GPUs to mtcore's generic device implementation."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from importlib import metadata

import torch

from mtcore.backend import Availability, DeviceModuleSpec, TorchModuleDevice, peaks_by_name

TORCH_MUSA = "torch_musa"

# Peak TFLOP/s, matched by name. Only figures Moore Threads published:
# MTT S4000 (launch, December 2023): FP32 25, TF32 50, FP16/BF16 100, INT8 200 TOPS.
# MTT S5000 is left out on purpose: the figure disclosed in February 2026 ("AI dense
# compute up to 1000 TFLOPS", 920 for the air-cooled card) names no dtype, so any
# per-dtype number would be a guess and would skew MFU. Unknown devices get {}.
# MT-MegatronLM's MFU divides by 98e12 for any card (musa_patch/training.py,
# throughput_calculator); the S4000 keeps its published 100 here (docs/musa.md).
_MUSA_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("S4000", {"bfloat16": 100.0, "float16": 100.0, "float32": 25.0}),
)

MUSA = DeviceModuleSpec(
    device_type="musa",
    import_name=TORCH_MUSA,
    visible_devices_env="MUSA_VISIBLE_DEVICES",
    # The driver's device nodes: /dev/mtgpu.N (the containers' --device flag names them).
    device_files=("/dev/mtgpu*",),
    # torch_musa: is_bf16_supported() is true from MUSA arch 2.2 (S4000, "QY2").
    bf16_min_capability=(2, 2),
    peak_tflops=peaks_by_name(_MUSA_PEAKS),
)

# muDNN flash attention, F.rope and F.swish_glu need arch >= 2.2 (S4000);
# torch._scaled_mm FP8 GEMM needs arch >= 3.1 (S5000, "PH1").
MUDNN_MIN_CAPABILITY = (2, 2)
FP8_MIN_CAPABILITY = (3, 1)

# torch_musa/__init__.py (v2.7.0 and v2.7.1) raises RuntimeError("torch version must not
# be less than v2.7.1 when using torch_musa,", " but now torch version is ...") on an
# older torch, and warns unless the version is 2.7.1. No torch_musa release serves a
# torch between 2.6 and 2.7.1 (v2.5.0 is for torch 2.5.0), so 2.7.1 is the minimum here.
TORCH_MUSA_MIN_TORCH = (2, 7, 1)
TORCH_MUSA_RELEASE = "2.7.1"

NOT_INSTALLED = (
    "torch_musa is not installed. Moore Threads ships it outside PyPI, built for one "
    "exact PyTorch build: install the matching torch and torch_musa wheels from Moore "
    "Threads, then install mtcore-musa without dependencies, so that pip keeps that torch "
    "(docs/musa.md, section 1)"
)
_PINNED = (
    " (each torch_musa build is pinned to one PyTorch build; undefined symbols mean "
    "the installed torch is not the one this torch_musa was built against)"
)
_TORCH_TOO_OLD = re.compile(r"torch version must not be less than v?([0-9][0-9.]*)")


def _release(version: str) -> tuple[int, ...]:
    """(2, 7, 1) from "2.7.1+cpu", "2.7.1a0+git..."; () when unreadable."""
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def _torch_musa_version() -> str:
    """The installed torch_musa distribution's version, read without importing it."""
    try:
        return metadata.version(TORCH_MUSA)
    except metadata.PackageNotFoundError:
        return TORCH_MUSA_RELEASE


def _torch_musa_present() -> bool:
    """Whether torch_musa can be found, without importing it (nor running its checks)."""
    if TORCH_MUSA in sys.modules:
        return True
    try:
        return importlib.util.find_spec(TORCH_MUSA) is not None
    except (ImportError, ValueError):
        return False


def torch_too_old(torch_version: str, needed: str) -> str:
    """The diagnostic for a torch older than torch_musa requires: both versions, and the fix."""
    return (
        f"torch_musa {_torch_musa_version()} needs torch >= {needed}, but the installed "
        f"torch is {torch_version}: install the torch wheel Moore Threads ships with that "
        f"torch_musa (torch_musa raises at import on an older torch)"
    )


def float8_on_device(device: TorchModuleDevice) -> Availability:
    """Whether float8 works on the device: create and cast a tensor of each format, and
    run one small ``torch._scaled_mm`` (the first muDNN kernel FP8 training needs).

    torch_musa maps Float8_e4m3fn/e5m2 to muDNN types only when built with MUSA >= 4.0
    (csrc/aten/utils/Utils.cpp, ``SetMUTensorDType``, under REAL_MUSA_VERSION >= 4000);
    other builds raise "SetMUTensorDType Unsupported tensor dtype" on the first float8
    kernel that reaches muDNN, whatever the device's architecture.
    """
    where = device.torch_device()
    made = {}
    dtype = torch.float8_e4m3fn
    try:
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            made[dtype] = torch.full((32, 32), 1.0, dtype=dtype, device=where)
            made[dtype].to(torch.float32)
        dtype = torch.float8_e4m3fn  # the scaled matmul's operands
        x, one = made[dtype], torch.ones((), device=where)
        torch._scaled_mm(x, x.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except Exception as exc:
        built_for = getattr(torch.version, "musa", None) or "unknown"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return Availability(
            False,
            f"{dtype} does not work on {where} ({first_line}): torch_musa supports float8 "
            f"only when built with MUSA >= 4.0 (this build: MUSA {built_for})",
        )
    return Availability(True)


def mixed_formats_on_device(device: TorchModuleDevice) -> bool:
    """Whether ``torch._scaled_mm`` multiplies an e5m2 operand by an e4m3 one right on the
    device: one 32x32 product of small integers (exact in both formats and in float32)
    must equal the float32 product.

    The hybrid recipe's gradient GEMMs mix the formats. torch_musa's ScaledMatmulOut
    (csrc/aten/ops/Matmul.cpp) checks that each operand is float8, not that both share a
    format, and its test_scaled_mm (tests/unittest/operator/test_mm.py) runs same-format
    operands only; so mixed operands reach muDNN only once this probe has passed.
    """
    where = device.torch_device()
    values = (torch.arange(32 * 32, dtype=torch.float32) % 7 - 3).view(32, 32)
    a, b = values, values.flip(0)
    try:
        one = torch.ones((), device=where)
        got = torch._scaled_mm(
            a.to(torch.float8_e5m2).to(where),
            b.to(torch.float8_e4m3fn).to(where).t(),
            scale_a=one,
            scale_b=one,
            out_dtype=torch.float32,
        )
        return torch.equal(got.cpu(), a @ b.t())
    except Exception:
        return False


class MusaDevice(TorchModuleDevice):
    """``TorchModuleDevice`` over ``torch.musa`` that says plainly why it cannot run."""

    def availability(self) -> Availability:
        found = torch.__version__
        if not _torch_musa_present():
            return Availability(False, NOT_INSTALLED)
        if _release(found) and _release(found) < TORCH_MUSA_MIN_TORCH:
            needed = ".".join(map(str, TORCH_MUSA_MIN_TORCH))
            return Availability(False, torch_too_old(found, needed))
        try:
            importlib.import_module(TORCH_MUSA)
        except ModuleNotFoundError as exc:
            if exc.name == TORCH_MUSA:
                return Availability(False, NOT_INSTALLED)
            return Availability(False, f"torch_musa failed to import: {exc}{_PINNED}")
        except RuntimeError as exc:
            # torch_musa passes its message as two arguments: join them before matching.
            text = "".join(str(arg) for arg in exc.args)
            too_old = _TORCH_TOO_OLD.search(text)
            if too_old:
                return Availability(False, torch_too_old(found, too_old.group(1).rstrip(".")))
            return Availability(False, f"torch_musa failed to import: {exc!r}{_PINNED}")
        except Exception as exc:  # a broken build raises ImportError, OSError, ...
            return Availability(False, f"torch_musa failed to import: {exc!r}{_PINNED}")
        try:
            return super().availability()
        except Exception as exc:
            return Availability(False, f"torch.musa could not be queried: {exc!r}")
