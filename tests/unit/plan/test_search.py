"""``--search`` lists only layouts the trainer accepts and that fit, fastest first."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtcore.plan import load_hardware
from mtcore.plan.search import _with_layout, candidates, search
from mtcore.training.overrides import load_config

SMALL = [
    "--model.hidden_size",
    "384",
    "--model.num_layers",
    "6",
    "--model.num_heads",
    "6",
    "--model.vocab_size",
    "4096",
    "--model.seq_len",
    "256",
    "--training.global_batch_size",
    "24",
]


def _tiny_hardware(tmp_path, memory_gb):
    text = Path(load_hardware("cpu-host").path).read_text()
    text = text.replace("memory_gb = 16.0", f"memory_gb = {memory_gb}")
    path = tmp_path / "tiny.toml"
    path.write_text(text)
    return load_hardware(str(path))


def test_results_pass_the_trainers_checks_and_fit(tmp_path):
    config = load_config(None, SMALL)
    hardware = load_hardware("cpu-host")
    ranked, fitting = search(config, 8, hardware, top=6)
    assert len(ranked) == 6 and fitting >= 6
    speeds = [r.plan.tokens_per_s for r in ranked]
    assert speeds == sorted(speeds, reverse=True)
    for r in ranked:
        lay = r.plan.layout
        assert 6 % lay["tp"] == 0, "6 heads cannot split over this tp"
        assert 6 % (lay["pp"] * lay["vpp"]) == 0, "6 layers cannot split over pp*vpp"
        r.config.check(8)  # the trainer's validators accept it
        assert r.plan.fits and r.why


def test_every_rejected_candidate_is_absent():
    config = load_config(None, SMALL)
    hardware = load_hardware("cpu-host")
    ranked, _ = search(config, 8, hardware, top=10_000)
    listed = {tuple(sorted(r.plan.layout.items())) for r in ranked}
    rejected = 0
    for c in candidates(config, 8, hardware):
        candidate = _with_layout(config, c)
        try:
            candidate.check(8)
        except ValueError:
            rejected += 1
            assert not any(
                dict(key)["tp"] == c["tp"]
                and dict(key)["pp"] == c["pp"]
                and dict(key)["vpp"] == c["vpp"]
                and dict(key)["micro_batch"] == c["mb"]
                and dict(key)["cp"] == c["cp"]
                and dict(key)["sequence_parallel"] == c["sp"]
                and dict(key)["first_stage_layers"] == c["first"]
                for key in listed
            ), f"a layout the trainer rejects is listed: {c}"
    assert rejected > 0  # the space did contain impossible layouts


def test_layouts_that_do_not_fit_are_absent(tmp_path):
    config = load_config(None, SMALL)
    roomy = search(config, 4, load_hardware("cpu-host"), top=10_000)[0]
    peaks = sorted(r.plan.peak_memory for r in roomy)
    limit = peaks[len(peaks) // 2]  # half of the layouts fit
    tight = _tiny_hardware(tmp_path, limit / 1e9)
    ranked, _ = search(config, 4, tight, top=10_000)
    assert ranked and len(ranked) < len(roomy)
    assert all(r.plan.peak_memory <= limit for r in ranked)


def test_one_trillion_on_ten_thousand_finds_fitting_layouts():
    config = load_config(
        None,
        [
            "--model.hidden_size",
            "25600",
            "--model.num_layers",
            "128",
            "--model.num_heads",
            "160",
            "--model.seq_len",
            "2048",
            "--model.vocab_size",
            "51200",
            "--model.style",
            "gpt2",
            "--training.global_batch_size",
            "5000",
            "--precision.dtype",
            "bf16",
        ],
    )
    ranked, _ = search(config, 10_000, load_hardware("H200"), top=3)
    assert ranked
    for r in ranked:
        assert r.plan.peak_memory <= 141e9
        assert (
            r.plan.layout["tp"] * r.plan.layout["pp"] * r.plan.layout["cp"] * r.plan.layout["dp"]
            == 10_000
        )
    with pytest.raises(ValueError, match="but the world has 9999 ranks"):
        ranked[0].config.check(9_999)
