"""``mtcore sweep --trace`` on two real 4-rank layouts, tp2 x pp2 and pp2 x dp2, 1F1B
(one sweep: two jobs of four ranks, tens of seconds on two cores, hence extended).

Checked: each layout's measured (merged) and planned traces are written; the table's
"measured / planned" cells are the categories of those files, read back; on every rank
the measured forward/backward ranges are the schedule's, and the planned trace of the
same layout has the same ranges in the same order (issue 44's tp2 x pp2 case); the
ranks traced mtcore's phases alone (no torch.profiler ops), so the tensor peak still
measured; and the picture names both layouts.
"""

from __future__ import annotations

import re

import pytest
from PIL import Image

from mtcore.cli.main import main
from mtcore.parallel.pipeline import build_schedule
from mtcore.parallel.pipeline.schedules import COMPUTE
from mtcore.plan.sweep import stage_of
from mtcore.plan.trace import category_ms, rows_of
from mtcore.training.trace_merge import load, phases

LAYOUTS = {"tp=2,pp=2": 4, "tp=1,pp=2": 2}  # layout -> micro-batches per rank (dp 1, dp 2)
SMALL = [
    "--model.hidden_size", "64", "--model.num_layers", "4", "--model.seq_len", "64",
    "--training.global_batch_size", "8", "--training.micro_batch_size", "2",
]  # fmt: skip
CELL = re.compile(r"([\d.]+) /\s*([\d.]+)")


@pytest.mark.extended
def test_sweep_trace_writes_both_traces_and_prints_their_categories(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = ["sweep", "configs/default.yaml", "--layouts", *LAYOUTS, "--nproc", "4"]
    code = main([*args, "--steps", "2", "--trace", "--output", str(out), *SMALL])
    printed = capsys.readouterr().out
    assert code == 0, printed
    lines = printed.splitlines()
    table = lines.index("ms per step, the mean over ranks, measured / planned:") + 1
    columns = lines[table].split()[1:]
    assert columns == ["step", "compute", "exposed", "comm", "bubble", "optimizer", "data", "other"]
    names = ["step", "compute", "exposed comm", "bubble", "optimizer", "data", "other"]
    rows = lines[table + 1 : table + 1 + len(LAYOUTS)]
    for row, (layout, microbatches) in zip(rows, LAYOUTS.items(), strict=True):
        assert row.split()[0] == layout
        measured = load(out / layout / "measured.json.gz")
        planned = load(out / layout / "planned.json.gz")
        cells = [(float(m), float(p)) for m, p in CELL.findall(row)]
        want_m, want_p = category_ms(measured), category_ms(planned)
        for name, (m, p) in zip(names, cells, strict=True):
            assert m == pytest.approx(want_m[name], abs=0.051), (layout, name)
            assert p == pytest.approx(want_p[name], abs=0.051), (layout, name)
        assert want_m["compute"] > 0 and want_p["compute"] > 0

        assert rows_of(measured) == [0, 1, 2, 3] and rows_of(planned) == [0, 1]
        assert not [e for e in measured["traceEvents"] if e.get("cat") == "cpu_op"]
        schedule = build_schedule("1f1b", 2, microbatches, 1)
        for rank in range(4):
            stage = stage_of(rank, 4, 2)
            mine = [e["name"] for e in phases(measured, rank) if e["args"]["category"] == "compute"]
            plan = [e["name"] for e in phases(planned, stage) if e["args"]["category"] == "compute"]
            want = [f"{a.kind} mb{a.microbatch} c{a.chunk}" for a in schedule.for_rank(stage)
                    if a.kind in COMPUTE]  # fmt: skip
            assert mine == plan == want, (layout, rank)

        measured_row = next(ln for ln in lines if ln.startswith(f"{layout} ") and "/" not in ln)
        assert float(measured_row.split()[4]) > 0  # peak MB: the memory recorder still ran

    assert lines[-1] == f"picture: {out / 'layouts.png'}, {out / 'layouts.svg'}"
    with Image.open(out / "layouts.png") as image:
        assert image.size == (1000, 450)
    svg = (out / "layouts.svg").read_text()
    assert all(f">{layout}<" in svg for layout in LAYOUTS) and ">measured<" in svg
