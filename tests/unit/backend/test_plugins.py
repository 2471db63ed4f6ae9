"""Plugin discovery and backend selection, with real entry points on sys.path."""

from __future__ import annotations

import warnings

import pytest

from mtcore.backend import (
    BackendError,
    PluginConfigError,
    PluginRegistry,
    PluginWarning,
    select_backend,
)

ACCEL = """
from mtcore.backend import BackendSpec, Collective, CpuDevice, hookimpl

@hookimpl
def mtcore_backends():
    return [BackendSpec(name="{name}", device=CpuDevice(), collective=Collective("gloo"),
                        priority={priority})]
"""

# An accelerator whose torch extension is not installed; its driver's device nodes are
# files matching PATTERN, so a test decides whether the device is plausibly here.
UNAVAILABLE = """
from mtcore.backend import BackendSpec, Collective, DeviceModuleSpec, TorchModuleDevice, hookimpl

NODEV = DeviceModuleSpec(
    "nodev", import_name="torch_nodev_not_installed", device_files=({pattern!r},)
)

@hookimpl
def mtcore_backends():
    return [BackendSpec(name="nodev", device=TorchModuleDevice(NODEV), collective=Collective("gloo"),
                        priority=500)]
"""


def registry() -> PluginRegistry:
    reg = PluginRegistry()
    reg.load_entry_points()
    return reg


def test_installed_cuda_plugin_is_found_with_version_and_cpu_is_the_cores(monkeypatch):
    monkeypatch.delenv("MTCORE_PLUGINS", raising=False)
    found = registry().backends()
    info = found.plugins["mtcore_cuda"]
    assert (info.dist, info.error) == ("mtcore-cuda", None)
    assert info.version
    assert {"cpu", "cuda"} <= set(found.backends)
    assert found.backends["cpu"][1].name == "mtcore"  # the core's host plugin, not a vendor's
    assert found.backends["cuda"][1].name == "mtcore_cuda"


def test_dev_install_on_a_machine_without_accelerators_falls_to_cpu_without_a_warning(monkeypatch):
    """The CUDA and MUSA plugins of `make setup` on a CPU machine (CI, a laptop): no warning."""
    for name in ("BACKEND", "PLUGINS", "DISABLE_PLUGIN_AUTOLOAD", "REQUIRE_ACCELERATOR"):
        monkeypatch.delenv(f"MTCORE_{name}", raising=False)
    reg = registry()
    accelerators = [spec for spec, _ in reg.backends().backends.values() if spec.accelerator]
    assert {"cuda", "musa"} <= {spec.name for spec in accelerators}
    if any(spec.device_seen() for spec in accelerators):
        pytest.skip("this machine has an accelerator's device files")
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        backend = select_backend(None, reg)
    assert backend.name == "cpu" and backend.selection_notes == ()


def test_third_party_plugin_selected_by_name_and_auto_by_priority(make_dist, monkeypatch):
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    make_dist("acme-accel", "acme_plugin", ACCEL.format(name="acme", priority=7))
    reg = registry()
    assert select_backend("acme", reg).plugin == "acme_plugin"
    # Available accelerator beats the host backend when nothing is asked for.
    assert select_backend(None, reg).name == "acme"
    monkeypatch.setenv("MTCORE_BACKEND", "cpu")
    assert select_backend(None, reg).name == "cpu"


def test_unavailable_accelerator_warns_only_when_its_device_is_plausibly_here(
    make_dist, monkeypatch, tmp_path
):
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    nodes = str(tmp_path / "nodev[0-9]*")
    make_dist("nodev-plugin", "nodev_plugin", UNAVAILABLE.format(pattern=nodes))
    reg = registry()
    reason = "cannot import 'torch_nodev_not_installed'"
    # No device node: a development install on a CPU machine falls to the host quietly.
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginWarning)
        backend = select_backend(None, reg)
    assert backend.name == "cpu" and backend.selection_notes == ()
    monkeypatch.setenv("MTCORE_REQUIRE_ACCELERATOR", "1")  # ... unless the host is forbidden
    with pytest.raises(BackendError, match=rf"(?s)MTCORE_REQUIRE_ACCELERATOR is set.*{reason}"):
        select_backend(None, reg)
    monkeypatch.delenv("MTCORE_REQUIRE_ACCELERATOR")
    # The driver's node exists but the backend cannot run: said on every selection.
    (tmp_path / "nodev0").touch()
    for _ in range(2):
        with pytest.warns(
            PluginWarning,
            match=rf"chose 'cpu'.*'nodev' from plugin nodev_plugin \(nodev-plugin 1.0\).*{reason}",
        ) as seen:
            backend = select_backend(None, reg)
        assert backend.name == "cpu" and str(seen[0].message) in backend.selection_notes
    monkeypatch.setenv("MTCORE_REQUIRE_ACCELERATOR", "1")
    with pytest.raises(BackendError, match=rf"(?s)MTCORE_REQUIRE_ACCELERATOR is set.*{reason}"):
        select_backend(None, reg)
    assert select_backend("cpu", reg).name == "cpu"  # asking for the host by name stays allowed
    monkeypatch.delenv("MTCORE_REQUIRE_ACCELERATOR")
    with pytest.raises(BackendError, match=reason) as err:
        select_backend("nodev", reg)
    assert "does not fall back" in str(err.value)
    monkeypatch.setenv("MTCORE_BACKEND", "nodev")
    with pytest.raises(BackendError, match="MTCORE_BACKEND"):
        select_backend(None, reg)


