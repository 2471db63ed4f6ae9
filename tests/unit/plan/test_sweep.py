"""``mtcore sweep``: the trainer's log lines parsed, bad input refused before any run, and
(slow) one real layout measured beside its prediction."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mtcore.cli.main import main
from mtcore.plan.sweep import parse_log

LOG = """\
rank 0: GPT (llama) 0.77M params
step 1/3 | loss 8.3000 | lr 2.00e-04 | grad norm 1.000 | 9,000 tokens/s | 0.010 TFLOP/s/rank | MFU n/a | mem 300.5 MiB | 0.90 s/step
step 2/3 | loss 8.2000 | lr 4.00e-04 | grad norm 1.000 | 9,000 tokens/s | 0.010 TFLOP/s/rank | MFU n/a | mem 350.0 MiB | 0.40 s/step
step 3/3 | loss 8.1000 | lr 6.00e-04 | grad norm 1.000 | 9,000 tokens/s | 0.010 TFLOP/s/rank | MFU n/a | mem 1.5 GiB | 0.50 s/step
"""


def test_parse_log_skips_the_warm_up_step_and_takes_the_peak():
    step_s, peak = parse_log(LOG)
    assert step_s == pytest.approx(0.45)
    assert peak == pytest.approx(1.5 * 1024**3)
    assert parse_log("no steps here") == (None, None)


def test_a_rejected_layout_stops_before_any_run(capsys):
    code = main(
        ["sweep", "configs/default.yaml", "--layouts", "tp=2,pp=2", "tp=4,pp=1", "--nproc", "4"]
    )
    assert code == 2
    assert "2 key/value heads are not divisible by tp=4" in capsys.readouterr().err


def test_layouts_are_required(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "configs/default.yaml"])
    assert "--layouts needs one or more layouts" in capsys.readouterr().err


@pytest.mark.slow
def test_one_layout_measured_beside_the_plan():
    done = subprocess.run(
        [sys.executable, "-m", "mtcore.cli.main", "sweep", "configs/default.yaml",
         "--layouts", "tp=2,pp=1", "--nproc", "2", "--steps", "3"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("tp=2,pp=1"))
    measured_s, planned_s, _, measured_mb, planned_mb, _ = (float(x) for x in row.split()[1:])
    assert measured_s > 0 and planned_s > 0 and measured_mb > planned_mb > 0
    assert "GEMM_EFFICIENCY 0.81" in done.stdout
