"""Plugin discovery and backend selection, with real entry points on sys.path."""

from __future__ import annotations

import pytest

from mtcore.backend import BackendError, PluginRegistry, PluginWarning, select_backend

ACCEL = """
from mtcore.backend import BackendSpec, Collective, CpuDevice, hookimpl

@hookimpl
def mtcore_backends():
    return [BackendSpec(name="{name}", device=CpuDevice(), collective=Collective("gloo"),
                        priority={priority})]
"""

UNAVAILABLE = """
from mtcore.backend import Availability, BackendSpec, Collective, CpuDevice, hookimpl

class NoDevice(CpuDevice):
    type = "nodev"
    def availability(self):
        return Availability(False, "no nodev card is plugged in")

@hookimpl
def mtcore_backends():
    return [BackendSpec(name="nodev", device=NoDevice(), collective=Collective("gloo"), priority=500)]
"""


def registry() -> PluginRegistry:
    reg = PluginRegistry()
    reg.load_entry_points()
    return reg


def test_installed_cuda_plugin_is_found_with_version(monkeypatch):
    monkeypatch.delenv("MTCORE_PLUGINS", raising=False)
    found = registry().backends()
    info = found.plugins["mtcore_cuda"]
    assert (info.dist, info.error) == ("mtcore-cuda", None)
    assert info.version
    assert {"cpu", "cuda"} <= set(found.backends)


def test_third_party_plugin_selected_by_name_and_auto_by_priority(make_dist, monkeypatch):
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    make_dist("acme-accel", "acme_plugin", ACCEL.format(name="acme", priority=7))
    reg = registry()
    assert select_backend("acme", reg).plugin == "acme_plugin"
    # Available accelerator beats the host backend when nothing is asked for.
    assert select_backend(None, reg).name == "acme"
    monkeypatch.setenv("MTCORE_BACKEND", "cpu")
    assert select_backend(None, reg).name == "cpu"


def test_unavailable_accelerator_is_skipped_automatically_but_error_when_asked(make_dist, monkeypatch):
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    make_dist("nodev-plugin", "nodev_plugin", UNAVAILABLE)
    reg = registry()
    assert select_backend(None, reg).name == "cpu"
    with pytest.raises(BackendError, match="no nodev card is plugged in") as err:
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
    assert set(registry().backends().backends) == {"acme"}
    monkeypatch.setenv("MTCORE_PLUGINS", "mtcore_cuda")  # so does an entry-point name
    assert set(registry().backends().backends) == {"cpu", "cuda"}
    monkeypatch.delenv("MTCORE_PLUGINS")
    monkeypatch.setenv("MTCORE_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = registry()
    assert reg.backends().backends == {}
    with pytest.raises(BackendError, match="no backend is available"):
        select_backend(None, reg)
    monkeypatch.setenv("MTCORE_PLUGINS", "acme_plugin")
    assert set(registry().backends().backends) == {"acme"}


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
    assert "Traceback" in message and "not_a_real_vendor_sdk_xyz" in message
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


def test_kernel_with_wrong_signature_rejected_naming_plugin_and_op(make_dist):
    make_dist("badkernel", "badkernel_plugin", """
        from mtcore.backend import KernelImpl, hookimpl

        def my_rms_norm(x, w):  # the contract is (x, weight, eps)
            return x

        @hookimpl
        def mtcore_kernels(backend, device_type):
            return [KernelImpl("rms_norm", my_rms_norm, "fast")] if backend == "cpu" else []
    """)
    reg = registry()
    with pytest.warns(PluginWarning, match=r"plugin 'badkernel_plugin'.*'rms_norm'.*\(x, w\).*\(x, weight, eps\)"):
        backend = select_backend("cpu", reg)
    # The rejected kernel is not used; the plugin shows as broken; the backend still works.
    assert "fast" not in [k.name for k in backend.kernel_table()["rms_norm"]]
    assert "rms_norm" in reg.discovery.plugins["badkernel_plugin"].traceback


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


def test_accelerator_whose_availability_raises_warns_under_auto(make_dist, monkeypatch):
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    make_dist("flaky-accel", "flaky_plugin", RAISING_PROBE)
    make_dist("acme-accel", "acme_plugin", ACCEL.format(name="acme", priority=1))
    reg = registry()
    with pytest.warns(PluginWarning, match=r"'flaky' from plugin flaky_plugin \(flaky-accel 1.0\).*driver ioctl failed"):
        assert select_backend(None, reg).name == "acme"  # the next one by priority


def test_second_plugin_claiming_cpu_is_a_conflict_not_a_missing_backend(make_dist, monkeypatch):
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    make_dist("other-host", "other_host", HOST)
    reg = registry()
    for name in ("cpu", None):  # asked for, and automatic
        with pytest.raises(BackendError, match="'cpu' is claimed by several plugins") as err:
            select_backend(name, reg)
        message = str(err.value)
        assert "other_host (other-host 1.0)" in message and "mtcore_cuda (mtcore-cuda" in message
        assert "MTCORE_PLUGINS=" in message and "pip install" not in message


def test_conflicting_accelerator_is_skipped_under_auto_with_a_warning(make_dist, monkeypatch):
    monkeypatch.delenv("MTCORE_BACKEND", raising=False)
    make_dist("dup-a", "dup_a", ACCEL.format(name="dup", priority=1))
    make_dist("dup-b", "dup_b", ACCEL.format(name="dup", priority=2))
    with pytest.warns(PluginWarning, match="skipped 'dup': backend 'dup' is claimed by several plugins: dup_a"):
        assert select_backend(None, registry()).name == "cpu"
