"""MoE expert compute on CPU: the reference ``grouped_mm`` (a loop of matmuls, one per
expert) against one padded batched matmul, forward + backward.

    .venv/bin/python benchmarks/bench_grouped_mm.py

The padded form copies each expert's rows into an ``[E, max_rows, k]`` block (zeros
after its own rows), runs one ``torch.bmm`` with the ``[E, k, n]`` weights and copies
the rows back: one kernel launch instead of E, at the price of the padding's
arithmetic when the routing is uneven. Shapes are those of the MoE configs here
(8 experts, top-2, hidden 128-256) and larger; "skewed" routing sends half the
tokens to one expert. Median of ``--repeat`` runs, one thread, fp32 and bf16; the
``uptime`` load is printed first, since the machine is shared.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _timing import load_average

from mtcore.ops.moe import grouped_mm


def padded_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``grouped_mm`` as one batched matmul over zero-padded per-expert blocks."""
    experts, width = weight.shape[0], max(counts, default=0)
    acc = torch.promote_types(x.dtype, torch.float32)
    rows = (
        torch.cat([torch.arange(c) for c in counts]) if counts else torch.zeros(0, dtype=torch.long)
    )
    owner = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    blocks = x.new_zeros(experts, width, x.shape[1], dtype=acc)
    blocks = blocks.index_put((owner, rows), x.to(acc))
    out = torch.bmm(blocks, weight.to(acc))
    return out[owner, rows].to(x.dtype)


def _counts(tokens: int, experts: int, skewed: bool) -> list[int]:
    if not skewed:
        base = [tokens // experts] * experts
        base[0] += tokens - sum(base)
        return base
    first = tokens // 2
    rest = [(tokens - first) // (experts - 1)] * (experts - 1)
    rest[0] += tokens - first - sum(rest)
    return [first, *rest]


def _time(fn, x, w, counts, repeat: int) -> float:
    times = []
    for i in range(repeat + 2):
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        start = time.perf_counter()
        fn(xg, wg, counts).sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(load_average())
    print(
        f"{'dtype':<6}{'T':>6}{'E':>4}{'k':>5}{'n':>6}{'routing':>9}{'loop ms':>10}{'padded ms':>11}{'ratio':>8}  max |diff|"
    )
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, experts, k, n in (
            (1024, 8, 128, 256),
            (2048, 8, 256, 512),
            (4096, 16, 256, 1024),
        ):
            for skewed in (False, True):
                counts = _counts(tokens, experts, skewed)
                x = torch.randn(tokens, k, generator=g).to(dtype)
                w = (torch.randn(experts, k, n, generator=g) * k**-0.5).to(dtype)
                loop = _time(
                    lambda a, b, c: grouped_mm(a, b, torch.tensor(c)), x, w, counts, args.repeat
                )
                padded = _time(padded_grouped_mm, x, w, counts, args.repeat)
                diff = (
                    (
                        grouped_mm(x, w, torch.tensor(counts)).float()
                        - padded_grouped_mm(x, w, counts).float()
                    )
                    .abs()
                    .max()
                )
                name = "skewed" if skewed else "even"
                print(
                    f"{str(dtype)[6:]:<6}{tokens:>6}{experts:>4}{k:>5}{n:>6}{name:>9}"
                    f"{loop * 1e3:>10.2f}{padded * 1e3:>11.2f}{padded / loop:>8.2f}  {diff.item():.2e}"
                )


if __name__ == "__main__":
    main()
