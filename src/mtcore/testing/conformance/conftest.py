"""Fixtures of the conformance kit; they serve only the tests of this package."""

from __future__ import annotations

import pytest

from mtcore.testing.conformance import plugin


def pytest_configure(config: pytest.Config) -> None:
    # Plugin autoloading off and no ``-p``: register the plugin now. The backend
    # then comes from MTCORE_BACKEND (the command-line option cannot be parsed).
    if not config.pluginmanager.is_registered(plugin):
        config.pluginmanager.register(plugin, "mtcore-conformance")


@pytest.fixture(scope="session")
def kit(pytestconfig: pytest.Config) -> plugin.KitState:
    return plugin.kit_state(pytestconfig)


@pytest.fixture(scope="session")
def backend(pytestconfig: pytest.Config):
    """The backend under test (``--mtcore-backend``, else MTCORE_BACKEND, else automatic)."""
    return plugin.kit_backend(pytestconfig)


@pytest.fixture(scope="session")
def device(backend):
    return backend.torch_device()
