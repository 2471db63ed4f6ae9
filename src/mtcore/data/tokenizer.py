"""The tokenizer: a HF ``tokenizers`` model, loaded from a ``tokenizer.json`` or trained here.

Training a byte-level BPE on the corpus at first use is what lets the default job
run with nothing downloaded: byte-level means every string is encodable (no
unknown token), and BPE on the corpus itself gives short sequences for it. The
result is cached as ``tokenizer-<hash>.json`` where the hash covers the corpus
files (paths, sizes, mtimes) and the training parameters, so a changed corpus or
vocab size retrains and an unchanged one never does.

``<|endoftext|>`` separates documents in the packed token stream, so the model
learns where a document ends instead of reading one file as the sequel of another.

Encoder families need more special tokens (BERT: ``[CLS] [SEP] [MASK] [PAD]``).
They are passed as ``special_tokens``: a trained BPE gets them as single ids right
after ``<|endoftext|>``, they are part of its cache key (so a GPT tokenizer is never
reused for BERT or the reverse), and a given ``tokenizer.json`` that lacks one is
rejected naming it. Like ``<|endoftext|>``, they never come out of ordinary text.
A GPT exported to HuggingFace keeps this rule (``split_special_tokens: true`` in its
tokenizer_config.json), so both give the same ids for any text (docs/hf-interop.md,
"Special tokens").
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from mtcore.data.cache import DataError, atomic_write, build_lock, fingerprint, text_hash
from mtcore.data.corpus import iter_documents
from mtcore.data.progress import say

log = logging.getLogger(__name__)

EOD_TOKEN = "<|endoftext|>"
# Tokens that mark a document's end in common pretrained tokenizer.json files.
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>")
# Training reads at most this much text: BPE merges settle long before a large
# corpus is exhausted, and a user with a huge corpus should bring a tokenizer.json.
TRAIN_MAX_BYTES = 256_000_000


class Tokenizer:
    """A thin wrapper that exposes what the data pipeline and the trainer need.

    ``required_tokens`` must each be one id of ``hf``. When ``[SEP]`` is required and
    none of the end-of-document tokens exists (a BERT ``tokenizer.json`` has none),
    ``[SEP]`` ends documents instead: it is what BERT puts at a segment's end.
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        path: Path | None = None,
        required_tokens: Sequence[str] = (),
    ):
        self.hf = hf
        self.path = path
        # A literal "<|endoftext|>" (or "[MASK]") inside a source file is text, not a token.
        self.hf.encode_special_tokens = True
        missing = [t for t in required_tokens if hf.token_to_id(t) is None]
        if missing:
            raise DataError(
                f"tokenizer {path or '<in memory>'} lacks the special token(s) {missing} "
                f"(this job needs {list(required_tokens)})"
            )
        candidates = _EOD_CANDIDATES + (("[SEP]",) if "[SEP]" in required_tokens else ())
        eod = next((hf.token_to_id(t) for t in candidates if hf.token_to_id(t) is not None), None)
        if eod is None:
            raise DataError(
                f"tokenizer {path or '<in memory>'} has none of the end-of-document tokens {_EOD_CANDIDATES}"
            )
        self.eod_id: int = eod
        # Max id + 1 rather than the entry count: some tokenizer.json files leave id gaps.
        self.vocab_size: int = max(hf.get_vocab(with_added_tokens=True).values()) + 1
        """Ids are in ``[0, vocab_size)``: the model's embedding needs at least this many rows."""
        self.fingerprint = text_hash(hf.to_str())
        self.chat_config: dict | None = None
        """A chat tokenizer's ``tokenizer_config.json`` (its chat template included), set by
        ``data.format chat``: checkpoints save it beside ``tokenizer.json``."""

    def reading_special_tokens(self) -> Tokenizer:
        """This tokenizer reading special tokens written in the text as those tokens: for
        a prompt the chat template rendered (``<|im_start|>user...``), not for a corpus."""
        hf = tokenizers.Tokenizer.from_str(self.hf.to_str())
        view = Tokenizer(hf, self.path)
        hf.encode_special_tokens = False
        view.eod_id, view.chat_config = self.eod_id, self.chat_config
        return view

    def token_id(self, token: str) -> int:
        """The id of ``token`` (e.g. ``"[MASK]"``), or a DataError naming it."""
        token_id = self.hf.token_to_id(token)
        if token_id is None:
            raise DataError(f"tokenizer {self.path or '<in memory>'} has no token {token!r}")
        return int(token_id)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special tokens (never masked, never drawn as random replacements)."""
        added = self.hf.get_added_tokens_decoder()
        return frozenset([self.eod_id, *(i for i, tok in added.items() if tok.special)])

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts on all cores (the Rust side parallelises the batch)."""
        return [e.ids for e in self.hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eod_id={self.eod_id}, path={self.path})"


