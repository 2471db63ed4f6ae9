"""BERT's ``attention_probs_dropout_prob``, T5's ``dropout_rate`` and Llama's
``attention_dropout`` carry into mtcore's ``attention_dropout`` and back out, through
transformers' own config classes."""

from __future__ import annotations

import pytest
import torch

from mtcore.models.bert import BertConfig
from mtcore.models.bert.hf import bert_config, model_config_from_bert
from mtcore.models.common.hf_files import HFInteropError
from mtcore.models.gpt import GPTConfig
from mtcore.models.gpt.hf import model_config_from_hf
from mtcore.models.t5 import T5Config
from mtcore.models.t5.hf import model_config_from_t5, t5_config

transformers = pytest.importorskip("transformers")
SMALL = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2)


def test_bert_attention_dropout_both_ways():
    hf = transformers.BertConfig(
        **SMALL, vocab_size=99, attention_probs_dropout_prob=0.2, hidden_dropout_prob=0.05
    ).to_dict()
    mine = model_config_from_bert(hf)
    assert (mine.attention_dropout, mine.dropout) == (0.2, 0.05)
    back = transformers.BertConfig(**bert_config(mine))
    assert back.attention_probs_dropout_prob == 0.2 and back.hidden_dropout_prob == 0.05
    assert BertConfig(vocab_size=99).attention_dropout == 0.0  # off unless asked for


def test_t5_dropout_rate_is_both_dropouts_and_one_rate_is_exported():
    hf = transformers.T5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        dropout_rate=0.15, feed_forward_proj="gated-gelu",
    ).to_dict()  # fmt: skip
    mine = model_config_from_t5(hf)
    assert (mine.dropout, mine.attention_dropout) == (0.15, 0.15)
    assert transformers.T5Config(**t5_config(mine)).dropout_rate == 0.15
    hidden_only = mine.model_copy(update={"attention_dropout": 0.0})
    assert t5_config(hidden_only)["dropout_rate"] == 0.15
    with pytest.raises(HFInteropError, match=r"attention_dropout=0.3 differs from dropout=0.15"):
        t5_config(T5Config(**{**mine.model_dump(), "attention_dropout": 0.3}))


def test_llama_attention_dropout_imports():
    hf = transformers.LlamaConfig(
        **SMALL, vocab_size=99, attention_dropout=0.1, max_position_embeddings=16
    ).to_dict()
    assert model_config_from_hf(hf).attention_dropout == 0.1
    assert GPTConfig(vocab_size=99).attention_dropout == 0.0


# -- the families use it ---------------------------------------------------------------
def _bert_logits(p: float, train: bool, seed: int = 0):
    from mtcore.backend import select_backend
    from mtcore.models.bert import Bert
    from mtcore.models.common.layers import single_context

    config = BertConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, seq_len=12,
                        dropout=0.0, attention_dropout=p)  # fmt: skip
    model = Bert(config, single_context(config, select_backend("cpu"), seed)).train(train)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    return model(tokens)[0]


def _t5_logits(p: float, train: bool):
    from mtcore.models.t5 import T5

    torch.manual_seed(0)
    config = T5Config(vocab_size=64, hidden_size=32, head_dim=8, num_heads=4, ffn_hidden_size=48,
                      dropout=0.0, attention_dropout=p)  # fmt: skip
    model = T5(config).train(train)
    g = torch.Generator().manual_seed(1)
    return model(
        torch.randint(0, 64, (2, 10), generator=g), torch.randint(0, 64, (2, 6), generator=g)
    )


@pytest.mark.parametrize("logits", [_bert_logits, _t5_logits], ids=["bert", "t5"])
def test_families_drop_attention_probabilities_only_when_training(logits):
    assert not torch.allclose(logits(0.3, True), logits(0.3, False))
    assert torch.equal(logits(0.3, False), logits(0.0, False))
    assert torch.equal(logits(0.0, True), logits(0.0, False))
