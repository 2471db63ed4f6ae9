"""The BERT family (``model.family: bert``): what the engine and trainer consume."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from mtcore.data import BERT_SPECIAL_TOKENS
from mtcore.models.bert import hf
from mtcore.models.bert.config import BertConfig
from mtcore.models.bert.model import DECODER_COPY, IGNORE_INDEX, WORD_EMBEDDING, Bert, build
from mtcore.models.chunks import hidden_state_messages
from mtcore.models.family import FamilyData, HFAdapter, ModelFamily
from mtcore.models.layers import single_context


def _one_process(config: BertConfig, backend=None) -> Bert:
    return Bert(config, single_context(config, backend))


def _loss_counts(config: BertConfig, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The counts ``Bert.loss`` returns: masked tokens, and sequences with a pair head."""
    counts = {"mlm": (batch["labels"] != IGNORE_INDEX).sum()}
    if config.pair_head:
        counts["pair"] = torch.tensor(batch["pair_labels"].numel())
    return counts


def _metric_names(config: BertConfig) -> tuple[str, ...]:
    """What ``Bert.metrics`` returns: accuracies of the masked tokens and the pairs."""
    return ("mlm_accuracy", "pair_accuracy") if config.pair_head else ("mlm_accuracy",)


def _data(data_config, model_config: BertConfig) -> FamilyData:
    """Sentence pairs with masked tokens (``mtcore.data.pairs``, imported only here)."""
    from mtcore.data.pairs import PairLoader, build_pair_data

    data = build_pair_data(
        data_config, model_config.seq_len, model_config.pair_task, seed=data_config.seed
    )
    loader = functools.partial(PairLoader, mask_prob=model_config.mask_prob)
    return FamilyData(data.tokenizer, data.train, data.valid, loader)


FAMILY = ModelFamily(
    name="bert",
    config=BertConfig,
    build=build,
    one_process=_one_process,
    messages=hidden_state_messages,  # padding mask and token types: each stage reads the batch
    loss_counts=_loss_counts,
    data=_data,
    checkpoint_aliases={DECODER_COPY: WORD_EMBEDDING},
    metric_names=_metric_names,
    hf=HFAdapter(("bert",), hf.import_bert, hf.export_bert, tokenizer_tokens=BERT_SPECIAL_TOKENS),
    generate=None,
    description="bidirectional encoder: masked LM with next-sentence or sentence-order head",
)
