"""benchmarks/bench_megatron.py's new configurations build and train one step on both
sides (mtcore's engine and Megatron-Core 0.16.1 on CPU ranks, the benchmark's own
shapes), each side's first loss where an untrained model starts (T5: both sides draw
T5's initialisation, so their first losses agree), and the dp2-distopt
report says which optimizer Megatron's side runs. Slow: one spawn of 2-4 ranks per
configuration (Megatron's import alone takes seconds a rank); the quick checks of the
package are tests/unit/test_bench_megatron.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_megatron

NEW = ("pp2", "pp2-tp2", "moe-ep2", "bert-tp2", "t5-tp2", "dp2-distopt")
ONE_STEP = ["--rounds", "1", "--steps-per-round", "1", "--warmup", "1", "--phase-steps", "1"]
ONE_STEP += ["--profile-steps", "0", "--ce-reps", "0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_a_new_configuration_trains_a_step_on_both_sides(name):
    res = bench_megatron.run_config(name, bench_megatron.parse_args(ONE_STEP))
    start = math.log(1024) + (math.log(2) if name == "bert-tp2" else 0.0)
    for side in ("mtcore", "megatron"):
        first, second = res["losses"][side]
        assert math.isfinite(second) and abs(first - start) < 0.7, (side, res["losses"])
        assert res["round_times"][side][0] > 0 and res["phases"][side]["step"] > 0
    if name == "t5-tp2":  # T5's init starts above ln V (its LM head's std is h^-0.5)
        assert abs(res["losses"]["mtcore"][0] - res["losses"]["megatron"][0]) < 0.15, res
    if name == "dp2-distopt":
        assert res["note"] == "" or "DistributedOptimizer refused" in res["note"]
