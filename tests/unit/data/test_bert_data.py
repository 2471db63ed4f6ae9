"""BERT pair data: layout, masking, nsp/sop pairs, determinism, resume, dp split, errors.

The corpus tags every line with its document and line number ("d03 l17 ..."), so a
decoded segment says where it came from and pair order can be checked on the text.
"""

from __future__ import annotations

import random
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers, trainers

from mtcore.data import DataConfig, DataError, Tokenizer
from mtcore.data.corpus import find_files, iter_documents, stdlib_files
from mtcore.data.tokenizer import get_tokenizer, train_tokenizer
from mtcore.models.bert.data import BERT_SPECIAL_TOKENS, PairBlend, build_pair_data
from mtcore.models.bert.pair_loader import PairLoader

SEQ_LEN = 64
_WORDS = ["alpha", "beta", "gamma", "delta", "shard", "rank", "token", "merge", "batch", "seed"]
_TAG = re.compile(r"d(\d+) l(\d+)")


def write_tagged_corpus(root: Path, n_docs: int = 16, n_lines: int = 48) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for doc in range(n_docs):
        lines = []
        for line in range(n_lines):
            lines.append(f"d{doc:02d} l{line:02d} " + " ".join(rng.choices(_WORDS, k=3)))
            if line % 7 == 6:
                lines.append("")  # a blank line now and then, as in real text
        suffix = (".py", ".txt", ".md")[doc % 3]
        (root / f"doc{doc:02d}{suffix}").write_text("\n".join(lines) + "\n")
    return root


def config_for(root: Path, cache: Path, **overrides) -> DataConfig:
    fields = {"paths": [str(root)], "vocab_size": 320, "valid_fraction": 0.0}
    return DataConfig(cache_dir=str(cache), **{**fields, **overrides})


