"""Collective checks, run inside ranks: one spawn per world size runs all of them.

Every check is called on every rank with the same arguments and issues the same
collectives in the same order, so one failing assertion cannot leave a peer
waiting: assertions come after the communication. Each rank returns
``{check: (outcome, text)}`` with outcome "passed", "failed" or "skipped"; the
parent merges the ranks (see ``merge``) and the pytest side turns every check
into its own test. Values are chosen so every expected result is exact in the
dtype under test (powers of two for FP8), so checks compare with equality.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable

import torch

from mtcore.backend import P2P, Handle, Support

CAPABILITY = "capability:"
REDUCE_OPS = ("sum", "max", "min", "avg")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = (torch.float32, torch.bfloat16)

CHECKS: dict[str, Callable] = {}


class SkipCheck(Exception):
    """Raised (on every rank alike) when the backend declares it cannot do a check."""


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check(name: str, **bound):
    def register(fn):
        CHECKS[name] = lambda ctx, shared: fn(ctx, shared, **bound)
        return fn

    return register


def _needs(ctx, op: str, dtype: torch.dtype) -> Support:
    support = ctx.backend.collective.support(op, dtype)
    if support is Support.NONE:
        raise SkipCheck(f"{CAPABILITY} {op} does not carry {_short(dtype)} (Support.NONE)")
    return support


def _device(ctx) -> torch.device:
    return ctx.backend.torch_device()


def _data(seed: int, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Deterministic values any rank can rebuild; exact in ``dtype`` by construction."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(device)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    )
    g, w = got.detach().cpu().float(), want.detach().cpu().float()
    if not torch.equal(g, w):
        bad = (g != w).nonzero()[:4].tolist()
        raise AssertionError(
            f"{what}: values differ at {bad}: got {[g[tuple(i)].item() for i in bad]}, "
            f"expected {[w[tuple(i)].item() for i in bad]}"
        )


# Reductions use powers of two times per-rank factors so sums, means, maxima
# and minima are exact even in e5m2 (2 mantissa bits).
_BASE = (1.0, 0.5, 2.0, -1.0, 0.25, -4.0, 0.0, 8.0, -0.5)
_FACTOR = (1.0, 2.0, 1.0, 4.0)


def _reduce_input(rank: int, dtype, device) -> torch.Tensor:
    return (torch.tensor(_BASE) * _FACTOR[rank % 4]).to(dtype).to(device)


def _reduce_expected(op: str, ranks, dtype, device) -> torch.Tensor:
    stack = torch.stack([torch.tensor(_BASE) * _FACTOR[r % 4] for r in ranks])
    value = {
        "sum": stack.sum(0),
        "max": stack.max(0).values,
        "min": stack.min(0).values,
        "avg": stack.sum(0) / len(ranks),
    }[op]
    return value.to(dtype).to(device)


def _all_reduce(ctx, shared, op, dtype, async_op=False):
    support = _needs(ctx, "all_reduce", dtype)
    device = _device(ctx)
    t = _reduce_input(ctx.rank, dtype, device)
    result = ctx.backend.collective.all_reduce(t, op=op, async_op=async_op)
    if async_op:
        assert isinstance(result, Handle), (
            f"async all_reduce returned {type(result).__name__}, not Handle"
        )
        result.wait()
        assert result.is_completed(), "Handle.is_completed() is False after wait()"
    else:
        assert result is None, f"synchronous all_reduce returned {result!r}, expected None"
    _same(t, _reduce_expected(op, range(ctx.world_size), dtype, device), f"all_reduce {op}")
    return f"path={support.value}"


for _op in REDUCE_OPS:
    for _dtype in DTYPES + FP8:
        check(f"all_reduce-{_op}-{_short(_dtype)}", op=_op, dtype=_dtype)(_all_reduce)
# Async reductions take another path (a work object, and a Handle whose wait()
# runs a fallback's epilogue: AVG emulation, FP8 widening), and a backend may map
# each reduce op differently there; so every reduce op is checked async too.
for _op in REDUCE_OPS:
    check(f"all_reduce-async-{_op}-float32", op=_op, dtype=torch.float32, async_op=True)(
        _all_reduce
    )
check("all_reduce-async-sum-float8_e4m3fn", op="sum", dtype=torch.float8_e4m3fn, async_op=True)(
    _all_reduce
)


def _scatter_rows(rank: int, ws: int, rows: int) -> torch.Tensor:
    # Shard j is scaled by (-1)**j * 2**(j % 3) so every shard differs from the others.
    return torch.stack(
        [
            torch.tensor(_BASE)
            * _FACTOR[(rank + i) % 4]
            * (-1) ** (i // rows)
            * 2 ** ((i // rows) % 3)
            for i in range(ws * rows)
        ]
    )


def _reduce_scatter(ctx, shared, op, dtype, async_op=False):
    support = _needs(ctx, "reduce_scatter", dtype)
    device, ws, rows = _device(ctx), ctx.world_size, 3
    inp = _scatter_rows(ctx.rank, ws, rows).to(dtype).to(device)
    out = torch.empty(rows, inp.shape[1], dtype=dtype, device=device)
    handle = ctx.backend.collective.reduce_scatter(out, inp, op=op, async_op=async_op)
    if async_op:
        assert isinstance(handle, Handle), (
            f"async reduce_scatter returned {type(handle).__name__}, not Handle"
        )
        handle.wait()
    stack = torch.stack([_scatter_rows(r, ws, rows) for r in range(ws)])
    value = {
        "sum": stack.sum(0),
        "max": stack.max(0).values,
        "min": stack.min(0).values,
        "avg": stack.sum(0) / ws,
    }[op]
    want = value[ctx.rank * rows : (ctx.rank + 1) * rows].to(dtype).to(device)
    _same(out, want, f"reduce_scatter {op}: shard of rank {ctx.rank}")
    return f"path={support.value}"


for _op in REDUCE_OPS:
    for _dtype in DTYPES:
        check(f"reduce_scatter-{_op}-{_short(_dtype)}", op=_op, dtype=_dtype)(_reduce_scatter)
check("reduce_scatter-sum-float8_e4m3fn", op="sum", dtype=torch.float8_e4m3fn)(_reduce_scatter)
for _op in REDUCE_OPS:
    check(f"reduce_scatter-async-{_op}-float32", op=_op, dtype=torch.float32, async_op=True)(
        _reduce_scatter
    )


def _all_gather(ctx, shared, dtype, async_op=False):
    support = _needs(ctx, "all_gather", dtype)
    device, ws = _device(ctx), ctx.world_size
    inp = _data(100 + ctx.rank, (3, 5), dtype, device)
    out = torch.empty(ws * 3, 5, dtype=dtype, device=device)
    handle = ctx.backend.collective.all_gather(out, inp, async_op=async_op)
    if async_op:
        handle.wait()
    want = torch.cat([_data(100 + r, (3, 5), dtype, device) for r in range(ws)])
    _same(out, want, "all_gather")
    return f"path={support.value}"


for _dtype in DTYPES + FP8:
    check(f"all_gather-{_short(_dtype)}", dtype=_dtype)(_all_gather)
check("all_gather-async-float32", dtype=torch.float32, async_op=True)(_all_gather)


def _all_gather_large(ctx, shared, dtype):
    """A large shard of an odd size (no multiple of any vector width or chunk size a
    backend may split it into): every rank's block must land whole, in rank order."""
    support = _needs(ctx, "all_gather", dtype)
    device, ws, rows = _device(ctx), ctx.world_size, 65_537
    values = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) % 251
    mine = (values + ctx.rank * 256).to(dtype).to(device)
    out = torch.empty(ws * rows, 3, dtype=dtype, device=device)
    ctx.backend.collective.all_gather(out, mine)
    for r in range(ws):
        block = out[r * rows : (r + 1) * rows]
        _same(block, (values + r * 256).to(dtype).to(device), f"all_gather block of rank {r}")
    return f"path={support.value}"


