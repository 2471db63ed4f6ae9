"""ZeRO-3 checkpoints: exact resume, and resharding between ZeRO stages (2 ranks, dp2).

The checkpoint format is layout-neutral; under ``parallel.zero: 3`` the blocks' params
are gathered whole for the save and the loaded weights written back into the shards.
So a checkpoint saved under zero 3 continues under zero 1, at pp2 and in one process,
and one saved under zero 0 continues under zero 3. The real trainer loop on gloo ranks
(``test_checkpoint_layouts``'s jobs): resume under the same layout is bitwise; across
stages the losses equal the unbroken run's within ``RESHARD_RTOL``.
"""

from __future__ import annotations

import io

from mtcore.testing.distributed import run_ranks
from mtcore.training.overrides import validate
from mtcore.training.trainer import train
from tests.distributed import test_checkpoint_layouts as layouts
from tests.distributed.test_checkpoint_layouts import _check_reshard, _resume, _run_jobs

job = layouts.job  # the fixture: a corpus and the job configs


def test_zero3_resumes_bitwise_and_reshards_to_zero1_pp2_and_one_process_and_back(job):
    root, make = job
    zero3, zero1, zero0 = {"dp": 2, "zero": 3}, {"dp": 2, "zero": 1}, {"dp": 2}
    z3_source, z0_source = root / "z3" / "checkpoints", root / "z0" / "checkpoints"
    jobs = [
        make("z3", zero3),
        _resume(make, "z3_resumed", zero3, z3_source),
        _resume(make, "z3_to_z1", zero1, z3_source),
        _resume(make, "z3_to_pp2", {"pp": 2}, z3_source),
        make("z0", zero0),
        _resume(make, "z0_to_z3", zero3, z0_source),
    ]
    results = run_ranks(_run_jobs, 2, jobs)[0]
    (z3_whole, _, _), z3_resumed, to_z1, to_pp2, (z0_whole, _, _), z0_to_z3 = results

    assert z3_resumed[1] == 3 and "RNG streams restored" in z3_resumed[2]
    assert z3_resumed[0] == z3_whole[3:]  # bitwise
    _check_reshard(z3_whole, to_z1, "dp2 zero3 -> dp2 zero1")
    _check_reshard(z3_whole, to_pp2, "dp2 zero3 -> pp2")
    _check_reshard(z0_whole, z0_to_z3, "dp2 zero0 -> dp2 zero3")
    assert "(zero=3) -> 2 ranks (zero=None)" in to_z1[2], to_z1[2]  # the reshard is named

    stream = io.StringIO()
    one = train(validate(_resume(make, "z3_to_one", {}, z3_source)), stream=stream)
    _check_reshard(z3_whole, (one.losses, one.start_step, stream.getvalue()), "zero3 -> one")
