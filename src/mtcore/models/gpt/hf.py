"""The GPT family's HuggingFace interop: Llama, Mistral, Qwen2 and Mixtral directories as a
``GPTConfig`` and full weights, through the shared decoder's mapping
(``mtcore.models.common.decoder.hf``, which has the table of names)."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from mtcore.models.common.decoder import hf as decoder_hf
from mtcore.models.common.decoder.hf import MODEL_TYPES, export_hf
from mtcore.models.common.hf_files import HFInteropError
from mtcore.models.gpt.config import GPTConfig

__all__ = [
    "MODEL_TYPES",
    "HFInteropError",
    "export_hf",
    "export_llama",
    "import_hf",
    "import_llama",
    "model_config_from_hf",
    "model_config_from_llama",
]


def model_config_from_hf(hf: dict, seq_len: int | None = None) -> GPTConfig:
    """The GPTConfig of a HuggingFace config.json (a dict) of a type in ``MODEL_TYPES``;
    ``seq_len`` None takes ``max_position_embeddings``."""
    return decoder_hf.model_config_from_hf(hf, seq_len, GPTConfig)


def import_hf(hf_dir: str | Path, seq_len: int | None = None) -> tuple[GPTConfig, dict[str, Tensor]]:
    """The GPTConfig and fp32 full weights of a HuggingFace decoder directory."""
    return decoder_hf.import_hf(hf_dir, seq_len, GPTConfig)


# The names of the Llama-only days.
import_llama, export_llama, model_config_from_llama = import_hf, export_hf, model_config_from_hf
