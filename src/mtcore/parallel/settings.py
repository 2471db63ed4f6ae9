"""The base of every settings model in a config: strict about what a number is.

A config's sections and the settings nested in them (a model's MoE, MLA and MTP
specs, its RoPE scaling, the layout, the data-parallel options) are pydantic models;
each refuses, in one line naming the key:

- an unknown key (``extra="forbid"``);
- inf or NaN for a float (``allow_inf_nan=False``): ``routed_scale: .inf`` would train
  on infinite expert outputs, ``capacity_factor: .inf`` fail on a rank;
- a boolean for a number (``reject_bool_numbers``): pydantic reads ``True`` as ``1``,
  so ``kv_lora_rank: true`` would quietly build a rank-1 latent.

Settings are frozen (hashable, shared between configs without copies).
"""

from __future__ import annotations

import types
import typing

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


def reject_bool_numbers(cls: type[BaseModel], value, info: ValidationInfo):
    """A ``field_validator("*", mode="before")`` for config models: a boolean given for
    a number field is an error.

    pydantic takes ``True`` as ``1`` for an int (and ``1.0`` for a float), so
    ``--parallel.tp true`` would quietly run tp=1. Fields that also accept a bool
    (``bool | int``) keep it.
    """
    if isinstance(value, bool) and info.field_name in cls.model_fields:
        annotation = cls.model_fields[info.field_name].annotation
        options = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
        if bool not in options and any(t in (int, float) for t in options):
            kind = "an integer" if int in options else "a number"
            raise PydanticCustomError("bool_not_number", f"must be {kind}, not a boolean")
    return value


def _is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


class Settings(BaseModel):
    """A frozen settings model that refuses unknown keys, inf/NaN floats and booleans for
    numbers (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    _no_bool_numbers = field_validator("*", mode="before")(reject_bool_numbers)
