"""Data that describes NVIDIA GPUs and the host to mtcore's generic implementations."""

from __future__ import annotations

from mtcore.backend import DeviceModuleSpec, peaks_by_name

# Dense peak TFLOP/s from NVIDIA's data sheets (no sparsity), matched by name.
_NVIDIA_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("B200", {"bfloat16": 2250.0, "float16": 2250.0, "float8": 4500.0}),
    ("H200", {"bfloat16": 989.4, "float16": 989.4, "float8": 1978.9}),
    ("H100 PCIe", {"bfloat16": 756.0, "float16": 756.0, "float8": 1513.0}),
    ("H100", {"bfloat16": 989.4, "float16": 989.4, "float8": 1978.9}),
    ("H800", {"bfloat16": 989.4, "float16": 989.4, "float8": 1978.9}),
    ("A100", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("A800", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}),
    ("L40S", {"bfloat16": 362.1, "float16": 362.1, "float8": 733.0}),
    ("L4", {"bfloat16": 121.0, "float16": 121.0, "float8": 242.0}),
)


CUDA = DeviceModuleSpec(
    device_type="cuda",
    import_name=None,
    visible_devices_env="CUDA_VISIBLE_DEVICES",
    # The driver's device nodes and /proc entry; WSL 2 exposes its libcuda instead.
    device_files=(
        "/dev/nvidia[0-9]*",
        "/proc/driver/nvidia/version",
        "/usr/lib/wsl/lib/libcuda.so*",
    ),
    bf16_min_capability=(8, 0),
    peak_tflops=peaks_by_name(_NVIDIA_PEAKS),
)

# torch._scaled_mm with tensor-wise and row-wise scales needs Ada (8.9) or newer.
FP8_MIN_CAPABILITY = (8, 9)
