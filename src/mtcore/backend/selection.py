"""Choosing a backend: explicit name > MTCORE_BACKEND > best available accelerator > cpu.

A backend that was asked for and cannot run is an error that says why; mtcore
never falls back to the CPU silently. Automatic selection skips an accelerator
whose availability check raises, or whose name several plugins claim, with a
warning that names it.
"""

from __future__ import annotations

import os
import warnings

from mtcore.backend.plugins import PLUGINS_ENV, PluginInfo, PluginRegistry, PluginWarning
from mtcore.backend.spec import Backend, BackendSpec

BACKEND_ENV = "MTCORE_BACKEND"
HOST_BACKEND = "cpu"


class BackendError(RuntimeError):
    """A backend cannot be selected; the message says why and what to do."""


_registry: PluginRegistry | None = None
_current: Backend | None = None


def plugin_registry(reload: bool = False) -> PluginRegistry:
    """The process-wide registry, loaded from entry points on first use."""
    global _registry, _current
    if _registry is None or reload:
        _registry = PluginRegistry()
        _registry.load_entry_points()
        _current = None
    return _registry


def select_backend(name: str | None = None, registry: PluginRegistry | None = None) -> Backend:
    """Build the backend ``name`` (or the automatic choice) from the installed plugins."""
    registry = registry or plugin_registry()
    found = registry.backends()
    requested = name or os.environ.get(BACKEND_ENV) or None
    if requested is not None:
        return _build(registry, requested, how="requested" if name else f"requested by {BACKEND_ENV}")
    for claimed, owners in sorted(found.conflicts.items()):
        if claimed != HOST_BACKEND:  # a conflict over cpu is the error below
            message = _conflict_message(registry, claimed, owners)
            warnings.warn(f"automatic backend selection skipped {claimed!r}: {message}", PluginWarning, stacklevel=2)
    accelerators = sorted(
        (entry for entry in found.backends.values() if entry[0].accelerator),
        key=lambda entry: (-entry[0].priority, entry[0].name),  # ties break by name, not install order
    )
    for spec, info in accelerators:
        if _available_for_auto(spec, info):
            return _build(registry, spec.name, how="auto")
    if HOST_BACKEND in found.backends or HOST_BACKEND in found.conflicts:
        return _build(registry, HOST_BACKEND, how="auto")
    raise BackendError(
        "no backend is available: no accelerator plugin found a device and no plugin "
        f"provides {HOST_BACKEND!r} (pip install mtcore-cuda provides it)" + _broken_suffix(registry)
    )


def get_backend(name: str | None = None) -> Backend:
    """The process's backend, selected once and then reused."""
    global _current
    if _current is None or (name is not None and name != _current.name):
        _current = select_backend(name)
    return _current


def _build(registry: PluginRegistry, name: str, how: str) -> Backend:
    found = registry.discovery
    if name in found.conflicts:
        raise BackendError(_conflict_message(registry, name, found.conflicts[name]))
    if name not in found.backends:
        known = ", ".join(sorted(found.backends)) or "none"
        error = BackendError(f"unknown backend {name!r} ({how}); known backends: {known}" + _broken_suffix(registry))
        broken = found.broken
        if broken:
            raise error from broken[0].error
        raise error
    spec, info = found.backends[name]
    available = spec.availability()
    if not available:
        raise BackendError(
            f"backend {name!r} from plugin {info.label} was {how} but cannot run here: "
            f"{available.reason}. mtcore does not fall back to another backend; choose one "
            f"that `mtcore doctor` lists as available."
        )
    try:
        kernels = registry.kernels_for(spec.name, spec.device.type)
        return Backend(spec, info.name, kernels)
    except Exception as exc:
        raise BackendError(f"backend {name!r} from plugin {info.label} failed to build: {exc}") from exc


def _available_for_auto(spec: BackendSpec, info: PluginInfo) -> bool:
    """Probe an accelerator; a probe that raises is a warning, not a silent skip."""
    try:
        return bool(spec.device.availability())
    except Exception as exc:
        warnings.warn(
            f"automatic backend selection skipped backend {spec.name!r} from plugin {info.label}: "
            f"its availability check raised {exc!r}",
            PluginWarning,
            stacklevel=3,
        )
        return False


def _conflict_message(registry: PluginRegistry, name: str, owners: list[PluginInfo]) -> str:
    first, *others = sorted(owners, key=lambda p: p.name)
    keep = ",".join(n for n in sorted(registry.discovery.plugins) if n not in {p.name for p in others})
    return (
        f"backend {name!r} is claimed by several plugins: {', '.join(p.label for p in owners)}, so none "
        f"of them is used. Uninstall all but one, or leave the others out with {PLUGINS_ENV} "
        f"(for example {PLUGINS_ENV}={keep} keeps {first.name}'s)"
    )


def _broken_suffix(registry: PluginRegistry) -> str:
    broken = registry.discovery.broken
    if not broken:
        return ""
    lines = [f"\n  plugin {p.label} is broken: {p.error!r}\n{_indent(p.traceback)}" for p in broken]
    return "\nThese plugins failed to load and may be the ones that provide it:" + "".join(lines)


def _indent(text: str) -> str:
    return "".join("    " + line for line in text.splitlines(keepends=True))