for _dtype in (torch.float32, torch.bfloat16):
    check(f"all_gather-large-odd-{_short(_dtype)}", dtype=_dtype)(_all_gather_large)


def _reduce_scatter_large(ctx, shared, dtype):
    """A large shard of an odd size (65,537 elements: a backend may switch algorithms
    above some size; one returning the unsummed shard above 4,096 passed 3-row cases):
    every element the sum of every rank's, small integers so bfloat16 sums are exact."""
    support = _needs(ctx, "reduce_scatter", dtype)
    device, ws, n = _device(ctx), ctx.world_size, 65_537

    def block(rank: int, shard: int) -> torch.Tensor:
        return (torch.arange(n) * 7 + rank * 3 + shard * 5) % 9 - 4.0

    inp = torch.cat([block(ctx.rank, j) for j in range(ws)]).to(dtype).to(device)
    out = torch.empty(n, dtype=dtype, device=device)
    ctx.backend.collective.reduce_scatter(out, inp)
    want = sum(block(r, ctx.rank) for r in range(ws)).to(dtype).to(device)
    _same(out, want, f"reduce_scatter sum of {n} elements: shard of rank {ctx.rank}")
    return f"path={support.value}"


for _dtype in (torch.float32, torch.bfloat16):
    check(f"reduce_scatter-large-odd-{_short(_dtype)}", dtype=_dtype)(_reduce_scatter_large)


