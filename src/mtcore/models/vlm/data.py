"""Image-text training data for vision-language models: records, samples and the loader.

*On disk* (``data.paths``: ``.jsonl`` files or directories of them), one JSON object a
line, image paths relative to the file's directory::

    {"image": "cats/1.png", "caption": "a cat on a mat"}
    {"image": "a.png", "conversations": [
        {"from": "human", "value": "<image>\\nWhat is this?"},
        {"from": "gpt", "value": "A red square."}]}

``images`` (a list) may stand for ``image``; a turn may say ``role``/``content``
(``user``/``assistant``) instead of ``from``/``value`` (``human``/``gpt``). A caption
record reads ``<image>\\n`` then the caption (LLaVA's pre-training form) unless the
caption holds the placeholder itself. Turns render as ``USER: {text}\\n`` and
``ASSISTANT: {text}<|endoftext|>`` (the answer's text tokenized apart from the
prompt, after one space).

*Samples.* Each ``<image>`` placeholder becomes ``image_tokens`` copies of the
``<image>`` token, where the model puts that image's projected patch embeddings, so
the sequence the language model sees has a length known before the step. Targets are
the caption, or the assistant turns (and their end token); image positions are never
targets, and the prompt (user turns, ``ASSISTANT:``) is a target only with
``train_on_prompt``. A sample is the sequence cut to ``seq_len + 1`` tokens:
``tokens = ids[:-1]``, ``labels = ids[1:]`` (-100 where the next token is no target),
padded with ``<|endoftext|>`` (label -100); it is never packed with another.

*Bad input.* A line that is not JSON or lacks the fields, or whose image is missing,
unreadable or of a mode with no RGB meaning, is a bad record: reported with the file
and line, counted, and skipped (a warning says how many and why), or a ``DataError``
with ``bad_records: error``. Images are decoded when the data is built, so a bad file
is found before training; one that changes under the job afterwards is dropped by the
loader (``ImageTextLoader``). Placeholders that do not match the images in number,
or more than ``max_images`` images, are an error naming the record; so is a sequence
longer than ``seq_len + 1`` once its images are expanded, unless ``overflow:
truncate``, which keeps the first ``seq_len + 1`` tokens (images whose tokens fall
after the cut are unused) and is still an error when the cut would fall inside an
image's tokens or leave no target.

Rendering and cutting live in ``image_samples``, reading and checking the files in
``image_records``; this module builds the datasets and the loader.

*The embedded default* (``data.paths`` unset): the coloured shapes of
``mtcore.models.vlm.images``, a conversation each: ``<image>\\nWhat is in the image?`` and
the caption as the answer; ``embedded_train`` images for training and
``embedded_valid`` further ones of the same stream held out.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mtcore.data.cache import DataError
from mtcore.data.loader import ALONE, SampleGroup, SamplesLost, TokenLoader
from mtcore.data.samples import split_documents
from mtcore.data.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from mtcore.models.vlm.image_records import (
    RecordDataset,
    UnreadableRecord,
    build_records,
    jsonl_files,
    record_texts,
)
from mtcore.models.vlm.image_samples import (
    EMBEDDED_PROMPT,
    IGNORE_INDEX,
    IMAGE_TOKEN,
    ImageDataConfig,
    SampleSpec,
    cut_sample,
    encode_turns,
    image_slots,
)
from mtcore.models.vlm.images import BadImage, open_image, shape_image, shape_vocabulary

log = logging.getLogger(__name__)

__all__ = [
    "IGNORE_INDEX",
    "IMAGE_TOKEN",
    "ImageDataConfig",
    "ImageTextData",
    "ImageTextLoader",
    "RecordDataset",
    "ShapeDataset",
    "build_image_text_data",
    "prompt_batch",
]


class ShapeDataset:
    """The embedded task: images ``first .. first + count - 1`` of the shape stream."""

    reads_files = False  # drawn from a seed

    def __init__(self, tokenizer: Tokenizer, spec: SampleSpec, first: int, count: int, name: str):
        self.tokenizer, self.spec, self.first, self.count = tokenizer, spec, first, count
        self.name, self.skipped = name, Counter()
        # Every caption the stream can draw, cut now: a sample that cannot fit seq_len is
        # an error when the data is built (at launch), not at the step that draws it.
        self._encoded = {caption: self._encode(caption) for caption in shape_vocabulary()}

    def _encode(self, caption: str) -> tuple[np.ndarray, np.ndarray]:
        turns = [("user", EMBEDDED_PROMPT), ("assistant", caption)]
        ids, target, _ = encode_turns(turns, self.tokenizer, self.spec)
        return cut_sample(ids, target, self.spec, f"{self.name} (caption {caption!r})")

    def __len__(self) -> int:
        return self.count

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, labels, pixels ``[1, 3, size, size]``) of sample ``i``."""
        img, caption = shape_image(self.spec.images.embedded_seed, self.first + i)
        tokens, labels = self._encoded[caption]
        return tokens, labels, image_slots([img], self.spec)

    def __repr__(self) -> str:
        return f"ShapeDataset({self.name}: {self.count} images from {self.first})"


