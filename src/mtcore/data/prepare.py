"""``mtcore data prepare``: a corpus and a tokenizer into one mtcore ``.bin``/``.idx`` pair.

What Megatron's ``tools/preprocess_data.py`` is to Megatron, ahead of training: the
trainer can tokenize text itself (cached, on first use), but a large corpus is better
tokenized once, by a job of its own, with its progress in view. The result is read by
the trainer as a data path (``data.paths: [PREFIX]`` with ``data.tokenizer``).

Inputs are what the trainer reads (``corpus.find_files``): ``.py``/``.md`` files,
``.txt`` files (documents split at blank lines, ``txt_separator``), ``.jsonl``,
``.parquet`` and HF ``datasets`` ``save_to_disk`` directories (``text_key``), and
directories of them. Documents are tokenized exactly as the trainer's own path does
(``indexed.encode_documents``: the same ids, each document ending with the
end-of-document id), so a prepared corpus trains on the same tokens.

Work is done one input file at a time into ``<prefix>.parts-<key>/``; each finished
file's part is committed atomically, so an interrupted run started again skips the
files already done. The parts are then joined into ``<prefix>.bin``/``.idx`` and
removed, and ``<prefix>.json`` records what was prepared: a re-run on the same
inputs and tokenizer does nothing, and one on changed inputs replaces the output
(never appends to it). ``key`` hashes the inputs (paths, sizes, mtimes) and the
tokenizer, as the trainer's cache does.

Batches of documents are encoded by ``workers`` processes (each loads the tokenizer
once); the main process reads the input and writes in order, so the output does not
depend on the number of workers.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from mtcore.data.cache import DataError, atomic_write, build_lock, fingerprint
from mtcore.data.corpus import batched_documents, find_files, iter_documents
from mtcore.data.indexed import (
    _HEADER,
    MAGIC,
    VERSION,
    IndexedDataset,
    check_ids,
    encode_documents,
    token_dtype,
    write_index,
)
from mtcore.data.progress import Progress, say
from mtcore.data.tokenizer import Tokenizer, load_tokenizer


class Prepared(NamedTuple):
    """What ``prepare_data`` wrote (or found already written)."""

    prefix: Path
    documents: int
    tokens: int
    seconds: float
    files: int
    up_to_date: bool  # True: the output already held these inputs; nothing was done


def prepare_data(
    inputs: Sequence[str | Path],
    tokenizer: str | Path,
    output: str | Path,
    *,
    text_key: str = "text",
    txt_separator: str | None = "",
    workers: int = 1,
) -> Prepared:
    """Tokenize every document of ``inputs`` into ``<output>.bin``/``.idx``."""
    if workers < 1:
        raise DataError(f"workers must be at least 1, got {workers}")
    if not inputs:
        raise DataError("no inputs to prepare")
    files = list(dict.fromkeys(f for path in inputs for f in find_files(path)))
    tok = load_tokenizer(tokenizer)
    prefix = Path(output).expanduser()
    if prefix.suffix in (".bin", ".idx"):
        prefix = prefix.with_suffix("")
    key = fingerprint(
        files, tokenizer=tok.fingerprint, text_key=text_key, txt_separator=txt_separator,
        version=VERSION,
    )  # fmt: skip
    manifest = _with(prefix, ".json")
    progress = Progress(f"prepare {prefix.name}", _size(files))
    with build_lock(_with(prefix, ".idx")):
        done = _up_to_date(prefix, manifest, key)
        if done is not None:
            say(f"{prefix}: already prepared from these inputs and tokenizer; nothing to do")
            return Prepared(prefix, done["documents"], done["tokens"], 0.0, len(files), True)
        parts = prefix.with_name(f"{prefix.name}.parts-{key}")
        reused = 0
        with _encoder(tok, workers) as encode:
            for i, path in enumerate(files):
                part = parts / f"part-{i:06d}"
                if _with(part, ".idx").is_file():  # finished by an earlier, interrupted run
                    damage = _damage(part, tok)
                    if damage is None:
                        offsets, _ = _part_index(part)
                        progress.update(len(offsets) - 1, int(offsets[-1]), _size([path]))
                        reused += 1
                        continue
                    say(f"{part}: {damage}; tokenizing {path} again")
                    for suffix in (".idx", ".bin"):
                        _with(part, suffix).unlink(missing_ok=True)
                _tokenize_file(path, part, tok, encode, text_key, txt_separator, progress)
        if reused:
            say(f"{prefix}: resumed; {reused} of {len(files)} input file(s) were already done")
        ds = _join([parts / f"part-{i:06d}" for i in range(len(files))], prefix, tok)
        with atomic_write(manifest, "w") as f:
            record = {"key": key, "documents": len(ds), "tokens": ds.num_tokens,
                      "tokenizer": str(tok.path), "inputs": [str(p) for p in files]}  # fmt: skip
            json.dump(record, f, indent=1)
        for stale in prefix.parent.glob(f"{prefix.name}.parts-*"):  # this run's and older ones
            shutil.rmtree(stale, ignore_errors=True)
    progress.docs, progress.tokens = len(ds), ds.num_tokens
    progress.close()
    return Prepared(prefix, len(ds), ds.num_tokens, progress.seconds, len(files), False)


def _up_to_date(prefix: Path, manifest: Path, key: str) -> dict | None:
    """The manifest when ``prefix`` holds a complete output for ``key``, else None."""
    try:
        record = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    try:
        ds = IndexedDataset(prefix)
    except DataError:
        return None
    if (len(ds), ds.num_tokens) != (record.get("documents"), record.get("tokens")):
        return None
    return record


def _tokenize_file(path, part, tok, encode, text_key, txt_separator, progress) -> None:
    """One input file into the part ``part``; its index is written last, on success."""
    docs = iter_documents([path], text_key, txt_separator)
    dtype = token_dtype(tok.vocab_size)
    lengths: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    max_id = 0
    with atomic_write(_with(part, ".bin")) as f:
        for (flat, batch_lengths), nbytes in encode(
            _sized(batched_documents(docs, 1_000_000, 1024))
        ):
            check_ids(flat, tok.vocab_size, path)
            max_id = max(max_id, int(flat.max(initial=0)))
            lengths.append(batch_lengths)
            f.write(flat.astype(dtype).tobytes())
            progress.update(len(batch_lengths), len(flat), nbytes)
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
    # A file without documents leaves a part of none (joined as nothing).
    write_index(_with(part, ".idx"), offsets, dtype, vocab_size=tok.vocab_size, max_id=max_id)


def _part_index(part: Path) -> tuple[np.ndarray, int]:
    """(offsets, max id) of a part; unlike ``read_index``, a part may hold no document."""
    idx = _with(part, ".idx")
    with open(idx, "rb") as f:
        header = f.read(_HEADER.size)
        if len(header) != _HEADER.size or header[:8] != MAGIC:
            raise DataError(f"{idx}: not a part this command wrote; delete {part.parent}")
        *_, count, _vocab, max_id = _HEADER.unpack(header)
        offsets = np.fromfile(f, dtype="<i8", count=count + 1)
    if len(offsets) != count + 1:
        raise DataError(f"{idx}: truncated; delete {part.parent}")
    return offsets, max_id


def _damage(part: Path, tok: Tokenizer) -> str | None:
    """What is wrong with a part an earlier run finished (None: it can be reused): its
    index unreadable, or its tokens not the size the index says (a disk that lost them)."""
    try:
        offsets, _ = _part_index(part)
    except (DataError, OSError) as e:
        return f"damaged ({e})"
    expected = int(offsets[-1]) * np.dtype(token_dtype(tok.vocab_size)).itemsize
    try:
        size = _with(part, ".bin").stat().st_size
    except OSError:
        return "its tokens are missing"
    if size != expected:
        return f"its tokens hold {size} bytes, its index says {expected}"
    return None


def _join(parts: list[Path], prefix: Path, tok: Tokenizer) -> IndexedDataset:
    """The parts, in order, as one ``.bin``/``.idx`` pair (the index written last)."""
    dtype = token_dtype(tok.vocab_size)
    offsets, max_id, total = [np.zeros(1, dtype=np.int64)], 0, 0
    with atomic_write(_with(prefix, ".bin")) as out:
        for part in parts:
            part_offsets, part_max = _part_index(part)
            max_id = max(max_id, part_max)
            with open(_with(part, ".bin"), "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
            offsets.append(part_offsets[1:] + total)
            total += int(part_offsets[-1])
    all_offsets = np.concatenate(offsets)
    if len(all_offsets) == 1:
        _with(prefix, ".bin").unlink(missing_ok=True)
        raise DataError(f"no documents to prepare for {prefix}: the inputs hold no text")
    _with(prefix, ".idx").unlink(missing_ok=True)  # a stale index never pairs with the new .bin
    write_index(_with(prefix, ".idx"), all_offsets, dtype, vocab_size=tok.vocab_size, max_id=max_id)
    return IndexedDataset(prefix, tok.vocab_size)


# -- encoding, here or in worker processes -------------------------------------------
_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    # One thread per worker: the workers are the parallelism, and the Rust pool of
    # every worker on all cores would oversubscribe them.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tokenizers

    global _worker_tokenizer
    _worker_tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(tokenizer_json))


def _encode_in_worker(item: tuple[list[str], int]) -> tuple[tuple[np.ndarray, np.ndarray], int]:
    batch, nbytes = item
    return encode_documents(batch, _worker_tokenizer), nbytes


class _encoder:
    """``with _encoder(tok, workers) as encode``: ``encode(batches)`` yields, in order,
    ``(encode_documents(batch), nbytes)`` of each ``(batch, nbytes)``."""

    def __init__(self, tok: Tokenizer, workers: int):
        self.tok, self.workers, self.pool = tok, workers, None

    def __enter__(self):
        if self.workers > 1:
            # fork: a spawned worker would import torch (through mtcore.data) for seconds.
            # TOKENIZERS_PARALLELISM set across the fork tells tokenizers the children's
            # thread pools are configured (off), instead of warning that it disables them.
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            try:
                self.pool = context.Pool(
                    self.workers, initializer=_init_worker, initargs=(self.tok.hf.to_str(),)
                )
            finally:
                if saved is None:
                    del os.environ["TOKENIZERS_PARALLELISM"]
                else:
                    os.environ["TOKENIZERS_PARALLELISM"] = saved
        return self.encode

    def encode(self, items: Iterator[tuple[list[str], int]]):
        if self.pool is None:
            return ((encode_documents(batch, self.tok), n) for batch, n in items)
        return self.pool.imap(_encode_in_worker, items, chunksize=1)

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.terminate() if exc[0] else self.pool.close()
            self.pool.join()


def _sized(batches: Iterator[list[str]]) -> Iterator[tuple[list[str], int]]:
    for batch in batches:
        yield batch, sum(len(d) for d in batch)  # characters: near enough to bytes


def _size(files: Sequence[Path]) -> int:
    total = 0
    for f in files:
        total += (
            sum(p.stat().st_size for p in f.rglob("*") if p.is_file())
            if f.is_dir()
            else f.stat().st_size
        )
    return total


def _with(prefix: Path, suffix: str) -> Path:
    return prefix.with_name(prefix.name + suffix)
