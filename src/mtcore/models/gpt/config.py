"""The GPT family's config: the shared decoder-only transformer's (``DecoderConfig``:
Llama and GPT-2 styles, GQA, mixture of experts), selected by ``model.family: gpt``."""

from __future__ import annotations

from typing import Literal

from mtcore.models.common.decoder.config import DecoderConfig


class GPTConfig(DecoderConfig):
    """A decoder-only transformer. ``vocab_size=None`` is filled in from the tokenizer."""

    family: Literal["gpt"] = "gpt"
