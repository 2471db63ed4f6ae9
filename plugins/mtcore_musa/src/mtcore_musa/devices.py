"""Data that describes Moore Threads GPUs to mtcore's generic device implementation."""

from __future__ import annotations

import importlib

from mtcore.backend import Availability, DeviceModuleSpec, TorchModuleDevice, peaks_by_name

TORCH_MUSA = "torch_musa"

# Peak TFLOP/s, matched by name. Only figures Moore Threads published:
# MTT S4000 (launch, December 2023): FP32 25, TF32 50, FP16/BF16 100, INT8 200 TOPS.
# MTT S5000 is left out on purpose: the figure disclosed in February 2026 ("AI dense
# compute up to 1000 TFLOPS", 920 for the air-cooled card) names no dtype, so any
# per-dtype number would be a guess and would skew MFU. Unknown devices get {}.
_MUSA_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("S4000", {"bfloat16": 100.0, "float16": 100.0, "float32": 25.0}),
)



MUSA = DeviceModuleSpec(
    device_type="musa",
    import_name=TORCH_MUSA,
    visible_devices_env="MUSA_VISIBLE_DEVICES",
    # torch_musa: is_bf16_supported() is true from MUSA arch 2.2 (S4000, "QY2").
    bf16_min_capability=(2, 2),
    peak_tflops=peaks_by_name(_MUSA_PEAKS),
)

# muDNN flash attention, F.rope and F.swish_glu need arch >= 2.2 (S4000);
# torch._scaled_mm FP8 GEMM needs arch >= 3.1 (S5000, "PH1").
MUDNN_MIN_CAPABILITY = (2, 2)
FP8_MIN_CAPABILITY = (3, 1)

NOT_INSTALLED = (
    "torch_musa is not installed. Moore Threads ships it outside PyPI, built for one "
    "exact PyTorch build: install the matching torch and torch_musa wheels from Moore "
    "Threads, then `pip install mtcore-musa` (see the mtcore-musa README)"
)
_PINNED = (
    " (each torch_musa build is pinned to one PyTorch build; undefined symbols mean "
    "the installed torch is not the one this torch_musa was built against)"
)


class MusaDevice(TorchModuleDevice):
    """``TorchModuleDevice`` over ``torch.musa`` that says plainly why it cannot run."""

    def availability(self) -> Availability:
        try:
            importlib.import_module(TORCH_MUSA)
        except ModuleNotFoundError as exc:
            if exc.name == TORCH_MUSA:
                return Availability(False, NOT_INSTALLED)
            return Availability(False, f"torch_musa failed to import: {exc}{_PINNED}")
        except Exception as exc:  # a broken build raises ImportError, OSError, ...
            return Availability(False, f"torch_musa failed to import: {exc!r}{_PINNED}")
        try:
            return super().availability()
        except Exception as exc:
            return Availability(False, f"torch.musa could not be queried: {exc!r}")
