"""Small deterministic corpora written to tmp_path, and a tokenizer trained on one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mtcore.data.corpus import find_files
from mtcore.data.tokenizer import get_tokenizer

_WORDS = [
    "alpha", "beta", "gamma", "delta", "tensor", "shard", "rank", "token", "merge", "batch",
    "epoch", "loss", "grad", "model", "layer", "norm", "rope", "attn", "scale", "seed",
]  # fmt: skip


def make_text(seed: int, n_lines: int = 40) -> str:
    """Code- and prose-like lines: varied enough for a few hundred BPE merges."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = rng.choices(_WORDS, k=rng.randint(3, 10))
        if i % 3 == 0:
            lines.append(
                f"def {words[0]}_{i}({', '.join(words[1:3])}):\n    return {' + '.join(words[3:])}"
            )
        else:
            lines.append(" ".join(words).capitalize() + f" {rng.randint(0, 9999)}.")
    return "\n".join(lines) + "\n"


def write_corpus(root: Path, n_docs: int = 12, seed: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    suffixes = [".py", ".txt", ".md"]
    for i in range(n_docs):
        (root / f"doc{i:02d}{suffixes[i % 3]}").write_text(make_text(seed * 1000 + i))
    return root


@pytest.fixture
def make_corpus():
    """``write_corpus`` itself, for tests that need corpora of their own."""
    return write_corpus


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(tokenizer, corpus dir) shared by tests that only read them."""
    root = write_corpus(tmp_path_factory.mktemp("shared") / "corpus", n_docs=12)
    tok = get_tokenizer(find_files(root), root.parent / "cache", vocab_size=400)
    return tok, root


@pytest.fixture(scope="session")
def chat_set(tmp_path_factory) -> tuple[Path, Path]:
    """(a jsonl of 120 generated conversations, the ChatML tokenizer directory trained on
    it: tokenizer.json + tokenizer_config.json with the chat template)."""
    import json

    from mtcore.data.chat_corpus import conversations, train_chat_tokenizer
    from mtcore.data.sft import conversation_texts

    root = tmp_path_factory.mktemp("chat")
    data = root / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in conversations(120, seed=5)))
    tokenizer = train_chat_tokenizer([data], root / "cache", 400, conversation_texts)
    return data, tokenizer