def _broadcast(ctx, shared, dtype, async_op=False):
    support = _needs(ctx, "broadcast", dtype)
    device, src = _device(ctx), ctx.world_size - 1
    t = _data(200 + ctx.rank, (4, 7), dtype, device)
    handle = ctx.backend.collective.broadcast(t, src=src, async_op=async_op)
    if async_op:
        handle.wait()
    _same(t, _data(200 + src, (4, 7), dtype, device), f"broadcast from rank {src}")
    return f"path={support.value}"


for _dtype in DTYPES + FP8:
    check(f"broadcast-{_short(_dtype)}", dtype=_dtype)(_broadcast)
check("broadcast-async-float32", dtype=torch.float32, async_op=True)(_broadcast)


def _split(src: int, dst: int) -> int:
    return (src + 2 * dst) % 4  # uneven, including empty slices


def _all_to_all(ctx, shared, dtype, async_op=False):
    support = _needs(ctx, "all_to_all", dtype)
    device, ws, r = _device(ctx), ctx.world_size, ctx.rank
    in_splits = [_split(r, d) for d in range(ws)]
    out_splits = [_split(s, r) for s in range(ws)]
    inp = torch.cat([_data(1000 * r + d, (_split(r, d), 3), dtype, "cpu") for d in range(ws)]).to(
        device
    )
    out = torch.empty(sum(out_splits), 3, dtype=dtype, device=device)
    handle = ctx.backend.collective.all_to_all(out, inp, out_splits, in_splits, async_op=async_op)
    if async_op:
        handle.wait()
    want = torch.cat([_data(1000 * s + r, (_split(s, r), 3), dtype, "cpu") for s in range(ws)]).to(
        device
    )
    _same(out, want, f"all_to_all (input splits {in_splits}, output splits {out_splits})")
    return f"path={support.value}"


for _dtype in DTYPES + FP8:
    check(f"all_to_all-uneven-{_short(_dtype)}", dtype=_dtype)(_all_to_all)
check("all_to_all-uneven-async-float32", dtype=torch.float32, async_op=True)(_all_to_all)


def _ring(ctx, shared, dtype):
    support = _needs(ctx, "send_recv", dtype)
    device, ws, r = _device(ctx), ctx.world_size, ctx.rank
    nxt, prv = (r + 1) % ws, (r - 1) % ws
    send = _data(300 + r, (6, 5), dtype, device)
    recv = torch.empty(6, 5, dtype=dtype, device=device)
    handles = ctx.backend.collective.batch_send_recv(
        [P2P("send", send, nxt), P2P("recv", recv, prv)]
    )
    assert all(isinstance(h, Handle) for h in handles), "batch_send_recv must return Handles"
    for h in handles:
        h.wait()
    _same(recv, _data(300 + prv, (6, 5), dtype, device), f"ring: rank {r} receiving from {prv}")
    return f"path={support.value}"


for _dtype in DTYPES + FP8:
    check(f"batch_send_recv-ring-{_short(_dtype)}", dtype=_dtype)(_ring)


