"""Chat rendering and its loss mask against transformers' own apply_chat_template, with
the ChatML tokenizer trained on the test set and a second (Zephyr-style) template."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtcore.data import DataError
from mtcore.data.chat import iter_conversations
from mtcore.data.chat_render import LAST_TURN, TURN, ChatRenderer

transformers = pytest.importorskip("transformers")

# Not ChatML: each turn is "<|role|>\n" + content + eos_token, so the answers' spans end
# in the tokenizer's eos (<|im_end|>) and the generation prompt is "<|assistant|>\n".
ZEPHYR = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] "
    "+ eos_token + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% endif %}"
)
MULTI_TURN = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "Repeat after me: red stone"},
    {"role": "assistant", "content": "red stone"},
]


@pytest.fixture(scope="module")
def renderer(chat_set) -> ChatRenderer:
    return ChatRenderer(chat_set[1])


def spans(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, value) of each run of equal non-zero mask values."""
    runs, start = [], None
    for i, value in enumerate([*mask.tolist(), 0]):
        if start is not None and value != mask[start]:
            runs.append((start, i, int(mask[start])))
            start = None
        if start is None and value:
            start = i
    return runs


def test_ids_are_apply_chat_template_s_and_the_mask_covers_each_answer(renderer, chat_set):
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_set[1]))
    checked = 0
    for _, messages in [("multi", MULTI_TURN), *list(iter_conversations([chat_set[0]]))[:40]]:
        ids, mask = renderer.render(messages)
        expected = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert ids.tolist() == list(expected)
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        runs = spans(mask)
        assert [hf.decode(ids[a:b]) for a, b, _ in runs] == [f"{x}<|im_end|>\n" for x in answers]
        assert [v for *_, v in runs] == [TURN] * (len(answers) - 1) + [LAST_TURN]
        # Everything else is the template's: roles, the system message, the prompts.
        prompt_text = hf.decode(ids[mask == 0])
        assert all(m["content"] in prompt_text for m in messages if m["role"] != "assistant")
        checked += len(answers) > 1
    assert checked > 5  # multi-turn conversations were among them


def test_a_configured_template_for_a_tokenizer_without_one(chat_set, tmp_path):
    bare = tmp_path / "bpe.json"
    bare.write_text((chat_set[1] / "tokenizer.json").read_text())
    with pytest.raises(DataError, match=r"has no chat template.*set data\.chat_template"):
        ChatRenderer(bare)
    template_file = tmp_path / "zephyr.jinja"
    template_file.write_text(ZEPHYR)
    renderer = ChatRenderer(bare, str(template_file))
    renderer.hf.eos_token = "<|im_end|>"  # a bare tokenizer.json names no eos; ZEPHYR uses it
    ids, mask = renderer.render(MULTI_TURN)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bare), eos_token="<|im_end|>")
    expected = hf.apply_chat_template(
        MULTI_TURN, chat_template=ZEPHYR, tokenize=True, return_dict=False
    )
    assert ids.tolist() == list(expected)
    assert [hf.decode(ids[a:b]) for a, b, _ in spans(mask)] == [
        "2 + 3 = 5.<|im_end|>\n",
        "red stone<|im_end|>\n",
    ]


def test_a_template_that_renders_prefixes_differently_is_refused(chat_set):
    # It numbers the conversation's length first: every prefix starts differently.
    counting = (
        "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    renderer = ChatRenderer(chat_set[1])
    renderer.template = counting
    with pytest.raises(DataError, match="renders the conversation up to message 2 differently"):
        renderer.render(MULTI_TURN, "chats.jsonl:7")


def test_a_configured_template_must_render_as_the_tokenizer_s_own(chat_set):
    renderer = ChatRenderer(chat_set[1], ZEPHYR)
    with pytest.raises(DataError, match=r"chats\.jsonl:1: data\.chat_template renders this"):
        renderer.check_configured(MULTI_TURN, "chats.jsonl:1")
    same = ChatRenderer(chat_set[1], renderer.own_template)
    same.check_configured(MULTI_TURN, "chats.jsonl:1")  # the same template: accepted


def test_named_templates_render_with_the_default_one(chat_set, tmp_path):
    config = json.loads((chat_set[1] / "tokenizer_config.json").read_text())
    chatml = config["chat_template"]
    config["chat_template"] = [{"name": "default", "template": chatml},
                               {"name": "tool_use", "template": ZEPHYR}]  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text((chat_set[1] / "tokenizer.json").read_text())
    named = ChatRenderer(tmp_path)
    assert named.template == chatml
    assert (
        named.render(MULTI_TURN)[0].tolist()
        == ChatRenderer(chat_set[1]).render(MULTI_TURN)[0].tolist()
    )
