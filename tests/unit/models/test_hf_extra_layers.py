"""A HuggingFace directory holding layers past the ``num_hidden_layers`` its config.json
declares is refused in one line (`mtcore convert from-hf`, exit 2, nothing written):
the import dropped them without a word, for every decoder model type (DeepSeek's
declared multi-token-prediction layers, the one real case, are in test_hf_deepseek)."""

from __future__ import annotations

import json

import pytest
import torch

from mtcore.cli.main import main
from mtcore.models.gpt import GPTConfig, full_weight_shapes
from mtcore.models.gpt.hf import export_hf

STYLES = {
    "llama": dict(style="llama"),
    "qwen2": dict(style="llama", qkv_bias=True),
    "mixtral": dict(style="llama", moe=dict(num_experts=2, top_k=1, ffn_size=16,
                                            topk_then_softmax=True)),
}


@pytest.mark.parametrize("style", STYLES)
def test_layers_past_the_declared_count_are_refused(tmp_path, capsys, style):
    config = GPTConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, seq_len=8,
                       **STYLES[style])  # fmt: skip
    g = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=g) for n, s in full_weight_shapes(config).items()}
    for name in weights:
        if name.endswith("router.expert_bias"):
            weights[name].zero_()
    hf = export_hf(config, weights, tmp_path / "hf")
    declared = json.loads((hf / "config.json").read_text())
    declared["num_hidden_layers"] = 2  # layer 2's tensors stay in the safetensors file
    (hf / "config.json").write_text(json.dumps(declared))
    out = tmp_path / "out"
    assert main(["convert", "from-hf", str(hf), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "layer(s) 2 past the 2 layers (num_hidden_layers)" in err, err
    assert not out.exists()