@check("barrier")
def _barrier(ctx, shared):
    # Rank 0 writes a marker late; after the barrier every rank must see it.
    marker = os.path.join(shared, "barrier-marker")
    if ctx.rank == 0:
        time.sleep(0.3)
        with open(marker, "w") as f:
            f.write("0")
    ctx.backend.collective.barrier()
    seen = os.path.exists(marker)
    ctx.backend.collective.barrier()
    assert seen, f"rank {ctx.rank} passed the barrier before rank 0 reached it"


@check("new_group-subgroups")
def _subgroups(ctx, shared):
    coll, ws, r = ctx.backend.collective, ctx.world_size, ctx.rank
    device = _device(ctx)
    evens, odds, ends = list(range(0, ws, 2)), list(range(1, ws, 2)), [0, ws - 1]
    groups = {
        name: (m, coll.new_group(m))
        for name, m in (("evens", evens), ("odds", odds), ("ends", ends))
    }
    members, group = groups["evens"] if r % 2 == 0 else groups["odds"]
    t = torch.tensor([float(r + 1), 1.0], device=device)
    coll.all_reduce(t, "sum", group=group)
    info = (
        coll.rank(group),
        coll.world_size(group),
        [coll.global_rank(group, i) for i in range(len(members))],
    )
    bcast = torch.tensor([float(r)], device=device)
    coll.broadcast(bcast, src=members[-1], group=group)
    gathered = None
    if r in ends:
        ends_group = groups["ends"][1]
        gathered = torch.empty(2, dtype=torch.float32, device=device)
        coll.all_gather(gathered, torch.tensor([float(r)], device=device), group=ends_group)
    _same(
        t,
        torch.tensor([float(sum(m + 1 for m in members)), float(len(members))], device=device),
        f"all_reduce in group {members}",
    )
    assert info == (members.index(r), len(members), members), (
        f"group {members} on rank {r}: rank/size/global ranks {info}"
    )
    _same(bcast, torch.tensor([float(members[-1])], device=device), f"broadcast in group {members}")
    if gathered is not None:
        _same(
            gathered,
            torch.tensor([0.0, float(ws - 1)], device=device),
            f"all_gather in group {ends}",
        )


@check("new_group-latency_bound")
def _latency_bound(ctx, shared):
    """A latency-bound group (tensor parallelism's) may take a faster path (the cpu
    backend's shared memory): it must give the same results as the world group."""
    coll, ws, r = ctx.backend.collective, ctx.world_size, ctx.rank
    device = _device(ctx)
    group = coll.new_group(list(range(ws)), latency_bound=True)
    results = []
    for op in REDUCE_OPS:
        for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
            if _needs(ctx, "all_reduce", dtype) is Support.NONE:
                continue
            t = _reduce_input(r, dtype, device)
            handle = coll.all_reduce(t, op=op, group=group, async_op=op == "sum")
            if handle is not None:
                handle.wait()
            results.append(
                (
                    f"all_reduce {op} {_short(dtype)}",
                    t,
                    _reduce_expected(op, range(ws), dtype, device),
                )
            )
    rows = 3
    inp = _scatter_rows(r, ws, rows).to(device)
    out = torch.empty(rows, inp.shape[1], device=device)
    coll.reduce_scatter(out, inp, group=group)
    stack = torch.stack([_scatter_rows(k, ws, rows) for k in range(ws)]).sum(0)
    results.append(("reduce_scatter sum", out, stack[r * rows : (r + 1) * rows].to(device)))
    for dtype in (torch.float32, torch.float8_e4m3fn):
        gathered = torch.empty(ws * 3, 5, dtype=dtype, device=device)
        coll.all_gather(gathered, _data(100 + r, (3, 5), dtype, device), group=group)
        want = torch.cat([_data(100 + k, (3, 5), dtype, device) for k in range(ws)])
        results.append((f"all_gather {_short(dtype)}", gathered, want))
    for what, got, want in results:
        _same(got, want, f"latency-bound group: {what}")
    channel = getattr(coll, "shared_memory_channel", lambda g: None)(group)
    return "path=shared-memory" if channel is not None else "path=c10d"