@pytest.fixture(scope="module")
def tagged(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("pairs")
    return write_tagged_corpus(base / "corpus"), base / "cache"


@pytest.fixture(scope="module")
def nsp(tagged):
    return build_pair_data(config_for(*tagged), SEQ_LEN, "nsp", seed=0)


def tags(tokenizer: Tokenizer, ids) -> list[tuple[int, int]]:
    return [(int(d), int(n)) for d, n in _TAG.findall(tokenizer.decode(ids))]


def test_special_tokens_are_single_ids_cached_apart_and_never_from_text(nsp, tagged):
    tok = nsp.tokenizer
    ids = [tok.token_id(t) for t in BERT_SPECIAL_TOKENS]
    assert len(set(ids)) == 4 and tok.eod_id not in ids and set(ids) <= tok.special_ids
    text = "x = '[MASK]' + [CLS] [SEP] [PAD]\n"
    assert not set(ids) & set(tok.encode(text)) and tok.decode(tok.encode(text)) == text
    gpt = get_tokenizer(find_files(tagged[0]), tagged[1], vocab_size=320)
    assert gpt.path != tok.path and gpt.hf.token_to_id("[MASK]") is None


def test_batch_layout_types_and_padding(nsp):
    vocab = nsp.train.vocab
    loader = PairLoader(nsp.train, micro_batch_size=8, shuffle=False)
    batch = next(loader)
    assert set(batch) == {"tokens", "labels", "token_types", "padding_mask", "pair_labels"}
    for key in ("tokens", "labels", "token_types"):
        assert batch[key].shape == (8, SEQ_LEN) and batch[key].dtype == torch.int64
    assert batch["padding_mask"].dtype == torch.bool and batch["pair_labels"].shape == (8,)
    for row in range(8):  # shuffle=False, epoch 0: rows are samples 0..7
        sample = nsp.train[row]
        tokens = batch["tokens"][row].numpy()
        seps = np.flatnonzero(tokens == vocab.sep_id)
        assert tokens[0] == vocab.cls_id and len(seps) == 2 and seps[1] == sample.length - 1
        expected_types = np.zeros(SEQ_LEN, dtype=np.int64)
        expected_types[seps[0] + 1 : seps[1] + 1] = 1
        assert np.array_equal(batch["token_types"][row].numpy(), expected_types)
        assert np.array_equal(batch["padding_mask"][row].numpy(), sample.tokens != vocab.pad_id)
        assert not batch["padding_mask"][row].all()  # segments are short: padding, no packing
        assert batch["pair_labels"][row] == sample.pair_label


def test_masking_rate_split_and_labels(nsp):
    vocab = nsp.train.vocab
    loader = PairLoader(nsp.train, micro_batch_size=16, shuffle=False, seed=3)
    originals, batches = [], []
    for _ in range(20):
        start = loader.samples_consumed
        batches.append(next(loader))
        originals += [nsp.train[i % len(nsp.train)].tokens for i in range(start, start + 16)]
    tokens = torch.cat([b["tokens"] for b in batches]).numpy()
    labels = torch.cat([b["labels"] for b in batches]).numpy()
    original = np.stack(originals)
    chosen = labels != -100
    maskable = ~np.isin(original, vocab.special_ids)
    assert not (chosen & ~maskable).any()  # never a special token or padding
    assert chosen.sum(axis=1).min() >= 1
    assert abs(chosen.sum() / maskable.sum() - 0.15) < 0.015
    assert np.array_equal(labels[chosen], original[chosen])
    assert np.array_equal(tokens[~chosen], original[~chosen])
    as_mask = tokens[chosen] == vocab.mask_id
    kept = tokens[chosen] == original[chosen]
    replaced = ~as_mask & ~kept
    assert abs(as_mask.mean() - 0.8) < 0.03 and abs(kept.mean() - 0.1) < 0.03
    assert abs(replaced.mean() - 0.1) < 0.03
    assert not np.isin(tokens[chosen][replaced], vocab.special_ids).any()


def test_nsp_next_pairs_are_in_order_and_random_ones_cross_documents(nsp):
    data = nsp.train
    label = data.pair_label
    assert 0.4 < label.mean() < 0.6 and len(data) > 100
    first, second = data.first_segment, data.second_segment
    nexts, randoms = label == 0, label == 1
    assert np.array_equal(second[nexts], first[nexts] + 1)
    assert np.array_equal(data.segment_end[first[nexts]], data.segment_start[second[nexts]])
    assert (data.segment_doc[first[randoms]] != data.segment_doc[second[randoms]]).all()
    for i in range(40):
        sample = data[i]
        seps = np.flatnonzero(sample.tokens == data.vocab.sep_id)
        a_tags = tags(nsp.tokenizer, sample.tokens[1 : seps[0]])
        b_tags = tags(nsp.tokenizer, sample.tokens[seps[0] + 1 : seps[1]])
        (a_doc, a_line), (b_doc, b_line) = a_tags[-1], b_tags[0]
        if sample.pair_label == 0:
            assert (b_doc, b_line) == (a_doc, a_line + 1)
        else:
            assert b_doc != a_doc
        assert len({doc for doc, _ in a_tags}) == 1  # a segment never crosses documents


def test_sop_swaps_consecutive_segments(tagged):
    data = build_pair_data(config_for(*tagged), SEQ_LEN, "sop", seed=1).train
    label, first, second = data.pair_label, data.first_segment, data.second_segment
    assert 0.4 < label.mean() < 0.6
    assert np.array_equal(second[label == 0], first[label == 0] + 1)
    assert np.array_equal(first[label == 1], second[label == 1] + 1)
    assert np.array_equal(data.segment_doc[first], data.segment_doc[second])


def test_single_segment_task_has_no_pair_label(tagged):
    data = build_pair_data(config_for(*tagged), 3, "none").train
    batch = next(PairLoader(data, micro_batch_size=4, shuffle=False))
    assert "pair_labels" not in batch and batch["tokens"].shape == (4, 3)
    assert (batch["token_types"] == 0).all() and batch["padding_mask"].all()
    assert (
        batch["tokens"][:, [0, 2]] == torch.tensor([data.vocab.cls_id, data.vocab.sep_id])
    ).all()
    assert (batch["labels"][:, 1] != -100).all()  # the one maskable token is always chosen


def test_same_seed_same_batches_and_resume_across_an_epoch(nsp):
    def loader():
        return PairLoader(nsp.train, micro_batch_size=16, seed=5)

    uninterrupted, other = loader(), loader()
    steps = len(nsp.train) // 16 + 3  # runs into the second epoch
    reference = [next(uninterrupted) for _ in range(steps)]
    for batch in reference[:4]:
        assert all(torch.equal(batch[k], value) for k, value in next(other).items())
    first = loader()
    for _ in range(steps - 5):
        next(first)
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    for batch in reference[steps - 5 :]:
        assert all(torch.equal(batch[k], value) for k, value in next(resumed).items())
    shifted = PairLoader(nsp.train, micro_batch_size=16, seed=6)
    assert not torch.equal(next(shifted)["tokens"], reference[0]["tokens"])


def test_masks_are_redrawn_each_epoch(nsp):
    loader = PairLoader(nsp.train, micro_batch_size=len(nsp.train), shuffle=False)
    epoch0, epoch1 = next(loader), next(loader)
    assert torch.equal(epoch0["token_types"], epoch1["token_types"])
    assert not torch.equal(epoch0["labels"], epoch1["labels"])


def test_two_ranks_interleave_to_the_single_rank_batch(nsp):
    single = PairLoader(nsp.train, micro_batch_size=8, global_batch_size=16, seed=2)
    ranks = [
        PairLoader(nsp.train, 4, global_batch_size=16, dp_rank=r, dp_size=2, seed=2)
        for r in range(2)
    ]
    for _ in range(4):
        whole = next(single)
        parts = [next(rank) for rank in ranks]
        for key, value in whole.items():
            interleaved = torch.stack([parts[0][key], parts[1][key]], dim=1).flatten(0, 1)
            assert torch.equal(interleaved, value), key


def test_seq_len_too_short_is_rejected_naming_it(tagged):
    for task, seq_len, needed in (("nsp", 4, 5), ("sop", 2, 5), ("none", 2, 3)):
        with pytest.raises(DataError, match=rf"seq_len={seq_len} .*seq_len >= {needed}"):
            build_pair_data(config_for(*tagged), seq_len, task)
    with pytest.raises(DataError, match="pair_task must be one of"):
        build_pair_data(config_for(*tagged), SEQ_LEN, "mlm")


def test_corpus_too_small_for_one_pair_names_the_numbers(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.txt").write_text("x = 1\n")
    (tmp_path / "one" / "b.txt").write_text("y = 2\n")
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "a.txt").write_text("".join(f"line {i} alpha beta\n" for i in range(40)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # such tiny corpora cannot fill the vocab
        with pytest.raises(DataError, match=r"2 document\(s\).* 2 segment\(s\) of at most 30 "):
            build_pair_data(config_for(tmp_path / "one", tmp_path / "cache"), SEQ_LEN, "sop")
        with pytest.raises(DataError, match=r"only 1 document\(s\) hold a segment"):
            build_pair_data(config_for(tmp_path / "long", tmp_path / "cache"), SEQ_LEN, "nsp")


def test_a_tokenizer_file_without_mask_is_rejected_naming_it(tagged, tmp_path):
    corpus, _ = tagged
    docs = iter_documents(find_files(corpus))
    no_mask = train_tokenizer(docs, 300, special_tokens=["[CLS]", "[SEP]", "[PAD]"])
    path = tmp_path / "tokenizer.json"
    path.write_text(no_mask.to_str())
    config = config_for(corpus, tmp_path / "cache", tokenizer=str(path))
    with pytest.raises(DataError, match=r"lacks the special token\(s\) \['\[MASK\]'\]"):
        build_pair_data(config, SEQ_LEN)


def test_a_bert_tokenizer_without_an_eod_token_ends_documents_with_sep(tagged):
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(BERT_SPECIAL_TOKENS))
    hf.train_from_iterator(iter_documents(find_files(tagged[0])), trainer)
    tok = Tokenizer(hf, required_tokens=BERT_SPECIAL_TOKENS)
    assert tok.eod_id == tok.token_id("[SEP]")
    with pytest.raises(DataError, match="end-of-document"):
        Tokenizer(hf)  # a GPT job still needs a real one


def test_several_paths_blend_into_one_pair_loader(tagged, tmp_path):
    corpus, cache = tagged
    notes = tmp_path / "notes.jsonl"
    rows = [f'{{"text": "note {i} alpha\\nnote {i} beta gamma\\nend {i}"}}' for i in range(60)]
    notes.write_text("\n".join(rows) + "\n")
    config = config_for(corpus, cache, paths=[str(corpus), str(notes)], weights=[1, 1])
    data = build_pair_data(config, 16, "nsp")
    assert isinstance(data.train, PairBlend)
    assert [d.name for d in data.train.datasets] == ["corpus/train", "notes/train"]
    batch = next(PairLoader(data.train, micro_batch_size=6, seed=0))
    assert batch["tokens"].shape == (6, 16) and "pair_labels" in batch


def test_segments_tile_each_document_and_never_exceed_the_budget(nsp):
    data = nsp.train
    assert (data.segment_end - data.segment_start).max() <= data.budget == (SEQ_LEN - 3) // 2
    for position, doc in enumerate(data.doc_ids):
        pieces = [data.segment_tokens(s) for s in np.flatnonzero(data.segment_doc == position)]
        assert np.array_equal(np.concatenate(pieces), data.index.document(int(doc))[:-1])


def test_default_corpus_gives_pairs_of_its_text_and_valid_from_held_out_documents(tmp_path):
    config = DataConfig(
        cache_dir=str(tmp_path), default_corpus_files=8, vocab_size=300, valid_fraction=0.25
    )
    data = build_pair_data(config, 48, "nsp")
    assert data.valid is not None and data.train.name == "stdlib/train"
    assert not set(data.train.doc_ids.tolist()) & set(data.valid.doc_ids.tolist())
    texts = list(iter_documents(stdlib_files(config.default_corpus_bytes, 8)))
    train = data.train
    doc = int(train.doc_ids[0])
    own = np.flatnonzero(train.segment_doc == 0)
    decoded = data.tokenizer.decode(np.concatenate([train.segment_tokens(s) for s in own]))
    assert decoded == texts[doc]
