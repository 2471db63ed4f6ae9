"""The rank harness reports a rank that hangs with where its threads were."""

from __future__ import annotations

import time

import pytest

from mtcore.testing.distributed import RankFailure, run_ranks


def _rank_one_waits_in_here(ctx):
    if ctx.rank == 1:
        while True:  # stands for a rank stuck in a call that never returns
            time.sleep(0.05)
    return ctx.rank


def test_a_hung_rank_is_reported_with_its_stack():
    with pytest.raises(RankFailure) as caught:
        run_ranks(_rank_one_waits_in_here, 2, timeout_s=6)
    report = str(caught.value)
    assert "rank 1:\ntimed out after 6 s; its threads were at:" in report
    assert "_rank_one_waits_in_here" in report  # the frame it was stuck in
    # rank 0 returned and waits for rank 1 in the harness's closing barrier
    rank0 = report.split("rank 1:")[0]
    assert "timed out after 6 s; its threads were at:" in rank0
    assert " in barrier" in rank0
