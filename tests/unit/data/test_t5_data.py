"""T5 span corruption: the lengths, the noise statistics, the input/target layout,
determinism, resume, the dp split and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtcore.data import DataConfig, DataError
from mtcore.models.t5.data import (
    IGNORE_INDEX,
    SpanLoader,
    build_span_data,
    corrupt,
    noise_mask,
)
from mtcore.models.t5.names import EOS_TOKEN, NUM_SENTINELS, PAD_TOKEN
from mtcore.models.t5.spans import lengths_of, span_counts, span_lengths

ENC, DEC = 48, 16


def test_t5s_own_lengths():
    """Raffel et al.: 512 input tokens at density 0.15 and mean span 3 are pieces of 568
    tokens with 114-token targets (T5's random_spans_helper)."""
    assert span_lengths(512)[:] == (568, 85, 28, 512, 114)
    for encoder_len in (5, 16, 48, 100, 333):
        need = span_lengths(encoder_len)
        assert need.encoder_len <= encoder_len
        assert lengths_of(need.raw_len + 1, 0.15, 3.0).encoder_len > encoder_len  # the longest


def test_a_decoder_length_limits_the_piece():
    free, limited = span_lengths(128), span_lengths(128, decoder_len=16)
    assert limited.decoder_len <= 16 < free.decoder_len and limited.raw_len < free.raw_len


def test_lengths_the_data_cannot_fill_are_refused():
    with pytest.raises(
        DataError, match=r"encoder length 2 cannot hold one corrupted span: .* at least 3 encoder"
    ):
        span_lengths(2)
    with pytest.raises(DataError, match=r"decoder length 2 cannot hold.*3 decoder positions"):
        span_lengths(64, decoder_len=2)


def test_noise_statistics_match_the_paper():
    """Over many draws: exactly round(n * 0.15) noise tokens per piece, spans of mean
    length ~3 (noise / round(noise / 3)), never the first token, kept runs between spans."""
    rng = np.random.default_rng(0)
    length, lengths = 200, []
    noise, spans = span_counts(length, 0.15, 3.0)
    assert (noise, spans) == (30, 10)
    for _ in range(300):
        mask = noise_mask(length, 0.15, 3.0, rng)
        assert mask.sum() == noise and not mask[0]
        starts = np.flatnonzero(mask & ~np.r_[False, mask[:-1]])
        ends = np.flatnonzero(mask & ~np.r_[mask[1:], False])
        assert len(starts) == spans
        lengths += (ends - starts + 1).tolist()
    assert np.mean(lengths) == pytest.approx(3.0)
    assert min(lengths) == 1 and max(lengths) > 6  # random span lengths, not fixed ones


def test_short_pieces_still_get_one_span():
    for length in (2, 3, 5):
        mask = noise_mask(length, 0.15, 3.0, np.random.default_rng(length))
        assert mask.sum() == 1 and not mask[0]


def test_corrupt_layout():
    tokens = np.arange(100, 110)
    mask = np.zeros(10, dtype=bool)
    mask[[2, 3, 7]] = True
    sentinels = np.arange(1000, 1000 + NUM_SENTINELS)
    source, target = corrupt(tokens, mask, sentinels, eos_id=1)
    assert source.tolist() == [100, 101, 1000, 104, 105, 106, 1001, 108, 109, 1]
    assert target.tolist() == [1000, 102, 103, 1001, 107, 1]


@pytest.fixture(scope="module")
def spans(tmp_path_factory, trained):
    _, root = trained  # the shared corpus; its own tokenizer, with T5's special tokens
    base = tmp_path_factory.mktemp("spans")
    config = DataConfig(
        paths=[str(root)], cache_dir=str(base / "cache"), vocab_size=400, valid_fraction=0.2
    )
    return build_span_data(config, ENC, DEC)


def _loader(data, **kw):
    args = dict(micro_batch_size=4, seed=3, encoder_len=ENC, decoder_len=DEC)
    return SpanLoader(data.train, **{**args, **kw})


def test_batches_hold_inputs_targets_and_masks(spans):
    tok, vocab = spans.tokenizer, spans.train.vocab
    assert tok.token_id("<extra_id_99>") == vocab.sentinel_ids[-1]
    batch = next(_loader(spans))
    assert set(batch) == {
        "tokens",
        "padding_mask",
        "decoder_tokens",
        "labels",
        "decoder_padding_mask",
    }
    assert batch["tokens"].shape == (4, ENC) and batch["labels"].shape == (4, DEC)
    pad, eos = tok.token_id(PAD_TOKEN), tok.token_id(EOS_TOKEN)
    for row in range(4):
        enc_real, dec_real = batch["padding_mask"][row], batch["decoder_padding_mask"][row]
        source = batch["tokens"][row][enc_real]
        target = batch["labels"][row][dec_real]
        assert (batch["tokens"][row][~enc_real] == pad).all()
        assert (batch["labels"][row][~dec_real] == IGNORE_INDEX).all()
        assert source[-1] == eos and target[-1] == eos
        used = [s for s in vocab.sentinel_ids.tolist() if s in source.tolist()]
        assert used == vocab.sentinel_ids[: len(used)].tolist() and len(used) >= 1
        assert [t for t in target.tolist() if t in used] == used  # each sentinel, in order
        assert batch["decoder_tokens"][row, 0] == pad  # the decoder start
        assert torch.equal(batch["decoder_tokens"][row, 1 : len(target)], target[:-1])
    # the piece's tokens, in order, are the input's kept tokens and the target's spans
    assert not batch["padding_mask"].all() or not batch["decoder_padding_mask"].all()


def test_the_corruption_covers_the_piece(spans):
    """Re-filling each sentinel of the input with its span from the target gives the piece."""
    loader = _loader(spans, micro_batch_size=1)
    sentinels = set(spans.train.vocab.sentinel_ids.tolist())
    for _ in range(10):
        (index,), (epoch,) = loader.next_draws()
        source, target = loader.sample(int(index), int(epoch))
        spans_of, current = {}, None
        for t in target[:-1].tolist():
            if t in sentinels:
                current = spans_of.setdefault(t, [])
            else:
                current.append(t)
        rebuilt = [
            x for t in source[:-1].tolist() for x in (spans_of[t] if t in sentinels else [t])
        ]
        assert rebuilt == spans.train[int(index)].tolist()


def test_deterministic_resumable_and_split_over_dp(spans):
    first = _loader(spans)
    whole = [next(first) for _ in range(3)]
    again = next(_loader(spans))
    assert all(torch.equal(whole[0][k], again[k]) for k in again)
    resumed = _loader(spans)
    next(resumed)
    state = resumed.state_dict()
    fresh = _loader(spans)
    fresh.load_state_dict(state)
    for want in whole[1:]:
        got = next(fresh)
        assert all(torch.equal(want[k], got[k]) for k in want)
    halves = [_loader(spans, micro_batch_size=2, dp_rank=r, dp_size=2) for r in (0, 1)]
    parts = [next(h) for h in halves]
    for key, value in whole[0].items():
        merged = torch.stack([parts[i % 2][key][i // 2] for i in range(4)])
        assert torch.equal(merged, value), key
    other = next(_loader(spans, seed=4))
    assert not torch.equal(other["tokens"], whole[0]["tokens"])


def test_each_epoch_corrupts_afresh(spans):
    loader = _loader(spans, micro_batch_size=1, shuffle=False)
    assert loader.sample(0, 0)[0].tolist() != loader.sample(0, 1)[0].tolist() or (
        loader.sample(0, 2)[0].tolist() != loader.sample(0, 0)[0].tolist()
    )


def test_a_loader_too_short_for_the_data_is_refused(spans):
    with pytest.raises(
        DataError, match=r"need \d+ encoder and \d+ decoder positions, more than 20 / 16"
    ):
        _loader(spans, encoder_len=20)
