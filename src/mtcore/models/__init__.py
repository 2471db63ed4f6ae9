"""Models: the family seam and its registry; one folder per family (``gpt``, ``bert``, ``t5``,
``vlm``), and what the families share (``common``).

The trainer, checkpoints, planner and CLI use only what this package exports: a
family is found by name (``get_family``) or from a config (``family_of``), and a
model section is parsed into its family's config class by ``parse_model_config``.
Concrete models are imported from their family's folder (``mtcore.models.gpt``).
LoRA (``LoRAConfig``, ``add_lora``) works on the blocks every family shares.

Importing the seam does not import torch (``mtcore plan`` and the CLI's parser read
families, configs and shapes without it); a family's models load when it builds them.
"""

from mtcore import lazy_exports
from mtcore.models.adapters import HFAdapter, MegatronAdapter, imported_on_call
from mtcore.models.common.lora import LoRAConfig, add_lora, check_targets, is_adapter
from mtcore.models.family import (
    Batch,
    BuiltModel,
    Capabilities,
    FamilyConfig,
    FamilyData,
    FamilyError,
    Loader,
    MessageSpecs,
    ModelFamily,
    PipelineStage,
    check_family,
)
from mtcore.models.registry import (
    BUILTIN as BUILTIN_FAMILIES,
)
from mtcore.models.registry import (
    DEFAULT_FAMILY,
    families_by_plugin,
    family_names,
    family_of,
    get_family,
    parse_model_config,
    reset_plugin_families,
)
from mtcore.models.shape import ModelShape, NotModelled

__all__ = [
    "BUILTIN_FAMILIES",
    "DEFAULT_FAMILY",
    "Batch",
    "BuiltModel",
    "Capabilities",
    "FamilyConfig",
    "FamilyData",
    "FamilyError",
    "HFAdapter",
    "LoRAConfig",
    "Loader",
    "MegatronAdapter",
    "MessageSpecs",
    "ModelFamily",
    "ModelShape",
    "NotModelled",
    "PipelineStage",
    "TensorSpec",
    "add_lora",
    "check_family",
    "check_targets",
    "families_by_plugin",
    "family_names",
    "family_of",
    "get_family",
    "imported_on_call",
    "is_adapter",
    "parse_model_config",
    "reset_plugin_families",
]


# TensorSpec is the pipeline runner's (torch); families that send tensors import it.
__getattr__ = lazy_exports(__name__, {"TensorSpec": "mtcore.parallel.pipeline"})
