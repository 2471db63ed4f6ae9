"""ZeRO-2 checkpoints: exact resume, and resharding between ZeRO stages (2 ranks, dp2).

The checkpoint format is layout-neutral (each parameter's whole optimizer state; ZeRO
shards are gathered at save and cut at load), so a checkpoint saved under
``parallel.zero: 2`` continues under zero 1, zero 0 and in one process, and one saved
under zero 0 continues under zero 2. The real trainer loop on gloo ranks
(``test_checkpoint_layouts``'s jobs): resume under the same layout is bitwise; across
stages the losses equal the unbroken run's within ``RESHARD_RTOL`` (reduction order
differs, as between layouts).
"""

from __future__ import annotations

import io

from mtcore.testing.distributed import run_ranks
from mtcore.training.overrides import validate
from mtcore.training.trainer import train
from tests.distributed import test_checkpoint_layouts as layouts
from tests.distributed.test_checkpoint_layouts import _check_reshard, _resume, _run_jobs

job = layouts.job  # the fixture: a corpus and the job configs


def test_zero2_resumes_bitwise_and_reshards_to_zero1_zero0_and_back(job):
    root, make = job
    zero2, zero1, zero0 = {"dp": 2, "zero": 2}, {"dp": 2, "zero1": True}, {"dp": 2}
    z2_source, z0_source = root / "z2" / "checkpoints", root / "z0" / "checkpoints"
    jobs = [
        make("z2", zero2),
        _resume(make, "z2_resumed", zero2, z2_source),
        _resume(make, "z2_to_z1", zero1, z2_source),
        _resume(make, "z2_to_z0", zero0, z2_source),
        make("z0", zero0),
        _resume(make, "z0_to_z2", zero2, z0_source),
    ]
    results = run_ranks(_run_jobs, 2, jobs)[0]
    (z2_whole, _, _), z2_resumed, to_z1, to_z0, (z0_whole, _, _), z0_to_z2 = results

    assert z2_resumed[1] == 3 and "RNG streams restored" in z2_resumed[2]
    assert z2_resumed[0] == z2_whole[3:]  # bitwise
    _check_reshard(z2_whole, to_z1, "dp2 zero2 -> dp2 zero1")
    _check_reshard(z2_whole, to_z0, "dp2 zero2 -> dp2 zero0")
    _check_reshard(z0_whole, z0_to_z2, "dp2 zero0 -> dp2 zero2")
    assert "zero=2" in to_z0[2] and "zero=None" in to_z0[2], to_z0[2]  # the reshard is named

    stream = io.StringIO()
    one = train(validate(_resume(make, "z2_to_one", {}, z2_source)), stream=stream)
    _check_reshard(z2_whole, (one.losses, one.start_step, stream.getvalue()), "zero2 -> one")
