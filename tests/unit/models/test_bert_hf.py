"""HuggingFace BERT <-> mtcore BERT: imported weights give transformers' logits, and an
export loads in transformers with mtcore's logits (fp32, real tiny transformers models)."""

from __future__ import annotations

import json

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models import get_family
from mtcore.models.bert import Bert, BertConfig
from mtcore.models.bert.hf import import_bert
from mtcore.models.common.hf_files import HFInteropError
from mtcore.models.common.layers import single_context

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 96, 16


pytestmark = pytest.mark.usefixtures("one_thread")


def _mtcore_logits(config, weights, tokens, token_types, padding_mask):
    model = Bert(config, single_context(config, select_backend("cpu"))).eval()
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(tokens, token_types, padding_mask)


def _legacy_sharded_copy(source, out):
    """``source``'s model as two safetensors shards and an index, LayerNorm.gamma/beta."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    renamed = {
        name.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): t
        for name, t in tensors.items()
    }
    assert any(name.endswith("gamma") for name in renamed)
    out.mkdir()
    names = sorted(renamed)
    weight_map = {}
    for shard, part in enumerate((names[::2], names[1::2])):
        file = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file({name: renamed[name] for name in part}, str(out / file))
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (out / "config.json").write_text((source / "config.json").read_text())
    return out


def test_imported_bert_for_pretraining_gives_transformers_logits(tmp_path, tiny_bert):
    model = tiny_bert.model(vocab_size=VOCAB, max_position_embeddings=SEQ)
    model.save_pretrained(tmp_path, safe_serialization=True)
    inputs = tiny_bert.inputs(VOCAB, SEQ)
    want_mlm, want_pair = tiny_bert.logits(model, *inputs)

    config, weights = get_family("bert").hf.import_dir(tmp_path, seq_len=None)
    assert (config.vocab_size, config.seq_len, config.ffn_size) == (VOCAB, SEQ, 48)
    assert config.pair_task == "nsp" and config.num_params() == model.num_parameters()
    mlm, pair = _mtcore_logits(config, weights, *inputs)
    # every position: padded queries attend to the real keys in both models
    torch.testing.assert_close(mlm, want_mlm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pair, want_pair, rtol=1e-5, atol=1e-5)

    # the same tensors with TF-era LayerNorm names (gamma, beta), in two indexed shards
    legacy = _legacy_sharded_copy(tmp_path, tmp_path / "legacy")
    for name, tensor in import_bert(legacy)[1].items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)

    # a shorter seq_len keeps the first rows of the position table
    short, short_weights = import_bert(tmp_path, seq_len=8)
    assert short.seq_len == 8 and short_weights["embed.position"].shape == (8, 32)
    torch.testing.assert_close(short_weights["embed.position"], weights["embed.position"][:8])
    with pytest.raises(HFInteropError, match="seq_len=32 exceeds max_position_embeddings=16"):
        import_bert(tmp_path, seq_len=32)


@pytest.mark.parametrize("pair_task", ["nsp", "none"])
def test_exported_bert_loads_in_transformers_with_the_same_logits(tmp_path, tiny_bert, pair_task):
    tokenizers = pytest.importorskip("tokenizers")
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, seq_len=SEQ,
        dropout=0.0, init_std=0.1, pair_task=pair_task,
    )  # fmt: skip
    model = Bert(config, single_context(config, select_backend("cpu"), seed=4)).eval()
    tiny_bert.perturb_ones_and_zeros(model)
    weights = model.state_dict()
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "hello": 5}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.save(str(tmp_path / "source.json"))

    out = get_family("bert").hf.export_dir(
        config, weights, tmp_path / "hf", torch.float32, tokenizer_json=tmp_path / "source.json"
    )
    written = json.loads((out / "config.json").read_text())
    architecture = "BertForPreTraining" if pair_task == "nsp" else "BertForMaskedLM"
    assert written["architectures"] == [architecture] and written["model_type"] == "bert"
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "source.json").read_bytes()
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert (tok_config["cls_token"], tok_config["mask_token"]) == ("[CLS]", "[MASK]")
    assert "token_type_ids" in tok_config["model_input_names"]  # pairs keep their segments

    loaded = getattr(transformers, architecture).from_pretrained(out, attn_implementation="eager")
    inputs = tiny_bert.inputs(VOCAB, SEQ)
    want_mlm, want_pair = _mtcore_logits(config, weights, *inputs)
    mlm, pair = tiny_bert.logits(loaded.eval(), *inputs)
    torch.testing.assert_close(mlm, want_mlm, rtol=1e-5, atol=1e-5)
    if pair_task == "nsp":
        torch.testing.assert_close(pair, want_pair, rtol=1e-5, atol=1e-5)
    # and the export imports back to the same weights
    again_config, again = import_bert(out)
    assert again_config.structure() == config.structure()
    for name, tensor in weights.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"hidden_act": "gelu_new"}, "hidden_act='gelu_new'"),
        ({"position_embedding_type": "relative_key"}, "position_embedding_type='relative_key'"),
        ({"is_decoder": True}, "is_decoder=true"),
        ({"model_type": "roberta"}, "model_type='roberta'"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings=false"),
    ],
)
def test_configs_that_do_not_map_are_refused_by_name(tmp_path, tiny_bert, change, needle):
    hf = {"model_type": "bert", **tiny_bert.SIZES, **change}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(HFInteropError, match=needle):
        import_bert(tmp_path)
