"""Hook implementation: mtcore imports this module through the entry point.

It runs whenever any training config is parsed, in every process: it imports the
family's config and functions, not the model code (``family.build`` imports that
when a model is built).
"""

from __future__ import annotations

from mtcore.backend import hookimpl
from mtcore_example_family.family import FAMILY


@hookimpl
def mtcore_model_families():
    return [FAMILY]
