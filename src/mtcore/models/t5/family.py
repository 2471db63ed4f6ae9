"""The T5 family (``model.family: t5``): what the engine and trainer consume.

The family, its config and its shape load without torch (the planner and the CLI read
them); the model, its data pipeline and its adapter are imported where they are used.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import TYPE_CHECKING

from mtcore.models.adapters import HFAdapter, imported_on_call
from mtcore.models.family import Capabilities, FamilyData, ModelFamily
from mtcore.models.t5.config import T5Config
from mtcore.models.t5.names import EMBEDDING, LM_HEAD, T5_SPECIAL_TOKENS
from mtcore.models.t5.shape import t5_shape

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from mtcore.models.t5.model import T5

HF = "mtcore.models.t5.hf"


class T5HF(HFAdapter):
    model_types = ("t5",)
    tokenizer_tokens = T5_SPECIAL_TOKENS
    import_dir = imported_on_call(HF, "import_t5")
    export_dir = imported_on_call(HF, "export_t5")


class T5Family(ModelFamily):
    name = "t5"
    config = T5Config
    capabilities = Capabilities(generates=True, context_parallel=True)
    checkpoint_aliases = MappingProxyType({LM_HEAD: EMBEDDING})
    hf = T5HF
    description = "encoder-decoder (T5 v1.1) trained on span corruption"

    def build_chunks(self, config: T5Config, layout, backend, seed: int = 0, fp8=None):
        from mtcore.models.t5.model import build

        return build(config, layout, backend, seed, fp8)

    def one_process(self, config: T5Config, backend=None) -> T5:
        from mtcore.models.common.layers import single_context
        from mtcore.models.t5.model import T5

        return T5(config, single_context(config, backend))

    def messages(self, config: T5Config, layout, micro_batch_size: int, dtype: torch.dtype):
        from mtcore.models.t5.model import messages

        return messages(config, layout, micro_batch_size, dtype)

    def loss_counts(self, config: T5Config, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """The count ``T5.loss`` returns: the target tokens that are not padding."""
        from mtcore.models.t5.model import IGNORE_INDEX

        return {"lm": (batch["labels"] != IGNORE_INDEX).sum()}

    def metric_names(self, config: T5Config) -> tuple[str, ...]:
        return ("accuracy",)

    def data(self, data_config, model_config: T5Config) -> FamilyData:
        """Span-corrupted pieces of the documents (``data.py``)."""
        from mtcore.models.t5.data import SpanLoader, build_span_data

        data_config.check_plain_text(self.name)

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

    def sequence_lengths(self, config: T5Config) -> dict[str, int]:
        """The encoder's tensors split at ``seq_len``, the decoder's at ``decoder_seq_len``."""
        se, sd = config.seq_len, config.decoder_seq_len
        return {"tokens": se, "padding_mask": se, "decoder_tokens": sd, "labels": sd,
                "decoder_padding_mask": sd}  # fmt: skip

    def shape(self, config: T5Config):
        return t5_shape(config)

    def generate(self, model: T5, tokenizer, prompt: str, max_new_tokens: int, top_k=None,
                 temperature: float = 1.0, generator=None, image=None) -> str:  # fmt: skip
        from mtcore.models.t5.generate import generate_text

        return generate_text(
            model, tokenizer, prompt, max_new_tokens, top_k, temperature, generator
        )


FAMILY = T5Family()