@dataclass(frozen=True)
class ImageTextData:
    tokenizer: Tokenizer
    train: Any
    valid: Any | None


def build_image_text_data(data_config, seq_len: int, image_tokens: int, image_size: int,
                          images: ImageDataConfig) -> ImageTextData:  # fmt: skip
    """Tokenizer, train and validation sets of ``data_config.paths`` (jsonl), or of the
    embedded shapes when it is unset. The tokenizer is ``data_config.tokenizer`` (it must
    hold ``<image>``) or a byte-level BPE trained on the records' text, in memory."""
    files = jsonl_files(data_config.paths) if data_config.paths else None
    required = (IMAGE_TOKEN,)
    if data_config.tokenizer:
        tokenizer = load_tokenizer(data_config.tokenizer, required)
    else:
        if files is None:
            texts = [f"USER: {EMBEDDED_PROMPT.replace(IMAGE_TOKEN, ' ')}\nASSISTANT: {c}"
                     for c in shape_vocabulary()]  # fmt: skip
        else:
            texts = record_texts(files)
        hf = train_tokenizer(texts, data_config.vocab_size, special_tokens=required)
        tokenizer = Tokenizer(hf, None, required)
    image_id = tokenizer.token_id(IMAGE_TOKEN)
    spec = SampleSpec(seq_len, image_tokens, image_size, image_id, tokenizer.eod_id, images)
    if files is None:
        train = ShapeDataset(tokenizer, spec, 0, images.embedded_train, "shapes/train")
        valid = None
        if images.embedded_valid:
            valid = ShapeDataset(
                tokenizer, spec, images.embedded_train, images.embedded_valid, "shapes/valid"
            )
        return ImageTextData(tokenizer, train, valid)
    records, skipped = build_records(files, tokenizer, spec)
    train_ids, valid_ids = split_documents(
        len(records), data_config.valid_fraction, "image-text data"
    )
    train = RecordDataset([records[i] for i in train_ids], spec, "train", skipped)
    valid = (
        RecordDataset([records[i] for i in valid_ids], spec, "valid", Counter())
        if len(valid_ids)
        else None
    )
    return ImageTextData(tokenizer, train, valid)


