"""The T5 family (``model.family: t5``): what the engine and trainer consume."""

from __future__ import annotations

import functools

from torch import Tensor

from mtcore.data.spans import T5_SPECIAL_TOKENS
from mtcore.models.family import FamilyData, HFAdapter, ModelFamily
from mtcore.models.layers import single_context
from mtcore.models.t5 import hf
from mtcore.models.t5.config import T5Config
from mtcore.models.t5.generate import generate_text
from mtcore.models.t5.model import EMBEDDING, IGNORE_INDEX, LM_HEAD, T5, build, messages


def _one_process(config: T5Config, backend=None) -> T5:
    return T5(config, single_context(config, backend))


def _loss_counts(config: T5Config, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """The count ``T5.loss`` returns: the target tokens that are not padding."""
    return {"lm": (batch["labels"] != IGNORE_INDEX).sum()}


def _data(data_config, model_config: T5Config) -> FamilyData:
    """Span-corrupted pieces of the documents (``mtcore.data.spans``, imported only here)."""
    from mtcore.data.spans import SpanLoader, build_span_data

    m = model_config
    data = build_span_data(
        data_config, m.seq_len, m.decoder_seq_len, m.noise_density, m.mean_span_length
    )
    loader = functools.partial(
        SpanLoader,
        encoder_len=m.seq_len,
        decoder_len=m.decoder_seq_len,
        noise_density=m.noise_density,
        mean_span_length=m.mean_span_length,
    )
    return FamilyData(data.tokenizer, data.train, data.valid, loader)


FAMILY = ModelFamily(
    name="t5",
    config=T5Config,
    build=build,
    one_process=_one_process,
    messages=messages,
    loss_counts=_loss_counts,
    data=_data,
    checkpoint_aliases={LM_HEAD: EMBEDDING},
    metric_names=lambda config: ("accuracy",),
    hf=HFAdapter(("t5",), hf.import_t5, hf.export_t5, tokenizer_tokens=T5_SPECIAL_TOKENS),
    generate=generate_text,
    description="encoder-decoder (T5 v1.1) trained on span corruption",
)