def test_unknown_backend_lists_known_ones():
    with pytest.raises(BackendError, match=r"unknown backend 'tpu'.*known backends: .*cpu"):
        select_backend("tpu", registry())


def test_allowlist_and_disable_autoload(make_dist, monkeypatch):
    make_dist("acme-accel", "acme_plugin", ACCEL.format(name="acme", priority=1))
    monkeypatch.setenv("MTCORE_PLUGINS", "acme-accel")  # a distribution name works
    assert set(registry().backends().backends) == {"acme", "cpu"}  # cpu is the core's: always there
    monkeypatch.setenv("MTCORE_PLUGINS", "mtcore_cuda")  # so does an entry-point name
    assert set(registry().backends().backends) == {"cpu", "cuda"}
    monkeypatch.delenv("MTCORE_PLUGINS")
    monkeypatch.setenv("MTCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = registry()
    assert set(reg.backends().backends) == {"cpu"}
    assert select_backend(None, reg).name == "cpu"
    monkeypatch.setenv("MTCORE_PLUGINS", "acme_plugin")
    assert set(registry().backends().backends) == {"acme", "cpu"}


@pytest.mark.parametrize("value", ["false", "0", "no", "off", ""])
def test_disable_autoload_false_values_keep_loading(make_dist, monkeypatch, value):
    make_dist("acme-accel", "acme_plugin", ACCEL.format(name="acme", priority=1))
    monkeypatch.delenv("MTCORE_PLUGINS", raising=False)
    monkeypatch.setenv("MTCORE_DISABLE_PLUGIN_AUTOLOAD", value)
    assert "acme" in registry().backends().backends


def test_disable_autoload_garbage_is_an_error_naming_the_value(monkeypatch):
    monkeypatch.setenv("MTCORE_DISABLE_PLUGIN_AUTOLOAD", "maybe")
    with pytest.raises(PluginConfigError, match=r"MTCORE_DISABLE_PLUGIN_AUTOLOAD='maybe'.*use 1"):
        registry()


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"MTCORE_PLUGINS": "acme_plugin"}, "not named in MTCORE_PLUGINS=acme_plugin"),
        ({"MTCORE_DISABLE_PLUGIN_AUTOLOAD": "1"}, "MTCORE_DISABLE_PLUGIN_AUTOLOAD is set"),
    ],
)
def test_unknown_backend_says_which_installed_plugins_were_skipped(make_dist, monkeypatch, env, reason):
    make_dist("acme-accel", "acme_plugin", ACCEL.format(name="acme", priority=1))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(BackendError) as err:
        select_backend("cuda", registry())
    message = str(err.value)
    assert "unknown backend 'cuda'" in message
    assert "not loaded and may provide it" in message
    assert f"mtcore_cuda (mtcore-cuda 0.1.0): {reason}" in message
    assert "pip install" not in message  # mtcore-cuda is installed; it was left out


def test_broken_plugin_warns_and_requested_backend_error_carries_traceback(make_dist):
    make_dist("broken-accel", "broken_plugin", "import not_a_real_vendor_sdk_xyz\n")
    with pytest.warns(PluginWarning, match="broken_plugin.*failed to import"):
        reg = registry()
    broken = reg.discovery.broken
    assert [p.name for p in broken] == ["broken_plugin"]
    assert "not_a_real_vendor_sdk_xyz" in broken[0].traceback
    with pytest.raises(BackendError) as err:
        select_backend("broken", reg)
    message = str(err.value)
    assert "broken_plugin (broken-accel 1.0)" in message
    # A few lines to print; the frames ride on the error (and doctor --verbose shows them).
    assert "Traceback" not in message and "doctor --verbose` shows their tracebacks" in message
    assert "Traceback" in err.value.tracebacks and "not_a_real_vendor_sdk_xyz" in err.value.tracebacks
    assert isinstance(err.value.__cause__, ModuleNotFoundError)
    # Other backends still work while one plugin is broken.
    assert select_backend("cpu", reg).name == "cpu"


