"""The cpu backend's shared-memory channel inside c10d groups: one 3-rank run.

A latency-bound group (tensor parallelism's) of one host gets a channel; its
all-reduce, all-gather, reduce-scatter and all-to-all must give what gloo gives on a plain group
over the same ranks, bit for bit where the result does not depend on the order of
the sum (integer-valued data), and the same bits on every rank where it does.
Tensors larger than a slot take several rounds; FP8 and bf16 take the collective's
fallbacks first. A p2p group's mailbox (``shared_memory_p2p``) must deliver what its
sends hold, in posting order, with both neighbours at once. ``MTCORE_SHM_COLLECTIVES=0``
keeps a latency-bound group on gloo,
and so does one member unable to create or map the segment.
Three ranks exercise the general reduction (two ranks have a shortcut in no path,
but bf16 is widened only from three up).
"""

from __future__ import annotations

import os

import pytest
import torch

from mtcore.backend import shared_memory
from mtcore.backend.collective import SHARED_MEMORY_ENV
from mtcore.backend.shared_memory import SLOT_BYTES
from mtcore.testing.distributed import run_ranks

pytestmark = pytest.mark.skipif(
    not shared_memory.supported_here(), reason="needs x86-64 and /dev/shm"
)

WORLD = 3
# element counts: empty, one, odd, and more than one slot of float32 (several rounds)
SIZES = (0, 1, 1001, SLOT_BYTES // 4 + 4099)
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.float8_e4m3fn)


