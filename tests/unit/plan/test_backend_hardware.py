"""``mtcore plan --backend NAME``: a running backend's capability table fills in what it
knows (device name, memory, the dtypes it computes in, peak figures) over a hardware
description, which keeps the rest. The cpu backend is built for real; a device this
machine lacks (no bf16, no FP8, known peaks) comes from a plugin registered in-process,
selected through the same ``select_backend`` path as any installed one."""

from __future__ import annotations

import json

import pytest
import torch

from mtcore.backend import (
    FP8,
    Availability,
    BackendSpec,
    Collective,
    CpuDevice,
    DeviceCapabilities,
    PluginRegistry,
    hookimpl,
    select_backend,
)
from mtcore.cli.main import main
from mtcore.plan import HardwareError, load_hardware, plan
from mtcore.plan.hardware import NOT_FROM_BACKEND, fill_from_backend
from mtcore.training.overrides import load_config

DEFAULT = "configs/default.yaml"
PLAN = ["plan", DEFAULT, "--gpus", "4", "--hardware", "cpu-host"]


def cpu_memory() -> int:
    return select_backend("cpu").device.capabilities().memory_bytes


def test_the_cpu_backends_memory_is_the_plans_limit():
    file = load_hardware("cpu-host")
    hardware, fill = fill_from_backend(file, select_backend("cpu"))
    caps = select_backend("cpu").device.capabilities()
    assert caps.memory_bytes and caps.memory_bytes != file.memory_bytes  # a real change
    assert plan(load_config(DEFAULT), 4, hardware).memory_limit == caps.memory_bytes
    assert hardware.name == caps.name and "memory_gb" in fill.filled
    # the host backend knows no bandwidths nor peak figures: they stay the file's
    for key in (*NOT_FROM_BACKEND, "peak_tflops"):
        assert getattr(hardware, key) == getattr(file, key), key
        if getattr(file, key) is not None:  # an optional field the file leaves out is not "kept"
            assert key in fill.kept
    assert hardware.sources["memory_gb"] == "backend 'cpu' (device capabilities)"
    assert hardware.sources["all"] == file.sources["all"]


def test_json_carries_the_backends_memory_and_where_each_field_came_from(capsys):
    assert main([*PLAN, "--backend", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["memory"]["limit_bytes"] == cpu_memory()
    source = out["hardware_from_backend"]
    assert source["backend"] == "cpu" and source["description"] == "cpu-host"
    assert "memory_bandwidth_gbs" in source["kept"] and "memory_gb" in source["filled"]
    assert "from backend 'cpu'" in captured.err  # stdout stays one JSON document


@pytest.mark.filterwarnings("ignore::mtcore.backend.PluginWarning")  # other plugins here
def test_text_report_says_where_the_numbers_came_from(capsys):
    assert main([*PLAN, "--backend", "auto"]) == 0  # here: the host backend
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("from backend 'cpu': name = ") and "memory_gb = " in lines[0]
    assert lines[1].startswith("from the 'cpu-host' description: ")
    assert f"of {cpu_memory() / 1e9:.2f} GB" in out


def test_search_and_compare_use_the_filled_description(capsys):
    assert main([*PLAN, "--backend", "cpu", "--compare", "tp=2,pp=2", "tp=1,pp=2"]) == 0
    assert capsys.readouterr().out.startswith("from backend 'cpu'")
    assert main([*PLAN, "--backend", "cpu", "--search", "--top", "1", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found[0]["memory"]["limit_bytes"] == cpu_memory()


def test_a_backend_without_a_description_says_what_it_cannot_know(capsys):
    assert main(["plan", DEFAULT, "--gpus", "4", "--backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--hardware NAME|FILE" in err
    assert all(key in err for key in NOT_FROM_BACKEND)


def test_an_unknown_backend_is_the_selections_error(capsys):
    assert main([*PLAN, "--backend", "nosuch"]) == 2
    assert "--backend nosuch: unknown backend 'nosuch'" in capsys.readouterr().err


class OlderDevice(CpuDevice):
    """What a plugin for an older accelerator would report: fp16 and fp32 only, its
    peaks known, 8 GB. (No such device here; its capabilities are the point.)"""

    def capabilities(self) -> DeviceCapabilities:
        return DeviceCapabilities(
            name="older accelerator",
            dtypes=(torch.float32, torch.float16),
            peak_tflops={"float16": 100.0, "float32": 20.0},
            memory_bytes=8 * 10**9,
        )


class OlderPlugin:
    @hookimpl
    def mtcore_backends(self):
        return [
            BackendSpec(
                name="older",
                device=OlderDevice(),
                collective=Collective("gloo"),
                fp8=FP8(available=lambda: Availability(False, "no FP8 units")),
                accelerator=False,
            )
        ]


@pytest.fixture
def older():
    registry = PluginRegistry()
    registry.register(OlderPlugin(), "older-plugin")
    return select_backend("older", registry)


def test_peaks_follow_the_dtypes_the_device_computes_in(older):
    file = load_hardware("H100-SXM")
    hardware, fill = fill_from_backend(file, older)
    # bf16 and fp8 dropped; tf32 (no dtype of a capability table) stays the file's
    assert hardware.peak_tflops == {"fp16": 100.0, "fp32": 20.0, "tf32": file.peak_tflops["tf32"]}
    assert fill.dropped == ("bf16", "fp8") and "(no bf16, fp8 on this device" in fill.summary()
    assert hardware.memory_gb == 8.0 and hardware.name == "older accelerator"
    assert hardware.intra_node_gbs == file.intra_node_gbs  # links: the file's
    fp16 = load_config(DEFAULT, ["--precision.dtype", "fp16"])
    assert plan(fp16, 4, hardware).peak_flops == 100e12
    with pytest.raises(HardwareError, match=r"older accelerator gives no peak for bf16"):
        plan(load_config(DEFAULT, ["--precision.dtype", "bf16"]), 4, hardware)
    fp8 = load_config(DEFAULT, ["--precision.dtype", "fp32", "--precision.fp8", "hybrid"])
    assert any("gives no fp8 peak" in n for n in plan(fp8, 4, hardware).notes)
