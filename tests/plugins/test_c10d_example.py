"""The c10d example of the plugin author guide (docs/examples/c10d-backend/toyccl.py) runs:
a backend registered by name with torch.distributed.Backend.register_backend carries every
operation of mtcore's Collective on 2 ranks, and each call reaches it (none goes to gloo
behind its back)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "c10d-backend" / "toyccl.py"


@pytest.mark.skipif(
    torch.__version__ < "2.8",
    reason="torch < 2.8 cannot run a Python ProcessGroup's all_gather_into_tensor: its "
    "PyProcessGroup has no override for _allgather_base ('No backend type associated with "
    "device type cpu'); a c10d backend for torch 2.7.1 is a C++ extension",
)
def test_toyccl_carries_every_collective_of_mtcore():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=180, env=env
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    got = json.loads(result.stdout.strip().splitlines()[-1])

    assert got["backend"] == "toyccl"
    assert got["all_reduce"] == {"avg": [1.5, 1.5], "async sum": [2.0, 2.0]}
    assert got["all_gather"] == [0.0, 0.0, 1.0, 1.0]
    assert got["reduce_scatter"] == [0.0]  # rank 0's shard of [0, 1] + [0, 1]
    assert got["broadcast"] == [1.0, 1.0]  # from rank 1
    assert got["all_to_all"] == [0.0, 1.0]
    assert got["send_recv"] == [1.0]  # from rank 1 round the ring
    assert got["broadcast float8"] == [2.0] * 4  # rank 0's values, moved as bytes
    assert got["subgroup all_reduce"] == [2.0]
    assert got["calls"] == {
        "world": {
            "allreduce": 2,
            "all_gather_single": 1,
            "reduce_scatter_single": 1,
            "broadcast": 2,
            "all_to_all_single": 1,
            "send": 1,
            "recv": 1,
            "barrier": 1,
        },
        "subgroup": {"allreduce": 1},  # new_group built a second toyccl group
    }
