"""What MCCL carries natively in this torch_musa build, read from the build itself.

torch_musa maps dtypes to MCCL at compile time (csrc/distributed/ProcessGroupMCCL.h):
``MCCL_BF16_SUPPORTED`` is set when ``MARCH_TYPE >= 220`` and ``MCCL_FP8_SUPPORTED``
(nested inside it in ProcessGroupMCCL.cpp's ``mcclDataType`` map) when ``MARCH_TYPE >=
310``. CMakeLists.txt sets ``MARCH_TYPE`` to ten times the highest entry of
TORCH_MUSA_ARCH_LIST, the first run of digits of each ("22" -> 220), and bakes the
same list into ``torch.musa.get_arch_list()`` (torch_musa/core/device.py, from the
MUSA_ARCH_FLAGS define of csrc/core/Module.cpp). So the arch list tells what MCCL
maps. A dtype it does not map raises "Input tensor data type in not supported for
MCCL process group" in every collective, data movement included; mtcore then moves
it as bytes and reduces it in float32.
"""

from __future__ import annotations

import re

import torch

from mtcore.backend.collective import FP8_DTYPES, OPS

BF16_MIN_BUILD_ARCH = 22
FP8_MIN_BUILD_ARCH = 31


def build_arch(device) -> int | None:
    """The highest arch torch_musa was built for (22, 31), or None when it cannot tell
    (no device visible: ``get_arch_list()`` is then empty; torch_musa does not import)."""
    try:
        archs = device.module.get_arch_list()
    except Exception:
        return None
    found = [int(m.group()) for m in (re.search(r"\d+", str(a)) for a in archs or ()) if m]
    return max(found) if found else None


def mccl_fallback_dtypes(device) -> dict[str, frozenset[torch.dtype]]:
    """Per op, the dtypes this MCCL build does not map; an unknown build is assumed to
    map neither bf16 nor FP8 (the fallback is slower, never wrong)."""
    arch = build_arch(device)
    wide: set[torch.dtype] = set()
    if arch is None or arch < FP8_MIN_BUILD_ARCH:
        wide.update(FP8_DTYPES)
    if arch is None or arch < BF16_MIN_BUILD_ARCH:
        wide.add(torch.bfloat16)
    return {op: frozenset(wide) for op in OPS if op != "barrier"}
