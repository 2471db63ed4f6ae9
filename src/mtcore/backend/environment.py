"""Environment variables set for a backend by its plugins (hook ``mtcore_environment``),
only where the user has not set them, and a record of which were, for ``mtcore doctor``."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping

# name -> (value, plugin) for every variable a plugin's default set in this process.
_SET_BY_PLUGIN: dict[str, tuple[str, str]] = {}


def apply_environment(
    defaults: Iterable[tuple[str, Mapping[str, str]]],
    environ: MutableMapping[str, str] | None = None,
) -> dict[str, str]:
    """Set each ``(plugin, {name: value})`` default that ``environ`` lacks; returns the
    names set now, with their values. A name already present (the user's) is kept."""
    environ = os.environ if environ is None else environ
    applied = {}
    for plugin, variables in defaults:
        for name, value in variables.items():
            if name in environ:
                continue
            environ[name] = value
            applied[name] = value
            _SET_BY_PLUGIN[name] = (value, plugin)
    return applied


def set_by_plugin(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The plugin that set ``name`` in this process, if the environment still holds its
    value; None when the user set it or nobody did."""
    environ = os.environ if environ is None else environ
    found = _SET_BY_PLUGIN.get(name)
    if found is None or environ.get(name) != found[0]:
        return None
    return found[1]
