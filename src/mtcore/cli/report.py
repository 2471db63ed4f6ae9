"""Facts about this installation, gathered as plain data for ``mtcore plugins`` and ``doctor``.

Everything here returns JSON-ready dicts and lists (``--json`` prints them as
they are; the text renderers read the same data). Every call into plugin code is
guarded: a plugin that raises shows up as an error in the report, never as a
crash of the command.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import traceback
import warnings

import pluggy
import torch

import mtcore
from mtcore.backend import (
    Backend,
    BackendError,
    BackendSpec,
    KernelQuery,
    PluginRegistry,
    PluginWarning,
    network,
    plugin_registry,
    select_backend,
)
from mtcore.backend.collective import OPS as COLLECTIVE_OPS
from mtcore.backend.kernels import KERNELS_ENV, REFERENCE
from mtcore.backend.plugins import DISABLE_AUTOLOAD_ENV, PLUGINS_ENV
from mtcore.backend.selection import BACKEND_ENV
from mtcore.precision.fp8 import SCALINGS, FP8Recipe

SCHEMA_VERSION = 1
ENV_VARS = (BACKEND_ENV, PLUGINS_ENV, DISABLE_AUTOLOAD_ENV, KERNELS_ENV)
COLLECTIVE_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
PEAK_DTYPES = ("float32", "bfloat16", "float16", "float8")


def load_registry() -> PluginRegistry:
    """The process-wide registry with backends collected.

    Broken plugins warn when they load; the report lists them with their error,
    so the warning would only repeat it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginWarning)
        registry = plugin_registry()
        registry.backends()
    return registry


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def error_facts(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


# -- header ------------------------------------------------------------------------
def header_facts() -> dict:
    return {
        "schema": SCHEMA_VERSION,
        "mtcore": mtcore.__version__,
        "torch": torch.__version__,
        "pluggy": pluggy.__version__,
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": sys.platform,
        "env": {name: os.environ.get(name) for name in ENV_VARS},
    }


# -- plugins -----------------------------------------------------------------------
def family_facts() -> dict:
    """The model families ``model.family`` can select: name, where it comes from, what it
    is, and whether it has a HuggingFace adapter and generation; or the error that
    listing them raised (a clashing family plugin)."""
    from mtcore.models import BUILTIN_FAMILIES, FamilyError, family_names, get_family

    try:
        names = family_names()
    except FamilyError as exc:
        return {"families": [], "error": error_facts(exc)}
    families = []
    for name in names:
        family = get_family(name)
        families.append(
            {
                "name": name,
                "source": "built-in" if name in BUILTIN_FAMILIES else "plugin",
                "description": family.description,
                "hf": list(family.hf.model_types) if family.hf is not None else [],
                "generates": family.capabilities.generates,
                "capabilities": dataclasses.asdict(family.capabilities),
            }
        )
    return {"families": families, "error": None}


def plugin_facts(registry: PluginRegistry) -> list[dict]:
    """One entry per loaded or broken plugin, with the backends (and model families) it
    provides."""
    found = registry.discovery
    provides: dict[str, list[str]] = {}
    for name, (_, info) in found.backends.items():
        provides.setdefault(info.name, []).append(name)
    contested: dict[str, list[str]] = {}
    for name, infos in found.conflicts.items():
        for info in infos:
            contested.setdefault(info.name, []).append(name)
    kernel_plugins = {h.plugin_name for h in registry.manager.hook.mtcore_kernels.get_hookimpls()}
    from mtcore.models import FamilyError, families_by_plugin

    try:
        families = families_by_plugin()
    except FamilyError:  # a clash: `mtcore doctor` reports it under "model families"
        families = {}
    plugins = []
    for info in found.plugins.values():
        entry = {
            "name": info.name,
            "dist": info.dist,
            "version": info.version,
            "status": "broken" if info.error is not None else "ok",
            "backends": sorted(provides.get(info.name, [])),
            "conflicting_backends": sorted(contested.get(info.name, [])),
            "kernels": info.name in kernel_plugins,
            "families": families.get(info.name, []),
            "error": None,
        }
        if info.error is not None:
            entry["error"] = {
                "type": type(info.error).__name__,
                "message": str(info.error),
                "traceback": info.traceback,
            }
        plugins.append(entry)
    return sorted(plugins, key=lambda p: p["name"])


def skipped_plugin_facts(registry: PluginRegistry) -> list[dict]:
    """Installed entry points that were not loaded, and allowlist names that match nothing."""
    found = registry.discovery
    skipped = [
        {"name": p.name, "dist": p.dist, "version": p.version, "reason": p.reason}
        for p in found.skipped
    ]
    raw = os.environ.get(PLUGINS_ENV, "")
    allow = {n.strip() for n in raw.split(",") if n.strip()}
    seen = {name for p in found.skipped for name in (p.name, p.dist) if name}
    seen |= {name for p in found.plugins.values() for name in (p.name, p.dist) if name}
    for name in sorted(allow - seen):
        skipped.append(
            {
                "name": name,
                "dist": None,
                "version": None,
                "reason": f"named in {PLUGINS_ENV} but no installed plugin or distribution has this name",
            }
        )
    return skipped


def installation_error(data: dict) -> dict | None:
    """Broken plugins, backend conflicts and a failed default selection as one error
    (``mtcore doctor`` exits 1 on it)."""
    problems, tracebacks = [], []
    for p in data["plugins"]:
        if p["status"] == "broken":
            problems.append(f"plugin {p['name']} is broken: {p['error']['message']}")
            tracebacks.append(f"traceback of plugin {p['name']}:\n{p['error']['traceback']}")
    for c in data["conflicts"]:
        owners = ", ".join(p["name"] for p in c["plugins"])
        problems.append(f"backend {c['backend']!r} is claimed by several plugins ({owners})")
    selection = data["selection"]["error"]
    if selection is not None:  # no default backend: MTCORE_REQUIRE_ACCELERATOR, say
        problems.append(f"no default backend: {selection['message'].splitlines()[0]}")
    if not problems:
        return None
    return {
        "type": "InstallationError",
        "message": "; ".join(problems),
        "traceback": "\n".join(tracebacks),
    }


# -- backends ----------------------------------------------------------------------
def backend_summaries(registry: PluginRegistry) -> list[dict]:
    """Every backend with its plugin and availability (cheap: builds nothing)."""
    summaries = []
    for name, (spec, info) in sorted(registry.discovery.backends.items()):
        entry = {
            "name": name,
            "plugin": info.name,
            "dist": info.dist,
            "version": info.version,
            "description": spec.description,
            "accelerator": spec.accelerator,
            "priority": spec.priority,
            "device_type": getattr(spec.device, "type", None),
            "available": False,
            "reason": "",
            "notes": list(spec.notes),
            "error": None,
            "diagnostics": None,
            "details": None,
        }
        try:
            availability = spec.availability()
            entry["available"] = bool(availability)
            entry["reason"] = "" if availability else availability.reason
        except Exception as exc:
            entry["reason"] = f"availability check raised {exc!r}"
            entry["error"] = error_facts(exc)
        summaries.append(entry)
    return summaries


def conflict_facts(registry: PluginRegistry) -> list[dict]:
    return [
        {
            "backend": name,
            "plugins": [{"name": i.name, "dist": i.dist, "version": i.version} for i in infos],
        }
        for name, infos in sorted(registry.discovery.conflicts.items())
    ]


def selection_facts(registry: PluginRegistry) -> dict:
    """What ``get_backend()`` would choose with no argument, and why."""
    requested = os.environ.get(BACKEND_ENV) or None
    how = f"{BACKEND_ENV}={requested}" if requested else "automatic"
    try:
        with warnings.catch_warnings():  # the report lists conflicts and failed probes itself
            warnings.simplefilter("ignore", PluginWarning)
            backend = select_backend(None, registry)
    except BackendError as exc:
        return {"backend": None, "how": how, "error": error_facts(exc), "notes": []}
    except Exception as exc:  # a plugin raised inside selection
        return {"backend": None, "how": how, "error": error_facts(exc), "notes": []}
    return {
        "backend": backend.name,
        "how": how,
        "error": None,
        "notes": list(backend.selection_notes),
    }


def diagnostic_facts(spec: BackendSpec) -> dict | None:
    """The plugin's own diagnostics ({label: value}); they may probe the machine (seconds)."""
    if spec.diagnostics is None:
        return None
    try:
        return {str(k): str(v) for k, v in dict(spec.diagnostics()).items()}
    except Exception as exc:
        return {"error": f"diagnostics raised {exc!r}"}


def build_backend(registry: PluginRegistry, name: str) -> Backend:
    """``select_backend(name)``; any failure becomes a BackendError naming the backend."""
    try:
        return select_backend(name, registry)
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(f"backend {name!r} failed to build: {exc!r}") from exc


def backend_details(backend: Backend) -> dict:
    """Capabilities, collectives, FP8 and the kernel table of a built backend."""
    return {
        "capabilities": _guarded(capability_facts, backend),
        "collective": _guarded(collective_facts, backend),
        "fp8": _guarded(fp8_facts, backend),
        "kernels": _guarded(kernel_facts, backend),
    }


def _guarded(fn, backend: Backend) -> dict:
    try:
        return fn(backend)
    except Exception as exc:
        return {"error": error_facts(exc)}


def capability_facts(backend: Backend) -> dict:
    device = backend.device
    caps = device.capabilities()
    dtypes = [dtype_name(d) for d in caps.dtypes]
    # Every dtype the device computes in, plus float8; None where the plugin knows no figure.
    peak_keys = [k for k in PEAK_DTYPES if k in dtypes or k == "float8"]
    peak_keys += [k for k in caps.peak_tflops if k not in peak_keys]
    return {
        "device_type": device.type,
        "device_name": caps.name,
        "device_count": device.device_count(),
        "dtypes": dtypes,
        "peak_tflops": {k: caps.peak_tflops.get(k) for k in peak_keys},
        "memory_bytes": caps.memory_bytes,
        "compute_capability": list(caps.compute_capability) if caps.compute_capability else None,
    }


def collective_facts(backend: Backend) -> dict:
    collective = backend.collective
    ops = {}
    for op in COLLECTIVE_OPS:
        if op == "barrier":  # moves no tensor
            continue
        ops[op] = {
            label: collective.support(op, dtype).value for label, dtype in COLLECTIVE_DTYPES.items()
        }
    return {
        "c10d_backend": collective.c10d_backend,
        "avg_native": collective.capabilities.avg_supported,
        "ops": ops,
        "shared_memory": shared_memory_facts(collective),
        "between_nodes": [b.describe() for b in network.bindings(collective.interface_variables)],
    }


def shared_memory_facts(collective) -> str:
    """Whether tensor-, data- and expert-parallel groups of one host get the shared-memory
    channel (and pipeline groups the mailbox), and why not."""
    from mtcore.backend import shared_memory
    from mtcore.backend.collective import SHARED_MEMORY_ENV

    if not getattr(collective, "same_host_channels", False):
        return "not offered by this backend"
    if not shared_memory.supported_here():
        return "off: needs an x86-64 host with /dev/shm"
    if not collective.uses_shared_memory():
        return f"off: {SHARED_MEMORY_ENV}=0"
    return f"on (set {SHARED_MEMORY_ENV}=0 to keep them on {collective.c10d_backend})"


def fp8_facts(backend: Backend) -> dict:
    fp8 = backend.fp8
    availability = fp8.availability()
    return {
        "available": bool(availability),
        "reason": "" if availability else availability.reason,
        "formats": {name: dtype_name(dtype) for name, dtype in fp8.formats.items()},
        "granularities": fp8.describe(),
        "why": fp8.why(),
        "path_sources": fp8.path_sources(),
        "native_pairs": sorted([a, b] for a, b in fp8.native_granularities),
        # e5m2 x e4m3 operands (precision.fp8 hybrid's gradient GEMMs) on a native pair.
        "mixed_formats_native": fp8.mixed_formats_native,
        # The GEMMs of an FP8 linear under each recipe (precision.fp8_recipe), e4m3 and hybrid.
        "recipes": {s: FP8Recipe(scaling=s).paths(fp8) for s in SCALINGS},
        "hybrid_recipes": {s: FP8Recipe(format="hybrid", scaling=s).paths(fp8) for s in SCALINGS},
    }


def kernel_facts(backend: Backend) -> dict:
    table = backend.kernels
    by_dtype = {}
    for dtype in KERNEL_DTYPES:
        query = KernelQuery(backend.device.type, dtype)
        rows = {}
        for op in table.ops():
            dispatcher = table[op]
            chain = dispatcher.select(query)
            others = [c for c in dispatcher.candidates if not any(c is s for s in chain)]
            rows[op] = {
                "chosen": [_impl_facts(impl, query) for impl in chain],
                "others": [_impl_facts(impl, query) for impl in others],
            }
        by_dtype[dtype_name(dtype)] = rows
    return {
        "forced_reference": table.force_reference,
        "env": os.environ.get(KERNELS_ENV),
        "dtypes": by_dtype,
    }


def _impl_facts(impl, query: KernelQuery) -> dict:
    try:
        accepts = impl.accepts(query)
    except Exception as exc:
        accepts = f"predicate raised {exc!r}"
    return {
        "name": impl.name,
        "plugin": impl.plugin,
        "priority": impl.priority,
        "guarded": impl.fallback_ok is not None,
        "reference": impl.name == REFERENCE,
        "accepts": accepts,
    }
