"""A malformed ``model.safetensors.index.json`` is an HFInteropError naming the file (which
``mtcore convert from-hf`` reports in one line), not a KeyError traceback."""

from __future__ import annotations

import json

import pytest

from mtcore.models.gpt.hf import HFInteropError, import_llama

HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 16,
}


@pytest.mark.parametrize("index", ["{}", "[1, 2]", '{"weight_map": 3}', "{not json"])
def test_a_malformed_index_names_the_file(tmp_path, index):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(
        HFInteropError, match=r"model\.safetensors\.index\.json is not a safetensors"
    ):
        import_llama(tmp_path)
