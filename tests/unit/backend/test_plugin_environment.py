"""Hook ``mtcore_environment``: a plugin's defaults are set when its backend is built,
only where the user has not set them, and the record says which plugin set what."""

from __future__ import annotations

import os

import pytest

from mtcore.backend import PluginRegistry, PluginWarning, select_backend
from mtcore.backend.environment import apply_environment, set_by_plugin

NAME = "MTCORE_TEST_ENV_DEFAULT"


def _registry() -> PluginRegistry:
    reg = PluginRegistry()
    reg.load_entry_points()
    return reg


def test_a_default_is_set_where_unset_and_the_users_value_is_kept(make_dist, monkeypatch):
    make_dist("envdefault", "envdefault_plugin", f"""
        from mtcore.backend import hookimpl

        @hookimpl
        def mtcore_environment(backend):
            return {{"{NAME}": "0"}} if backend == "cpu" else {{"{NAME}_OTHER": "1"}}
    """)  # fmt: skip
    monkeypatch.delenv(NAME, raising=False)
    monkeypatch.delenv(f"{NAME}_OTHER", raising=False)
    select_backend("cpu", _registry())
    assert os.environ[NAME] == "0" and f"{NAME}_OTHER" not in os.environ
    assert set_by_plugin(NAME) == "envdefault_plugin"
    monkeypatch.setenv(NAME, "1")  # the user's value, set before the build
    select_backend("cpu", _registry())
    assert os.environ[NAME] == "1" and set_by_plugin(NAME) is None


def test_an_empty_value_counts_as_set_and_nothing_else_is_touched():
    environ = {"KEPT": ""}
    applied = apply_environment([("p", {"KEPT": "0", "NEW": "2"})], environ)
    assert applied == {"NEW": "2"} and environ == {"KEPT": "", "NEW": "2"}
    assert set_by_plugin("NEW", environ) == "p" and set_by_plugin("KEPT", environ) is None


def test_a_hook_returning_a_non_string_value_is_broken_and_sets_nothing(make_dist, monkeypatch):
    make_dist("envbad", "envbad_plugin", f"""
        from mtcore.backend import hookimpl

        @hookimpl
        def mtcore_environment(backend):
            return {{"{NAME}_BAD": 0}}
    """)  # fmt: skip
    monkeypatch.delenv(f"{NAME}_BAD", raising=False)
    with pytest.warns(PluginWarning, match="envbad_plugin.*mtcore_environment"):
        select_backend("cpu", _registry())
    assert f"{NAME}_BAD" not in os.environ
