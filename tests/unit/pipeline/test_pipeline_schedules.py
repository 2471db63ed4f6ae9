"""Schedules as data: orders against hand-derived lists, in-flight bounds, and the
simulator's verdict (no deadlock, no message mix-up, bubble = theory)."""

from __future__ import annotations

import itertools

import pytest

from mtcore.parallel.pipeline import (
    ScheduleError,
    build_schedule,
    gpipe,
    interleaved_1f1b,
    no_pipelining,
    one_f_one_b,
    simulate,
)
from mtcore.parallel.pipeline.schedules import FORWARD, Action, counterpart, peer, with_transfers
from mtcore.parallel.pipeline.simulate import MODES


def order(schedule, rank):
    chunks = schedule.vpp > 1
    return " ".join(a.label(chunks) for a in schedule.compute_order(rank))


def full(schedule, rank):
    """The rank's list with each fused batch in brackets."""
    out = []
    for batch, compute in schedule.steps(rank):
        if batch:
            out.append("[" + " ".join(a.label(schedule.vpp > 1) for a in batch) + "]")
        if compute:
            out.append(compute.label(schedule.vpp > 1))
    return " ".join(out)


# -- hand-derived orders ----------------------------------------------------------------
def test_no_pipelining_is_gradient_accumulation():
    s = no_pipelining(3)
    assert full(s, 0) == "F0 B0 F1 B1 F2 B2"


def test_1f1b_pp2_m4_with_comm():
    s = one_f_one_b(2, 4)
    assert full(s, 0) == "F0 [sF0] F1 [sF1 rB0] B0 F2 [sF2 rB1] B1 F3 [sF3 rB2] B2 [rB3] B3"
    assert full(s, 1) == "[rF0] F0 B0 [sB0 rF1] F1 B1 [sB1 rF2] F2 B2 [sB2 rF3] F3 B3 [sB3]"


