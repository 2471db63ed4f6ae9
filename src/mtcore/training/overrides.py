"""Reading a ``TrainConfig``: a YAML or TOML file, then ``--section.key value`` overrides.

Override values are parsed as YAML scalars (``2`` is an int, ``true`` a bool,
``null`` None, ``[a, b]`` a list); a plain word stays a string. Every key is
checked against the config's schema before anything else happens, so a typo
stops the job with a message that names the key and the keys that exist there.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from mtcore.models import DEFAULT_FAMILY, FamilyConfig, FamilyError, get_family
from mtcore.training.config import ConfigError, TrainConfig

__all__ = ["ConfigError", "load_config", "parse_overrides", "read_file", "set_key", "validate"]


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The config in ``path`` (YAML or TOML; None: the defaults) with ``overrides`` applied."""
    data = read_file(path) if path is not None else {}
    # The family decides which model keys exist: set it before the keys it allows.
    for key, value in sorted(parse_overrides(overrides), key=lambda kv: kv[0] != "model.family"):
        set_key(data, key, value)
    logging_section = data.get("logging")
    if path is not None and (logging_section is None or isinstance(logging_section, dict)):
        # A run is named after its config file unless it says otherwise: runs/<name>/.
        data["logging"] = {"run_name": _run_name(Path(path)), **(logging_section or {})}
    return validate(data, source=str(path) if path else "the defaults")


def _run_name(path: Path) -> str:
    name = "".join(c if c.isalnum() or c in "._-" else "_" for c in path.stem)
    return name if name.strip(".") else "run"


def read_file(path: str | Path) -> dict[str, Any]:
    """The sections in ``path``; ``{}`` for an empty file (``mtcore train`` says so).

    A key given twice in one YAML mapping is an error naming both lines: plain
    YAML loading keeps the last one, so the earlier setting would vanish unseen.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
        elif path.suffix == ".toml":
            data = _toml().loads(text)
        else:
            raise ConfigError(f"config file {path} must end in .yaml, .yml or .toml")
    except (yaml.YAMLError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"cannot parse {path}: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, not a {type(data).__name__}")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's SafeLoader, except that a mapping holding one key twice is an error."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # keys merged in may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first is not None:
                    where = f"line {line}" if first == line else f"lines {first} and {line}"
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} ({where})"
                    )
                lines[key] = line
        return super().construct_mapping(node, deep)


def _toml():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    return tomllib


def parse_overrides(args: Sequence[str]) -> list[tuple[str, Any]]:
    """``["--a.b", "2", "--c.d=x"]`` -> ``[("a.b", 2), ("c.d", "x")]``."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --section.key VALUE "
                "(for example --parallel.tp 2)"
            )
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"override --{key} has no value")
            value, i = args[i + 1], i + 1
        out.append((key, _parse_value(value)))
        i += 1
    return out


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        return text


def set_key(data: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` in ``data``, after checking it against ``TrainConfig``'s fields."""
    parts = key.split(".")
    model: type[BaseModel] | None = TrainConfig
    node = data
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the config"
        if model is None:
            raise ConfigError(f"unknown config key {key!r}: {where} has no sub-keys")
        if part not in model.model_fields:
            known = ", ".join(model.model_fields)
            raise ConfigError(f"unknown config key {key!r}: {where} has no {part!r} (known: {known})")
        annotation = model.model_fields[part].annotation
        if depth == len(parts) - 1:
            if isinstance(value, str) and _is_list(annotation):
                value = [value]  # --data.paths FILE: a one-element list
            node[part] = value
            return
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key!r}: {'.'.join(parts[: depth + 1])} is not a section")
        node, model = child, _section(annotation)
        if model is FamilyConfig:  # the model section: its family's own class
            try:
                model = get_family(child.get("family", DEFAULT_FAMILY)).config
            except FamilyError as e:
                raise ConfigError(str(e)) from None


def _section(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model of a section; an optional one (``MoESpec | None``) counts too."""
    options = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(options) == 1 and isinstance(options[0], type) and issubclass(options[0], BaseModel):
        return options[0]
    return None


def _is_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) is list:
        return True
    return any(typing.get_origin(a) is list for a in typing.get_args(annotation))


def validate(data: dict[str, Any], source: str = "the config") -> TrainConfig:
    """``TrainConfig`` from ``data``; a ConfigError lists every problem by its dotted key."""
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        lines = [_describe(err) for err in e.errors()]
        raise ConfigError(f"invalid config ({source}):\n  " + "\n  ".join(lines)) from None


def _describe(err: dict) -> str:
    loc = [str(p) for p in err["loc"]]
    if loc == ["model"] and err["type"] == "value_error":  # the family's own message
        return str(err["ctx"]["error"])
    key = ".".join(loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        model: type[BaseModel] | None = TrainConfig
        for part in loc[:-1]:
            field = model.model_fields.get(part) if model else None
            model = _section(field.annotation) if field else None
        known = f" (known: {', '.join(model.model_fields)})" if model else ""
        return f"unknown config key {key!r}{known}"
    return f"{key}: {err['msg']} (got {err.get('input')!r})"