def _integers(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in every dtype here, and in sums of three): rank-dependent."""
    span = 3 if dtype == torch.float8_e4m3fn else 17
    values = (torch.arange(n) * (rank + 2) + rank) % span - span // 2
    return values.to(dtype)


def _checks(ctx) -> dict:
    coll, rank = ctx.backend.collective, ctx.rank
    ranks = list(range(WORLD))
    fast = coll.new_group(ranks, latency_bound=True)
    plain = coll.new_group(ranks)
    os.environ[SHARED_MEMORY_ENV] = "0"
    switched_off = coll.new_group(ranks, latency_bound=True)
    os.environ.pop(SHARED_MEMORY_ENV)
    # A member that cannot take part (the first cannot create the segment; another
    # cannot map it) leaves the whole group on gloo, agreed by all, and it still works.
    from mtcore.backend import collective as collective_module

    def refuse(*args, **kwargs):
        raise OSError("refused for the test")

    refused = []
    for who, module, name in ((0, shared_memory, "create_segment"),
                              (1, collective_module, "SharedMemoryChannel")):  # fmt: skip
        original = getattr(module, name)
        if rank == who:
            setattr(module, name, refuse)
        try:
            group = coll.new_group(ranks, latency_bound=True)
        finally:
            setattr(module, name, original)
        total = torch.tensor([float(rank)])
        coll.all_reduce(total, group=group)
        refused.append((coll.shared_memory_channel(group) is None, total.item()))
    # A group of the later ranks: its channel names its members by their global ranks
    # (what a stopped member's message says), not by their ranks inside it.
    later = coll.new_group(ranks[1:], latency_bound=True)
    later_channel = coll.shared_memory_channel(later) if rank > 0 else None
    out = {
        "later ranks": later_channel and list(later_channel.global_ranks),
        "channels": [
            coll.shared_memory_channel(g) is not None for g in (fast, plain, switched_off)
        ],
        "refused": refused,
        "mismatches": [],
    }

    def compare(what, fast_result, plain_result):
        if not torch.equal(fast_result.float(), plain_result.float()):
            out["mismatches"].append(what)

    for dtype in DTYPES:
        for n in SIZES:
            x = _integers(rank, n, dtype)
            for op in ("sum", "max", "min") + (("avg",) if dtype.is_floating_point else ()):
                if op == "avg" and dtype != torch.float32:
                    continue  # a mean of integers is not exact in bf16/FP8
                results = []
                for group in (fast, plain):
                    y = x.clone()
                    coll.all_reduce(y, op=op, group=group)
                    results.append(y)
                compare(f"all_reduce {op} {dtype} {n}", *results)
            gathered = []
            for group in (fast, plain):
                y = torch.empty(WORLD * n, dtype=dtype)
                coll.all_gather(y, x, group=group)
                gathered.append(y)
            compare(f"all_gather {dtype} {n}", *gathered)
            full = torch.cat([_integers(rank + k, n, dtype) for k in range(WORLD)])
            scattered = []
            for group in (fast, plain):
                y = torch.empty(n, dtype=dtype)
                coll.reduce_scatter(y, full, group=group)
                scattered.append(y)
            compare(f"reduce_scatter {dtype} {n}", *scattered)

    # all-to-all of rows with uneven splits: one member sends nothing to another, the
    # pair 0 -> 1 needs three rounds (rank 2, outside it, learns that from the headers),
    # a row wider than a member's part of a slot goes through gloo
    width = 64
    part_rows = (SLOT_BYTES - 64) // WORLD // (width * 4)
    sends = [[(s * 3 + d * 5) % 7 for d in range(WORLD)] for s in range(WORLD)]
    sends[0][1], sends[2][0] = 2 * part_rows + 5, 0
    for dtype in DTYPES:
        for row_width in (width, (SLOT_BYTES // WORLD) // dtype.itemsize + 1):
            splits = sends if row_width == width else [[1] * WORLD for _ in range(WORLD)]
            x = _integers(rank, sum(splits[rank]) * row_width, dtype).view(-1, row_width)
            received = [splits[src][rank] for src in range(WORLD)]
            results = []
            for group in (fast, plain):
                y = torch.empty(sum(received), row_width, dtype=dtype)
                coll.all_to_all(y, x, received, splits[rank], group=group)
                results.append(y)
            compare(f"all_to_all {dtype} width {row_width}", *results)
    even = torch.arange(WORLD * 4, dtype=torch.float32) + 100 * rank
    results = []
    for group in (fast, plain):  # no splits: equal parts; output a strided view
        y = torch.empty(2, WORLD * 4)[0]
        coll.all_to_all(y, even, group=group)
        results.append(y)
    compare("all_to_all even strided output", *results)
    out["all_to_all sample"] = results[0].tolist()

    # sends and receives through a p2p group's mailbox, to both neighbours at once:
    # messages larger than a ring (several laps), an empty one, a strided receive (gloo
    # takes contiguous ones only); each
    # rank waits on its sends first (its waits must fill its posted receives meanwhile)
    from mtcore.backend.collective import P2P
    from mtcore.backend.shared_memory_p2p import RING_SLOTS
    from mtcore.backend.shared_memory_p2p import SLOT_BYTES as MAILBOX_SLOT

    boxed = coll.new_group(ranks, p2p=True)
    out["mailbox"] = coll.shared_memory_mailbox(boxed) is not None
    lengths = (RING_SLOTS * MAILBOX_SLOT // 4 + 4099, 0, 1001)

    def message(src, dst, n):
        return torch.arange(n, dtype=torch.float32) * (dst + 1) + 1000 * src

    for group in (boxed, plain):
        ops, expected = [], []
        for peer in ((rank + 1) % WORLD, (rank - 1) % WORLD):
            ops += [P2P("send", message(rank, peer, n), peer, group) for n in lengths]
        for peer in ((rank - 1) % WORLD, (rank + 1) % WORLD):
            for n in lengths:
                target = torch.empty(n, 2)[:, 0] if group is boxed else torch.empty(n)
                ops.append(P2P("recv", target, peer, group))
                expected.append(message(peer, rank, n))
        handles = coll.batch_send_recv(ops)
        for handle in handles:
            handle.wait()
        got = [op.tensor for op in ops if op.kind == "recv"]
        ok = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        out[f"p2p {'mailbox' if group is boxed else 'gloo'}"] = ok
        out["sends completed"] = all(h.is_completed() for h in handles)

    # rounding-dependent sums: the same bits on every rank, whatever the order
    noise = noise_of(rank)
    for dtype in (torch.float32, torch.bfloat16):
        y = noise.to(dtype, copy=True)
        coll.all_reduce(y, group=fast)
        every = torch.empty(WORLD * y.numel(), dtype=dtype)
        coll.all_gather(every, y, group=plain)
        rows = every.view(WORLD, -1)
        out[f"replicated {dtype}"] = all(torch.equal(rows[0], row) for row in rows)
        exact = sum(noise_of(r).to(dtype).double() for r in range(WORLD))
        out[f"error {dtype}"] = (y.double() - exact).abs().max().item()

    y = torch.full((5,), float(rank))
    handle = coll.all_reduce(y, group=fast, async_op=True)
    handle.wait()
    out["async"] = (handle.is_completed(), y.tolist())
    return out


def noise_of(rank: int) -> torch.Tensor:
    """Normal values, one slot and a bit long: a rounding-dependent sum over two rounds."""
    return torch.randn(SLOT_BYTES // 4 + 17, generator=torch.Generator().manual_seed(rank))


def test_the_channel_gives_what_gloo_gives_on_every_op_dtype_and_size():
    results = run_ranks(_checks, WORLD)
    for rank, result in enumerate(results):
        assert result["channels"] == [True, False, False], rank
        assert result["later ranks"] == (list(range(1, WORLD)) if rank else None), rank
        assert result["refused"] == [(True, 3.0), (True, 3.0)], (rank, result["refused"])
        assert result["mismatches"] == [], (rank, result["mismatches"][:5])
        assert result["replicated torch.float32"] and result["replicated torch.bfloat16"]
        assert result["error torch.float32"] < 1e-5
        # bf16 is summed in float32 and rounded once: within half a bf16 ulp of |sum| <= 16
        assert result["error torch.bfloat16"] <= 2**-4, result["error torch.bfloat16"]
        assert result["async"] == (True, [3.0] * 5)
        expected = [float(100 * src + 4 * rank + i) for src in range(WORLD) for i in range(4)]
        assert result["all_to_all sample"] == expected, rank
        assert result["mailbox"] and result["p2p mailbox"] and result["p2p gloo"], rank
        assert result["sends completed"], rank
