"""The collectives a job calls, checked on its own groups before step 1.

The conformance kit checks every collective on 2 and 4 ranks with small and a few
large messages; a job may call them on other groups (tensor parallelism's take the
cpu backend's shared-memory channel), in another dtype and at sizes the kit never
sends. ``check_collectives`` runs, on each group the job uses, every operation that
group carries in training (``GroupUse.ops``), at the job's dtype, once small and
once at the group's largest message (``GroupUse.elements``, capped by
``MAX_ELEMENTS`` so the check stays within its budget, and made odd so that no
vector width or chunk size divides it). Values are small integers, exact in every
dtype and in any summation order, so results compare with equality and every rank
can predict every other rank's result.

Every rank calls the same checks in the same order on groups of the same kind, so a
wrong result on one rank cannot leave another waiting: comparisons come after the
communication, and nothing raises in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The largest message checked, in elements (1 MiB of float32): a lie above it goes
# unseen here, the price of a check that takes a second, not a step.
MAX_ELEMENTS = 1 << 18
SMALL_ELEMENTS = 5  # fewer than any vector width
OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")


@dataclass(frozen=True)
class GroupUse:
    """One group of the job and what training sends over it.

    ``label`` names it in messages ("tp", "world"); ``group`` is the process group
    (None: the world); ``ops`` a subset of ``OPS``; ``elements`` the largest message
    the job sends over it (per rank), ``dtype`` the dtype it sends."""

    label: str
    group: object
    ops: tuple[str, ...]
    elements: int
    dtype: torch.dtype


def large_size(elements: int) -> int:
    """The large message's element count for a job whose largest is ``elements``: at
    least 64 KiB of float32 and odd, at most ``MAX_ELEMENTS`` (odd too)."""
    n = min(max(elements, (64 << 10) // 4 + 1), MAX_ELEMENTS)
    return n | 1


def _values(n: int, who: int, dtype, device) -> torch.Tensor:
    # Integers in [-4, 4]: sums over up to 64 ranks are exact even in bfloat16 and e5m2-free.
    i = torch.arange(n, dtype=torch.int64)
    return ((i * 7 + who * 3) % 9 - 4).to(dtype).to(device)


def _differs(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {got.dtype} {list(got.shape)}, expected {want.dtype} {list(want.shape)}"
    g, w = got.detach().cpu().float().flatten(), want.detach().cpu().float().flatten()
    bad = (g != w).nonzero().flatten()
    if not len(bad):
        return None
    first = int(bad[0])
    return (
        f"{len(bad)} of {w.numel()} elements wrong, first at {first}: got {g[first].item():g}, "
        f"expected {w[first].item():g}"
    )


def _check_group(collective, use: GroupUse, device) -> list[str]:
    group, dtype = use.group, use.dtype
    me, size = collective.rank(group), collective.world_size(group)
    short = str(dtype).removeprefix("torch.")
    results: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for n in (SMALL_ELEMENTS, large_size(use.elements)):
        where = f"{{}} of {n} {short} on {use.label} (size {size})"
        if "all_reduce" in use.ops:
            for op, fold in (("sum", torch.sum), ("max", torch.amax), ("min", torch.amin)):
                t = _values(n, me, dtype, device)
                collective.all_reduce(t, op=op, group=group)
                stack = torch.stack([_values(n, r, torch.float32, "cpu") for r in range(size)])
                results.append((where.format(f"all_reduce {op}"), t, fold(stack, 0).to(dtype)))
        if "reduce_scatter" in use.ops:
            inp = torch.cat([_values(n, me * size + j, dtype, device) for j in range(size)])
            out = torch.empty(n, dtype=dtype, device=device)
            collective.reduce_scatter(out, inp, group=group)
            want = sum(_values(n, r * size + me, torch.float32, "cpu") for r in range(size))
            results.append((where.format("reduce_scatter sum"), out, want.to(dtype)))
        if "all_gather" in use.ops:
            out = torch.empty(size * n, dtype=dtype, device=device)
            collective.all_gather(out, _values(n, me, dtype, device), group=group)
            want = torch.cat([_values(n, r, dtype, "cpu") for r in range(size)])
            results.append((where.format("all_gather (rank order)"), out, want))
        if "broadcast" in use.ops:
            src = size - 1  # not 0: a backend that always sends rank 0's shows
            t = _values(n, me, dtype, device)
            collective.broadcast(t, src=collective.global_rank(group, src), group=group)
            results.append(
                (where.format(f"broadcast from {src}"), t, _values(n, src, dtype, "cpu"))
            )
        if "all_to_all" in use.ops:
            results.append(_all_to_all(collective, group, me, size, n, dtype, device, where))
    problems = []
    for what, got, want in results:
        wrong = _differs(got, want)
        if wrong:
            problems.append(f"{what}: {wrong}")
    return problems


def _split(src: int, dst: int, n: int) -> int:
    return (n * (1 + (src + 2 * dst) % 3)) // 3  # uneven, 0 included for small n


def _all_to_all(collective, group, me, size, n, dtype, device, where):
    def chunk(src, dst):
        return _values(_split(src, dst, n), src * 31 + dst, dtype, "cpu")

    ins = [_split(me, d, n) for d in range(size)]
    outs = [_split(s, me, n) for s in range(size)]
    inp = torch.cat([chunk(me, d) for d in range(size)]).to(device)
    out = torch.empty(sum(outs), dtype=dtype, device=device)
    collective.all_to_all(out, inp, outs, ins, group=group)
    want = torch.cat([chunk(s, me) for s in range(size)])
    return where.format(f"all_to_all (splits {ins})"), out, want


def check_collectives(collective, uses: list[GroupUse], device) -> list[str]:
    """Every group's checks, in the order given (the same on every rank); what was wrong."""
    problems = []
    for use in uses:
        problems += _check_group(collective, use, device)
    return problems
