"""Plugin health: every installed mtcore plugin is healthy once the backend under test is built.

A plugin is broken when it failed to import, when one of its hooks raised, or
when a kernel it offered breaks its op's contract (a parameter name that is not
the reference op's, an op that mtcore does not have). The registry skips such a
plugin with a warning and builds the backend from the others, so every other
area can pass on what remains while the user's kernels never run. This area
makes it a failure that names the plugin and carries its traceback.

The plugins are read after the backend is built (``kit_backend``), because
building it is what calls the plugins' ``mtcore_kernels`` hooks.
"""

from __future__ import annotations

import pytest

from mtcore.backend import plugin_registry
from mtcore.testing.conformance.plugin import kit_backend


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "plugin_name" in metafunc.fixturenames:
        kit_backend(metafunc.config)
        names = sorted(plugin_registry().discovery.plugins)
        metafunc.parametrize("plugin_name", names)


def test_plugin_is_healthy(plugin_name, backend):
    info = plugin_registry().discovery.plugins[plugin_name]
    if info.error is not None:
        pytest.fail(
            f"mtcore plugin {info.label} is broken (found while building backend "
            f"{backend.name!r}): {info.error!r}\n{info.traceback}",
            pytrace=False,
        )
