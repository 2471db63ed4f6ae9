"""Choosing a backend: explicit name > MTCORE_BACKEND > best available accelerator > cpu.

A backend that was asked for and cannot run is an error that says why; mtcore
never falls back to the CPU silently. When automatic selection lands on the host
although an accelerator plugin is installed whose device is plausibly here (its
driver's files exist, yet the backend cannot run: library missing, no visible
device, its probe raised), or two plugins claim one backend, or a plugin is broken,
it warns with each plugin and reason, and records them on the backend
(``Backend.selection_notes``) for the trainer's first lines. An accelerator plugin
whose device is nowhere on this machine (a development install on a CPU host, CI)
is passed over quietly: ``mtcore doctor`` lists it with its reason.
``MTCORE_REQUIRE_ACCELERATOR=1`` makes any landing on the host an error instead,
naming every plugin passed over, for clusters where the CPU is never the target.
"""

from __future__ import annotations

import os
import warnings

from mtcore.backend.environment import apply_environment
from mtcore.backend.host import HOST_BACKEND, PLUGIN_NAME
from mtcore.backend.plugins import (
    _FALSE,
    _TRUE,
    PLUGINS_ENV,
    BackendError,
    PluginConfigError,
    PluginInfo,
    PluginRegistry,
    PluginWarning,
)
from mtcore.backend.spec import Backend

BACKEND_ENV = "MTCORE_BACKEND"
REQUIRE_ACCELERATOR_ENV = "MTCORE_REQUIRE_ACCELERATOR"


_registry: PluginRegistry | None = None
_current: Backend | None = None


def plugin_registry(reload: bool = False) -> PluginRegistry:
    """The process-wide registry, loaded from entry points on first use."""
    global _registry, _current
    if _registry is None or reload:
        registry = PluginRegistry()
        registry.load_entry_points()
        _registry, _current = registry, None
    return _registry


def accelerator_required() -> bool:
    """``MTCORE_REQUIRE_ACCELERATOR``: 1/true/yes/on forbid automatic selection of the host."""
    raw = os.environ.get(REQUIRE_ACCELERATOR_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise PluginConfigError(
        f"{REQUIRE_ACCELERATOR_ENV}={raw!r} is not understood; use 1 (or true, yes, on) "
        "or 0 (or false, no, off)"
    )


def select_backend(name: str | None = None, registry: PluginRegistry | None = None) -> Backend:
    """Build the backend ``name`` (or the automatic choice) from the installed plugins."""
    registry = registry or plugin_registry()
    found = registry.backends()
    requested = name or os.environ.get(BACKEND_ENV) or None
    if requested is not None:
        return _build(registry, requested, how="requested" if name else f"requested by {BACKEND_ENV}")
    # Notes worth a warning, then those about accelerators whose device is not here.
    passed_over = [_conflict_message(registry, n, owners) for n, owners in sorted(found.conflicts.items())]
    absent: list[str] = []
    accelerators = sorted(
        (entry for entry in found.backends.values() if entry[0].accelerator),
        key=lambda entry: (-entry[0].priority, entry[0].name),  # ties break by name, not install order
    )
    for spec, info in accelerators:
        available = spec.availability()
        if available:
            return _build(registry, spec.name, how="auto")
        note = f"backend {spec.name!r} from plugin {info.label} cannot run here: {available.reason}"
        # A check that raised is the plugin's bug: worth a word even with no device here.
        (passed_over if available.raised or spec.device_seen() else absent).append(note)
    passed_over += [f"plugin {p.label} is broken ({p.what}): {p.error!r}" for p in found.broken]
    if accelerator_required():
        why = "\n  ".join(passed_over + absent) or (
            "no accelerator plugin is installed (install your accelerator's mtcore plugin)"
        )
        raise BackendError(
            f"{REQUIRE_ACCELERATOR_ENV} is set and no accelerator backend can run here:\n  {why}"
            "\n`mtcore doctor --verbose` shows every plugin and backend, with tracebacks"
        )
    backend = _build(registry, HOST_BACKEND, how="auto")
    if passed_over:
        note = (
            f"automatic backend selection chose {HOST_BACKEND!r} although accelerator plugins "
            "are installed: " + "; ".join(passed_over)
            + f" (set {REQUIRE_ACCELERATOR_ENV}=1 to make this an error, or "
            f"{BACKEND_ENV}={HOST_BACKEND} to choose the host)"
        )
        backend.selection_notes = (note,)
        warnings.warn(note, PluginWarning, stacklevel=2)
    return backend


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
        error = BackendError(
            f"unknown backend {name!r} ({how}); known backends: {known}"
            + _skipped_suffix(registry)
            + _broken_suffix(registry.discovery.broken, "failed to load and may be the ones that provide it"),
            _tracebacks(registry.discovery.broken),
        )
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
    apply_environment(registry.environment_for(spec.name))  # before any process group
    kernels = registry.kernels_for(spec.name, spec.device.type)
    failed = registry.kernel_failures(spec.name)
    if failed:
        keep = ",".join(n for n in _loadable(registry) if n not in {p.name for p in failed})
        raise BackendError(
            f"backend {name!r} from plugin {info.label} failed to build: a plugin offered it "
            f"kernels that break their op's contract. Fix the plugin, or leave it out with "
            f"{PLUGINS_ENV} (for example {PLUGINS_ENV}={keep})"
            + _broken_suffix(failed, "offered unusable kernels"),
            _tracebacks(failed),
        ) from failed[0].error
    try:
        return Backend(spec, info.name, kernels)
    except Exception as exc:
        raise BackendError(f"backend {name!r} from plugin {info.label} failed to build: {exc}") from exc


def _conflict_message(registry: PluginRegistry, name: str, owners: list[PluginInfo]) -> str:
    first, *others = sorted(owners, key=lambda p: p.name)
    keep = ",".join(n for n in _loadable(registry) if n not in {p.name for p in others})
    return (
        f"backend {name!r} is claimed by several plugins: {', '.join(p.label for p in owners)}, so none "
        f"of them is used. Uninstall all but one, or leave the others out with {PLUGINS_ENV} "
        f"(for example {PLUGINS_ENV}={keep} keeps {first.name}'s)"
    )


def _loadable(registry: PluginRegistry) -> list[str]:
    """Loaded plugins that ``MTCORE_PLUGINS`` can name (the core's own is always loaded)."""
    return sorted(n for n in registry.discovery.plugins if n != PLUGIN_NAME)


def _skipped_suffix(registry: PluginRegistry) -> str:
    skipped = registry.discovery.skipped
    if not skipped:
        return ""
    lines = [f"\n  {p.label}: {p.reason}" for p in skipped]
    return "\nThese installed plugins were not loaded and may provide it:" + "".join(lines)


def _broken_suffix(broken: list[PluginInfo], what: str) -> str:
    """One line per broken plugin (its error); the tracebacks stay out of the message
    (``_tracebacks``): a command's error is a few lines, not pages of frames."""
    if not broken:
        return ""
    lines = [f"\n  plugin {p.label} is broken: {p.error!r}" for p in broken]
    hint = "\n(`mtcore doctor --verbose` shows their tracebacks)"
    return f"\nThese plugins {what}:" + "".join(lines) + hint


def _tracebacks(broken: list[PluginInfo]) -> str:
    return "".join(f"plugin {p.label}:\n{_indent(p.traceback)}" for p in broken)


def _indent(text: str) -> str:
    return "".join("    " + line for line in text.splitlines(keepends=True))
