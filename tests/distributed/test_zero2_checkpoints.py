"""ZeRO-2 checkpoints: exact resume, and resharding between ZeRO stages (2 ranks, dp2).

The checkpoint format is layout-neutral (each parameter's whole optimizer state; ZeRO
shards are gathered at save and cut at load), so a checkpoint saved under
``parallel.zero: 2`` continues under zero 1, zero 0 and in one process, and one saved
under zero 0 continues under zero 2. The real trainer loop on gloo ranks
(``test_checkpoint_layouts``'s jobs): resume under the same layout is bitwise; across
stages the losses equal the unbroken run's within ``RESHARD_RTOL`` (reduction order
differs, as between layouts). ``check_stage_round_trip`` serves ZeRO-3 too.
"""

from __future__ import annotations

import io

import pytest

from mtcore.testing.distributed import run_ranks
from mtcore.training.overrides import validate
from mtcore.training.trainer import train
from tests.distributed import test_checkpoint_layouts as layouts
from tests.distributed.test_checkpoint_layouts import _check_reshard, _resume, _run_jobs

# ZeRO-1 checkpoints are in the default suite: CI runs this file after make test (make
# test-extended).
pytestmark = pytest.mark.extended

job = layouts.job  # the fixture: a corpus and the job configs


def check_stage_round_trip(job, stage: int, other: dict) -> None:
    """Under dp2 at ZeRO ``stage``: resume bitwise; continue under ZeRO-1, under the
    layout ``other`` and in one process; and a ZeRO-0 checkpoint continues at ``stage``."""
    root, make = job
    mine, zero1, zero0 = {"dp": 2, "zero": stage}, {"dp": 2, "zero1": True}, {"dp": 2}
    source, z0_source = root / "mine" / "checkpoints", root / "z0" / "checkpoints"
    jobs = [
        make("mine", mine),
        _resume(make, "resumed", mine, source),
        _resume(make, "to_z1", zero1, source),
        _resume(make, "to_other", other, source),
        make("z0", zero0),
        _resume(make, "z0_to_mine", mine, z0_source),
    ]
    results = run_ranks(_run_jobs, 2, jobs)[0]
    (whole, _, _), resumed, to_z1, to_other, (z0_whole, _, _), z0_to_mine = results

    assert resumed[1] == 3 and "RNG streams restored" in resumed[2]
    assert resumed[0] == whole[3:]  # bitwise
    _check_reshard(whole, to_z1, f"dp2 zero{stage} -> dp2 zero1")
    _check_reshard(whole, to_other, f"dp2 zero{stage} -> {other}")
    _check_reshard(z0_whole, z0_to_mine, f"dp2 zero0 -> dp2 zero{stage}")
    assert f"(zero={stage}) -> 2 ranks (zero=None)" in to_z1[2], to_z1[2]  # the reshard is named

    stream = io.StringIO()
    one = train(validate(_resume(make, "to_one", {}, source)), stream=stream)
    _check_reshard(whole, (one.losses, one.start_step, stream.getvalue()), f"zero{stage} -> one")


def test_zero2_resumes_bitwise_and_reshards_to_zero1_zero0_and_back(job):
    check_stage_round_trip(job, 2, {"dp": 2})
