"""ZeRO-3 checkpoints: exact resume, and resharding between ZeRO stages and layouts
(2 ranks, dp2).

The checkpoint format is layout-neutral; under ``parallel.zero: 3`` the blocks' params
are gathered whole for the save and the loaded weights written back into the shards.
So a checkpoint saved under zero 3 continues under zero 1, at pp2 and in one process,
and one saved under zero 0 continues under zero 3 (``test_zero2_checkpoints``'s round
trip: the real trainer loop on gloo ranks; resume under the same layout is bitwise,
across stages and layouts within ``RESHARD_RTOL``).
"""

from __future__ import annotations

import pytest

from tests.distributed import test_checkpoint_layouts as layouts
from tests.distributed.test_zero2_checkpoints import check_stage_round_trip

# ZeRO-1 checkpoints are in the default suite: CI runs this file after make test (make
# test-extended).
pytestmark = pytest.mark.extended

job = layouts.job  # the fixture: a corpus and the job configs


def test_zero3_resumes_bitwise_and_reshards_to_zero1_pp2_and_one_process_and_back(job):
    check_stage_round_trip(job, 3, {"pp": 2})
