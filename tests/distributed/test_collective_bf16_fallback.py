"""The collective fallback for a dtype the library cannot carry, with bf16 on gloo.

A MUSA build for an architecture below 2.2 has no bf16 in MCCL, and the musa backend
then declares bf16 a fallback dtype (tests/plugins/test_musa_wiring.py checks that
declaration). Here a real ``Collective`` over gloo declares the same table, so every
op takes the fallback path: reductions in float32 then cast back (one rounding, where
gloo's own bf16 sum rounds after every addition), data movement as raw bytes (a 1-D
all-to-all with uneven splits and a 0-d broadcast included). A reduce-scatter that only sums (gloo
before torch 2.8) gets MAX and MIN right through an all-reduce. One 3-rank run.
"""

from __future__ import annotations

import dataclasses

import torch

from mtcore.backend import P2P, Collective, CollectiveCapabilities, gloo_capabilities
from mtcore.backend.collective import OPS
from mtcore.testing.distributed import run_ranks

WORLD, N = 3, 4096
BF16 = torch.bfloat16


def _values(rank: int) -> torch.Tensor:
    """bf16 values of magnitude in [2^-4, 2^4]: sums of three are exact in float32, so the
    fallback's result (the float32 sum, rounded once) does not depend on the order."""
    g = torch.Generator().manual_seed(100 + rank)
    x = (torch.randn(N, generator=g) * 4).clamp(-16, 16).to(BF16)
    return torch.where(x.abs() < 2**-4, torch.full_like(x, 0.5), x)


def _all_values() -> torch.Tensor:
    return torch.stack([_values(r) for r in range(WORLD)])  # [WORLD, N]


def _checks(ctx) -> dict:
    rank = ctx.rank
    table = {op: frozenset({BF16}) for op in OPS if op != "barrier"}
    gloo = gloo_capabilities()  # AVG and reduce-scatter MAX/MIN as gloo has them here
    wide = Collective("gloo", dataclasses.replace(gloo, fallback_dtypes=lambda: table))
    native = Collective("gloo", gloo)
    everyone = _all_values()
    exact_sum = everyone.float().sum(0)
    out = {
        "support": [
            wide.support("all_reduce", BF16).value,
            wide.support("all_reduce", torch.float32).value,
        ]
    }

    t = _values(rank)
    wide.all_reduce(t)
    out["sum_is_one_rounding"] = torch.equal(t, exact_sum.to(BF16))
    t = _values(rank)
    native.all_reduce(t)
    out["native_sum_mismatches"] = int((t != exact_sum.to(BF16)).sum())

    t = _values(rank)
    wide.all_reduce(t, op="avg")
    out["avg"] = torch.equal(t, (exact_sum / WORLD).to(BF16))
    t = _values(rank)
    wide.all_reduce(t, op="max")
    out["max"] = torch.equal(t, everyone.max(0).values)
    t = _values(rank)
    handle = wide.all_reduce(t, async_op=True)
    handle.wait()
    out["async_sum"] = torch.equal(t, exact_sum.to(BF16)) and t.dtype == BF16

    shard = torch.empty(N // 4, dtype=BF16)
    full = _values(rank)[: (N // 4) * WORLD]
    wide.reduce_scatter(shard, full)
    lo = rank * (N // 4)
    out["reduce_scatter"] = torch.equal(shard, exact_sum[lo : lo + N // 4].to(BF16))

    # A reduce-scatter that only sums (gloo before torch 2.8): MAX and MIN go through an
    # all-reduce, of which each rank keeps its shard; bf16 through float32 on the way.
    sums_only = Collective(
        "gloo", CollectiveCapabilities(lambda: table, reduce_scatter_ops=frozenset({"sum"}))
    )
    whole = everyone[:, : (N // 4) * WORLD]
    for op, want in (("max", whole.max(0).values), ("min", whole.min(0).values)):
        for dtype, is_async in ((BF16, False), (torch.float32, True)):
            shard = torch.empty(N // 4, dtype=dtype)
            handle = sums_only.reduce_scatter(shard, full.to(dtype), op=op, async_op=is_async)
            if handle is not None:
                handle.wait()
            expected = want[lo : lo + N // 4].to(dtype)
            out[f"reduce_scatter_{op}_{dtype}"] = torch.equal(shard, expected)

    mine = _values(rank).view(64, 64)
    gathered = torch.empty(WORLD * 64, 64, dtype=BF16)
    wide.all_gather(gathered, mine)
    out["all_gather"] = torch.equal(gathered, everyone.view(WORLD * 64, 64))

    scalar = torch.tensor(1.5 + rank, dtype=BF16)  # 0-d: no last dim to reinterpret
    wide.broadcast(scalar, src=1)
    out["broadcast_0d"] = scalar.item() == 2.5 and scalar.dtype == BF16

    # Rank r sends (r + 1) * (peer + 1) elements to each peer: uneven 1-D splits.
    send_splits = [(rank + 1) * (peer + 1) for peer in range(WORLD)]
    recv_splits = [(peer + 1) * (rank + 1) for peer in range(WORLD)]
    send = torch.cat([torch.full((n,), float(10 * rank + peer), dtype=BF16)
                      for peer, n in enumerate(send_splits)])  # fmt: skip
    recv = torch.empty(sum(recv_splits), dtype=BF16)
    wide.all_to_all(recv, send, output_splits=recv_splits, input_splits=send_splits)
    expected = torch.cat([torch.full((n,), float(10 * peer + rank), dtype=BF16)
                          for peer, n in enumerate(recv_splits)])  # fmt: skip
    out["all_to_all_1d_uneven"] = torch.equal(recv, expected)

    right, left = (rank + 1) % WORLD, (rank - 1) % WORLD
    outgoing = _values(rank)[:7]
    incoming = torch.empty(7, dtype=BF16)
    for h in wide.batch_send_recv([P2P("send", outgoing, right), P2P("recv", incoming, left)]):
        h.wait()
    out["send_recv"] = torch.equal(incoming, _values(left)[:7])
    return out


def test_bf16_declared_fallback_reduces_in_float32_and_moves_bytes():
    results = run_ranks(_checks, WORLD)
    for rank, r in enumerate(results):
        assert r["support"] == ["fallback", "native"]
        for key in [k for k in r if k.startswith("reduce_scatter_m")]:
            assert r[key] is True, (rank, key)
        assert len([k for k in r if k.startswith("reduce_scatter_m")]) == 4
        for key in ("sum_is_one_rounding", "avg", "max", "async_sum", "reduce_scatter",
                    "all_gather", "broadcast_0d", "all_to_all_1d_uneven", "send_recv"):  # fmt: skip
            assert r[key] is True, (rank, key)
    # gloo's own bf16 sum rounds after each addition: the same data gives other numbers,
    # so the one-rounding result above is the fallback's work, not gloo's.
    assert all(r["native_sum_mismatches"] > 0 for r in results)
