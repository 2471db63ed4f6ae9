"""benchmarks/bench_gemm_shapes.py, which the GPU check runs to measure what the H100
rows miss: its products are the planner's, and its CPU self-check runs end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import tomllib
from published import MEGATRON_CORE_2024, megatron_core_config

from mtcore.plan import load_hardware, model_shape

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_gemm_shapes.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gemm_shapes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rows_and_products_are_the_planners():
    """Same rows as the published table; one layer's four products hold a tp rank's
    share of the planner's block weights, and the logits its share of the vocabulary."""
    bench = _bench()
    published = {row[0]: row for row in MEGATRON_CORE_2024}
    assert [row[0] for row in bench.ROWS] == list(published)
    for name, hidden, layers, tp, micro_batch in bench.ROWS:
        _, p_hidden, p_layers, heads, p_tp, pp, gpus, batch, _ = published[name]
        assert (hidden, layers, tp) == (p_hidden, p_layers, p_tp)
        assert micro_batch == (batch // (gpus // (tp * pp)) if pp == 1 else 1)
        config = megatron_core_config(hidden, layers, heads, tp, pp, gpus, batch, micro_batch)
        shape = model_shape(config.model)
        found = bench.products(hidden, tp, micro_batch * bench.SEQ)
        layer = sum(k * n for product, _, k, n in found if product != "logits")
        assert layer == shape.blocks[0].active_weights() / tp
        (logits,) = [(t, k, n) for product, t, k, n in found if product == "logits"]
        assert logits == (micro_batch * 4096, hidden, shape.vocab // tp)


def test_the_cpu_self_check_times_every_product(tmp_path):
    out = tmp_path / "gemm.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    timed = [r for r in results if r["product"] != "all"]
    assert len(timed) == 5 * 5 * 3 and all(r["tflops"] > 0 for r in timed)
    rows = [r for r in results if r["product"] == "all"]
    assert [r["row"] for r in rows] == ["1.7B", "7.1B", "16B", "70B", "177B"]
    assert "the planner credits 0.7" in proc.stdout


def test_the_planner_mode_writes_a_table_a_hardware_file_takes(tmp_path):
    """``--planner`` times the plan's own products of a config and writes them as a
    ``[gemm_efficiency]`` table that loads into a hardware file (how cpu-host's was made)."""
    out = tmp_path / "table.toml"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--planner", "configs/default.yaml", "--layouts",
         "tp=2,pp=2", "--nproc", "4", "--reps", "2", "--toml", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = tomllib.loads(out.read_text())["gemm_efficiency"]["fp32"]
    # tp 2, micro-batches of 4 x 128 tokens: the query/key/value product, its share of the
    # 4096-entry vocabulary, and one head's scores (128 queries, 32 dims, 128 keys)
    assert {"512x128x128", "512x128x2048", "128x32x128"} <= set(table)
    assert all(0 < fraction <= 1 for fraction in table.values())
    hardware = load_hardware("cpu-host")
    assert replace(hardware, gemm_efficiency={"fp32": table}).gemm_efficiency["fp32"] == table
