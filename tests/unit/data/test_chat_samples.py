"""Chat samples: labels exactly on the answers (both chat_loss options), packing with
documents, padding, overlong conversations cut or refused with their count, the
prepared set read back without rendering again, the loader's exact resume; and
``data.document_masks`` on text."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mtcore.cli.main import main
from mtcore.data import DataConfig, DataError
from mtcore.data.chat import iter_conversations
from mtcore.data.documents import DOCUMENTS, POSITIONS, check_documents
from mtcore.data.sft import build_chat_datasets, chat_loader
from mtcore.models.gpt import FAMILY

transformers = pytest.importorskip("transformers")


def chat_config(chat_set, tmp_path, **overrides) -> DataConfig:
    data, tokenizer = chat_set
    base = dict(format="chat", paths=[str(data)], tokenizer=str(tokenizer), seq_len=96,
                valid_fraction=0.0, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    return DataConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def hf(chat_set):
    return transformers.AutoTokenizer.from_pretrained(str(chat_set[1]))


@pytest.fixture(scope="module")
def rendered(chat_set, hf) -> list[tuple[list[int], list[str]]]:
    """(apply_chat_template's ids, the assistant answers) of each conversation, in order."""
    out = []
    for _, messages in iter_conversations([chat_set[0]]):
        ids = hf.apply_chat_template(messages, tokenize=True, return_dict=False)
        out.append((list(ids), [m["content"] for m in messages if m["role"] == "assistant"]))
    return out


def documents_of(sample) -> list[np.ndarray]:
    """The positions of each document of a sample."""
    docs = sample[DOCUMENTS]
    return [np.flatnonzero(docs == d) for d in range(int(docs.max()) + 1)]


@pytest.mark.parametrize("chat_loss", ["all_assistant", "last_assistant"])
def test_padded_samples_train_exactly_the_answers(chat_set, tmp_path, hf, rendered, chat_loss):
    train = build_chat_datasets(
        chat_config(chat_set, tmp_path, packing=False, chat_loss=chat_loss)
    ).train
    assert len(train) == len(rendered) and DOCUMENTS not in train[0]  # padded: no documents
    for i, (ids, answers) in enumerate(rendered):
        sample = train[i]
        n = len(ids) - 1
        assert sample["tokens"][:n].tolist() == ids[:-1]
        assert (sample["tokens"][n:] == hf.convert_tokens_to_ids("<|endoftext|>")).all()
        assert (sample["labels"][n:] == -100).all()  # the padding trains nothing
        trained = sample["labels"] != -100
        assert (sample["labels"][trained] == np.asarray(ids[1:])[trained[:n]]).all()
        wanted = answers if chat_loss == "all_assistant" else answers[-1:]
        assert hf.decode(sample["labels"][trained]) == "".join(f"{a}<|im_end|>\n" for a in wanted)


def test_packing_is_greedy_next_fit_with_a_document_per_conversation(chat_set, tmp_path, rendered):
    config = chat_config(chat_set, tmp_path, reset_position_ids=True)
    train = build_chat_datasets(config).train
    lengths = [len(ids) - 1 for ids, _ in rendered]
    seen = 0
    for i in range(len(train)):
        sample = train[i]
        check_documents(torch.from_numpy(sample[DOCUMENTS])[None], torch.zeros(1, 96))
        docs = documents_of(sample)
        padded = (sample["labels"][docs[-1]] == -100).all()  # an answer always trains
        used = 0
        for d, positions in enumerate(docs[:-1] if padded else docs):
            ids = rendered[seen + d][0]
            assert positions.tolist() == list(range(used, used + lengths[seen + d]))
            assert sample["tokens"][positions].tolist() == ids[:-1]
            used += len(positions)
        assert used + (len(docs[-1]) if padded else 0) == 96
        seen += len(docs) - padded
        if seen < len(rendered):  # next-fit: the next conversation did not fit
            assert used + lengths[seen] > 96
    assert seen == len(rendered)  # every conversation once, in order
    loader = chat_loader(config)(train, micro_batch_size=4, seed=0)
    batch = next(loader)
    assert set(batch) == {"tokens", "labels", DOCUMENTS, POSITIONS}
    starts = torch.ones_like(batch[DOCUMENTS], dtype=torch.bool)
    starts[:, 1:] = batch[DOCUMENTS][:, 1:] != batch[DOCUMENTS][:, :-1]
    assert (batch[POSITIONS][starts] == 0).all() and (batch[POSITIONS][~starts] > 0).all()


def test_overlong_conversations_are_cut_or_refused_with_their_count(
    chat_set, tmp_path, rendered, capsys
):
    from mtcore.data.progress import report_to

    seq_len = 40
    long = sum(len(ids) - 1 > seq_len for ids, _ in rendered)
    assert 0 < long < len(rendered)
    with pytest.raises(DataError, match=rf"train: {long} of {len(rendered)} conversation\(s\) "):
        build_chat_datasets(chat_config(chat_set, tmp_path, seq_len=seq_len, overlong="refuse"))
    report_to(__import__("sys").stderr)
    try:
        train = build_chat_datasets(chat_config(chat_set, tmp_path, seq_len=seq_len)).train
    finally:
        report_to(None)
    err = capsys.readouterr().err
    assert f"train: {long} of {len(rendered)} conversation(s) longer than seq_len=40" in err
    assert train.overlong == long
    assert all(len(train[i]["tokens"]) == seq_len for i in range(len(train)))
    assert len(train._length) == len(rendered) - train.dropped  # each kept one has answers
    for i in range(len(train)):
        assert (train[i]["labels"] != -100).any()


def test_prepared_once_then_read_without_rendering(chat_set, tmp_path, capsys):
    data, tokenizer = chat_set
    prefix = tmp_path / "prepared" / "chats"
    prefix.parent.mkdir()
    argv = ["data", "prepare", str(data), "--format", "chat", "--tokenizer", str(tokenizer),
            "--output", str(prefix)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "120 conversations" in out and "--data.format chat --data.paths" in out
    record = json.loads(prefix.with_name("chats.json").read_text())
    assert record["conversations"] == 120 and record["format"] == "chat"
    mtime = prefix.with_name("chats.bin").stat().st_mtime_ns
    assert main(argv) == 0 and "up to date" in capsys.readouterr().out
    assert prefix.with_name("chats.bin").stat().st_mtime_ns == mtime

    from_files = build_chat_datasets(chat_config(chat_set, tmp_path / "a")).train
    cache = tmp_path / "b" / "cache"
    from_prefix = build_chat_datasets(chat_config(chat_set, tmp_path / "b", paths=[str(prefix)]))
    assert not cache.exists() or not list(cache.glob("chat-*"))  # nothing rendered again
    assert len(from_prefix.train) == len(from_files)
    for i in range(len(from_files)):
        for name, array in from_files[i].items():
            np.testing.assert_array_equal(from_prefix.train[i][name], array)
    text = tmp_path / "text"
    for suffix in (".bin", ".idx"):  # a text prefix (no .mask) is not chat data
        text.with_name("text" + suffix).write_bytes(prefix.with_name("chats" + suffix).read_bytes())
    with pytest.raises(DataError, match=r"holds text tokens \(\.bin/\.idx, no \.mask\)"):
        build_chat_datasets(chat_config(chat_set, tmp_path / "d", paths=[str(text)]))
    with pytest.raises(DataError, match="prepared with another tokenizer or chat template"):
        build_chat_datasets(
            chat_config(chat_set, tmp_path / "c", paths=[str(prefix)], chat_template="{{ 1 }}")
        )


def test_the_loader_resumes_exactly_and_splits_over_dp(chat_set, tmp_path):
    config = chat_config(chat_set, tmp_path, reset_position_ids=True)
    train = build_chat_datasets(config).train
    make = chat_loader(config)
    args = dict(micro_batch_size=2, global_batch_size=8, dp_size=2, seed=3)
    first = make(train, dp_rank=0, **args)
    for _ in range(len(train)):  # past an epoch's end
        next(first)
    state = first.state_dict()
    expected = [next(first) for _ in range(3)]
    again = make(train, dp_rank=0, **args)
    again.load_state_dict(state)
    for want in expected:
        got = next(again)
        assert set(got) == set(want)
        for name in want:
            assert torch.equal(got[name], want[name])
    other = make(train, dp_rank=1, **args)
    other.load_state_dict(state)
    assert not torch.equal(next(other)["tokens"], expected[0]["tokens"])  # rank 1's own


def test_text_document_masks_split_at_the_eod(tmp_path, cache):
    words = ["alpha", "beta", "gamma", "tensor", "shard", "rank"]
    docs = [" ".join(words[(i + j) % 6] for j in range(3 + i % 7)) for i in range(200)]
    corpus = tmp_path / "short.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    config = DataConfig(paths=[str(corpus)], vocab_size=280, seq_len=16, cache_dir=str(cache),
                        document_masks=True, reset_position_ids=True)  # fmt: skip
    data = FAMILY.data(config, None)
    batch = next(data.loader(data.train, micro_batch_size=8, seed=0))
    tokens, docs, positions = batch["tokens"], batch[DOCUMENTS], batch[POSITIONS]
    eod = data.tokenizer.eod_id
    assert (tokens == eod).any()
    check_documents(docs, tokens)
    for row in range(len(tokens)):
        for t in range(1, tokens.shape[1]):
            # A new document starts right after each eod, and only there.
            assert docs[row, t] - docs[row, t - 1] == int(tokens[row, t - 1] == eod)
            assert positions[row, t] == (
                0 if tokens[row, t - 1] == eod else positions[row, t - 1] + 1
            )
    plain = FAMILY.data(config.model_copy(update={"document_masks": False,
                                                  "reset_position_ids": False}), None)  # fmt: skip
    assert set(next(plain.loader(plain.train, micro_batch_size=8, seed=0))) == {"tokens", "labels"}
