"""Image-text records on disk: jsonl files read, each record checked (its images decoded
once), bad ones counted and skipped or fatal (the format is in
``mtcore.models.vlm.data``'s docstring)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mtcore.data.cache import DataError
from mtcore.data.corpus import read_utf8
from mtcore.data.tokenizer import Tokenizer
from mtcore.models.vlm.image_samples import (
    IGNORE_INDEX,
    IMAGE_TOKEN,
    SampleSpec,
    cut_sample,
    encode_turns,
    image_slots,
    record_turns,
)
from mtcore.models.vlm.images import BadImage, open_image

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Record:
    where: str  # file:line
    images: tuple[Path, ...]
    tokens: np.ndarray
    labels: np.ndarray


class UnreadableRecord(Exception):
    """A record whose image was read when the data was built and cannot be now (deleted
    or rewritten under the job): ``where`` (file:line) and ``reason`` (the image's)."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


class RecordDataset:
    """Checked records of jsonl files; images are read (again) when a sample is drawn."""

    reads_files = True  # a sample's image may have changed since the records were checked

    def __init__(self, records: list[Record], spec: SampleSpec, name: str, skipped: Counter):
        self.records, self.spec, self.name, self.skipped = records, spec, name, skipped

    def __len__(self) -> int:
        return len(self.records)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        r = self.records[i]
        try:
            images = [open_image(p) for p in r.images]
        except BadImage as e:  # checked at build time: the file changed since
            raise UnreadableRecord(r.where, str(e)) from None
        return r.tokens, r.labels, image_slots(images, self.spec)

    def dropped(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Sample ``i`` with nothing to learn: its tokens, no target, blank image slots
        (what stands in for a record whose image became unreadable)."""
        r, size = self.records[i], self.spec.image_size
        pixels = np.zeros((self.spec.images.max_images, 3, size, size), dtype=np.float32)
        return r.tokens, np.full_like(r.labels, IGNORE_INDEX), pixels

    def __repr__(self) -> str:
        return f"RecordDataset({self.name}: {len(self.records)} records, {sum(self.skipped.values())} skipped)"


def jsonl_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.rglob("*.jsonl"))
            if not found:
                raise DataError(f"data path {p} holds no .jsonl file")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise DataError(f"data path {p} does not exist")
    return files


def read_records(files: list[Path]) -> list[tuple[str, Path, Any]]:
    """(file:line, the file's directory, the parsed object or a ValueError) per line."""
    out = []
    for f in files:
        for n, line in enumerate(read_utf8(f).splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj: Any = json.loads(line)
            except json.JSONDecodeError as e:
                obj = ValueError(f"not JSON ({e.msg})")
            out.append((f"{f}:{n}", f.parent, obj))
    return out


def check_record(where: str, root: Path, obj, tokenizer: Tokenizer, spec: SampleSpec) -> Record:
    """A checked record; ValueError/BadImage for a bad record, DataError for a wrong one."""
    if isinstance(obj, Exception):
        raise obj
    if not isinstance(obj, dict):
        raise ValueError("a record must be a JSON object")
    names = obj.get("images", [obj["image"]] if "image" in obj else [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("'image' must be a path, 'images' a list of paths")
    ids, target, placeholders = encode_turns(record_turns(obj), tokenizer, spec)
    if placeholders != len(names):
        raise DataError(
            f"{where}: {placeholders} {IMAGE_TOKEN} placeholder(s) for {len(names)} image(s); "
            "each image needs exactly one placeholder in the text"
        )
    if len(names) > spec.images.max_images:
        raise DataError(f"{where}: {len(names)} images, more than model.images.max_images="
                        f"{spec.images.max_images}")  # fmt: skip
    paths = tuple(root / n for n in names)
    for p in paths:
        open_image(p)
    tokens, labels = cut_sample(ids, target, spec, where)
    return Record(where, paths, tokens, labels)


def build_records(
    files: list[Path], tokenizer: Tokenizer, spec: SampleSpec
) -> tuple[list[Record], Counter]:
    """The checked records of ``files`` and the bad ones counted by reason; the first
    ``_REPORTED`` bad ones are logged with their file and line, then a summary."""
    records, skipped = [], Counter()
    strict = spec.images.bad_records == "error"
    for where, root, obj in read_records(files):
        try:
            records.append(check_record(where, root, obj, tokenizer, spec))
        except DataError:
            raise  # a record that is wrong, not unreadable: always an error
        except ValueError as e:
            if strict:
                raise DataError(
                    f"bad record {where}: {e} (model.images.bad_records: error)"
                ) from None
            if sum(skipped.values()) < _REPORTED:
                log.warning("skipping bad record %s: %s", where, e)
            skipped[_reason(e)] += 1
    if skipped:
        total = sum(skipped.values())
        log.warning(
            "skipped %d of %d records (%s); set model.images.bad_records: error to stop instead",
            total, total + len(records), ", ".join(f"{why}: {n}" for why, n in skipped.items()),
        )  # fmt: skip
    if not records:
        raise DataError(f"no usable record in {', '.join(map(str, files))}")
    return records, skipped


_REPORTED = 10


def _reason(e: ValueError) -> str:
    """What was wrong with a bad record, in a few words (the skip counts' key)."""
    text = str(e)
    if not isinstance(e, BadImage):
        return "not JSON" if text.startswith("not JSON") else "missing or malformed fields"
    if "does not exist" in text:
        return "image missing"
    return "image of another mode" if "has mode" in text else "image unreadable"


def record_texts(files: list[Path]) -> list[str]:
    """The text of every parseable record (what a trained tokenizer learns from)."""
    texts = []
    for _, _, obj in read_records(files):
        try:
            texts += [text for _, text in record_turns(obj)] if isinstance(obj, dict) else []
        except ValueError:
            continue
    return [t.replace(IMAGE_TOKEN, " ") for t in texts] + ["USER: ASSISTANT: "]
