"""``mtcore trace merge`` places the ranks of one host on the host's own clock (exact)
and aligns hosts at the barrier; traces without that clock align at the barrier."""

from __future__ import annotations

from mtcore.training.trace_format import PHASES_TID, TRACE_KEY
from mtcore.training.trace_merge import merge

MONOTONIC = "clock_gettime(CLOCK_MONOTONIC)"


def _trace(rank: int, host: str, sync_us: float, clock_ns: int | None, clock=MONOTONIC):
    """One rank's trace: a phase that starts at its own sync mark."""
    info = {"rank": rank, "world": 4, "host": host, "device": "cpu", "steps": [1],
            "sync_us": sync_us, "torch_profiler": False}  # fmt: skip
    if clock_ns is not None:
        info |= {"sync_clock_ns": clock_ns, "clock": clock}
    phase = {"ph": "X", "name": "forward mb0 c0", "pid": 1, "tid": PHASES_TID,
             "ts": sync_us, "dur": 10.0, "args": {"category": "forward"}}  # fmt: skip
    return {"traceEvents": [phase], TRACE_KEY: info}


def _starts(merged) -> dict[int, float]:
    return {e["pid"]: e["ts"] for e in merged["traceEvents"] if e.get("ph") == "X"}


def test_one_hosts_ranks_keep_their_clock_and_hosts_meet_at_the_barrier():
    merged = merge([
        _trace(0, "node-a", sync_us=1_000.0, clock_ns=50_000_000),
        _trace(1, "node-a", sync_us=9_999.0, clock_ns=55_000_000),  # left 5 ms later
        _trace(2, "node-b", sync_us=123.0, clock_ns=7_000_000),
        _trace(3, "node-b", sync_us=456.0, clock_ns=7_250_000),  # 0.25 ms later
    ])  # fmt: skip
    starts = _starts(merged)
    assert starts[1] - starts[0] == 5_000.0
    assert starts[3] - starts[2] == 250.0
    assert starts[2] == starts[0]  # each host's first rank at the barrier's instant
    assert "one clock per host" in merged[TRACE_KEY]["aligned_at"]


def test_a_host_without_the_monotonic_clock_aligns_rank_by_rank_at_the_barrier():
    merged = merge([
        _trace(0, "node-a", sync_us=1_000.0, clock_ns=50_000_000),
        _trace(1, "node-a", sync_us=2_000.0, clock_ns=None),  # written before the clock
        _trace(2, "node-b", sync_us=3_000.0, clock_ns=1_000, clock="mach_absolute_time()"),
        _trace(3, "node-b", sync_us=4_000.0, clock_ns=9_000_000, clock="mach_absolute_time()"),
    ])  # fmt: skip
    assert set(_starts(merged).values()) == {0.0}
