"""The host CPU's FP8 kernels: quantize, quantize-and-transpose and dequantize in C.

The reference ops (``mtcore.ops.fp8``) take a dozen torch passes per quantization, and
torch converts float32 to FP8 one element at a time on the CPU; on the small tensors of
a training step most of that time is dispatch. ``host_fp8.c`` does each in one or two
vectorised passes and gives the reference's bits (tests/unit/backend/test_host_fp8.py;
the conformance kit checks them as any plugin's kernels). The library is compiled on
first use (``mtcore.backend.native_build``); where that fails the reference ops serve
and :func:`unavailable_reason` says why.

Each function has the parameter names of the reference op it implements. Inputs
outside what the C code takes (float16 ``x``, a float16 result) go to the reference
through the ``*_fits`` guards.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from mtcore.backend.native_build import NativeBuildError, load_library
from mtcore.ops import FP8_MAX
from mtcore.ops.fp8 import (
    BLOCK,
    check_dequantize_args,
    check_quantize_args,
    unit_dims,
    unit_shape,
)

SOURCE = Path(__file__).with_name("host_fp8.c")
KERNEL_NAME = "host-c"
INPUT_DTYPES = (torch.float32, torch.bfloat16)
OUTPUT_DTYPES = (torch.float32, torch.bfloat16)
_FORMAT = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}  # host_fp8.c's FORMAT_*
FORMATS = tuple(_FORMAT)
_TILE = 16  # host_fp8.c's TILE

_pointer, _size, _int, _float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "mtcore_fp8_quantize": [
        _pointer, _int, _size, _size, _int, _float, _size, _size, _pointer, _pointer, _int,
        _pointer, _pointer, _pointer,
    ],
    "mtcore_fp8_dequantize": [_pointer, _size, _size, _int, _pointer, _size, _size, _int, _pointer],
}  # fmt: skip


class _Library:
    """The loaded library, or why there is none (one build or load per process)."""

    def __init__(self, machine: str):
        self.functions: dict[str, ctypes._CFuncPtr] = {}
        self.error = self.path = ""
        try:
            library = load_library(SOURCE, machine)
        except NativeBuildError as exc:
            self.error = str(exc)
            return
        self.path = library._name
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, None
            self.functions[name] = function


_loaded: _Library | None = None


def load(machine: str) -> bool:
    """Build or load the library for ``machine`` (once); whether the kernels can run."""
    global _loaded
    if _loaded is None:
        _loaded = _Library(machine)
    return not _loaded.error


def unavailable_reason() -> str:
    """Why the kernels do not run here ("" when they do, or before :func:`load`)."""
    return _loaded.error if _loaded is not None else ""


def describe(machine: str) -> str:
    """One line for ``mtcore doctor``: the library in use, or why the reference ops serve."""
    if load(machine):
        return f"C, compiled for this CPU: {_loaded.path}"
    return f"reference ops (the C kernels are not available: {_loaded.error})"


def _function(name: str):
    if _loaded is None or _loaded.error:
        raise RuntimeError("mtcore.backend.host_fp8: the library is not loaded (call load())")
    return _loaded.functions[name]


def _quantize_into(
    x: Tensor, dtype: torch.dtype, unit: tuple[int, int], scale: Tensor | None, transpose: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """One C call: ``x`` [M, K] (contiguous, float32 or bfloat16) quantized per ``unit``;
    the data (and the unit arrays) come out transposed when ``transpose``."""
    (rows, cols), (unit_rows, unit_cols) = x.shape, unit
    down, across = -(-rows // unit_rows), -(-cols // unit_cols)
    units = (across, down) if transpose else (down, across)
    data = torch.empty((cols, rows) if transpose else (rows, cols), dtype=dtype)
    scale_inv, amax = torch.empty(units), torch.empty(units)
    work = torch.empty(2 * across + -(-_TILE * cols // 4))
    _function("mtcore_fp8_quantize")(
        x.data_ptr(), int(x.dtype == torch.bfloat16), rows, cols, _FORMAT[dtype], FP8_MAX[dtype],
        unit_rows, unit_cols, None if scale is None else scale.data_ptr(), data.data_ptr(),
        int(transpose), scale_inv.data_ptr(), amax.data_ptr(), work.data_ptr(),
    )  # fmt: skip
    return data, scale_inv, amax


def _given_scale(scale) -> Tensor | None:
    if scale is None:
        return None
    given = torch.as_tensor(scale, dtype=torch.float32).detach().cpu()
    if given.numel() != 1:
        raise ValueError(f"scale must have one element, got shape {list(given.shape)}")
    return given.reshape(1).contiguous()


def _as_input(x: Tensor) -> Tensor:
    return x.detach().contiguous()


def fp8_quantize(x, dtype, granularity, scale=None):
    """``mtcore.ops.fp8_quantize`` in one C call."""
    check_quantize_args(x, dtype, granularity, scale)
    shape = unit_shape(tuple(x.shape), granularity)
    data, scale_inv, amax = _quantize_into(
        _as_input(x), dtype, unit_dims(x.shape, granularity), _given_scale(scale), False
    )
    return data, scale_inv.view(shape), amax.view(shape)


def fp8_quantize_transpose(x, dtype, granularity, scale=None):
    """``mtcore.ops.fp8_quantize_transpose``: ``x`` along its rows, then along its
    columns (in 128-row strips for 1x128) written transposed, in two C calls; per tensor
    and in 128x128 blocks the transpose's units are the same, so its bytes are ``x``'s
    data transposed."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {list(x.shape)}")
    check_quantize_args(x, dtype, granularity, scale)
    source, given = _as_input(x), _given_scale(scale)
    data, scale_inv, amax = fp8_quantize(source, dtype, granularity, scale)
    if granularity in ("tensor", "128x128"):
        transposed = (data.t().contiguous(), scale_inv.t().contiguous(), amax.t().contiguous())
        return (data, scale_inv, amax), transposed
    strip = BLOCK if granularity == "1x128" else x.shape[0]
    return (data, scale_inv, amax), _quantize_into(source, dtype, (strip, 1), given, True)


def fp8_dequantize(data, scale_inv, granularity, out_dtype=torch.float32):
    """``mtcore.ops.fp8_dequantize`` in one C call."""
    check_dequantize_args(data, scale_inv, granularity)
    rows, cols = data.shape
    unit_rows, unit_cols = unit_dims(data.shape, granularity)
    out = torch.empty((rows, cols), dtype=out_dtype)
    scales = scale_inv.detach().float().contiguous()
    data = data.contiguous()  # kept in a name: the C call reads its memory
    _function("mtcore_fp8_dequantize")(
        data.data_ptr(), rows, cols, _FORMAT[data.dtype],
        scales.data_ptr(), unit_rows, unit_cols, int(out_dtype == torch.bfloat16), out.data_ptr(),
    )  # fmt: skip
    return out


def quantize_fits(x, dtype, granularity, scale=None) -> bool:
    """``fallback_ok`` of both quantize kernels: CPU float32 or bfloat16 input."""
    return x.device.type == "cpu" and x.dtype in INPUT_DTYPES


def dequantize_fits(data, scale_inv, granularity, out_dtype=torch.float32) -> bool:
    """``fallback_ok`` of the dequantize kernel: FP8 bytes on the CPU to float32 or bfloat16."""
    return data.device.type == "cpu" and data.dtype in _FORMAT and out_dtype in OUTPUT_DTYPES
