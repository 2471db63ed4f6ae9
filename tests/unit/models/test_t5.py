"""The T5 family in one process: relative-position buckets against the paper's function,
the config's derived fields and refusals, parameter counts, the registry, and the
logits of a random transformers T5 v1.1 (untied) and original-style (tied) model."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from mtcore.models.registry import BUILTIN, FamilyError, parse_model_config
from mtcore.models.t5 import T5, T5Config
from mtcore.models.t5.blocks import relative_position_bucket
from mtcore.models.t5.weights import (
    from_hf_tensors,
    full_weight_shapes,
    load_full_weights,
    to_hf_tensors,
)
from mtcore.parallel.layout import LayoutError, LayoutSpec


def paper_bucket(
    relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int
) -> int:
    """Raffel et al. 2020 (Mesh TensorFlow's ``_relative_position_bucket``), one distance
    at a time in plain Python: ``relative_position = key - query``."""
    ret, n = 0, -relative_position
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    large = max_exact + int(
        math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    )
    return ret + min(large, num_buckets - 1)


DISTANCES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 63, 64, 100, 127, 128, 129, 500, 10_000]


@pytest.mark.parametrize(
    ("bidirectional", "buckets", "max_distance"),
    [(True, 32, 128), (False, 32, 128), (True, 8, 20), (False, 10, 40)],
)
def test_buckets_match_the_paper(bidirectional, buckets, max_distance):
    table = torch.tensor([d for d in DISTANCES] + [-d for d in DISTANCES])
    got = relative_position_bucket(table, bidirectional, buckets, max_distance).tolist()
    want = [paper_bucket(int(d), bidirectional, buckets, max_distance) for d in table]
    assert got == want
    assert max(got) == buckets - 1  # the largest bucket is reached, by the farthest keys


def test_bucket_table_by_hand():
    """T5's defaults (32 buckets, 128): exact buckets up to 7 per direction, keys after
    the query in the upper half (bidirectional), the log range and the last bucket."""
    bi = dict(bidirectional=True, num_buckets=32, max_distance=128)
    rel = torch.tensor([0, -1, 1, -7, 7, -8, -127, -128, -10_000, 10_000])
    assert relative_position_bucket(rel, **bi).tolist() == [0, 1, 17, 7, 23, 8, 15, 15, 15, 31]
    causal = dict(bidirectional=False, num_buckets=32, max_distance=128)
    rel = torch.tensor([5, 0, -1, -15, -16, -127, -128, -10_000])
    assert relative_position_bucket(rel, **causal).tolist() == [0, 0, 1, 15, 16, 31, 31, 31]


def test_config_derives_the_stack_and_the_decoder_length():
    config = T5Config(encoder_layers=3, decoder_layers=5, seq_len=128)
    assert config.num_layers == 8 and config.decoder_seq_len == 29 and config.template_layers == 8 and config.template_layer(7) == 7
    assert T5Config(seq_len=128, decoder_seq_len=40).decoder_seq_len == 40
    with pytest.raises(ValueError, match=r"num_layers=4 is derived for T5: .* = 3 \+ 5 = 8"):
        T5Config(encoder_layers=3, decoder_layers=5, num_layers=4)


def test_family_is_registered_lazily():
    assert BUILTIN["t5"] == "mtcore.models.t5.family"
    config = parse_model_config({"family": "t5", "encoder_layers": 1, "decoder_layers": 1})
    assert isinstance(config, T5Config)
    with pytest.raises(FamilyError, match=r"unknown config key 'model.pair_task'"):
        parse_model_config({"family": "t5", "pair_task": "nsp"})


@pytest.mark.parametrize(
    ("sizes", "layout", "message"),
    [
        (
            {"encoder_layers": 1, "decoder_layers": 1},
            {"pp": 4},
            r"= 2 layers leave pipeline stages empty: pp\*vpp = 4\*1",
        ),
        ({"encoder_layers": 3}, {"pp": 2}, r"5 layers are not divisible by pp\*vpp = 2\*1 = 2"),
        (
            {"pipeline_split_rank": 2},
            {"pp": 2},
            r"split rank 2 must leave encoder and decoder stages",
        ),
        (
            {"encoder_layers": 3, "decoder_layers": 3, "pipeline_split_rank": 1},
            {"pp": 2, "vpp": 2},
            r"split_rank=1 gives stages \[3, 1, 1, 1\] layers, but .* 6 layers divisible by pp\*vpp = 2\*2 = 4",
        ),
        (
            {"num_heads": 3, "hidden_size": 48},
            {"tp": 2},
            r"3 attention heads are not divisible by tp=2",
        ),
        (
            {"seq_len": 32, "decoder_seq_len": 7},
            {"tp": 2, "sequence_parallel": True},
            r"decoder sequence length 7 is not divisible by tp\*cp = 2\*1",
        ),
        (
            {},
            {"cp": 2},
            r"T5 under cp=2 attends by all-gather .* set parallel.cp_method: allgather",
        ),
        (
            {"seq_len": 32, "decoder_seq_len": 10},
            {"cp": 2, "cp_method": "allgather"},
            r"^decoder_seq_len=10 is not divisible by 2\*cp = 4 \(context .*decoder_seq_len: 12$",
        ),
        (
            {"seq_len": 30, "decoder_seq_len": 8},
            {"cp": 2, "cp_method": "allgather"},
            r"^seq_len=30 is not divisible by 2\*cp = 4",
        ),
        (
            {"seq_len": 32, "decoder_seq_len": 20},
            {"cp": 2, "tp": 4, "sequence_parallel": True, "cp_method": "allgather"},
            r"decoder sequence length 20 is not divisible by tp\*cp = 4\*2",
        ),
        (
            {"attention_dropout": 0.1},
            {"cp": 2, "cp_method": "allgather"},
            r"attention_dropout=0.1 under cp=2 is not built",
        ),
        ({}, {"pp": 2, "first_stage_layers": 1}, r"T5 splits its stages by .*split_rank"),
    ],
)
def test_impossible_layouts_are_named(sizes, layout, message):
    config = T5Config(vocab_size=128, **sizes)
    with pytest.raises(LayoutError, match=message):
        config.check_layout(LayoutSpec(**layout).resolve(8))


def test_split_rank_layouts_pass():
    config = T5Config(vocab_size=128, encoder_layers=2, decoder_layers=6, pipeline_split_rank=1)
    config.check_layout(LayoutSpec(pp=2).resolve(2))
    assert config.stage_counts(2) == [2, 6]


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_and_names(tie, one_thread):
    config = T5Config(
        vocab_size=64,
        hidden_size=32,
        head_dim=4,
        num_heads=4,
        ffn_hidden_size=48,
        tie_embeddings=tie,
    )
    model = T5(config)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    assert shapes == full_weight_shapes(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    assert ("lm_head.weight" in shapes) is not tie


def _hf_pair(transformers, tie: bool, seed: int = 0):
    hf_config = transformers.T5Config(
        vocab_size=96, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
        dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=tie,
        decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    hf = transformers.T5ForConditionalGeneration(hf_config).eval()
    config = T5Config(
        vocab_size=96, hidden_size=32, head_dim=8, ffn_hidden_size=48, encoder_layers=2,
        decoder_layers=3, num_heads=4, relative_buckets=8, relative_max_distance=20,
        dropout=0.0, seq_len=24, decoder_seq_len=10, tie_embeddings=tie,
    )  # fmt: skip
    return hf, config


@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(tie, one_thread):
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf, config = _hf_pair(transformers, tie)
    model = T5(config).eval()
    load_full_weights([model], from_hf_tensors(config, hf.state_dict()))
    g = torch.Generator().manual_seed(1)
    tokens, decoder = (
        torch.randint(0, 96, (3, 24), generator=g),
        torch.randint(0, 96, (3, 10), generator=g),
    )
    mask = torch.ones(3, 24, dtype=torch.bool)
    mask[1, 15:] = False
    mask[2, 4:] = False
    with torch.no_grad():
        want = hf(input_ids=tokens, attention_mask=mask.long(), decoder_input_ids=decoder).logits
        got = model(tokens, decoder, mask)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    back = to_hf_tensors(config, model.state_dict())
    theirs = hf.state_dict()
    assert all(torch.equal(back[name], theirs[name]) for name in back)
    assert set(theirs) - set(back) <= {
        "encoder.embed_tokens.weight",
        "decoder.embed_tokens.weight",
        "lm_head.weight",
    }
