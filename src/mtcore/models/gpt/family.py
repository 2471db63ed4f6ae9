"""The GPT family (``model.family: gpt``, the default): what the engine and trainer consume."""

from __future__ import annotations

import torch
from torch import Tensor

from mtcore.data import TokenLoader, build_datasets
from mtcore.models.chunks import hidden_state_messages
from mtcore.models.family import FamilyData, HFAdapter, ModelFamily
from mtcore.models.gpt import hf
from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.model import GPT, IGNORE_INDEX, build
from mtcore.models.layers import single_context


def _one_process(config: GPTConfig, backend=None) -> GPT:
    return GPT(config, single_context(config, backend))


def _loss_counts(config: GPTConfig, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {"lm": (batch["labels"] != IGNORE_INDEX).sum()}


class LMLoader:
    """Packed next-token batches ``{"tokens", "labels"}`` from a ``TokenLoader``."""

    def __init__(self, dataset, **kwargs):
        self.tokens = TokenLoader(dataset, **kwargs)

    def __iter__(self) -> LMLoader:
        return self

    def __next__(self) -> dict[str, Tensor]:
        tokens, labels = next(self.tokens)
        return {"tokens": tokens, "labels": labels}

    def state_dict(self) -> dict:
        return self.tokens.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.tokens.load_state_dict(state)


def lm_batches(tokens, labels) -> list[dict[str, Tensor]]:
    """Micro-batches ``{"tokens", "labels"}`` from matching lists of tensors (for tests and
    benchmarks that build their own token batches)."""
    return [{"tokens": x, "labels": y} for x, y in zip(tokens, labels, strict=True)]


def _data(data_config, model_config: GPTConfig) -> FamilyData:
    datasets = build_datasets(data_config)
    return FamilyData(datasets.tokenizer, datasets.train, datasets.valid, LMLoader)


def _generate(model: GPT, tokenizer, prompt: str, max_new_tokens: int, top_k=None,
              temperature: float = 1.0, generator=None) -> str:  # fmt: skip
    """The prompt and its continuation (greedy, or top-k sampling with ``generator``)."""
    ids = tokenizer.encode(prompt) or [tokenizer.eod_id]
    tokens = torch.tensor([ids], device=next(model.parameters()).device)
    out = model.generate(tokens, max_new_tokens, top_k, temperature, generator)
    return tokenizer.decode(out[0].tolist())


FAMILY = ModelFamily(
    name="gpt",
    config=GPTConfig,
    build=build,
    one_process=_one_process,
    messages=hidden_state_messages,
    loss_counts=_loss_counts,
    data=_data,
    checkpoint_aliases={"output.weight": "embed.tok.weight"},
    hf=HFAdapter(hf.MODEL_TYPES, hf.import_hf, hf.export_hf),
    generate=_generate,
    description="decoder-only transformer: Llama and GPT-2 styles, GQA, mixture of experts",
)
