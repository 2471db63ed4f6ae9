"""A hardware or plan input that is not finite, positive and of its kind is refused in one
line (exit 2); the search over an absurd accelerator count stays bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtcore.cli.main import main
from mtcore.plan import HardwareError, load_hardware
from mtcore.plan.search import candidates
from mtcore.training.overrides import load_config

H100 = Path(load_hardware("H100-SXM").path).read_text()
DEFAULT = "configs/default.yaml"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("inter_node_latency_us = 5.0", "inter_node_latency_us = -5.0", "inter_node_latency_us"),
        ("intra_node_latency_us = 3.0", "intra_node_latency_us = nan", "intra_node_latency_us"),
        ("intra_node_gbs = 450.0", "intra_node_gbs = inf", "intra_node_gbs"),
        ("memory_gb = 80.0", "memory_gb = 0.0", "memory_gb"),
        ("memory_bandwidth_gbs = 3350.0", "memory_bandwidth_gbs = -1.0", "memory_bandwidth_gbs"),
        ("gpus_per_node = 8", "gpus_per_node = 7.5", "gpus_per_node"),
        ("gpus_per_node = 8", "gpus_per_node = 8.0", "gpus_per_node"),
        ("gpus_per_node = 8", "gpus_per_node = true", "gpus_per_node"),
        ("bf16 = 989.0", "bf16 = nan", "peak_tflops.bf16"),
        ("fp8 = 1979.0", 'fp8 = "fast"', "peak_tflops.fp8"),
        ("fused_attention = true", "fused_attention = 1", "fused_attention"),
        ("inter_node_latency_us = 5.0", "nodes_per_pod = 32", "nodes_per_pod and inter_pod_gbs"),
        ("inter_node_latency_us = 5.0", "nodes_per_pod = 0\ninter_pod_gbs = 6.25", "nodes_per_pod"),
    ],
)
def test_a_bad_number_is_refused_naming_the_key(tmp_path, capsys, old, new, message):
    assert old in H100
    bad = tmp_path / "bad.toml"
    bad.write_text(H100.replace(old, new, 1))
    with pytest.raises(HardwareError, match=message) as refused:
        load_hardware(str(bad))
    assert "bad.toml" in str(refused.value)
    assert main(["plan", DEFAULT, "--gpus", "4", "--hardware", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "1.5"], "--gpus needs a whole number"),
        (["--gpus", "-4"], "--gpus needs a whole number"),
        (["--gpus", "4", "--zero", "5"], "ZeRO stage must be 0, 1, 2 or 3"),
        (["--gpus", "4", "--zero", "two"], "give a ZeRO stage"),
        (["--gpus", "4", "--flash-attention", "maybe"], "give on or off"),
        (["--gpus", "4", "--comm-overlap", "tp,dp"], "comm overlap takes distinct axes"),
        (["--gpus", "4", "--grad-reduce-dtype", "int8"], "--grad-reduce-dtype needs one of"),
        (["--gpus", "4", "--compare", "tp=2,zero=9"], "ZeRO stage must be"),
    ],
)
def test_a_bad_plan_option_is_refused_in_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as done:
        code = main(["plan", DEFAULT, "--hardware", "cpu-host", *args])
        raise SystemExit(code)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_the_search_over_an_absurd_count_is_bounded():
    """Every size is searched up to a bound of its own (tp a node, cp 16, pp the layers,
    the micro-batch 16), not up to the accelerator count (the divisor scans used to run
    to the count itself: 10^18 steps)."""
    config = load_config(DEFAULT, ["--training.global_batch_size", str(10**18)])
    found = list(candidates(config, 10**18, load_hardware("H100-SXM")))
    layers = config.model.num_layers
    assert found and all(c["tp"] <= 8 and c["pp"] <= layers and c["mb"] <= 16 for c in found)
    # tp 1/2/4/8 x cp 1/2/4/8/16 x pp 1/2/4 x vpp x mb x sp x zero1 x recompute
    assert len(found) <= 4 * 5 * 3 * 4 * 16 * 2 * 2 * 3
