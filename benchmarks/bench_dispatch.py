"""Cost of calling a kernel through the registry against calling the function directly.

    python benchmarks/bench_dispatch.py

Target (issue 2): under 1 microsecond of overhead per call. Both paths run the
same function on the same tiny tensor, interleaved, so machine noise hits both.
"""

from __future__ import annotations

import timeit

import torch

from mtcore.backend import KernelImpl, KernelTable, select_backend
from mtcore.ops import rms_norm, swiglu


def trivial_swiglu(x):
    return x


def overhead_ns(direct, dispatched, number: int = 20000, repeats: int = 15) -> tuple[float, float]:
    direct_t, dispatched_t = [], []
    for _ in range(repeats):
        direct_t.append(timeit.timeit(direct, number=number) / number)
        dispatched_t.append(timeit.timeit(dispatched, number=number) / number)
    # The minimum over repeats is the least disturbed by other work on a shared machine.
    d, k = min(direct_t), min(dispatched_t)
    return (k - d) * 1e9, k / d


def main() -> None:
    torch.set_num_threads(1)
    kernels = select_backend("cpu").kernels
    x = torch.randn(2, 8)
    w = torch.ones(4)
    h = torch.randn(2, 4)
    # A kernel that does nothing isolates the registry's own cost from the op's.
    bare = KernelTable("cpu", [KernelImpl("swiglu", trivial_swiglu, "trivial")]).swiglu
    print(f"{'op':<10} {'overhead/call':>14} {'ratio':>7}")
    for name, direct, dispatched in [
        ("no-op", lambda: trivial_swiglu(x), lambda: bare(x)),
        ("swiglu", lambda: swiglu(x), lambda: kernels.swiglu(x)),
        ("rms_norm", lambda: rms_norm(h, w, 1e-6), lambda: kernels.rms_norm(h, w, 1e-6)),
    ]:
        ns, ratio = overhead_ns(direct, dispatched)
        print(f"{name:<10} {ns:>11.0f} ns {ratio:>7.3f}")


if __name__ == "__main__":
    main()
