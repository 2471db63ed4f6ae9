"""The GPT family's data: documents packed into next-token sequences, or conversations
for supervised fine-tuning (``data.format: chat``), from ``mtcore.data``."""

from __future__ import annotations

import functools

from mtcore.data import LMLoader, build_datasets
from mtcore.models.family import FamilyData


def gpt_data(data_config, model_config) -> FamilyData:
    """The tokenizer, the train and validation sets and their loader: ``LMLoader`` over
    packed text (with ``documents`` split at the eod id under ``data.document_masks``),
    or ``SampleLoader`` over rendered conversations."""
    if data_config.format == "chat":
        from mtcore.data.sft import build_chat_datasets, chat_loader

        datasets = build_chat_datasets(data_config)
        return FamilyData(
            datasets.tokenizer, datasets.train, datasets.valid, chat_loader(data_config)
        )
    datasets = build_datasets(data_config)
    loader = LMLoader
    if data_config.document_masks:
        loader = functools.partial(
            LMLoader,
            separator_id=datasets.tokenizer.eod_id,
            reset_position_ids=data_config.reset_position_ids,
        )
    return FamilyData(datasets.tokenizer, datasets.train, datasets.valid, loader)
