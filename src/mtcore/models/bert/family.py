"""The BERT family (``model.family: bert``): what the engine and trainer consume.

The family, its config and its shape load without torch (the planner and the CLI read
them); the model, its data pipeline and its adapter are imported where they are used.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import TYPE_CHECKING

from mtcore.models.adapters import HFAdapter, imported_on_call
from mtcore.models.bert.config import BertConfig
from mtcore.models.bert.names import BERT_SPECIAL_TOKENS, DECODER_COPY, WORD_EMBEDDING
from mtcore.models.bert.shape import bert_shape
from mtcore.models.family import Capabilities, FamilyData, ModelFamily

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from mtcore.models.bert.model import Bert

HF = "mtcore.models.bert.hf"


class BertHF(HFAdapter):
    model_types = ("bert",)
    tokenizer_tokens = BERT_SPECIAL_TOKENS
    import_dir = imported_on_call(HF, "import_bert")
    export_dir = imported_on_call(HF, "export_bert")


class BertFamily(ModelFamily):
    name = "bert"
    config = BertConfig
    capabilities = Capabilities(context_parallel=True)
    checkpoint_aliases = MappingProxyType({DECODER_COPY: WORD_EMBEDDING})
    hf = BertHF
    description = "bidirectional encoder: masked LM with next-sentence or sentence-order head"

    def build_chunks(self, config: BertConfig, layout, backend, seed: int = 0, fp8=None):
        from mtcore.models.bert.model import build

        return build(config, layout, backend, seed, fp8)

    def one_process(self, config: BertConfig, backend=None) -> Bert:
        from mtcore.models.bert.model import Bert
        from mtcore.models.common.layers import single_context

        return Bert(config, single_context(config, backend))

    def messages(self, config: BertConfig, layout, micro_batch_size: int, dtype: torch.dtype):
        # padding mask and token types: each stage reads them from the batch
        from mtcore.models.common.chunks import hidden_state_messages

        return hidden_state_messages(config, layout, micro_batch_size, dtype)

    def loss_counts(self, config: BertConfig, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The counts ``Bert.loss`` returns: masked tokens, and sequences with a pair head."""
        import torch

        from mtcore.models.bert.model import IGNORE_INDEX

        counts = {"mlm": (batch["labels"] != IGNORE_INDEX).sum()}
        if config.pair_head:
            counts["pair"] = torch.tensor(batch["pair_labels"].numel())
        return counts

    def metric_names(self, config: BertConfig) -> tuple[str, ...]:
        """What ``Bert.metrics`` returns: accuracies of the masked tokens and the pairs."""
        return ("mlm_accuracy", "pair_accuracy") if config.pair_head else ("mlm_accuracy",)

    def data(self, data_config, model_config: BertConfig) -> FamilyData:
        """Sentence pairs with masked tokens (``data.py``)."""
        from mtcore.models.bert.data import build_pair_data
        from mtcore.models.bert.pair_loader import PairLoader

        data_config.check_plain_text(self.name)

        data = build_pair_data(
            data_config, model_config.seq_len, model_config.pair_task, seed=data_config.seed
        )
        loader = functools.partial(PairLoader, mask_prob=model_config.mask_prob)
        return FamilyData(data.tokenizer, data.train, data.valid, loader)

    def shape(self, config: BertConfig):
        return bert_shape(config)


FAMILY = BertFamily()
