"""The encoder-decoder layer split: where the boundary falls, Megatron's split rank, and
the splits refused (naming the numbers)."""

from __future__ import annotations

import pytest

from mtcore.parallel.pipeline.split import SplitError, encoder_decoder_counts, stage_plans


@pytest.mark.parametrize(
    ("encoder", "decoder", "pp", "vpp", "counts"),
    [
        (2, 2, 2, 1, [2, 2]),  # the boundary at the stage boundary
        (2, 4, 2, 1, [3, 3]),  # stage 0 ends inside the decoder
        (4, 2, 2, 1, [3, 3]),  # stage 1 starts inside the encoder
        (4, 4, 2, 2, [2, 2, 2, 2]),  # interleaved: virtual stages 0, 1 the encoder
        (3, 3, 3, 2, [1] * 6),
    ],
)
def test_even_split_of_the_whole_stack(encoder, decoder, pp, vpp, counts):
    assert encoder_decoder_counts(encoder, decoder, pp, vpp) == counts
    plans = [p for r in range(pp) for p in stage_plans(encoder + decoder, pp, r, vpp, counts)]
    covered = sorted(i for p in plans for i in p.layers)
    assert covered == list(range(encoder + decoder))


def test_split_rank_gives_each_stack_its_stages():
    assert encoder_decoder_counts(2, 6, 2, split_rank=1) == [2, 6]
    assert encoder_decoder_counts(2, 6, 4, split_rank=1) == [2, 2, 2, 2]
    assert encoder_decoder_counts(4, 2, 3, split_rank=2) == [2, 2, 2]
    assert encoder_decoder_counts(2, 3, 2, split_rank=1) == [2, 3]  # uneven, but each divides
    assert encoder_decoder_counts(2, 3, 2, 2, split_rank=1) == [2, 1, 1, 1]  # virtual stages


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (
            (1, 1, 4),
            {},
            r"1 encoder \+ 1 decoder = 2 layers leave pipeline stages empty: pp\*vpp = 4\*1 = 4",
        ),
        ((1, 2, 2, 2), {}, r"1 encoder \+ 2 decoder = 3 layers leave .* pp\*vpp = 2\*2 = 4"),
        ((3, 2, 2), {}, r"5 layers are not divisible by pp\*vpp = 2\*1 = 2"),
        (
            (2, 2, 2),
            {"split_rank": 2},
            r"split rank 2 must leave encoder and decoder stages: .*\[1, 1\]",
        ),
        (
            (3, 2, 2, 2),
            {"split_rank": 2},
            r"gives the encoder 2 stage\(s\), which do not divide its 3 layers",
        ),
        (
            (2, 3, 3),
            {"split_rank": 1},
            r"gives the decoder 2 stage\(s\), which do not divide its 3",
        ),
        ((0, 2, 1), {}, r"needs layers in both stacks, got 0 encoder and 2 decoder"),
    ],
)
def test_impossible_splits_are_named(args, kwargs, message):
    with pytest.raises(SplitError, match=message):
        encoder_decoder_counts(*args, **kwargs)
