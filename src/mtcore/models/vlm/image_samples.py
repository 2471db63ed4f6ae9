"""Image-text samples: the settings, the rendering of a record's turns into tokens with
its images expanded, the cut to ``seq_len``, and the pixels of a sample's image slots
(the rules are in ``mtcore.models.vlm.data``'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from mtcore.data.cache import DataError
from mtcore.data.tokenizer import Tokenizer
from mtcore.models.vlm.images import CLIP_MEAN, CLIP_STD, to_pixels
from mtcore.parallel.settings import Settings

IMAGE_TOKEN = "<image>"
IGNORE_INDEX = -100
EMBEDDED_PROMPT = f"{IMAGE_TOKEN}\nWhat is in the image?"
_USER_ROLES, _ASSISTANT_ROLES = ("human", "user"), ("gpt", "assistant")
_SMALLEST_STD = float(np.finfo(np.float32).tiny)  # below it, 1 / std overflows float32


class ImageDataConfig(Settings):
    """How images become pixels and records become samples (the ``model.images`` section)."""

    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    resample: Literal["nearest", "bilinear", "bicubic"] = "bicubic"
    max_images: int = Field(1, ge=1, description="image slots per sample")
    bad_records: Literal["skip", "error"] = "skip"
    max_unreadable: int = Field(
        16, ge=0, description="records whose image becomes unreadable during the job that are "
        "dropped before it stops (bad_records: error stops at the first)",
    )  # fmt: skip
    overflow: Literal["error", "truncate"] = "error"
    train_on_prompt: bool = False
    embedded_train: int = Field(4096, ge=1)
    embedded_valid: int = Field(256, ge=0)
    embedded_seed: int = Field(0, ge=0)

    @field_validator("mean")
    @classmethod
    def _mean_is_a_pixel_value(cls, mean: tuple[float, ...]) -> tuple[float, ...]:
        if not all(0.0 <= m <= 1.0 for m in mean):
            raise ValueError(
                f"each channel's mean must lie in [0, 1] (pixels are scaled to [0, 1] before "
                f"it is subtracted), got {list(mean)}"
            )
        return mean

    @field_validator("std")
    @classmethod
    def _std_divides(cls, std: tuple[float, ...]) -> tuple[float, ...]:
        # Pixels are divided by it in float32: zero (or a value float32 rounds to zero or
        # below its normal range) makes every image inf/NaN, and every step with it.
        if not all(s >= _SMALLEST_STD for s in std):
            raise ValueError(
                f"each channel's std must be positive, at least {_SMALLEST_STD:.3g} "
                f"(pixels are divided by it in float32), got {list(std)}"
            )
        return std


@dataclass(frozen=True)
class SampleSpec:
    """What cutting records into samples needs: the sequence and image sizes, and ids."""

    seq_len: int
    image_tokens: int  # tokens per image after expansion
    image_size: int
    image_id: int
    eod_id: int
    images: ImageDataConfig


def record_turns(record: dict) -> list[tuple[str, str]]:
    """``(role, text)`` pieces of a record, role ``user`` or ``assistant``."""
    if "conversations" in record:
        turns = record["conversations"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("'conversations' must be a non-empty list of turns")
        out = []
        for turn in turns:
            role = turn.get("from", turn.get("role")) if isinstance(turn, dict) else None
            text = turn.get("value", turn.get("content")) if isinstance(turn, dict) else None
            if role not in _USER_ROLES + _ASSISTANT_ROLES or not isinstance(text, str):
                raise ValueError(f"turn {turn!r} needs from/role (human, gpt) and value/content")
            out.append(("user" if role in _USER_ROLES else "assistant", text))
        return out
    caption = record.get("caption")
    if not isinstance(caption, str):
        raise ValueError("the record has neither 'caption' (a string) nor 'conversations'")
    if IMAGE_TOKEN in caption:
        return [("assistant", caption)]
    return [("prompt", f"{IMAGE_TOKEN}\n"), ("assistant", caption)]


def encode_turns(
    turns: list[tuple[str, str]], tokenizer: Tokenizer, spec: SampleSpec
) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids, is_target, placeholders): the record's tokens with every placeholder
    expanded, which of them are targets, and how many placeholders it held."""
    ids: list[int] = []
    target: list[bool] = []
    placeholders = 0
    train_prompt = spec.images.train_on_prompt

    def add(text: str, is_target: bool) -> None:
        nonlocal placeholders
        for k, piece in enumerate(text.split(IMAGE_TOKEN)):
            if k:
                placeholders += 1
                ids.extend([spec.image_id] * spec.image_tokens)
                target.extend([False] * spec.image_tokens)
            tokens = tokenizer.encode(piece) if piece else []
            ids.extend(tokens)
            target.extend([is_target] * len(tokens))

    for role, text in turns:
        if role == "prompt":
            add(text, train_prompt)
        elif role == "user":
            add(f"USER: {text}\n", train_prompt)
        else:
            add("ASSISTANT:", train_prompt)
            add(" " + text.lstrip(" "), True)
            ids.append(spec.eod_id)
            target.append(True)
    return np.asarray(ids, dtype=np.int64), np.asarray(target, dtype=bool), placeholders


def cut_sample(ids: np.ndarray, target: np.ndarray, spec: SampleSpec, where: str):
    """(tokens, labels) ``[seq_len]`` each from a record's expanded ids (see the module
    docstring for the overflow rule); DataError naming ``where``."""
    limit = spec.seq_len + 1
    if len(ids) > limit:
        with_images = f"{len(ids) - 1} tokens with its images expanded"
        if spec.images.overflow == "error":
            raise DataError(
                f"{where}: {with_images}, more than seq_len={spec.seq_len}; raise "
                "model.seq_len, shorten the text, or set model.images.overflow: truncate"
            )
        if ids[limit - 1] == spec.image_id:  # the last input token would be an image's
            raise DataError(f"{where}: {with_images}; truncating to seq_len={spec.seq_len} "
                            "would cut an image's tokens: raise model.seq_len")  # fmt: skip
        ids, target = ids[:limit], target[:limit]
    labels = np.where(target[1:], ids[1:], IGNORE_INDEX)
    if not (labels != IGNORE_INDEX).any():
        raise DataError(f"{where}: no target token within seq_len={spec.seq_len}")
    tokens = np.full(spec.seq_len, spec.eod_id, dtype=np.int64)
    out = np.full(spec.seq_len, IGNORE_INDEX, dtype=np.int64)
    tokens[: len(ids) - 1], out[: len(labels)] = ids[:-1], labels
    return tokens, out


def image_slots(images: list, spec: SampleSpec) -> np.ndarray:
    cfg, size = spec.images, spec.image_size
    out = np.zeros((cfg.max_images, 3, size, size), dtype=np.float32)
    for k, img in enumerate(images):
        out[k] = to_pixels(img, size, cfg.mean, cfg.std, cfg.resample)
    return out
