"""A backend whose device module sees no device, or a device with no memory, is refused
in one line before training (issue 48 section 4): the trainer divided by the device
count (ZeroDivisionError), and the memory check skipped a 0-byte device. The devices are
stand-ins (no such hardware here): what their plugin reports is the point."""

from __future__ import annotations

import dataclasses

import pytest

from mtcore.backend import (
    FP8,
    BackendError,
    BackendSpec,
    Collective,
    CpuDevice,
    PluginRegistry,
    hookimpl,
    select_backend,
)
from mtcore.cli.main import main
from mtcore.plan import HardwareError, load_hardware
from mtcore.plan.hardware import fill_from_backend
from mtcore.plan.memory_fit import check_memory
from mtcore.training.backend_check import local_device_index
from mtcore.training.config import ConfigError
from mtcore.training.overrides import load_config


class StandInAccelerator(CpuDevice):
    """An accelerator type whose count and memory the test sets."""

    type = "stand_in_accel"

    def __init__(self, count: int, memory: int | None):
        self.count, self.memory = count, memory

    def device_count(self) -> int:
        return self.count

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), memory_bytes=self.memory)


def _backend(count: int, memory: int | None):
    class Plugin:
        @hookimpl
        def mtcore_backends(self):
            device = StandInAccelerator(count, memory)
            return [BackendSpec(name="stand_in", device=device, collective=Collective("gloo"),
                                fp8=FP8(), accelerator=False)]  # fmt: skip

    registry = PluginRegistry()
    registry.register(Plugin(), "stand-in-plugin")
    return select_backend("stand_in", registry)


def test_no_device_is_a_backend_error_not_a_division_by_zero():
    with pytest.raises(BackendError, match=r"^backend 'stand_in' sees 0 stand_in_accel devices"):
        local_device_index(_backend(0, 10**9), local_rank=1)
    assert local_device_index(_backend(2, 10**9), local_rank=3) == 1


def test_a_device_with_no_memory_is_refused_by_the_fit_check_and_the_planner():
    config = load_config("configs/default.yaml")
    empty = _backend(1, 0)
    with pytest.raises(ConfigError, match=r"reports 0 bytes of stand_in_accel device memory"):
        check_memory(config, 4, 4, empty)
    with pytest.raises(HardwareError, match=r"reports 0 bytes of device memory"):
        fill_from_backend(load_hardware("cpu-host"), empty)
    check_memory(config, 4, 4, _backend(1, None))  # unknown memory: nothing to check


def test_a_hardware_file_with_no_memory_is_one_line_exit_2(tmp_path, capsys):
    import re
    from pathlib import Path

    import mtcore.plan

    shipped = Path(mtcore.plan.__file__).parent / "hardware" / "h100-sxm.toml"
    described = tmp_path / "empty.toml"
    described.write_text(re.sub(r"(?m)^memory_gb = .*$", "memory_gb = 0", shipped.read_text(), count=1))
    assert main(["plan", "configs/default.yaml", "--gpus", "4", "--hardware", str(described)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "memory_gb must be a finite positive number" in err, err
