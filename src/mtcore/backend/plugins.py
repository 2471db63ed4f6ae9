"""Plugin discovery through entry points, with pytest-like switches.

``MTCORE_PLUGINS=a,b``: load only the entry points (or distributions) named.
``MTCORE_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point unless ``MTCORE_PLUGINS``
names it. The core's own plugin (``mtcore.backend.host``: the ``cpu`` backend) is
always registered first and is not subject to either switch.

A plugin that fails to import, whose hook raises, or whose kernel breaks its
op's contract is kept as *broken*, with its traceback: a warning is issued,
``mtcore doctor`` reports it and exits non-zero, the conformance kit fails, and
building a backend that it offered unusable kernels to is an error that carries it.

Hooks are called through pluggy (so tryfirst/trylast ordering, wrappers and
``PluginManager.trace`` apply), one plugin at a time through
``PluginManager.subset_hook_caller``, so that one raising plugin is isolated
instead of failing every other plugin's call.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from importlib import metadata

import pluggy

from mtcore.backend import host
from mtcore.backend.hookspecs import ENTRY_POINT_GROUP, HOOKSPEC_GROUP, PROJECT, MtcoreHookSpecs
from mtcore.backend.kernels import KernelImpl, KernelRegistrationError, check_signature
from mtcore.backend.spec import BackendSpec

PLUGINS_ENV = "MTCORE_PLUGINS"
DISABLE_AUTOLOAD_ENV = "MTCORE_DISABLE_PLUGIN_AUTOLOAD"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class PluginWarning(UserWarning):
    """A plugin that was not asked for failed and was skipped."""


class BackendError(RuntimeError):
    """A backend cannot be selected; the message says why and what to do, in a few lines
    a command can print as they are. ``tracebacks``: the broken plugins' tracebacks, when
    that is why (the first is also the exception's ``__cause__``); ``mtcore doctor
    --verbose`` and the conformance kit show them."""

    def __init__(self, message: str, tracebacks: str = ""):
        super().__init__(message)
        self.tracebacks = tracebacks


class PluginConfigError(BackendError):
    """A plugin-selection environment variable has a value mtcore does not understand."""


@dataclass
class PluginInfo:
    name: str
    dist: str | None = None
    version: str | None = None
    error: BaseException | None = None
    traceback: str = ""
    what: str = ""  # how it broke: "failed to import", "raised in mtcore_backends", ...

    @property
    def label(self) -> str:
        dist = f" ({self.dist} {self.version})" if self.dist else ""
        return f"{self.name}{dist}"


@dataclass(frozen=True)
class SkippedPlugin:
    """An installed entry point that was not loaded, and why (an env switch)."""

    name: str
    dist: str | None
    version: str | None
    reason: str

    @property
    def label(self) -> str:
        dist = f" ({self.dist} {self.version})" if self.dist else ""
        return f"{self.name}{dist}"


@dataclass
class Discovery:
    """What plugin discovery found: loaded, broken and skipped plugins, backends, conflicts."""

    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    skipped: list[SkippedPlugin] = field(default_factory=list)
    backends: dict[str, tuple[BackendSpec, PluginInfo]] = field(default_factory=dict)
    conflicts: dict[str, list[PluginInfo]] = field(default_factory=dict)

    @property
    def broken(self) -> list[PluginInfo]:
        return [p for p in self.plugins.values() if p.error is not None]


def autoload_disabled() -> bool:
    """``MTCORE_DISABLE_PLUGIN_AUTOLOAD`` read strictly: 1/true/yes/on disable autoloading,
    0/false/no/off or unset keep it; anything else is an error, not a guess."""
    raw = os.environ.get(DISABLE_AUTOLOAD_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise PluginConfigError(
        f"{DISABLE_AUTOLOAD_ENV}={raw!r} is not understood; use 1 (or true, yes, on) to "
        "disable plugin autoloading, 0 (or false, no, off) or unset to keep it"
    )


class PluginRegistry:
    """A pluggy manager plus bookkeeping of where each plugin came from."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(PROJECT)
        self.manager.add_hookspecs(MtcoreHookSpecs)
        for ep in metadata.entry_points(group=HOOKSPEC_GROUP):
            self.manager.add_hookspecs(ep.load())  # the upper layers' hooks (their contract)
        self.discovery = Discovery()
        self._backends_collected = False
        self._kernel_failures: dict[str, list[PluginInfo]] = {}
        self.register(host, PluginInfo(host.PLUGIN_NAME, "mtcore", _core_version()))

    # -- loading -------------------------------------------------------------------
    def load_entry_points(self) -> None:
        allow = _allowlist()
        disabled = autoload_disabled()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            version = ep.dist.version if ep.dist is not None else None
            names = {ep.name, dist} - {None}
            if allow is not None and not names & allow:
                reason = f"not named in {PLUGINS_ENV}={os.environ.get(PLUGINS_ENV, '')}"
                self.discovery.skipped.append(SkippedPlugin(ep.name, dist, version, reason))
                continue
            if allow is None and disabled:
                reason = f"{DISABLE_AUTOLOAD_ENV} is set and {PLUGINS_ENV} does not name it"
                self.discovery.skipped.append(SkippedPlugin(ep.name, dist, version, reason))
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
        info.what = what
        info.traceback = "".join(traceback.format_exception(exc))
        self.discovery.plugins[info.name] = info
        warnings.warn(
            f"mtcore plugin {info.label} {what} and was skipped: {exc!r}"
            " (`mtcore doctor --verbose` shows the traceback)",
            PluginWarning,
            stacklevel=3,
        )

    # -- hooks ---------------------------------------------------------------------
    def _each(self, hook: str, **kwargs) -> Iterator[tuple[PluginInfo, object, BaseException | None]]:
        """Call ``hook`` through pluggy once per healthy plugin that implements it, in
        pluggy's call order: ``(plugin, result, error)``. Wrappers stay in every call."""
        caller = getattr(self.manager.hook, hook)
        impls = [i for i in caller.get_hookimpls() if not (i.hookwrapper or i.wrapper)]
        for impl in reversed(impls):  # pluggy calls the last of get_hookimpls() first
            info = self.discovery.plugins[impl.plugin_name]
            if info.error is not None:
                continue
            others = [i.plugin for i in impls if i is not impl]
            try:
                result = self.manager.subset_hook_caller(hook, others)(**kwargs)
            except Exception as exc:
                yield info, None, exc
                continue
            # A historic-free, firstresult-free hook returns one list per plugin called.
            yield info, (result[0] if result else None), None

    def backends(self) -> Discovery:
        """Collect every plugin's backends once; record name conflicts."""
        if self._backends_collected:
            return self.discovery
        found: dict[str, list[tuple[BackendSpec, PluginInfo]]] = {}
        for info, result, error in self._each("mtcore_backends"):
            try:
                if error is not None:
                    raise error
                specs = _backend_specs(result, info)
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
        for info, result, error in self._each(hook, **kwargs):
            if error is not None:
                self._mark_broken(info, error, f"raised in {hook}")
                continue
            out.append((info, list(result or [])))
        return out

    def kernels_for(self, backend: str, device_type: str) -> list[KernelImpl]:
        """Every plugin's kernels for ``backend``, each tagged with its plugin's name.

        A plugin whose hook raises or offers a kernel that breaks the op's
        contract contributes nothing and is marked broken; it is also recorded
        against ``backend`` (:meth:`kernel_failures`), and ``select_backend``
        refuses to build that backend without it.
        """
        impls: list[KernelImpl] = []
        failed: list[PluginInfo] = []
        for info, result, error in self._each("mtcore_kernels", backend=backend, device_type=device_type):
            try:
                if error is not None:
                    raise error
                tagged = [_tag(impl, info.name) for impl in result or []]
                for impl in tagged:
                    check_signature(impl)
            except Exception as exc:
                self._mark_broken(info, exc, f"offered unusable kernels for backend {backend!r}")
                failed.append(info)
                continue
            impls.extend(tagged)
        # Kept for good: a later build of ``backend`` skips the broken plugin, and must
        # fail the same way instead of quietly building without it.
        self._kernel_failures.setdefault(backend, []).extend(failed)
        return impls

    def environment_for(self, backend: str) -> list[tuple[str, dict[str, str]]]:
        """Every plugin's ``mtcore_environment`` defaults for ``backend``: ``(plugin,
        {name: value})``. A hook that raises or returns anything but str -> str is marked
        broken and contributes nothing."""
        found = []
        for info, result, error in self._each("mtcore_environment", backend=backend):
            try:
                if error is not None:
                    raise error
                result = {} if result is None else result
                if not isinstance(result, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in result.items()
                ):
                    raise TypeError(f"mtcore_environment returned {result!r}, not dict[str, str]")
            except Exception as exc:
                self._mark_broken(info, exc, "raised in mtcore_environment")
                continue
            found.append((info.name, result))
        return found

    def kernel_failures(self, backend: str) -> list[PluginInfo]:
        """Plugins whose kernels for ``backend`` were unusable when it was built."""
        return list(self._kernel_failures.get(backend, []))


def _backend_specs(result: object, info: PluginInfo) -> list[BackendSpec]:
    specs = list(result or [])
    for spec in specs:
        if not isinstance(spec, BackendSpec):
            raise TypeError(f"mtcore_backends returned {type(spec).__name__}, not BackendSpec")
        if spec.name == host.HOST_BACKEND and info.name != host.PLUGIN_NAME:
            raise ValueError(
                f"plugin {info.label} declares a backend named {spec.name!r}, which is the "
                "core's own host backend (mtcore.backend.host); give the backend another name"
            )
    return specs


def _core_version() -> str | None:
    try:
        return metadata.version("mtcore")
    except metadata.PackageNotFoundError:
        return None


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
