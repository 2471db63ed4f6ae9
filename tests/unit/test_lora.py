"""LoRA in one process: the adapters' init and arithmetic, freezing, the config, and the
base reference of a LoRA checkpoint (the layouts are ``test_lora_equivalence``'s)."""

from __future__ import annotations

import math

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.common.lora import LoRAConfig, add_lora, is_adapter
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.parallel.tensor import ColumnParallelLinear, TPGroup
from mtcore.parallel.tensor.lora import LoRA, SectionAdapters
from mtcore.training.checkpoint.lora_base import base_directory, checkpoint_reference
from mtcore.training.checkpoint.manifest import CheckpointError
from mtcore.training.overrides import ConfigError, load_config

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=8)


def _gpt(seed: int = 0) -> GPT:
    config = GPTConfig(style="llama", init_std=0.1, **SIZES)
    return GPT(config, single_context(config, select_backend("cpu"), seed))


def test_init_is_peft_default_and_the_adapted_model_starts_as_its_base():
    model = _gpt()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(tokens)
    assert (
        add_lora([model], LoRAConfig(rank=4, alpha=8, targets=["q", "v", "o", "fc1", "fc2"])) == 8
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(n) for n in trainable)
    assert "layers.1.mlp.fc1.lora.gate.A" in trainable and "layers.1.mlp.fc1.lora.up.B" in trainable
    assert not any(".lora.k." in n for n in trainable)  # k was not named
    expected = torch.empty(4, 32)
    torch.nn.init.kaiming_uniform_(
        expected, a=math.sqrt(5), generator=model.c.generator("layers.0.attn.qkv.lora.q")
    )  # PEFT's reset_parameters, from the adapter's own stream
    adapter = model.layers["0"].attn.qkv.lora["q"]
    assert torch.equal(adapter.A, expected) and adapter.A.abs().max() <= 1 / math.sqrt(32)
    assert torch.equal(adapter.B, torch.zeros(32, 4))  # q: 4 heads x 8
    assert not torch.equal(adapter.A, model.layers["0"].attn.qkv.lora["v"].A)  # own streams
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)


def test_a_fused_layer_adds_each_sections_update_and_zeros_elsewhere():
    tp = TPGroup.single(select_backend("cpu"))
    g = torch.Generator().manual_seed(0)
    linear = ColumnParallelLinear(8, 6 + 2 + 2, tp, bias=False, sections=(6, 2, 2), generator=g)
    linear.requires_grad_(False)
    kwargs = dict(rank=2, alpha=6.0, generator=g)
    q, v = LoRA("column", 8, 6, tp, **kwargs), LoRA("column", 8, 2, tp, **kwargs)
    with torch.no_grad():
        q.B.normal_(generator=g)
        v.B.normal_(generator=g)
    linear.lora = SectionAdapters([("q", 6), ("k", 2), ("v", 2)], {"q": q, "v": v}, tp)
    x = torch.randn(3, 5, 8, generator=g)
    delta = torch.cat([3.0 * x @ q.A.T @ q.B.T, torch.zeros(3, 5, 2), 3.0 * x @ v.A.T @ v.B.T], -1)
    torch.testing.assert_close(linear(x), x @ linear.weight.T + delta)
    merged = linear.weight + linear.lora.merged_delta()
    torch.testing.assert_close(linear(x), x @ merged.T)
    linear(x).sum().backward()
    assert linear.weight.grad is None and q.A.grad is not None and v.B.grad is not None


def test_config_is_checked_before_any_process_starts():
    config = load_config(
        None, ["--finetune.lora.rank", "16", "--finetune.lora.targets", "[q, k, v]"]
    )
    assert config.finetune.lora == LoRAConfig(rank=16, targets=["q", "k", "v"])
    assert config.finetune.lora.scale == 0.5 and load_config(None).finetune.lora is None
    bad = {
        ("--finetune.lora.targets", "[q, w]"): "unknown LoRA target 'w'",
        ("--finetune.lora.targets", "[q, q]"): "is named twice",
        ("--finetune.lora.targets", "[kv_up]"): "'kv_up' names no linear of this attention",
        ("--finetune.lora.rank", "0"): "greater than or equal to 1",
        ("--finetune.lora.dropout", "1.0"): "less than 1",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, list(override))


def test_a_lora_checkpoints_base_is_refused_when_gone_or_changed(tmp_path):
    from mtcore.training.checkpoint import write_model_weights

    model = _gpt()
    directory = write_model_weights(tmp_path / "base", model.state_dict(), model.config)
    reference = checkpoint_reference(directory)
    assert (
        reference["step"] == 0 and base_directory(reference, tmp_path / "a") == directory.resolve()
    )
    assert base_directory({"init_seed": 3}, tmp_path / "a") is None
    changed = {**reference, "manifest_sha256": "0" * 64}
    with pytest.raises(CheckpointError, match="changed since"):
        base_directory(changed, tmp_path / "a")
    with pytest.raises(CheckpointError, match="which is gone"):
        base_directory({**reference, "path": str(tmp_path / "nowhere")}, tmp_path / "a")
    with pytest.raises(CheckpointError, match="malformed"):
        base_directory({"step": 1}, tmp_path / "a")


def test_bert_takes_adapters_and_t5_whose_attention_is_its_own_is_refused():
    from mtcore.models import get_family, parse_model_config

    lora = LoRAConfig(targets=["q", "v", "fc1", "fc2"])
    sizes = dict(hidden_size=32, num_heads=4, seq_len=16, vocab_size=64)
    bert = parse_model_config({"family": "bert", "num_layers": 2, **sizes})
    model = get_family("bert").one_process(bert, select_backend("cpu"))
    assert add_lora([model], lora) == 6  # qkv, fc1 and fc2 of 2 layers
    t5 = parse_model_config({"family": "t5", "encoder_layers": 1, "decoder_layers": 1, **sizes})
    model = get_family("t5").one_process(t5, select_backend("cpu"))
    with pytest.raises(ValueError, match="no linear of this t5 model answers to q, v, fc1, fc2"):
        add_lora([model], lora)
