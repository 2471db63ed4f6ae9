"""The GPT family's data: documents packed into next-token sequences (``mtcore.data``)."""

from __future__ import annotations

from mtcore.data import LMLoader, build_datasets
from mtcore.models.family import FamilyData


def gpt_data(data_config, model_config) -> FamilyData:
    """The tokenizer, the packed train and validation sets and ``LMLoader``."""
    datasets = build_datasets(data_config)
    return FamilyData(datasets.tokenizer, datasets.train, datasets.valid, LMLoader)
