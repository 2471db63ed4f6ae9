"""The embedded chat set and its tokenizer: what ``data.format: chat`` trains on with no
``data.paths`` (``configs/sft.yaml``), made here, with nothing downloaded.

Conversations are generated from a fixed seed, so every machine writes the same files:
short tasks whose answers follow from the prompt by a rule a small model can pick up in
a few hundred steps (adding two numbers, reversing or counting words, repeating a
phrase, capitalising a word), single- and multi-turn, some with a system message.
``heldout.jsonl`` holds prompts that ``train.jsonl`` never asks (drawn from operand
pairs kept out of training), with their answers, for a check after training (does the
model answer in the template's format, and correctly?).

Without ``data.tokenizer`` a byte-level BPE is trained on the conversations with the
ChatML tokens ``<|im_start|>`` and ``<|im_end|>``, and saved as a HF tokenizer
directory (``tokenizer.json`` + ``tokenizer_config.json`` whose ``chat_template`` is
``templates/chatml.jinja``), so transformers renders it like any released chat model.

    python -m mtcore.data.chat_corpus DIR   # DIR/train.jsonl, DIR/heldout.jsonl, DIR/tokenizer/
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from mtcore.data.cache import atomic_write, build_lock, fingerprint

VERSION = 2  # 2: no held-out prompt occurs in training
TRAIN_CONVERSATIONS = 3000
HELDOUT_PROMPTS = 64
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = Path(__file__).with_name("templates") / "chatml.jinja"
_WORDS = (
    "red", "green", "blue", "apple", "river", "stone", "cloud", "tiger", "paper", "window",
    "music", "garden", "silver", "orange", "planet", "forest", "bread", "candle", "mirror",
    "rocket", "winter", "summer", "island", "pencil", "bottle", "dragon", "castle", "lemon",
)  # fmt: skip
_SYSTEM = ("You answer briefly.", "You are a careful assistant.", "Answer in one line.")


def _heldout(a: int, b: int) -> bool:
    """Operand pairs kept out of training (about one in eleven)."""
    return (a * 7 + b * 3) % 11 == 0


def _task(rng: random.Random, heldout: bool) -> tuple[str, str]:
    kind = rng.randrange(5)
    while True:
        a, b = rng.randrange(100), rng.randrange(100)
        if _heldout(a, b) == heldout:
            break
    words = [_WORDS[(a + i * b) % len(_WORDS)] for i in range(2 + (a + b) % 3)]
    if kind == 0:
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        return f"Reverse the words: {' '.join(words)}", " ".join(reversed(words))
    if kind == 2:
        return f"How many words are in: {' '.join(words)}?", f"There are {len(words)} words."
    if kind == 3:
        return f"Repeat after me: {' '.join(words)}", " ".join(words)
    return f"Write {words[0]} in capitals.", words[0].upper()


def conversations(
    count: int, seed: int = 0, heldout: bool = False, exclude=frozenset()
) -> list[dict]:
    """``count`` conversations (``heldout``: single prompts with their answers, in the
    prompt/completion form, none of them a prompt in ``exclude``)."""
    rng = random.Random(seed)
    records = []
    while len(records) < count:
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM)})
        for _turn in range(1 if heldout or rng.random() < 0.6 else 2):
            prompt, answer = _task(rng, heldout)
            messages += [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": answer},
            ]
        if not heldout:
            records.append({"messages": messages})
        elif prompt not in exclude:
            records.append({"prompt": prompt, "completion": answer})
    return records


def write_chat_set(directory: str | Path) -> list[Path]:
    """``train.jsonl`` and ``heldout.jsonl`` under ``directory`` (once: kept if written).
    No held-out prompt is a prompt of the training set."""
    directory = Path(directory).expanduser()
    paths = [directory / "train.jsonl", directory / "heldout.jsonl"]
    train = conversations(TRAIN_CONVERSATIONS, seed=0)
    seen = {m["content"] for r in train for m in r["messages"] if m["role"] == "user"}
    sets = [train, conversations(HELDOUT_PROMPTS, seed=1, heldout=True, exclude=seen)]
    with build_lock(directory / "chat-set"):
        for path, records in zip(paths, sets, strict=True):
            if not path.is_file():
                with atomic_write(path, "w") as f:
                    f.writelines(json.dumps(record) + "\n" for record in records)
    return paths


def default_chat_files(cache_dir: Path) -> list[Path]:
    """The embedded set's training file, written into the data cache at first use."""
    return write_chat_set(Path(cache_dir) / f"chat-set-v{VERSION}")[:1]


def train_chat_tokenizer(files: Sequence[Path], cache_dir: Path, vocab_size: int, text_of) -> Path:
    """A cached HF tokenizer directory (BPE with the ChatML tokens, the ChatML template)
    trained on the conversations of ``files``; ``text_of(files)`` yields their texts."""
    template = CHATML_TEMPLATE.read_text(encoding="utf-8")
    key = fingerprint(
        files, vocab_size=vocab_size, template=template, kind="chat-bpe-v1",
        tokens=list(CHATML_TOKENS),
    )  # fmt: skip
    directory = Path(cache_dir).expanduser() / f"chat-tokenizer-{key}"
    with build_lock(directory):
        if not (directory / "tokenizer_config.json").is_file():
            write_chat_tokenizer(text_of(files), directory, vocab_size)
    return directory


def write_chat_tokenizer(texts: Iterable[str], directory: Path, vocab_size: int) -> Path:
    """``directory/tokenizer.json`` (a byte-level BPE trained on ``texts``, with
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) and ``tokenizer_config.json``
    (the ChatML template; ``<|im_end|>`` ends a turn and generation)."""
    from mtcore.data.tokenizer import EOD_TOKEN, train_tokenizer

    hf = train_tokenizer(texts, vocab_size, CHATML_TOKENS)
    with atomic_write(directory / "tokenizer.json", "w") as f:
        f.write(hf.to_str())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML_TEMPLATE.read_text(encoding="utf-8"),
        "eos_token": CHATML_TOKENS[1],
        "pad_token": EOD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 1 << 20,
    }
    with atomic_write(directory / "tokenizer_config.json", "w") as f:  # last: marks it done
        json.dump(config, f, indent=1)
    return directory


def main(argv: Sequence[str]) -> None:
    """``python -m mtcore.data.chat_corpus DIR [VOCAB_SIZE]``: the set and its tokenizer
    (``DIR/tokenizer/``, what training on the set without data.tokenizer trains)."""
    from mtcore.data.sft import conversation_texts

    directory = Path(argv[0] if argv else ".")
    train, heldout = write_chat_set(directory)
    vocab_size = int(argv[1]) if len(argv) > 1 else 1024
    tokenizer = directory / "tokenizer"
    if not (tokenizer / "tokenizer_config.json").is_file():
        write_chat_tokenizer(conversation_texts([train]), tokenizer, vocab_size)
    for written in (train, heldout, tokenizer):
        print(written)


if __name__ == "__main__":
    main(sys.argv[1:])
