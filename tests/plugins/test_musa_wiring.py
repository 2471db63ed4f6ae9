"""Wiring of the mtcore-musa plugin, tested on CPU. No test here runs MUSA hardware.

torch_musa cannot be installed here, so ``TorchMusaCpuStandIn`` (tests/plugins/
musa_standin.py) takes its place in a subprocess: a module flagged ``STANDIN = True``
that answers with configurable CPU facts and registers torch_musa's entry points under
the names torch_musa v2.7.1 uses. What is checked is that the plugin probes, gates and
converts as torch_musa's source says it must, not what muDNN or MCCL compute. One
subprocess (tests/plugins/musa_probe.py) runs every check and reports JSON; the tests
here assert on it.

Needs ``pip install -e plugins/mtcore_musa --no-deps --no-build-isolation``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("musa_probe.py")


@pytest.fixture(scope="module")
def facts():
    if importlib.util.find_spec("torch_musa") is not None:
        pytest.skip("a real torch_musa is installed: run the conformance kit instead")
    if not metadata.entry_points(group="mtcore.plugins", name="mtcore_musa"):
        pytest.fail(
            "mtcore-musa is not installed: pip install -e plugins/mtcore_musa --no-deps --no-build-isolation"
        )
    launch = ("MCCL_CHECK_POINTERS", "MUSA_KERNEL_TIMEOUT", "MCCL_PROTOS", "CUDA_DEVICE_MAX_CONNECTIONS")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTCORE_") and k not in launch}
    run = subprocess.run(
        [sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_entry_point_is_the_plugin_module():
    (ep,) = metadata.entry_points(group="mtcore.plugins", name="mtcore_musa")
    assert (ep.value, ep.dist.name) == ("mtcore_musa.plugin", "mtcore-musa")


def test_discovery_finds_musa_and_imports_neither_torch_musa_nor_triton(facts):
    d = facts["discovery"]
    assert (d["plugin"], d["dist"]) == ("mtcore_musa", "mtcore-musa")
    assert d["torch_musa_imports"] == []
    assert not d["triton_imported"]


def test_without_torch_musa_asking_is_an_error_and_auto_picks_cpu(facts):
    error = facts["absent_error"]
    assert error is not None and "torch_musa is not installed" in error
    assert "'musa'" in error and "mtcore-musa" in error
    assert facts["absent_tried_import"]
    assert facts["absent_auto"] == "cpu"


def test_standin_is_what_the_plugin_imported(facts):
    assert facts["standin"] == {
        "type": "TorchMusaCpuStandIn",
        "flag": True,
        "torch_musa_is_standin": True,
    }


def test_capability_2_2_kernel_table(facts):
    s = facts["s22"]
    assert s["plugin"] == "mtcore_musa"
    assert s["bf16"]["attention"] == ["sdpa", "reference"]
    assert s["bf16"]["rms_norm"] == ["F.rms_norm", "reference"]
    assert facts["rms_norm_guard"] == [True, False]  # fp32 weight with bf16 x: reference
    assert facts["rms_norm_probe"] == [False, True]
    assert facts["rms_norm_unfused"] == ["reference"]
    assert s["fp32"]["attention"] == ["reference"]  # flash is fp16/bf16 only
    # torch's own _fused_adamw_ raises on musa; without torch_musa's op, the reference.
    assert s["fp32"]["adamw_step"] == ["reference"]
    assert s["bf16"]["fp8_quantize"] == ["reference"]
    assert facts["s21_bf16_attention"] == ["reference"]  # arch 2.1 has no muDNN flash


def test_rms_norm_probe_uses_torch_musas_op_name_only(facts):
    n = facts["norms"]
    assert n["op_name"] == "aten::_fused_rmsnorm_forward"
    # torch's aten::_fused_rms_norm is in no torch_musa tag: a kernel for it proves nothing.
    assert n["after_torch_op"] is False
    assert n["after_torch_musa_op"] is True


def test_layer_norm_through_mudnn_once_native_layer_norm_has_a_musa_kernel(facts):
    n = facts["norms"]
    assert n["layer_norm_before"] == ["reference"]
    assert n["layer_norm_bf16"] == ["F.layer_norm", "reference"]
    assert n["layer_norm_fp32"] == ["F.layer_norm", "reference"]
    # LayerNorm.cpp: weight and bias must have the output's dtype (a missing bias is fine).
    assert n["layer_norm_guard"] == [True, True, False, False]


def test_flash_head_size_guard_falls_through_to_reference(facts):
    assert facts["attention_served_by_head_dim"] == {
        "64": "sdpa",
        "128": "sdpa",
        "160": "sdpa",
        "256": "reference",
    }


def test_fp8_native_only_from_capability_3_1(facts):
    s = facts["s22"]
    assert set(s["fp8"].values()) == {"fallback (matmul in higher precision)"}
    assert "(3, 1)" in s["fp8_available"]
    assert facts["fp8"]["musa4"] == {"available": True, "reason": "", "native": [True, True, False]}


def test_fp8_needs_float8_tensors_on_the_device(facts):
    musa3 = facts["fp8"]["musa3"]
    assert musa3["available"] is False and musa3["native"] == [False, False, False]
    reason = musa3["reason"]
    assert "float8_e4m3fn" in reason and "MUSA >= 4.0" in reason
    assert "SetMUTensorDType" in reason and "3.2.0" in reason  # the error and the build


def test_scaled_mm_shape_rule_is_musas_own(facts):
    fp8 = facts["fp8"]
    assert fp8["musa_shape_rule"] == {
        "M16 K32 N32": True,
        "K48 N32": False,
        "K32 N48": False,
        "K64 N256": True,
    }
    assert fp8["cpu_shape_rule"] == dict.fromkeys(fp8["cpu_shape_rule"], True)  # % 16


def test_collective_dtypes_follow_the_arch_torch_musa_was_built_for(facts):
    t = facts["collective_tables"]
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send_recv"):
        assert t["21"][f"{op} bfloat16"] == "fallback", op  # MCCL_BF16_SUPPORTED is 0
        assert t["22"][f"{op} bfloat16"] == "native", op
        assert t["22"][f"{op} float8_e4m3fn"] == "fallback", op
        assert t["22+31"][f"{op} float8_e4m3fn"] == "native", op  # MARCH_TYPE 310
        assert t["22+31"][f"{op} bfloat16"] == "native", op
        assert t["none"][f"{op} bfloat16"] == t["none"][f"{op} float8_e4m3fn"] == "fallback"
        assert {row[f"{op} float32"] for row in t.values()} == {"native"}
    # Read lazily, once per backend: the table asks torch_musa on first use only.
    assert {row["arch_list_reads"] for row in t.values()} == {1}


def test_device_and_collective_facts(facts):
    s = facts["s22"]
    assert "torch.bfloat16" in s["dtypes"]
    assert s["peak"] == {"bfloat16": 100.0, "float16": 100.0, "float32": 25.0}
    assert facts["peak_unknown"] == {}
    assert (s["c10d"], s["fp8_all_gather"], s["bf16_all_reduce"], s["avg"]) == (
        "mccl",
        "fallback",
        "native",
        True,
    )


def test_notes_say_musa_hardware_was_not_exercised(facts):
    assert any("not exercised on MUSA hardware" in note for note in facts["s22"]["notes"])


def test_notes_state_the_triton_warp_size_below_arch_3_1(facts):
    assert any("warp size 128" in note and "3.1" in note for note in facts["s22"]["notes"])
    assert any("not offered below 3.1" in note and "loss.py:21" in note
               for note in facts["s22"]["notes"])  # fmt: skip
    assert any("Data-parallel overlap" in note and "patch.py:215-219" in note
               for note in facts["s22"]["notes"])  # fmt: skip


def test_torch_version_diagnostic_names_both_versions(facts):
    for reason, needed, installed in (
        (facts["torch_2_6"], "2.7.1", "2.6.0+cpu"),
        (facts["torch_older_than_torch_musa_wants"], "99.0.0", torch.__version__),
    ):
        assert f"needs torch >= {needed}, but the installed torch is {installed}" in reason
        assert reason.startswith("torch_musa 2.7.1 needs"), reason
        assert "undefined symbols" not in reason  # not a build mismatch


def test_plugin_requires_the_torch_torch_musa_needs():
    project = tomllib.loads((ROOT / "plugins/mtcore_musa/pyproject.toml").read_text())["project"]
    (torch_req,) = [Requirement(r) for r in project["dependencies"] if r.startswith("torch")]
    assert "2.7.1" in torch_req.specifier and "2.7.0" not in torch_req.specifier
    assert "2.6.0" not in torch_req.specifier and "3.0.0" not in torch_req.specifier


def test_fused_adamw_uses_torch_musa_op_when_registered(facts):
    assert facts["adamw_with_op"] == ["musa-fused", "reference"]
    assert facts["adamw_steps_seen"] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert facts["adamw_max_diff"] < 1e-6
    assert facts["adamw_guard_bf16"] is False


def test_rope_and_swiglu_adapters_match_reference_conventions(facts):
    assert facts["rope_before"] == ["reference"]
    assert facts["old_mudnn"] == [["reference"], ["reference"]]  # muDNN < 2800 lacks both
    assert facts["rope_fp32"] == ["F.rope", "reference"]
    assert facts["swiglu_bf16"] == ["F.swish_glu", "reference"]
    assert facts["rope_max_diff"] < 1e-5
    assert facts["rope_contiguous_shape"] == [True, [2, 6, 3, 8]]
    assert facts["rope_guard_odd_table"] is False
    assert facts["swiglu_max_diff"] < 1e-2


def test_rope_gets_the_layout_torch_musa_tests_and_any_float_dtype(facts):
    calls = facts["rope_calls"]
    assert len(calls) == 2
    assert all(c["tested_layout"] and not c["interleaved_or_batch_first"] for c in calls), calls
    # RoPE.cpp checks only the input's dtype; the angles stay float32.
    assert facts["rope_bf16"] == ["F.rope", "reference"]
    assert [c["freq_dtype"] for c in calls] == ["torch.float32", "torch.float32"]
    assert facts["rope_bf16_dtype"] == "torch.bfloat16"
    assert facts["rope_bf16_max_diff"] < 5e-2  # bf16 rounding of values up to ~4


def test_docs_state_what_was_not_exercised_and_the_musa_settings():
    text = (ROOT / "docs/musa.md").read_text()
    assert "Not exercised on MUSA hardware" in text
    for fact in (
        "warp size 128",
        "MUSA_BLOCK_SCHEDULE_MODE",
        "MUSA_DEVICE_MAX_CONNECTIONS",
        "_flash_attention_forward",
        "parallel_fused_cross_entropy",
        "_MIN_MUSA_DIM = 64",
        "mfu = tflops / 98e12",
    ):
        assert fact in text, fact
    # Issue 47: MT-MegatronLM's scripts do not set MCCL_SOCKET_IFNAME, and the hybrid
    # format runs natively on musa only after the probe: the docs say so, no more.
    for page in ("musa.md", "clusters.md", "fp8.md"):
        page_text = (ROOT / "docs" / page).read_text()
        assert "named in Moore Threads' multi-node scripts" not in page_text, page
        assert "named from Moore Threads' launch scripts" not in page_text, page
        assert "(recommended)" not in page_text, page
    assert "MT-MegatronLM's launch scripts do not set it" in text
    assert "--precision.fp8 hybrid --precision.fp8_recipe delayed" not in text


def test_sdpa_scale_other_than_the_default_runs_where_the_probe_finds_it_honoured(facts):
    # The stand-in's SDPA honours the scale, as a MUSA >= 4.2 build does (SDP.cpp); builds
    # that raise or ignore it: tests/plugins/test_musa_attention_scale.py.
    assert facts["attention_by_scale"] == {"none": "sdpa", "default": "sdpa", "one": "sdpa"}


def test_attention_lse_through_musa_flash_once_the_op_exists(facts):
    assert facts["lse_before_op"] == ["reference"]
    assert facts["lse_table"] == ["mudnn-flash", "reference"]
    assert facts["lse_fp32_table"] == ["reference"]  # muDNN flash is fp16/bf16 only
    # Padded by 8 in backward, the head dim must stay <= 128, and be >= 64 (what
    # MT-TransformerEngine sends the op); only the default scale.
    assert facts["lse_served"] == {
        "d32-default": "reference",
        "d32-one": "reference",
        "d56-default": "reference",
        "d56-one": "reference",
        "d64-default": "mudnn-flash",
        "d64-one": "reference",
        "d120-default": "mudnn-flash",
        "d120-one": "reference",
        "d128-default": "reference",
        "d128-one": "reference",
    }


def test_attention_lse_adapter_matches_the_reference_through_the_lse(facts):
    # The stand-in computes as SDP.cpp specifies and ignores any scale it is given.
    for case, diff in facts["lse_max_diff"].items():
        assert diff < 1e-4, (case, diff)
    assert facts["lse_bf16_dtypes"] == ["torch.bfloat16", "torch.float32"]


def test_hybrid_fp8_native_only_where_the_probe_finds_it_exact(facts):
    h = facts["hybrid"]
    assert {mode: f["same_format_native"] for mode, f in h.items()} == dict.fromkeys(h, True)
    assert {mode: f["mixed_native"] for mode, f in h.items()} == {
        "right": True,
        "wrong": False,
        "raise": False,
    }
    assert h["right"]["hybrid_paths"] == dict.fromkeys(("forward", "dgrad", "wgrad"), "native")
    for mode in ("wrong", "raise"):
        paths = h[mode]["hybrid_paths"]
        assert paths["forward"] == "native", mode  # e4m3 x e4m3
        assert paths["dgrad"] == paths["wgrad"] == "fallback (matmul in higher precision)", mode


def test_notes_say_hybrid_fp8_and_the_sdpa_scale_are_handled(facts):
    notes = "\n".join(facts["s22"]["notes"])
    assert "Hybrid FP8 (e5m2 x e4m3" in notes and "unverified" in notes
    assert "SDPA's scale" in notes and "attention_lse" in notes


def test_doctor_shows_the_variables_mt_megatronlm_s_scripts_export(monkeypatch):
    """Issue 47: MUSA_KERNEL_TIMEOUT, MCCL_PROTOS, MCCL_CHECK_POINTERS and
    CUDA_DEVICE_MAX_CONNECTIONS, each with this machine's value beside the scripts'."""
    from mtcore_musa import plugin
    from mtcore_musa.environment import MT_MEGATRON_VARIABLES

    for name in MT_MEGATRON_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MCCL_PROTOS", "0")
    facts = plugin._diagnostics()
    assert set(MT_MEGATRON_VARIABLES) == {"MUSA_KERNEL_TIMEOUT", "MCCL_PROTOS",
                                          "MCCL_CHECK_POINTERS", "CUDA_DEVICE_MAX_CONNECTIONS"}  # fmt: skip
    assert facts["env MCCL_PROTOS"].startswith("'0' here; MT-MegatronLM's scripts: 2 (")
    assert facts["env MUSA_KERNEL_TIMEOUT"].startswith("unset here; MT-MegatronLM's scripts: 3200000")
    assert "trade-off; not set by mtcore" in facts["env CUDA_DEVICE_MAX_CONNECTIONS"]
    assert facts["env MCCL_CHECK_POINTERS"].startswith("unset (mtcore-musa sets '0' when")
    assert "triton backend for musa" in facts


def test_cross_entropy_takes_mudnns_fused_loss_from_arch_3_0(facts):
    """torch_musa's F.cross_entropy runs muDNN's fused loss when its op exists and the
    device's major arch is >= 3 (Loss.cpp:557); otherwise the reference serves. The
    adapter passes float32 logits, reduction='none' and ignore_index, and at tp 1 the
    vocab-parallel loss equals the reference's, losses and gradients (on the stand-in,
    whose F.cross_entropy is torch's: the call is checked, not muDNN)."""
    ce = facts["cross_entropy"]
    assert ce["without_op_31"] == ["reference"]
    assert ce["with_op_31"] == {
        "torch.float32": ["F.cross_entropy"],
        "torch.bfloat16": ["F.cross_entropy"],
    }
    assert ce["with_op_30"] == ["F.cross_entropy"]
    assert ce["with_op_22"] == ["reference"]
    assert ce["calls"] == [
        {"dtype": "torch.float32", "dim": 2, "ignore_index": -100, "reduction": "none"}
    ] * 2
    for dtype, diff in ce["vs_reference"].items():
        assert diff["loss"] <= 1e-6 and diff["grad"] <= 1e-6, (dtype, diff)
        assert diff["loss_dtype"] == "torch.float32"
        assert diff["ignored"] == [0.0, 0.0] and diff["ignored_grad_zero"]


