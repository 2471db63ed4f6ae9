"""Chat data read from every input kind, and bad input refused: one line, exit 2, nothing
written or trained (``mtcore data prepare --format chat`` in process, ``mtcore train``
once as a real subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtcore.cli.main import main
from mtcore.data import DataConfig
from mtcore.data.chat import iter_conversations
from mtcore.training.config import ConfigError
from mtcore.training.overrides import load_config

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[3]
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def jsonl(path: Path, *records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def one_error_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


def test_prompt_completion_parquet_and_datasets_directories(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pairs = jsonl(tmp_path / "pairs.jsonl", {"prompt": "2 + 2?", "completion": "4."},
                  {"prompt": [{"role": "user", "content": "a"}],
                   "completion": [{"role": "assistant", "content": "b"}]})  # fmt: skip
    assert [m for _, m in iter_conversations([pairs])] == [
        [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4."}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    ]
    table = pa.table({"messages": [GOOD["messages"], GOOD["messages"][::-1] + GOOD["messages"]],
                      "id": [1, 2]})  # fmt: skip
    pq.write_table(table, tmp_path / "chats.parquet")
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    arrow = str(hf_dir / "data-00000-of-00001.arrow")
    with pa.OSFile(arrow, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)  # what save_to_disk writes
    (hf_dir / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (hf_dir / "dataset_info.json").write_text("{}")
    for source in (tmp_path / "chats.parquet", hf_dir):
        got = [m for _, m in iter_conversations([source])]
        assert got == [GOOD["messages"], GOOD["messages"][::-1] + GOOD["messages"]]


BAD = {
    "no-assistant.jsonl": (
        [GOOD, {"messages": [{"role": "user", "content": "alone"}]}],
        "no-assistant.jsonl:2: no assistant turn in this conversation",
    ),
    "role.jsonl": (
        [{"messages": [{"role": "tool", "content": "x"}, GOOD["messages"][1]]}],
        "role.jsonl:1: message 0 has the unknown role 'tool'",
    ),
    "content.jsonl": (
        [{"messages": [{"role": "user", "content": [{"type": "text"}]}, GOOD["messages"][1]]}],
        "content.jsonl:1: message 0 (user) has a content that is not a string (list)",
    ),
    "empty.jsonl": ([], "empty.jsonl is empty: its 1 file(s) hold no text"),
    "blank.jsonl": (None, "blank.jsonl: no conversations in this file (it is empty)"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_records_one_line_exit_2_nothing_written(tmp_path, chat_set, capsys, name):
    records, message = BAD[name]
    path = jsonl(tmp_path / name, *records) if records is not None else tmp_path / name
    if records is None:
        path.write_text("\n  \n")  # blank lines only
    out = tmp_path / "out"
    argv = ["data", "prepare", str(path), "--format", "chat", "--tokenizer", str(chat_set[1]),
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 2
    assert message in one_error_line(capsys, "mtcore data prepare: error:")
    written = sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock")  # the build lock
    assert written == [name]  # no .bin/.idx/.mask/.json


def test_bad_templates_one_line_exit_2(tmp_path, chat_set, capsys):
    data = jsonl(tmp_path / "ok.jsonl", GOOD)
    bare = tmp_path / "bpe.json"
    bare.write_text((chat_set[1] / "tokenizer.json").read_text())
    base = ["data", "prepare", str(data), "--format", "chat", "--output", str(tmp_path / "o")]
    assert main([*base, "--tokenizer", str(bare)]) == 2
    assert "has no chat template" in one_error_line(capsys, "mtcore data prepare: error:")
    other = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert main([*base, "--tokenizer", str(chat_set[1]), "--chat-template", other]) == 2
    line = one_error_line(capsys, "mtcore data prepare: error:")
    assert "ok.jsonl:1: data.chat_template renders this conversation differently" in line
    rewriting = "{{ messages|length }}" + other
    assert main([*base, "--tokenizer", str(bare), "--chat-template", rewriting]) == 2
    line = one_error_line(capsys, "mtcore data prepare: error:")
    assert "ok.jsonl:1: the chat template renders the conversation up to message 1" in line
    assert [p.name for p in tmp_path.glob("o.*")] == ["o.idx.lock"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"reset_position_ids": True}, "data.reset_position_ids needs documents in the batch: "
                                       "set data.document_masks true"),
        ({"format": "chat", "packing": False, "reset_position_ids": True},
         "set data.packing true"),
        ({"chat_loss": "last_assistant"}, "data.chat_loss applies to data.format chat only"),
        ({"format": "chat", "paths": ["a", "b"], "weights": [1, 2]},
         "chat data reads every path once"),
    ],
)  # fmt: skip
def test_impossible_combinations_are_refused_by_the_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**overrides)


def test_other_families_refuse_chat_and_document_masks(tmp_path):
    for family in ("bert", "t5"):
        config = load_config(None, [f"--model.family={family}", "--data.document_masks=true"])
        from mtcore.training.trainer import prepare

        with pytest.raises(ConfigError, match=f"the {family} family reads plain text"):
            prepare(config, 1)


def test_mtcore_train_on_bad_chat_data_exits_2_in_one_line(tmp_path, chat_set):
    bad = jsonl(tmp_path / "bad.jsonl", GOOD, {"messages": [{"role": "user", "content": "q"}]})
    env = {**os.environ, "MTCORE_DATA_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        [sys.executable, "-m", "mtcore.cli.main", "train", str(ROOT / "configs" / "sft.yaml"),
         "--nproc", "1", "--parallel.tp", "1", "--data.paths", f"[{bad}]",
         "--data.tokenizer", str(chat_set[1]),
         "--checkpoint.dir", str(tmp_path / "ck")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stderr
    assert lines == [
        f"mtcore train: error: {bad}:2: no assistant turn in this conversation (nothing to "
        "train on)"
    ]
    assert not (tmp_path / "ck").exists()  # nothing trained, nothing saved


def test_the_embedded_set_is_the_same_everywhere_and_holds_out_its_prompts(tmp_path):
    from mtcore.data.chat_corpus import HELDOUT_PROMPTS, TRAIN_CONVERSATIONS, write_chat_set

    first, again = write_chat_set(tmp_path / "a"), write_chat_set(tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in again]
    train = [m for _, m in iter_conversations([first[0]])]
    heldout = [m for _, m in iter_conversations([first[1]])]
    assert (len(train), len(heldout)) == (TRAIN_CONVERSATIONS, HELDOUT_PROMPTS)
    asked = {m["content"] for messages in train for m in messages if m["role"] == "user"}
    assert not asked & {messages[0]["content"] for messages in heldout}
    assert sum(len(messages) > 3 for messages in train) > TRAIN_CONVERSATIONS // 4  # multi-turn


def test_without_transformers_chat_data_is_refused_naming_the_extra(monkeypatch, chat_set):
    from mtcore.data import DataError
    from mtcore.data.chat_render import ChatRenderer

    monkeypatch.setitem(sys.modules, "transformers", None)  # what an absent package gives
    with pytest.raises(DataError, match=r"pip install 'mtcore\[sft\]'"):
        ChatRenderer(chat_set[1])


def test_a_dumped_data_config_validates_again():
    """A checkpoint's config.yaml and the planner's re-check hold every key."""
    for config in (DataConfig(), DataConfig(format="chat", chat_loss="last_assistant")):
        assert DataConfig.model_validate(config.model_dump()) == config
