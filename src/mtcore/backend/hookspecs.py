"""The plugin contract: the hooks an accelerator plugin implements.

The upper layers declare their own hooks in their own modules (the models layer:
``mtcore.models.hookspecs``), found through the ``mtcore.hookspecs`` entry point group.

A plugin is any importable object (usually a module) named by an entry point in
the group ``mtcore.plugins``::

    [project.entry-points."mtcore.plugins"]
    myaccel = "mtcore_myaccel.plugin"

and implementing any of the hooks below, each marked with ``@hookimpl``.
Hook functions run at discovery time: keep them cheap and never touch the
hardware there (no device queries, no vendor imports that may fail). Do that
lazily, in ``Device.availability()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # annotations only: the spec modules import this one's markers
    from mtcore.backend.kernels import KernelImpl
    from mtcore.backend.spec import BackendSpec

PROJECT = "mtcore"
ENTRY_POINT_GROUP = "mtcore.plugins"
# Hooks of the layers above this one (models: ``mtcore_model_families``) are declared
# where they belong and named by an entry point of this group; the registry adds them
# before it loads any plugin, so a plugin's hook is checked against every layer's spec.
HOOKSPEC_GROUP = "mtcore.hookspecs"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class MtcoreHookSpecs:
    @hookspec
    def mtcore_backends(self) -> list[BackendSpec]:
        """Contribute backends: return a list of ``mtcore.backend.BackendSpec``.

        Each spec names the backend (the string users pass as
        ``MTCORE_BACKEND``), and carries its device (``Device``), its collective
        (``Collective``), its FP8 support (``FP8``), a ``priority`` for
        automatic selection among available accelerators (higher first), and
        ``notes`` that ``mtcore doctor`` prints (say there what was not tested).

        A backend name must be unique across installed plugins; two plugins
        claiming one name make that name unusable until one is removed or
        excluded with ``MTCORE_PLUGINS``. ``cpu`` is the core's own
        (``mtcore.backend.host``): a plugin declaring it is broken.

        Called through pluggy once per plugin, so a hook that raises marks only
        its own plugin broken; ``tryfirst``/``trylast`` and hook wrappers apply.
        """

    @hookspec
    def mtcore_kernels(self, backend: str, device_type: str) -> list[KernelImpl]:
        """Contribute kernel implementations to ``backend``.

        Called once for every backend being built, with its name and its torch
        device type. Return a list of ``mtcore.backend.KernelImpl`` (or an
        empty list when none apply). Each implementation must have exactly the
        parameter names of the reference op in ``mtcore.ops.REFERENCE_OPS``;
        a mismatch (or an unknown op name, or a hook that raises) marks the
        plugin broken and makes ``backend`` fail to build, with an error naming
        the plugin and the op. A kernel pack may be a plugin of its own that
        implements only this hook.

        Implementations must match the reference op within the tolerances of
        the conformance kit (``pytest --pyargs mtcore.testing.conformance
        --mtcore-backend NAME``).
        """

    @hookspec
    def mtcore_environment(self, backend: str) -> dict[str, str]:
        """Environment variables that ``backend``'s libraries read and that have one
        sensible value for training: return ``{name: value}`` (an empty dict for other
        backends).

        Called when ``backend`` is built in a process, after its device was found
        available and before any process group exists. mtcore sets each variable the
        user has not set (a value already in the environment, even an empty one, is
        kept) and ``mtcore doctor`` says which ones it set. Return only variables with
        no trade-off (a debug check that costs time, say); tuning choices belong in the
        user's launch script and in the plugin's documentation.
        """