def test_hook_that_raises_marks_plugin_broken(make_dist):
    make_dist("raising", "raising_plugin", """
        from mtcore.backend import hookimpl

        @hookimpl
        def mtcore_backends():
            raise RuntimeError("driver probe exploded")
    """)
    reg = registry()
    with pytest.warns(PluginWarning, match="raised in mtcore_backends"):
        reg.backends()
    assert "driver probe exploded" in reg.discovery.plugins["raising_plugin"].traceback


def test_two_plugins_claiming_one_name_conflict(make_dist):
    make_dist("dup-a", "dup_a", ACCEL.format(name="dup", priority=1))
    make_dist("dup-b", "dup_b", ACCEL.format(name="dup", priority=2))
    reg = registry()
    assert sorted(p.name for p in reg.backends().conflicts["dup"]) == ["dup_a", "dup_b"]
    assert "dup" not in reg.discovery.backends
    with pytest.raises(BackendError, match="claimed by several plugins") as err:
        select_backend("dup", reg)
    assert "dup-a" in str(err.value) and "dup-b" in str(err.value)


BAD_KERNEL = """
from mtcore.backend import KernelImpl, hookimpl

def my_rms_norm(x, w):  # the contract is (x, weight, eps)
    return x

@hookimpl
def mtcore_kernels(backend, device_type):
    return [KernelImpl("rms_norm", my_rms_norm, "fast")] if backend == "cpu" else []
"""


def test_kernel_with_wrong_signature_fails_the_build_naming_plugin_and_op(make_dist, monkeypatch):
    make_dist("badkernel", "badkernel_plugin", BAD_KERNEL)
    reg = registry()
    contract = r"plugin 'badkernel_plugin'.*'rms_norm'.*\(x, w\).*\(x, weight, eps\)"
    with pytest.warns(PluginWarning, match=contract), pytest.raises(BackendError) as err:
        select_backend("cpu", reg)
    message = str(err.value)
    assert "backend 'cpu' from plugin mtcore (mtcore 0.1.0) failed to build" in message
    assert "badkernel_plugin (badkernel 1.0) is broken" in message and "Traceback" not in message
    assert "Traceback" in err.value.tracebacks
    assert "MTCORE_PLUGINS=" in message and "badkernel_plugin" not in message.split("MTCORE_PLUGINS=")[1].split(")")[0]
    assert "rms_norm" in reg.discovery.plugins["badkernel_plugin"].traceback
    # Leaving the plugin out, as the message says, builds the backend.
    monkeypatch.setenv("MTCORE_PLUGINS", "mtcore_cuda")
    assert select_backend("cpu", registry()).name == "cpu"


def test_kernel_for_unknown_op_fails_the_build(make_dist):
    make_dist("unknownop", "unknownop_plugin", """
        from mtcore.backend import KernelImpl, hookimpl

        def flash(q, k, v):
            return q

        @hookimpl
        def mtcore_kernels(backend, device_type):
            return [KernelImpl("flash_attn", flash, "flash")]
    """)
    with pytest.warns(PluginWarning), pytest.raises(BackendError, match="unknownop_plugin"):
        select_backend("cpu", registry())


def test_misspelt_hook_marks_plugin_broken(make_dist):
    make_dist("typo", "typo_plugin", """
        from mtcore.backend import hookimpl

        @hookimpl
        def mtcore_backend():
            return []
    """)
    with pytest.warns(PluginWarning, match="typo_plugin.*rejected"):
        reg = registry()
    assert "mtcore_backend" in reg.discovery.plugins["typo_plugin"].traceback


def test_kernel_pack_plugin_contributes_to_another_plugins_backend(make_dist):
    make_dist("kpack", "kpack_plugin", """
        from mtcore.backend import KernelImpl, hookimpl
        from mtcore.ops import swiglu

        def pack_swiglu(x):
            return swiglu(x)

        @hookimpl
        def mtcore_kernels(backend, device_type):
            return [KernelImpl("swiglu", pack_swiglu, "kpack", priority=99)]
    """)
    backend = select_backend("cpu", registry())
    chosen = backend.kernel_table()["swiglu"]
    assert [(k.name, k.plugin) for k in chosen] == [("kpack", "kpack_plugin")]


