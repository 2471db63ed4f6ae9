"""The LLaVA family (``model.family: llava``): what the engine and trainer consume.

The family, its config and its shape load without torch (the planner and the CLI read
them); the model, its data pipeline and its adapter are imported where they are used.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

from mtcore.models.adapters import HFAdapter, imported_on_call
from mtcore.models.family import Capabilities, FamilyData, ModelFamily
from mtcore.models.vlm.config import LlavaConfig
from mtcore.models.vlm.image_samples import IMAGE_TOKEN
from mtcore.models.vlm.shape import llava_shape

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from mtcore.models.vlm.model import Llava

HF = "mtcore.models.vlm.hf"


class LlavaHF(HFAdapter):
    model_types = ("llava",)
    tokenizer_tokens = (IMAGE_TOKEN,)
    import_dir = imported_on_call(HF, "import_llava")
    export_dir = imported_on_call(HF, "export_llava")


class LlavaFamily(ModelFamily):
    name = "llava"
    config = LlavaConfig
    capabilities = Capabilities(
        generates=True, reads_images=True, mixture_of_experts=True, context_parallel=True
    )
    checkpoint_aliases = MappingProxyType({"output.weight": "embed.tok.weight"})
    hf = LlavaHF
    description = "vision-language: a ViT and a projector in front of a GPT (LLaVA)"

    def build_chunks(self, config: LlavaConfig, layout, backend, seed: int = 0, fp8=None):
        from mtcore.models.vlm.model import build

        return build(config, layout, backend, seed, fp8)

    def one_process(self, config: LlavaConfig, backend=None) -> Llava:
        from mtcore.models.common.layers import single_context
        from mtcore.models.vlm.model import Llava

        return Llava(config, single_context(config, backend))

    def messages(self, config: LlavaConfig, layout, micro_batch_size: int, dtype: torch.dtype):
        # image embeddings join the hidden states on stage 0
        from mtcore.models.common.chunks import hidden_state_messages

        return hidden_state_messages(config, layout, micro_batch_size, dtype)

    def loss_counts(self, config: LlavaConfig, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Target tokens (captions and answers; never image positions or masked prompts)."""
        from mtcore.models.common.decoder.model import IGNORE_INDEX

        return {"lm": (batch["labels"] != IGNORE_INDEX).sum()}

    def metric_names(self, config: LlavaConfig) -> tuple[str, ...]:
        return ("caption_accuracy",)

    def data(self, data_config, model_config: LlavaConfig) -> FamilyData:
        """Image-text records, or the embedded shapes (``data.py``)."""
        from mtcore.models.vlm.data import ImageTextLoader, build_image_text_data

        data_config.check_plain_text(self.name)

        data = build_image_text_data(
            data_config,
            model_config.seq_len,
            model_config.image_tokens,
            model_config.vision.image_size,
            model_config.images,
        )
        return FamilyData(
            data.tokenizer, data.train, data.valid, ImageTextLoader, loader_takes_group=True
        )

    def sequence_lengths(self, config: LlavaConfig) -> dict[str, int | None]:
        """Tokens, labels and the image mask split at ``seq_len``; every cp rank keeps the
        images whole (the tower is replicated over cp)."""
        s = config.seq_len
        return {"tokens": s, "labels": s, "image_mask": s, "pixel_values": None}

    def shape(self, config: LlavaConfig):
        return llava_shape(config)

    def generate(self, model: Llava, tokenizer, prompt: str, max_new_tokens: int, top_k=None,
                 temperature: float = 1.0, generator=None, image=None) -> str:  # fmt: skip
        """The answer to ``prompt`` about ``image`` (a path; None: no image), rendered as the
        data pipeline renders a user turn; greedy or top-k sampling."""
        from mtcore.models.vlm.data import prompt_batch

        batch = prompt_batch(prompt, image, tokenizer, model.config)
        device = next(model.parameters()).device
        batch = {name: t.to(device) for name, t in batch.items()}
        out = model.generate(batch, max_new_tokens, top_k, temperature, generator, tokenizer.eod_id)
        new = out[0, batch["tokens"].shape[1] :].tolist()
        if new and new[-1] == tokenizer.eod_id:
            new = new[:-1]
        return tokenizer.decode(new).strip()


FAMILY = LlavaFamily()