def load_tokenizer(path: str | Path, required_tokens: Sequence[str] = ()) -> Tokenizer:
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"tokenizer file does not exist: {path}")
    try:
        hf = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:
        raise DataError(f"cannot load tokenizer {path}: {e}") from e
    return Tokenizer(hf, path, required_tokens)


def train_tokenizer(
    docs: Iterable[str], vocab_size: int, special_tokens: Sequence[str] = ()
) -> tokenizers.Tokenizer:
    """Train a byte-level BPE with ``<|endoftext|>`` (id 0) then ``special_tokens`` (ids 1, ...)."""
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN, *(t for t in special_tokens if t != EOD_TOKEN)],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unknown
        show_progress=False,
    )
    hf.train_from_iterator(_capped(docs, TRAIN_MAX_BYTES), trainer)
    return hf


def get_tokenizer(
    files: Sequence[Path],
    cache_dir: str | Path,
    vocab_size: int,
    tokenizer_path: str | Path | None = None,
    text_key: str = "text",
    special_tokens: Sequence[str] = (),
) -> Tokenizer:
    """Load ``tokenizer_path`` if given, else the cached BPE for ``files``, training it once.

    ``special_tokens`` (beyond ``<|endoftext|>``) are trained in, or required of the file.
    """
    special_tokens = tuple(special_tokens)
    if tokenizer_path is not None:
        return load_tokenizer(tokenizer_path, special_tokens)
    # Only a non-empty list enters the key, so GPT caches built before it existed stay valid.
    extra = {"special_tokens": list(special_tokens)} if special_tokens else {}
    key = fingerprint(
        files,
        vocab_size=vocab_size,
        text_key=text_key,
        max_bytes=TRAIN_MAX_BYTES,
        kind="bytelevel-bpe-v1",
        **extra,
    )
    path = Path(cache_dir).expanduser() / f"tokenizer-{key}.json"
    with build_lock(path):
        if not path.exists():
            start = time.perf_counter()
            say(
                f"training a {vocab_size}-token byte-level BPE on {len(files)} file(s) (once; cached)"
            )
            hf = train_tokenizer(iter_documents(files, text_key), vocab_size, special_tokens)
            log.info(
                "trained a %d-token byte-level BPE on %d file(s) in %.1f s",
                hf.get_vocab_size(),
                len(files),
                time.perf_counter() - start,
            )
            if hf.get_vocab_size() < vocab_size:
                warnings.warn(
                    f"the corpus only supports {hf.get_vocab_size()} BPE tokens, fewer than "
                    f"vocab_size={vocab_size}; size the model's embedding from tokenizer.vocab_size",
                    stacklevel=2,
                )
            with atomic_write(path, "w") as f:
                f.write(hf.to_str())
    return load_tokenizer(path, special_tokens)


def _capped(docs: Iterable[str], max_bytes: int) -> Iterable[str]:
    total = 0
    for doc in docs:
        yield doc
        total += len(doc)
        if total >= max_bytes:
            return
