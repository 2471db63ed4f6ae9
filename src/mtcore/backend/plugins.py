"""Plugin discovery through entry points, with pytest-like switches.

``MTCORE_PLUGINS=a,b``: load only the entry points (or distributions) named.
``MTCORE_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point unless ``MTCORE_PLUGINS``
names it. A plugin that fails to import or whose hook raises is kept as
*broken*, with its traceback: a warning is issued, ``mtcore doctor`` shows it,
and asking for a backend while it is broken raises an error that carries it.
"""

from __future__ import annotations

import os
import traceback
import warnings
from dataclasses import dataclass, field, replace
from importlib import metadata

import pluggy

from mtcore.backend.hookspecs import ENTRY_POINT_GROUP, PROJECT, MtcoreHookSpecs
from mtcore.backend.kernels import KernelImpl, KernelRegistrationError, check_signature
from mtcore.backend.spec import BackendSpec

PLUGINS_ENV = "MTCORE_PLUGINS"
DISABLE_AUTOLOAD_ENV = "MTCORE_DISABLE_PLUGIN_AUTOLOAD"


class PluginWarning(UserWarning):
    """A plugin that was not asked for failed and was skipped."""


@dataclass
class PluginInfo:
    name: str
    dist: str | None = None
    version: str | None = None
    error: BaseException | None = None
    traceback: str = ""

    @property
    def label(self) -> str:
        dist = f" ({self.dist} {self.version})" if self.dist else ""
        return f"{self.name}{dist}"


@dataclass
class Discovery:
    """What plugin discovery found: loaded and broken plugins, backends, conflicts."""

    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    backends: dict[str, tuple[BackendSpec, PluginInfo]] = field(default_factory=dict)
    conflicts: dict[str, list[PluginInfo]] = field(default_factory=dict)

    @property
    def broken(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.error is not None]


class PluginRegistry:
    """A pluggy manager plus bookkeeping of where each plugin came from."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(MtcoreHookSpecs)
        self.discovery = Discovery()
        self._backends_collected = False

    # -- loading -------------------------------------------------------------------
    def load_entry_points(self) -> None:
        allow = _allowlist()
        disabled = os.environ.get(DISABLE_AUTOLOAD_ENV, "").strip() not in ("", "0")
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            names = {ep.name, dist} - {None}
            if allow is not None and not names & allow:
                continue
            if allow is None and disabled:
                continue
            info = PluginInfo(ep.name, dist, version)
            try:
                obj = ep.load()
            except Exception as exc:
                self._mark_broken(info, exc, "failed to import")
                continue
            self.register(obj, info)

    def register(self, obj: object, info: PluginInfo | str) -> None:
        """Register a plugin object (entry points do this; tests and embedders may too)."""
        if isinstance(info, str):
            info = PluginInfo(info)
        try:
            self.manager.register(obj, name=info.name)
            # A misspelt hook (say ``mtcore_backend``) would otherwise never be called.
            self.manager.check_pending()
        except Exception as exc:  # pluggy rejects malformed or unknown hooks here
            if self.manager.is_registered(obj):
                self.manager.unregister(obj)
            self._mark_broken(info, exc, "was rejected by pluggy")
            return
        self.discovery.plugins[info.name] = info
        self._backends_collected = False

    def _mark_broken(self, info: PluginInfo, exc: BaseException, what: str) -> None:
        info.error = exc
        info.traceback = "".join(traceback.format_exception(exc))
        self.discovery.plugins[info.name] = info
        warnings.warn(
            f"mtcore plugin {info.label} {what} and was skipped: {exc!r}"
            " (run `mtcore doctor` for the traceback)",
            PluginWarning,
            stacklevel=3,
        )

    # -- hooks ---------------------------------------------------------------------
    def backends(self) -> Discovery:
        """Collect every plugin's backends once; record name conflicts."""
        if self._backends_collected:
            return self.discovery
        found: dict[str, list[tuple[BackendSpec, PluginInfo]]] = {}
        for hook_impl in self.manager.hook.mtcore_backends.get_hookimpls():
            info = self.discovery.plugins[hook_impl.plugin_name]
            try:
                specs = list(hook_impl.function() or [])
                for spec in specs:
                    if not isinstance(spec, BackendSpec):
                        raise TypeError(f"mtcore_backends returned {type(spec).__name__}, not BackendSpec")
            except Exception as exc:
                self._mark_broken(info, exc, "raised in mtcore_backends")
                continue
            for spec in specs:
                found.setdefault(spec.name, []).append((spec, info))
        self.discovery.backends = {n: c[0] for n, c in found.items() if len(c) == 1}
        self.discovery.conflicts = {n: [i for _, i in c] for n, c in found.items() if len(c) > 1}
        self._backends_collected = True
        return self.discovery

    def collect(self, hook: str, **kwargs) -> list[tuple[PluginInfo, list]]:
        """Call ``hook`` of every healthy plugin that implements it: ``(plugin, results)``
        pairs. A plugin whose hook raises is marked broken (warning, doctor) and skipped."""
        out = []
        for hook_impl in getattr(self.manager.hook, hook).get_hookimpls():
            info = self.discovery.plugins[hook_impl.plugin_name]
            if info.error is not None:
                continue
            try:
                out.append((info, list(hook_impl.function(**kwargs) or [])))
            except Exception as exc:
                self._mark_broken(info, exc, f"raised in {hook}")
        return out

    def kernels_for(self, backend: str, device_type: str) -> list[KernelImpl]:
        """Every plugin's kernels for ``backend``, each tagged with its plugin's name.

        A plugin whose hook raises or offers a kernel that breaks the op's
        contract contributes nothing: it is marked broken (a warning, and
        ``mtcore doctor`` shows why) and the backend builds without it.
        """
        impls: list[KernelImpl] = []
        for hook_impl in self.manager.hook.mtcore_kernels.get_hookimpls():
            info = self.discovery.plugins[hook_impl.plugin_name]
            if info.error is not None:
                continue
            try:
                offered = hook_impl.function(backend=backend, device_type=device_type) or []
                tagged = [_tag(impl, info.name) for impl in offered]
                for impl in tagged:
                    check_signature(impl)
            except Exception as exc:
                self._mark_broken(info, exc, f"offered unusable kernels for backend {backend!r}")
                continue
            impls.extend(tagged)
        return impls


def _tag(impl: KernelImpl, plugin: str) -> KernelImpl:
    if not isinstance(impl, KernelImpl):
        raise KernelRegistrationError(
            f"plugin {plugin!r}: mtcore_kernels returned {type(impl).__name__}, not KernelImpl"
        )
    return replace(impl, plugin=plugin)


def _allowlist() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None or not raw.strip():
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}