@check("new_group-p2p")
def _pipeline_group(ctx, shared):
    """A pipeline group (``p2p=True``) may carry its neighbours' sends and receives on a
    faster path (the cpu backend's shared-memory mailbox): as 1F1B does, every rank
    sends to both neighbours and receives from both in one batch, small messages of two
    dtypes and then one of 6 MiB each way (larger than a small transport buffer, so a
    sender must keep it moving while it waits); every byte must arrive from the right
    peer, in posting order."""
    coll, ws, r = ctx.backend.collective, ctx.world_size, ctx.rank
    device = _device(ctx)
    group = coll.new_group(list(range(ws)), p2p=True)
    nxt, prv = (r + 1) % ws, (r - 1) % ws
    dtypes = [d for d in (torch.float32, torch.bfloat16)
              if coll.support("send_recv", d) is not Support.NONE]  # fmt: skip
    if not dtypes:
        raise SkipCheck(f"{CAPABILITY} send_recv carries neither float32 nor bfloat16")
    big = (6 << 20) // 4  # float32 elements
    rounds = [[(d, (4, 7)) for d in dtypes], [(torch.float32, (big,))]]
    for k, messages in enumerate(rounds):
        ops, expected = [], []
        for j, (dtype, shape) in enumerate(messages):
            to_next = _data(1000 * k + 10 * j + r, shape, dtype, device)
            to_prev = _data(1000 * k + 10 * j + 500 + r, shape, dtype, device)
            from_prev = torch.empty(shape, dtype=dtype, device=device)
            from_next = torch.empty(shape, dtype=dtype, device=device)
            ops += [P2P("send", to_next, nxt, group), P2P("recv", from_prev, prv, group),
                    P2P("send", to_prev, prv, group), P2P("recv", from_next, nxt, group)]  # fmt: skip
            expected += [
                (from_prev, _data(1000 * k + 10 * j + prv, shape, dtype, device), prv),
                (from_next, _data(1000 * k + 10 * j + 500 + nxt, shape, dtype, device), nxt),
            ]
        handles = coll.batch_send_recv(ops)
        assert all(isinstance(h, Handle) for h in handles), "batch_send_recv must return Handles"
        for handle in handles:
            handle.wait()
        for got, want, peer in expected:
            _same(got, want, f"pipeline group: rank {r} receiving {tuple(got.shape)} from {peer}")
    mailbox = getattr(coll, "shared_memory_mailbox", lambda g: None)(group)
    return "path=shared-memory" if mailbox is not None else "path=c10d"


CHECK_NAMES: tuple[str, ...] = tuple(CHECKS)


def run_all(ctx, shared: str) -> dict[str, tuple[str, str]]:
    """Rank entry point: every check, in order, with its outcome on this rank."""
    results: dict[str, tuple[str, str]] = {}
    for name, fn in CHECKS.items():
        try:
            results[name] = ("passed", fn(ctx, shared) or "")
        except SkipCheck as exc:
            results[name] = ("skipped", str(exc))
        except AssertionError as exc:
            results[name] = ("failed", f"AssertionError: {exc}")
        except Exception:
            results[name] = ("failed", traceback.format_exc(limit=-2).rstrip())
    return results


def merge(per_rank: list[dict[str, tuple[str, str]]]) -> dict[str, tuple[str, str]]:
    """One outcome per check: failed if any rank failed, skipped if every rank skipped."""
    merged = {}
    for name in CHECK_NAMES:
        outcomes = [(rank, *res[name]) for rank, res in enumerate(per_rank)]
        failed: dict[str, list[int]] = {}  # identical failures, grouped by rank
        for rank, o, text in outcomes:
            if o == "failed":
                failed.setdefault(text, []).append(rank)
        if failed:
            lines = [
                f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {t}" for t, r in failed.items()
            ]
            merged[name] = ("failed", "\n".join(lines))
        elif all(o == "skipped" for _, o, _ in outcomes):
            merged[name] = ("skipped", outcomes[0][2])
        else:
            merged[name] = ("passed", outcomes[0][2])
    return merged
