"""The software's fixed costs as hardware-file parameters (issue 46.7), by hand: a
micro-batch's forward and backward through each chunk pay ``microbatch_overhead_us``,
each pipeline send ``p2p_overhead_us``; both 0 unless the file says (what a framework's
pipeline engine costs beyond the work is not fitted per run)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mtcore.plan import load_hardware, plan
from mtcore.plan.hardware import HardwareError
from mtcore.training.overrides import load_config

A100 = load_hardware("A100-80GB")
COSTLY = replace(A100, microbatch_overhead_us=100.0, p2p_overhead_us=50.0)


def test_overheads_by_hand():
    config = load_config("configs/default.yaml", ["--parallel.tp", "1", "--parallel.pp", "2", "--parallel.vpp", "2",
                                                  "--training.global_batch_size", "16"])  # fmt: skip
    base, costly = plan(config, 2, A100), plan(config, 2, COSTLY)
    m, vpp = base.microbatches, 2
    assert base.time.overhead == 0.0
    assert costly.time.overhead == pytest.approx(m * 2 * vpp * 100e-6)
    assert costly.time.pp_comm - base.time.pp_comm == pytest.approx(m * 2 * vpp * 50e-6)
    # the fill and drain pass through the other stage once (over v): its overheads too
    per_microbatch = 2 * vpp * (100e-6 + 50e-6)
    assert costly.time.bubble - base.time.bubble == pytest.approx(per_microbatch / vpp)
    assert costly.time.total - base.time.total == pytest.approx(
        m * per_microbatch + per_microbatch / vpp
    )


def test_a_negative_overhead_is_refused(tmp_path):
    path = tmp_path / "a100.toml"
    with open(A100.path) as shipped:  # top-level keys come before the file's tables
        path.write_text("microbatch_overhead_us = -1.0\n" + shipped.read())
    with pytest.raises(HardwareError, match="microbatch_overhead_us must be a finite number"):
        load_hardware(str(path))