def test_building_musa_sets_mccl_check_pointers_only_where_unset(facts):
    """The plugin's mtcore_environment hook: MCCL_CHECK_POINTERS=0 (MCCL's debugging checks,
    0 in every MUSA script read) when unset; the user's value is kept and doctor says who
    set it; the three tuning/trade-off variables are left alone."""
    env = facts["environment"]
    assert env["set"] == "0"
    assert env["doctor"].startswith("'0' (set by mtcore-musa: it was unset) here")
    assert env["doctor_unset"].startswith("unset (mtcore-musa sets '0' when the backend is built)")
    assert env["doctor_user"].startswith("'1' here;")
    assert env["others"] == dict.fromkeys(
        ("MUSA_KERNEL_TIMEOUT", "MCCL_PROTOS", "CUDA_DEVICE_MAX_CONNECTIONS")
    )


def test_dp_reduction_after_backward_below_arch_3_1_as_torch_musa_runs_fsdp2(facts):
    """torch_musa turns FSDP2's overlap off below arch 3.1 (fsdp/patch.py:215-219): the
    musa backend advises reducing dp buckets after backward there, during it from 3.1;
    doctor says which and that MTCORE_DP_OVERLAP decides instead."""
    below, above = facts["dp_overlap"]["22"], facts["dp_overlap"]["31"]
    assert below[0] is False and "patch.py:215-219" in below[1] and "(3, 1)" in below[1]
    assert above == [True, "backend 'musa': overlap"]
    assert facts["dp_overlap_doctor_22"].startswith("after backward: torch_musa disables FSDP2")
    assert "MTCORE_DP_OVERLAP" in facts["dp_overlap_doctor_22"]