class ImageTextLoader(TokenLoader):
    """Micro-batch dicts, forever: ``tokens``, ``labels`` (int64 ``[b, seq_len]``),
    ``image_mask`` (bool ``[b, seq_len]``: where image embeddings go) and
    ``pixel_values`` (float32 ``[b, max_images, 3, size, size]``, zeros in unused slots).
    Sampling, dp striding and the resumable state are ``TokenLoader``'s.

    A record whose image became unreadable after the data was built (deleted, truncated,
    rewritten) is dropped: its sample keeps its place in the batch with no target and
    blank images, so the order and the batch shapes do not change. ``group``'s ranks
    (one model replica) agree on what they drop, and one of them says each record once,
    with the count so far; past ``model.images.max_unreadable`` records (0 with
    ``bad_records: error``) the job stops with ``SamplesLost`` naming the last one."""

    def __init__(self, dataset, *, group: SampleGroup = ALONE, **sampling):
        super().__init__(dataset, **sampling)
        self.group = group
        self.unreadable: dict[str, str] = {}  # record (file:line) -> why, as they were found

    def __next__(self) -> dict[str, torch.Tensor]:  # type: ignore[override]
        indices = [int(i) for i in self.next_indices()]
        rows: list = []
        reasons: dict[int, UnreadableRecord] = {}
        for k, i in enumerate(indices):
            try:
                rows.append(self.dataset.sample(i))
            except UnreadableRecord as e:
                rows.append(None)
                reasons[k] = e
        if self.dataset.reads_files:  # every rank of the group asks, or none does
            lost = self.group.any(torch.tensor([k in reasons for k in range(len(rows))]))
            for k in torch.nonzero(lost).flatten().tolist():
                rows[k] = self._drop(indices[k], reasons.get(k))
        tokens = torch.from_numpy(np.stack([r[0] for r in rows]))
        return {
            "tokens": tokens,
            "labels": torch.from_numpy(np.stack([r[1] for r in rows])),
            "image_mask": tokens == self.dataset.spec.image_id,
            "pixel_values": torch.from_numpy(np.stack([r[2] for r in rows])),
        }

    def _drop(self, index: int, found: UnreadableRecord | None):
        where = self.dataset.records[index].where
        if where not in self.unreadable:
            why = found.reason if found else "its image is unreadable on another rank"
            self.unreadable[where] = why
            images = self.dataset.spec.images
            limit = 0 if images.bad_records == "error" else images.max_unreadable
            count = len(self.unreadable)
            if count > limit:
                raise SamplesLost(
                    f"{where}: {why}; {count} record(s) became unreadable since the data "
                    f"was built, more than model.images.max_unreadable={limit}"
                    f"{' (bad_records: error)' if images.bad_records == 'error' else ''}: "
                    "restore the files, or rebuild the data and start a new run",
                    self.group.speaks,
                )
            if self.group.speaks:
                log.warning("dropping %s: %s (changed since the data was built; %d record(s) "
                            "so far, the job stops past %d)", where, why, count, limit)  # fmt: skip
        return self.dataset.dropped(index)


def prompt_batch(prompt: str, image: str | Path | None, tokenizer: Tokenizer, model_config) -> dict:
    """A one-sample batch for generation: ``USER: {prompt}\\nASSISTANT:`` rendered as in
    training (``<image>\\n`` put first when an image is given and the prompt lacks the
    placeholder), the image read and preprocessed as in training."""
    images_cfg, vision = model_config.images, model_config.vision
    if image is not None and IMAGE_TOKEN not in prompt:
        prompt = f"{IMAGE_TOKEN}\n{prompt}"
    spec = SampleSpec(model_config.seq_len, model_config.image_tokens, vision.image_size,
                    tokenizer.token_id(IMAGE_TOKEN), tokenizer.eod_id, images_cfg)  # fmt: skip
    ids, _, placeholders = encode_turns([("user", prompt)], tokenizer, spec)
    answer, _, _ = encode_turns([("prompt", "ASSISTANT:")], tokenizer, spec)
    ids = np.concatenate([ids, answer])
    wanted = 0 if image is None else 1
    if placeholders != wanted:
        raise DataError(
            f"the prompt holds {placeholders} {IMAGE_TOKEN} placeholder(s) for {wanted} image(s)"
        )
    if len(ids) >= spec.seq_len:
        raise DataError(
            f"the prompt is {len(ids)} tokens with its image, seq_len is {spec.seq_len}"
        )
    try:
        pixels = image_slots([open_image(image)] if image is not None else [], spec)
    except BadImage as e:
        raise DataError(str(e)) from None
    tokens = torch.from_numpy(ids)[None]
    return {"tokens": tokens, "image_mask": tokens == spec.image_id,
            "pixel_values": torch.from_numpy(pixels)[None]}  # fmt: skip
