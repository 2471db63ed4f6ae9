"""The family registry: built-in families plus those plugins contribute, and config parsing.

``model.family`` is a discriminator: ``parse_model_config({"family": "bert", ...})``
validates the section with the BERT family's config class, and a section without
``family`` is a GPT's (so every config written before families existed still
parses). Families from other distributions come through the ``mtcore_model_families``
hook of an ``mtcore.plugins`` entry point, like backends.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from pydantic import ValidationError

from mtcore.models.family import FamilyConfig, FamilyError, ModelFamily, check_family

DEFAULT_FAMILY = "gpt"
# Built-in families, imported on first use (a GPT job never imports BERT's code).
BUILTIN = {
    "gpt": "mtcore.models.gpt.family",
    "bert": "mtcore.models.bert.family",
    "t5": "mtcore.models.t5.family",
    "llava": "mtcore.models.vlm.family",
}


_plugin_families: dict[str, tuple[ModelFamily, str, str]] | None = None


def _from_plugins() -> dict[str, tuple[ModelFamily, str, str]]:
    """Family name -> (family, plugin label, plugin name), from every healthy plugin."""
    global _plugin_families
    if _plugin_families is None:
        from mtcore.backend import plugin_registry

        found: dict[str, tuple[ModelFamily, str, str]] = {}
        for info, families in plugin_registry().collect("mtcore_model_families"):
            for family in families:
                check_family(family, f"plugin {info.label}")
                clash = "a built-in family" if family.name in BUILTIN else None
                if family.name in found:
                    clash = f"plugin {found[family.name][1]}"
                if clash:
                    raise FamilyError(
                        f"plugin {info.label} contributes model family {family.name!r}, "
                        f"which {clash} already provides; uninstall one or exclude it with "
                        "MTCORE_PLUGINS"
                    )
                found[family.name] = (family, info.label, info.name)
        _plugin_families = found
    return _plugin_families


def reset_plugin_families() -> None:
    """Forget the plugin families found so far (tests that install a plugin call this)."""
    global _plugin_families
    _plugin_families = None


def families_by_plugin() -> dict[str, list[str]]:
    """Plugin name -> the model families it contributes (``mtcore plugins`` shows them)."""
    out: dict[str, list[str]] = {}
    for name, (_, _, plugin) in sorted(_from_plugins().items()):
        out.setdefault(plugin, []).append(name)
    return out


def family_names() -> list[str]:
    """Every family that can be selected: built-in first, then plugins'."""
    return [*BUILTIN, *sorted(_from_plugins())]


@functools.cache
def _builtin(name: str) -> ModelFamily:
    return check_family(importlib.import_module(BUILTIN[name]).FAMILY, "built-in")


def get_family(name: str) -> ModelFamily:
    """The family called ``name``; FamilyError names the known ones otherwise."""
    if name in BUILTIN:
        return _builtin(name)
    plugins = _from_plugins()
    if name in plugins:
        return plugins[name][0]
    from mtcore.backend import plugin_registry

    broken = [p.label for p in plugin_registry().discovery.broken]
    hint = f"; broken plugins (see `mtcore doctor`): {', '.join(broken)}" if broken else ""
    raise FamilyError(
        f"unknown model family {name!r}; known: {', '.join(family_names())}{hint}"
    )


def family_of(config: FamilyConfig) -> ModelFamily:
    return get_family(config.family)


def parse_model_config(data: Any) -> FamilyConfig:
    """A model section (dict or config) as its family's config class."""
    if isinstance(data, FamilyConfig):
        return data
    if not isinstance(data, dict):
        raise FamilyError(f"the model section must be a mapping, got {type(data).__name__}")
    name = data.get("family", DEFAULT_FAMILY)
    if not isinstance(name, str):
        raise FamilyError(f"model.family must be a string, got {name!r}")
    family = get_family(name)
    try:
        return family.config.model_validate({**data, "family": name})
    except ValidationError as e:
        problems = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                known = ", ".join(family.config.model_fields)
                problems.append(
                    f"unknown config key 'model.{where}' (known for family {name}: {known})"
                )
            else:
                problems.append(f"model{'.' + where if where else ''}: {err['msg']}")
        raise FamilyError("; ".join(problems)) from None
