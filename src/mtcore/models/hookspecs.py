"""The models layer's plugin hook: a distribution contributes model families.

Declared here, beside the families it is about, and found by the plugin registry
through the ``mtcore.hookspecs`` entry point of the core distribution
(``pyproject.toml``). A plugin implements it with ``mtcore.backend.hookimpl``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mtcore.backend.hookspecs import hookspec

if TYPE_CHECKING:
    from mtcore.models.family import ModelFamily


class ModelHookSpecs:
    @hookspec
    def mtcore_model_families(self) -> list[ModelFamily]:
        """Contribute model families: return a list of ``mtcore.models.ModelFamily``.

        A family is selected by ``model.family`` in a training config (its
        ``ModelFamily.name``) and supplies its config class, how to build one rank's
        pipeline chunks, the tensors that cross pipeline boundaries, its loss as
        (sum, count) terms, its data pipeline and, optionally, its planner shape, its
        HuggingFace adapter and generation (docs/models.md has the contract). Import
        the model code lazily if it is heavy: this hook runs when any config is
        parsed. A name must not repeat a built-in family or another plugin's; a clash
        is an error naming both. A family that breaks the contract is refused in one
        line naming it and the missing member.
        """