def test_1f1b_pp4_orders():
    s = one_f_one_b(4, 8)
    assert order(s, 0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert order(s, 1) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert order(s, 2) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert order(s, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    s = one_f_one_b(4, 4)
    assert order(s, 0) == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert order(s, 1) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert order(one_f_one_b(4, 2), 0) == "F0 F1 B0 B1"  # warmup capped at m


def test_interleaved_pp2_v2_m4():
    s = interleaved_1f1b(2, 2, 4)
    assert order(s, 0) == (
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
    )
    assert order(s, 1) == (
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
    )
    # Megatron's send_forward_backward_recv_forward_backward after each (F, B) unit:
    assert full(s, 0).startswith(
        "F0.0 [sF0.0] F1.0 [sF1.0 rF0.1] F0.1 [sF0.1 rF1.1] F1.1 [sF1.1 rB0.1] F2.0 B0.1 "
        "[sF2.0 sB0.1 rB1.1] F3.0 B1.1 [sF3.0 sB1.1 rF2.1 rB0.0] F2.1 B0.0"
    )


def test_interleaved_pp4_v2_m8_rank0():
    s = interleaved_1f1b(4, 2, 8)
    warmup = "F0.0 F1.0 F2.0 F3.0 F0.1 F1.1 F2.1 F3.1 F4.0 F5.0"  # 2 (pp-1) + (v-1) pp = 10
    steady = "F6.0 B0.1 F7.0 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0.0 F7.1 B1.0"
    cooldown = "B2.0 B3.0 B4.1 B5.1 B6.1 B7.1 B4.0 B5.0 B6.0 B7.0"
    assert order(s, 0) == f"{warmup} {steady} {cooldown}"
    assert order(s, 3).startswith("F0.0 F1.0 F2.0 F3.0 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1")


def test_interleaved_with_m_equal_pp_is_all_warmup():
    s = interleaved_1f1b(4, 2, 4)
    for r in range(4):
        names = order(s, r).split()
        assert all(n.startswith("F") for n in names[:8]) and all(n.startswith("B") for n in names[8:])


# -- errors and tables ------------------------------------------------------------------------
def test_interleaved_needs_microbatches_multiple_of_pp():
    with pytest.raises(ScheduleError, match=r"micro-batches \(6\).*multiple of pp \(4\)"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ScheduleError, match="pp >= 2"):
        interleaved_1f1b(1, 2, 4)
    with pytest.raises(ScheduleError, match="no_pipelining runs one stage"):
        build_schedule("no_pipelining", 2, 4)
    with pytest.raises(ScheduleError, match="unknown schedule"):
        build_schedule("zb", 2, 4)
    assert build_schedule("1f1b", 2, 4, vpp=2).name == "interleaved_1f1b"


def test_table_is_readable():
    text = one_f_one_b(2, 4).table()
    lines = text.splitlines()
    assert lines[0] == "1f1b: pp=2 vpp=1 microbatches=4"
    assert "rank 0" in lines[1] and "rank 1" in lines[1]
    assert "[sF1 rB0] B0" in text and "[sB3]" in text
    assert str(interleaved_1f1b(2, 2, 4)).count("\n") == 3 + 17 - 1


# -- in-flight bound ----------------------------------------------------------------------
@pytest.mark.parametrize("pp,m", list(itertools.product((2, 3, 4), (1, 2, 4, 8))))
def test_1f1b_in_flight_never_exceeds_pp(pp, m):
    s = one_f_one_b(pp, m)
    assert s.max_in_flight(0) == min(pp, m)
    assert all(s.max_in_flight(r) == min(pp - r, m) for r in range(pp))
    assert gpipe(pp, m).max_in_flight(0) == m  # what 1F1B saves


def test_every_microbatch_runs_once_per_chunk():
    for s in (one_f_one_b(4, 8), interleaved_1f1b(2, 3, 4), gpipe(3, 5), no_pipelining(4)):
        for r in range(s.pp):
            comp = s.compute_order(r)
            want = {(k, mb, c) for k in ("forward", "backward") for mb in range(s.microbatches) for c in range(s.vpp)}
            assert {(a.kind, a.microbatch, a.chunk) for a in comp} == want and len(comp) == len(want)


# -- simulation: deadlock-free, ordered messages, bubble as theory ----------------------------
SIM_CASES = [(p, m, v) for p in (2, 3, 4) for m in (1, 2, 3, 4, 6, 8, 12) for v in (1, 2, 3) if v == 1 or m % p == 0]


@pytest.mark.parametrize("mode", MODES)
def test_schedules_run_in_every_transport_mode(mode):
    for p, m, v in SIM_CASES:
        s = one_f_one_b(p, m) if v == 1 else interleaved_1f1b(p, v, m)
        for split in (False, True):
            t = simulate(s, mode=mode, split_directions=split)
            theory = (p - 1) / (v * m + p - 1)
            assert all(abs(t.idle_share(r) - theory) < 1e-9 for r in range(p)), (p, m, v, mode)
        simulate(gpipe(p, m), mode=mode)


def test_sending_between_f_and_b_would_deadlock_interleaving():
    """Why interleaving posts its transfers after each (F, B) unit, as Megatron does."""
    s = interleaved_1f1b(2, 2, 4)
    units = [[(a,) for a in s.compute_order(r)] for r in range(2)]
    eager = with_transfers("eager", units, 2, 2, 4)
    simulate(eager, mode="async")  # gloo would survive it ...
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate(eager, mode="strict", split_directions=False)  # ... NCCL would not


def test_simulator_catches_message_mix_up():
    good = one_f_one_b(2, 2)
    r1 = list(good.actions[1])
    i, j = r1.index(Action("recv_fwd", 0)), r1.index(Action("recv_fwd", 1))
    r1[i], r1[j] = r1[j], r1[i]
    bad = type(good)("bad", 2, 1, 2, (good.actions[0], tuple(r1)))
    with pytest.raises(ScheduleError, match=r"mismatch|never posted"):
        simulate(bad)


def test_gantt_shows_the_bubble():
    t = simulate(one_f_one_b(4, 8))
    assert t.makespan == 33  # (m + p - 1) (f + b)
    assert t.gantt().splitlines()[0].startswith("rank 0: 0123......aa4bb5")
    assert [a.kind for a, *_ in t.compute[3][:2]] == [FORWARD, "backward"]


def _most_sends_held(schedule, rank) -> int:
    """Sends a runner holds at once on ``rank`` when it lets go of each as soon as a
    receive proves it delivered (``Schedule.delivered_by``), the rest at the step's end."""
    proven, held, most = schedule.delivered_by(rank), set(), 0
    for action in schedule.for_rank(rank):
        if action.kind in ("send_fwd", "send_bwd"):
            held.add(action)
            most = max(most, len(held))
        elif action.kind in ("recv_fwd", "recv_bwd"):
            held -= set(proven.get(action, ()))
    return most


@pytest.mark.parametrize(
    "name,pp,vpp,m",
    [("1f1b", 2, 1, 8), ("1f1b", 4, 1, 16), ("interleaved_1f1b", 2, 2, 8),
     ("interleaved_1f1b", 4, 2, 16), ("gpipe", 2, 1, 8)],
)  # fmt: skip
def test_sent_tensors_are_let_go_of_as_receives_prove_them_delivered(name, pp, vpp, m):
    """Every proof is sound (the peer consumed the send before posting the proving
    message) and enough of them exist that a 1F1B rank holds about its in-flight
    micro-batches' sends, not one per micro-batch; GPipe's forwards all go before any
    backward returns, so it holds them all."""
    schedule = build_schedule(name, pp, m, vpp)
    for rank in range(pp):
        total = sum(a.kind in ("send_fwd", "send_bwd") for a in schedule.for_rank(rank))
        for receive, sends in schedule.delivered_by(rank).items():
            other = peer(receive, rank, pp)
            theirs = schedule.for_rank(other)
            proof = theirs.index(counterpart(receive, rank, pp))
            for send in sends:
                matching = counterpart(send, rank, pp)
                kind = FORWARD if matching.kind == "recv_fwd" else "backward"
                consumer = theirs.index(Action(kind, matching.microbatch, matching.chunk))
                assert theirs.index(matching) < consumer < proof, (name, rank, send, receive)
        most = _most_sends_held(schedule, rank)
        if name == "gpipe":
            assert most >= m - 1 or rank == pp - 1
        else:
            assert most <= schedule.max_in_flight(rank) + 1 < total, (name, rank, most, total)
