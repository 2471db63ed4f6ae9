"""ZB-H1 and its interleaved form as data: orders against hand-derived lists, memory,
no deadlock in any transport mode, and the paper's bubble (p - 1)(F + B - W) (over v
when interleaved) in the simulator."""

from __future__ import annotations

import itertools

import pytest

from mtcore.parallel.pipeline import (
    ScheduleError,
    build_schedule,
    interleaved_1f1b,
    interleaved_zb,
    one_f_one_b,
    simulate,
    zb_h1,
)
from mtcore.parallel.pipeline.simulate import MODES


def order(schedule, rank):
    return " ".join(a.label() for a in schedule.compute_order(rank))


def test_zb_h1_pp4_orders():
    s = zb_h1(4, 8)
    assert order(s, 0) == (
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    )
    assert order(s, 3) == (
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    )
    # W needs no transfer: before it a rank only posts the gradient of the B just run
    for rank in range(4):
        for batch, compute in s.steps(rank):
            if compute is not None and compute.kind == "weight":
                assert all(a.kind == "send_bwd" for a in batch), (rank, batch)


def test_zb_h1_pp2_with_transfers():
    s = zb_h1(2, 3)
    text = " ".join(
        ("[" + " ".join(a.label() for a in b) + "] " if b else "") + (c.label() if c else "")
        for b, c in s.steps(1)
    )
    assert text == "[rF0] F0 B0 [sB0 rF1] F1 B1 [sB1] W0 [rF2] F2 B2 [sB2] W1 W2"


@pytest.mark.parametrize("pp,m", list(itertools.product((2, 3, 4), (1, 2, 4, 8))))
def test_zb_h1_holds_1f1b_rank0_memory_on_every_rank(pp, m):
    s = zb_h1(pp, m)
    for r in range(pp):
        assert s.max_in_flight(r) == min(pp, m), (pp, m, r)
        kinds = [(a.kind, a.microbatch) for a in s.compute_order(r)]
        for mb in range(m):  # F before B before W, each once
            assert (
                kinds.index(("forward", mb))
                < kinds.index(("backward", mb))
                < kinds.index(("weight", mb))
            )
        assert len(kinds) == 3 * m
    assert s.splits_backward and not one_f_one_b(pp, m).splits_backward


@pytest.mark.parametrize("mode", MODES)
def test_zb_h1_runs_in_every_transport_mode_with_the_papers_bubble(mode):
    for p, m in itertools.product((2, 3, 4), (4, 6, 8, 12)):
        for split in (False, True):
            s = zb_h1(p, m)
            # F = B = W = 1: ZB-H1 idles (p - 1)(F + B - W), 1F1B (p - 1)(F + B + W)
            t = simulate(s, forward=1, backward=2, weight=1, mode=mode, split_directions=split)
            assert all(abs(t.idle(r) - (p - 1)) < 1e-9 for r in range(p)), (p, m, mode)
            ref = simulate(one_f_one_b(p, m), forward=1, backward=2, mode=mode)
            assert all(abs(ref.idle(r) - 3 * (p - 1)) < 1e-9 for r in range(p))
    # a W half the B: the bubble is (p - 1)(F + B - W) as long as W fits the gaps
    t = simulate(zb_h1(4, 8), forward=2, backward=3, weight=1)
    assert abs(t.idle(0) - 3 * (2 + 2 - 1)) < 1e-9


def test_zb_h1_build_and_gantt():
    assert build_schedule("zb_h1", 4, 8) == zb_h1(4, 8)
    with pytest.raises(ScheduleError, match="vpp=2"):
        build_schedule("zb_h1", 2, 4, vpp=2)
    gantt = simulate(zb_h1(4, 8), forward=1, backward=2, weight=1).gantt()
    assert gantt.splitlines()[0] == "rank 0: 0123...aA4bB5cC6dD7eEfFgGhH"


def test_parallel_config_takes_zb_h1_with_one_chunk():
    from pydantic import ValidationError

    from mtcore.training.config import ParallelConfig

    assert ParallelConfig(pp=4, schedule="zb_h1").schedule == "zb_h1"
    with pytest.raises(ValidationError, match="zb_h1 runs one chunk per rank"):
        ParallelConfig(pp=2, vpp=2, schedule="zb_h1")
    with pytest.raises(ValidationError, match="zb_v"):
        ParallelConfig(pp=2, schedule="zb_v")  # ZB-V is not built: refused by name


INTERLEAVED_CASES = [(p, v, m) for p in (2, 3, 4) for v in (2, 3) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("mode", MODES)
def test_interleaved_zb_runs_in_every_transport_mode_with_less_bubble(mode):
    """gloo ("async"): (p - 1)(F + B - W) / v once m > p, against interleaving's
    (p - 1)(F + B + W) / v; where a wait covers a whole fused call (NCCL's worst case)
    a W can hold up a gradient's call: more idle than that, still less than interleaving
    (pp 4, v 2: 2.5 time units against 4.5; async 1.5)."""
    for p, v, m in INTERLEAVED_CASES:
        s = interleaved_zb(p, v, m)
        for split in (False, True):
            t = simulate(s, forward=1, backward=2, weight=1, mode=mode, split_directions=split)
            ref = simulate(interleaved_1f1b(p, v, m), forward=1, backward=2, mode=mode)
            for r in range(p):
                assert t.idle(r) < ref.idle(r) - 1e-9, (p, v, m, mode, r)
                if mode == "async" and m > p:
                    assert abs(t.idle(r) - (p - 1) / v) < 1e-9, (p, v, m, r)
    strict = simulate(interleaved_zb(4, 2, 8), forward=1, backward=2, weight=1, mode="strict")
    assert abs(strict.idle(0) - 2.5) < 1e-9


@pytest.mark.parametrize("p,v,m", INTERLEAVED_CASES)
def test_interleaved_zb_holds_at_most_interleavings_rank0_peak(p, v, m):
    s, ref = interleaved_zb(p, v, m), interleaved_1f1b(p, v, m)
    assert s.name == "interleaved_zb" and s.splits_backward
    for r in range(p):
        assert ref.max_in_flight(r) <= s.max_in_flight(r) <= ref.max_in_flight(0), r
        kinds = [(a.kind, a.microbatch, a.chunk) for a in s.compute_order(r)]
        assert len(kinds) == len(set(kinds)) == 3 * m * v
        for _, mb, c in [k for k in kinds if k[0] == "weight"]:
            assert kinds.index(("backward", mb, c)) < kinds.index(("weight", mb, c))
        # the forwards and backwards keep interleaving's order
        plain = [k for k in kinds if k[0] != "weight"]
        assert plain == [(a.kind, a.microbatch, a.chunk) for a in ref.compute_order(r)]
    assert build_schedule("interleaved_zb", p, m, v) == s


def test_interleaved_zb_needs_chunks_and_config_agrees():
    from pydantic import ValidationError

    from mtcore.training.config import ParallelConfig

    with pytest.raises(ScheduleError, match="vpp > 1"):
        build_schedule("interleaved_zb", 2, 4)
    assert ParallelConfig(pp=2, vpp=2, schedule="interleaved_zb").schedule == "interleaved_zb"
    with pytest.raises(ValidationError, match="interleaved_zb needs vpp > 1"):
        ParallelConfig(pp=2, schedule="interleaved_zb")
