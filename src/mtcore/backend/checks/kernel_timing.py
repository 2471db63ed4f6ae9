"""How long a kernel takes against the reference op on the same inputs: a generous bound.

A kernel that computes the right numbers 100 times slower than mtcore's pure-torch
reference passes every numerical check and turns a job into a crawl that nobody
connects to the plugin. Here an implementation and the reference op run in turns on
the op's largest kit case (the forward only, on the device, in the dtype under
test), in blocks of as many calls as make the reference's block take ``BLOCK_S``,
each ``REPEATS`` times; the fastest block of each is kept (the least disturbed by
other processes). The kernel fails when its block takes more than ``SLOWER_BOUND``
times the reference's *and* ``SLACK_S`` more: a fused kernel is rarely slower than
the reference at all. A failure is measured again with more repeats before it
counts, so one busy moment of the machine does not fail an honest kernel.

The FP8 area applies the same rule, with its own slack, to a declared-native scaled
matmul against the fallback matmul (``check_native_matmul_speed``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from mtcore.ops import REFERENCE_OPS

SLOWER_BOUND = 10.0
SLACK_S = 2e-3
REPEATS = 3
# Each timed block repeats a call until the reference's block takes about this long, so
# a tiny op's Python overhead and the clock's resolution do not decide (a kernel 100x
# slower than a 20 us reference is 2 ms a call: within any per-call slack).
BLOCK_S = 2e-3
MAX_CALLS = 1000
# After this long measuring one kernel, no further blocks start: an honest kernel's
# blocks take milliseconds, and a kernel whose blocks take seconds has failed already.
MEASURE_BUDGET_S = 2.0
UNTIMED = ("adamw_step",)  # updates its state in place: no inputs to call it on again
# A native FP8 GEMM may be slower than its fallback on a device where torch runs it as
# a plain loop (the CPU's torch._scaled_mm per tensor: 6 ms against 0.05 for
# 160x48x256); the kit's 160x48x256 product taking more than this is a path no job can use.
NATIVE_MATMUL_SLACK_S = 50e-3


def fastest(calls: dict[str, Callable[[], object]], sync: Callable[[], None], repeats: int):
    """The fastest of ``repeats`` timed blocks of each callable, taken in turns; a block
    is as many calls as make the first callable's (the reference's) about ``BLOCK_S``."""
    first = next(iter(calls.values()))
    sync()
    start = time.perf_counter()
    first()
    sync()
    once = time.perf_counter() - start
    n = max(1, min(MAX_CALLS, int(BLOCK_S / max(once, 1e-7))))
    best = dict.fromkeys(calls, float("inf"))
    began = time.perf_counter()
    for _ in range(repeats):
        if time.perf_counter() - began > MEASURE_BUDGET_S:
            break  # far too slow already (more blocks only lower a minimum by noise)
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            for _ in range(n):
                call()
            sync()
            best[name] = min(best[name], (time.perf_counter() - start) / n)
    return best, n


def too_slow(
    calls: dict[str, Callable[[], object]], sync, slack_s: float = SLACK_S
) -> tuple[float, float] | None:
    """``(kernel_s, reference_s)`` a call when ``calls["kernel"]`` is beyond the bound
    (``SLOWER_BOUND`` times the reference's block plus ``slack_s``), measured twice."""
    threads = torch.get_num_threads()
    # One host thread for both: on a busy machine a parallel region waits for its slowest
    # thread (torch's layer_norm took 9 ms a call at load 18, 0.05 alone), and a kernel
    # 100x slower is 100x slower on one thread too.
    torch.set_num_threads(1)
    try:
        for repeats in (REPEATS, 4 * REPEATS):  # confirm a failure before reporting it
            best, n = fastest(calls, sync, repeats)
            kernel, reference = best["kernel"], best["reference"]
            if kernel * n <= SLOWER_BOUND * reference * n + slack_s:
                return None
    finally:
        torch.set_num_threads(threads)
    return kernel, reference


def check_speed(op: str, fn: Callable, guard, case_args, sync) -> None:
    """Raise AssertionError when ``fn`` is far slower than the reference op on the inputs
    ``case_args`` returns (``(args, kwargs)`` on the device, built once per call)."""
    args, kwargs = case_args()
    if guard is not None and not guard(*args, **kwargs):
        return
    reference = REFERENCE_OPS[op]
    ref_args, ref_kwargs = case_args()

    def run(f, a, k):
        def call():
            with torch.no_grad():
                return f(*a, **k)

        return call

    calls = {"reference": run(reference, ref_args, ref_kwargs), "kernel": run(fn, args, kwargs)}
    slow = too_slow(calls, sync)
    if slow is not None:
        kernel, ref = slow
        raise AssertionError(
            f"{op}: {kernel * 1e3:.3g} ms a call against the reference op's {ref * 1e3:.3g} ms "
            f"on the same inputs ({kernel / ref:.0f}x; the bound is {SLOWER_BOUND:g}x + "
            f"{SLACK_S * 1e3:g} ms): correct, but slow enough to make a job crawl"
        )


def speed_inputs(op: str, dtype, device):
    """A callable giving fresh ``(args, kwargs)`` on ``device`` for timing ``op``: its
    largest kit case (by input elements); None for ops without one (``adamw_step``
    updates its state in place)."""
    from mtcore.backend.checks import kernel_cases as kit

    if op in kit.CASES:

        def size(case) -> int:
            return sum(
                a.value.numel() for a in [*case.args, *case.kwargs.values()] if isinstance(a, kit.X)
            )

        largest = max(kit.CASES[op](), key=size)
        return lambda: kit.materialize(largest, dtype, device)
    cases = {c[0]: c for c in kit.fp8_quantize_cases()}
    _, x, fmt, gran, scale = cases["130x257-zero-row-e4m3-tensor"]
    if op in ("fp8_quantize", "fp8_quantize_transpose"):
        return lambda: ((x.to(dtype).to(device), fmt, gran, scale), {})
    if op == "fp8_dequantize":
        data, scale_inv, _ = REFERENCE_OPS["fp8_quantize"](x, fmt, gran, scale)
        return lambda: ((data.to(device), scale_inv.to(device), gran), {"out_dtype": dtype})
    return None
