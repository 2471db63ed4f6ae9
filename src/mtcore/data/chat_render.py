"""Conversations into token ids and a loss mask, by the tokenizer's own chat template.

Rendering is transformers' ``apply_chat_template`` with the template the tokenizer
ships (``tokenizer_config.json``'s ``chat_template``, or a ``chat_template.jinja``
beside it): the exact text the model will be prompted with at inference, never a
format re-typed in Python. ``data.chat_template`` (a template, or a file holding one)
serves a tokenizer without one; given for a tokenizer that has its own, it must render
the first conversation exactly as the tokenizer's own does.

The loss mask comes from rendering each conversation prefix by prefix (what TRL and
torchtune's ``apply_chat_template`` maskers do, without needing a ``{% generation %}``
tag in the template): assistant turn ``i`` is the text that ``messages[:i + 1]`` adds
to ``messages[:i]`` rendered with the generation prompt, i.e. the answer and its
end-of-turn token, which the model must learn to emit to stop. This holds only for a
template whose renderings of the prefixes are prefixes of the whole conversation's
(one that, say, drops earlier turns' reasoning is not), and whose assistant spans
start on a token boundary: a conversation breaking either is refused in one line,
since its mask would be wrong.

Mask values: 0 not trained, 1 an assistant turn, 2 the last assistant turn, so
``data.chat_loss`` is chosen when samples are read, not when tokens are written.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mtcore.data.cache import DataError, text_hash
from mtcore.data.chat import Messages
from mtcore.data.tokenizer import Tokenizer, load_tokenizer

EXTRA_HINT = "install the optional extra: pip install 'mtcore[sft]'"
TURN, LAST_TURN = 1, 2


def _transformers():
    try:
        import jinja2  # noqa: F401 (apply_chat_template renders with it)
        import transformers
    except ImportError:
        raise DataError(f"data.format chat renders with transformers: {EXTRA_HINT}") from None
    return transformers


def tokenizer_files(path: str | Path) -> tuple[Path, Path | None]:
    """(the tokenizer.json, the directory whose tokenizer_config.json / chat_template.jinja
    go with it, or None) of ``data.tokenizer``: a tokenizer.json or a HF model directory."""
    path = Path(path).expanduser()
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise DataError(f"tokenizer directory {path} holds no tokenizer.json")
        return path / "tokenizer.json", path
    if not path.is_file():
        raise DataError(f"tokenizer file does not exist: {path}")
    configured = path.name == "tokenizer.json" and (
        (path.parent / "tokenizer_config.json").is_file()
        or (path.parent / "chat_template.jinja").is_file()
    )
    return path, (path.parent if configured else None)


def _config_file(directory: Path | None) -> dict:
    """``directory/tokenizer_config.json``'s settings ({} without one)."""
    path = directory / "tokenizer_config.json" if directory is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable tokenizer_config.json ({e})") from None
    return loaded if isinstance(loaded, dict) else {}


def read_template(value: str) -> str:
    """``data.chat_template``: the template itself, or the path of a file holding it."""
    if "{%" in value or "{{" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise DataError(
            f"data.chat_template {value!r} is neither a Jinja template nor an existing file"
        )
    return path.read_text(encoding="utf-8")


class ChatRenderer:
    """A tokenizer with a chat template: ``render(messages) -> (ids, mask)``.

    ``tokenizer``: mtcore's view of the same tokenizer.json (vocabulary size, eod id);
    ``fingerprint``: the tokenizer and the template, for cache keys."""

    def __init__(self, tokenizer_path: str | Path, chat_template: str | None = None):
        transformers = _transformers()
        json_path, config_dir = tokenizer_files(tokenizer_path)
        self.tokenizer: Tokenizer = load_tokenizer(json_path)
        fast = transformers.PreTrainedTokenizerFast
        try:
            if config_dir is not None:
                self.hf = fast.from_pretrained(str(config_dir), local_files_only=True)
            else:
                self.hf = fast(tokenizer_file=str(json_path))
        except Exception as e:  # transformers' own message says what it could not read
            raise DataError(f"cannot load tokenizer {tokenizer_path} in transformers: {e}") from e
        own = self.hf.chat_template
        if isinstance(own, dict):  # named templates (tool use, RAG): conversations use "default"
            own = own.get("default")
        own = own if isinstance(own, str) else None
        configured = read_template(chat_template) if chat_template is not None else None
        if own is None and configured is None:
            raise DataError(
                f"tokenizer {tokenizer_path} has no chat template (tokenizer_config.json's "
                "chat_template): set data.chat_template to a template or a file holding one"
            )
        self.own_template, self.template = own, configured or own
        self.hf.chat_template = self.template
        self.tokenizer.chat_config = {**_config_file(config_dir), "chat_template": self.template}
        self.fingerprint = text_hash(f"{self.tokenizer.fingerprint}\n{self.template}")

    def text(self, messages: Messages, generation_prompt: bool = False, template=None) -> str:
        try:
            return self.hf.apply_chat_template(
                messages,
                chat_template=template or self.template,
                tokenize=False,
                add_generation_prompt=generation_prompt,
            )
        except Exception as e:  # a template's own raise_exception(), or a Jinja error
            raise DataError(f"the chat template fails on this conversation: {e}") from None

    def check_configured(self, messages: Messages, where: str) -> None:
        """A configured template for a tokenizer with its own must render ``messages``
        as the tokenizer's own does (the model will be prompted with the tokenizer's)."""
        if self.own_template is None or self.template == self.own_template:
            return
        if self.text(messages) != self.text(messages, template=self.own_template):
            raise DataError(
                f"{where}: data.chat_template renders this conversation differently from the "
                "tokenizer's own chat template; drop data.chat_template or fix the template"
            )

    def ids(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def render(
        self, messages: Messages, where: str = "conversation"
    ) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, loss mask): int64 and uint8 arrays of one length."""
        ids = self.ids(self.text(messages))
        mask = np.zeros(len(ids), dtype=np.uint8)
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for i in assistants:
            # Token ids, not characters: a prefix must also tokenize as the start of the
            # whole (no merge across the boundary), or the span would be off by a token.
            before = self.ids(self.text(messages[:i], generation_prompt=True)) if i else []
            through = self.ids(self.text(messages[: i + 1]))
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise DataError(
                    f"{where}: the chat template renders the conversation up to message {i} "
                    "differently from the whole conversation, so its answers cannot be "
                    "located (a template that rewrites earlier turns); use another template"
                )
            mask[len(before) : len(through)] = LAST_TURN if i == assistants[-1] else TURN
        return np.asarray(ids, dtype=np.int64), mask
