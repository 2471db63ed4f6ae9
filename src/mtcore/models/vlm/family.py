"""The LLaVA family (``model.family: llava``): what the engine and trainer consume."""

from __future__ import annotations

from torch import Tensor

from mtcore.models.chunks import hidden_state_messages
from mtcore.models.family import FamilyData, HFAdapter, ModelFamily
from mtcore.models.gpt.model import IGNORE_INDEX
from mtcore.models.layers import single_context
from mtcore.models.vlm import hf
from mtcore.models.vlm.config import LlavaConfig
from mtcore.models.vlm.model import Llava, build


def _one_process(config: LlavaConfig, backend=None) -> Llava:
    return Llava(config, single_context(config, backend))


def _loss_counts(config: LlavaConfig, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """Target tokens (captions and answers; never image positions or masked prompts)."""
    return {"lm": (batch["labels"] != IGNORE_INDEX).sum()}


def _metric_names(config: LlavaConfig) -> tuple[str, ...]:
    return ("caption_accuracy",)


def _data(data_config, model_config: LlavaConfig) -> FamilyData:
    """Image-text records, or the embedded shapes (``mtcore.data.image_text``)."""
    from mtcore.data.image_text import ImageTextLoader, build_image_text_data

    data = build_image_text_data(
        data_config,
        model_config.seq_len,
        model_config.image_tokens,
        model_config.vision.image_size,
        model_config.images,
    )
    return FamilyData(data.tokenizer, data.train, data.valid, ImageTextLoader)


def _generate(model: Llava, tokenizer, prompt: str, max_new_tokens: int, top_k=None,
              temperature: float = 1.0, generator=None, image=None) -> str:  # fmt: skip
    """The answer to ``prompt`` about ``image`` (a path; None: no image), rendered as the
    data pipeline renders a user turn; greedy or top-k sampling."""
    from mtcore.data.image_text import prompt_batch

    batch = prompt_batch(prompt, image, tokenizer, model.config)
    device = next(model.parameters()).device
    batch = {name: t.to(device) for name, t in batch.items()}
    out = model.generate(batch, max_new_tokens, top_k, temperature, generator, tokenizer.eod_id)
    new = out[0, batch["tokens"].shape[1] :].tolist()
    if new and new[-1] == tokenizer.eod_id:
        new = new[:-1]
    return tokenizer.decode(new).strip()


FAMILY = ModelFamily(
    name="llava",
    config=LlavaConfig,
    build=build,
    one_process=_one_process,
    messages=hidden_state_messages,  # image embeddings join the hidden states on stage 0
    loss_counts=_loss_counts,
    data=_data,
    checkpoint_aliases={"output.weight": "embed.tok.weight"},
    metric_names=_metric_names,
    hf=HFAdapter(("llava",), hf.import_llava, hf.export_llava, tokenizer_tokens=(hf.IMAGE_TOKEN,)),
    generate=_generate,
    description="vision-language: a ViT and a projector in front of a GPT (LLaVA)",
)
