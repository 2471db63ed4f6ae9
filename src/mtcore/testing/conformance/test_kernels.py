"""Kernel contract: every implementation the kernel table can select, against the reference ops.

"Can select" means every candidate whose predicate accepts the backend's device
type and the dtype, not only the winner: ``MTCORE_KERNELS=reference`` and the
``fallback_ok`` guards can route a call to any of them. Every candidate that is not
the reference op is also timed against it (``kernel_timing``: more than 10x slower
and 2 ms fails).
"""

from __future__ import annotations

import pytest

from mtcore.backend import KernelQuery
from mtcore.backend.checks import kernel_timing
from mtcore.backend.checks.kernel_cases import (
    CASES,
    KERNEL_DTYPES,
    SPECIAL_CHECKS,
    check_op,
    dtype_name,
)
from mtcore.backend.kernels import REFERENCE
from mtcore.testing.conformance.plugin import CAPABILITY, kit_backend


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "impl" not in metafunc.fixturenames:
        return
    backend = kit_backend(metafunc.config)
    timing = metafunc.function.__name__ == "test_kernel_speed"  # the reference is the yardstick
    params, ids = [], []
    for op in backend.kernels.ops():
        for dtype in KERNEL_DTYPES:
            query = KernelQuery(backend.device.type, dtype)
            for impl in backend.kernels[op].candidates:
                if impl.accepts(query) and not (
                    timing and (impl.name == REFERENCE or op in kernel_timing.UNTIMED)
                ):
                    params.append((op, impl, dtype))
                    ids.append(f"{op}-{impl.name}-{dtype_name(dtype)}")
    metafunc.parametrize(("op", "impl", "dtype"), params, ids=ids)


def test_kernel(op, impl, dtype, device):
    try:
        if op in SPECIAL_CHECKS:
            ran = SPECIAL_CHECKS[op](impl.fn, impl.fallback_ok, dtype, device)
        elif op in CASES:
            ran = check_op(op, impl.fn, impl.fallback_ok, dtype, device)
        else:
            pytest.fail(
                f"the conformance kit has no cases for op {op!r}; add them to mtcore/backend/checks/kernel_cases.py"
            )
    except AssertionError as exc:
        raise AssertionError(
            f"kernel {impl.name!r} (plugin {impl.plugin!r}) for {op}: {exc}"
        ) from None
    if not ran:
        pytest.skip(
            f"{CAPABILITY} {impl.name!r} declines every case of {op} ({dtype_name(dtype)}) in fallback_ok"
        )


def test_kernel_speed(op, impl, dtype, device, backend):
    inputs = kernel_timing.speed_inputs(op, dtype, device)
    try:
        kernel_timing.check_speed(op, impl.fn, impl.fallback_ok, inputs, backend.device.synchronize)
    except AssertionError as exc:
        raise AssertionError(
            f"kernel {impl.name!r} (plugin {impl.plugin!r}) for {op} ({dtype_name(dtype)}): {exc}"
        ) from None
