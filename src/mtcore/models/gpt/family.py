"""The GPT family (``model.family: gpt``, the default): what the engine and trainer consume.

The family, its config and its shape load without torch (the planner and the CLI read
them); the model, its data pipeline and its adapters are imported where they are used.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from mtcore.models.adapters import HFAdapter, MegatronAdapter, imported_on_call
from mtcore.models.common.decoder.hf_architectures import MODEL_TYPES
from mtcore.models.common.decoder.shape import decoder_shape
from mtcore.models.family import Capabilities, FamilyData, ModelFamily
from mtcore.models.gpt.config import GPTConfig
from mtcore.models.gpt.megatron.args import (
    MODEL_ARGUMENTS,
    megatron_args,
    model_config_from_megatron,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from mtcore.models.common.decoder.model import GPT

HF = "mtcore.models.gpt.hf"
HF_LORA = "mtcore.models.common.decoder.hf_lora"
MEGATRON = "mtcore.models.gpt.megatron.ranks"


class GPTHF(HFAdapter):
    """Llama, Mistral, Qwen2, Mixtral, DeepSeek and GPT-2 checkpoints; LoRA in PEFT's format."""

    model_types = MODEL_TYPES
    import_dir = imported_on_call(HF, "import_hf")
    export_dir = imported_on_call(HF, "export_hf")
    export_adapter = imported_on_call(HF_LORA, "export_peft")
    import_adapter = imported_on_call(HF_LORA, "import_peft")


class GPTMegatron(MegatronAdapter):
    """Megatron-LM's GPT (``pretrain_gpt.py``): legacy per-rank and torch_dist checkpoints."""

    model_arguments = MODEL_ARGUMENTS
    config_from_args = staticmethod(model_config_from_megatron)
    args_for = staticmethod(megatron_args)
    from_dist = imported_on_call(MEGATRON, "from_dist")
    from_ranks = imported_on_call(MEGATRON, "from_ranks")
    to_ranks = imported_on_call(MEGATRON, "to_ranks")
    to_dist = imported_on_call("mtcore.models.gpt.megatron.dist", "to_dist")


class GPTFamily(ModelFamily):
    name = "gpt"
    config = GPTConfig
    capabilities = Capabilities(generates=True, mixture_of_experts=True, context_parallel=True)
    checkpoint_aliases = MappingProxyType(
        {"output.weight": "embed.tok.weight", "mtp_embed.tok.weight": "embed.tok.weight"}
    )
    hf = GPTHF
    megatron = GPTMegatron
    description = "decoder-only transformer: Llama and GPT-2 styles, GQA, mixture of experts"

    def build_chunks(self, config: GPTConfig, layout, backend, seed: int = 0, fp8=None):
        from mtcore.models.common.decoder.model import build

        return build(config, layout, backend, seed, fp8)

    def one_process(self, config: GPTConfig, backend=None) -> GPT:
        from mtcore.models.common.decoder.model import GPT
        from mtcore.models.common.layers import single_context

        return GPT(config, single_context(config, backend))

    def messages(self, config: GPTConfig, layout, micro_batch_size: int, dtype: torch.dtype):
        from mtcore.models.common.chunks import hidden_state_messages

        return hidden_state_messages(config, layout, micro_batch_size, dtype)

    def loss_counts(self, config: GPTConfig, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        from mtcore.models.common.decoder.model import IGNORE_INDEX
        from mtcore.models.common.decoder.mtp import mtp_targets, mtp_term

        counts = {"lm": (batch["labels"] != IGNORE_INDEX).sum()}
        for k in range(1, config.mtp_depth + 1):  # multi-token prediction's targets
            counts[mtp_term(k)] = (mtp_targets(batch["labels"], k) != IGNORE_INDEX).sum()
        return counts

    def data(self, data_config, model_config: GPTConfig) -> FamilyData:
        from mtcore.models.gpt.data import gpt_data

        return gpt_data(data_config, model_config)

    def shape(self, config: GPTConfig):
        return decoder_shape(config)

    def generate(self, model: GPT, tokenizer, prompt: str, max_new_tokens: int, top_k=None,
                 temperature: float = 1.0, generator=None, image=None) -> str:  # fmt: skip
        """The prompt and its continuation (greedy, or top-k sampling with ``generator``)."""
        import torch

        ids = tokenizer.encode(prompt) or [tokenizer.eod_id]
        tokens = torch.tensor([ids], device=next(model.parameters()).device)
        out = model.generate(tokens, max_new_tokens, top_k, temperature, generator)
        return tokenizer.decode(out[0].tolist())


FAMILY = GPTFamily()