RAISING_PROBE = """
from mtcore.backend import BackendSpec, Collective, CpuDevice, hookimpl

class ProbeFails(CpuDevice):
    type = "flaky"
    def availability(self):
        raise OSError("driver ioctl failed")
    def device_seen(self):
        return {seen}  # True: the driver's node is there; talking to it fails

@hookimpl
def mtcore_backends():
    return [BackendSpec(name="flaky", device=ProbeFails(), collective=Collective("gloo"), priority=900)]
"""

HOST = """
from mtcore.backend import BackendSpec, Collective, CpuDevice, hookimpl

@hookimpl
def mtcore_backends():
    return [BackendSpec(name="cpu", device=CpuDevice(), collective=Collective("gloo"), accelerator=False)]
"""


@pytest.mark.parametrize("seen", [True, False])
def test_accelerator_whose_availability_raises_warns_under_auto(make_dist, monkeypatch, seen):
    """A probe that raises is the plugin's bug: said even when its device is not here (a
    device that is merely absent passes quietly, as above)."""
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    make_dist("flaky-accel", "flaky_plugin", RAISING_PROBE.format(seen=seen))
    make_dist("acme-accel", "acme_plugin", ACCEL.format(name="acme", priority=1))
    reg = registry()
    assert select_backend(None, reg).name == "acme"  # the next one by priority
    monkeypatch.setenv("MTCORE_PLUGINS", "flaky_plugin")
    with pytest.warns(PluginWarning, match=r"'flaky' from plugin flaky_plugin \(flaky-accel 1.0\).*driver ioctl failed"):
        assert select_backend(None, registry()).name == "cpu"


def test_plugin_claiming_the_cores_cpu_backend_is_broken(make_dist, monkeypatch):
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    make_dist("other-host", "other_host", HOST)
    reg = registry()
    with pytest.warns(PluginWarning, match="other_host.*raised in mtcore_backends"):
        found = reg.backends()
    assert found.backends["cpu"][1].name == "mtcore" and not found.conflicts
    assert "core's own host backend" in str(found.plugins["other_host"].error)
    assert select_backend("cpu", reg).plugin == "mtcore"


def test_conflicting_accelerator_is_skipped_under_auto_with_a_warning(make_dist, monkeypatch):
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    make_dist("dup-a", "dup_a", ACCEL.format(name="dup", priority=1))
    make_dist("dup-b", "dup_b", ACCEL.format(name="dup", priority=2))
    with pytest.warns(PluginWarning, match="chose 'cpu'.*backend 'dup' is claimed by several plugins: dup_"):
        assert select_backend(None, registry()).name == "cpu"


def test_hooks_run_through_pluggy_wrappers_and_tracing(make_dist):
    """A hook wrapper sees each plugin's call and pluggy's tracing records them: the
    registry calls hooks through the plugin manager, not the functions directly."""
    make_dist("acme-accel", "acme_plugin", ACCEL.format(name="acme", priority=1))
    make_dist("spy", "spy_plugin", """
        from mtcore.backend import hookimpl

        SEEN = []

        @hookimpl(wrapper=True)
        def mtcore_backends():
            specs = yield
            SEEN.append(sorted(spec.name for result in specs for spec in result))
            return specs
    """)
    reg = registry()
    trace: list[str] = []
    reg.manager.trace.root.setwriter(trace.append)
    undo = reg.manager.enable_tracing()
    try:
        assert "acme" in reg.backends().backends
    finally:
        undo()
    import spy_plugin

    assert ["acme"] in spy_plugin.SEEN and ["cpu"] in spy_plugin.SEEN  # one call per plugin
    assert any("mtcore_backends" in line for line in trace)


def test_tryfirst_plugin_is_called_first(make_dist):
    for name, mark in (("early", "@hookimpl(tryfirst=True)"), ("late", "@hookimpl")):
        make_dist(f"{name}-accel", f"{name}_plugin", f"""
            import sys
            from mtcore.backend import BackendSpec, Collective, CpuDevice, hookimpl

            {mark}
            def mtcore_backends():
                sys.modules["mtcore"].__dict__.setdefault("_test_call_order", []).append("{name}")
                return [BackendSpec(name="{name}", device=CpuDevice(), collective=Collective("gloo"))]
        """)
    import mtcore

    mtcore.__dict__.pop("_test_call_order", None)
    registry().backends()
    order = mtcore.__dict__.pop("_test_call_order")
    assert order.index("early") < order.index("late")
