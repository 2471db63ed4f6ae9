"""LoRA adapters and PEFT, checked against the real ``peft`` library (no mock).

A random tiny ``LlamaForCausalLM`` is imported (``mtcore convert from-hf``); ``peft``
itself makes a LoRA adapter on it (random A and B: ``init_lora_weights=False``) and
saves it. ``mtcore convert from-hf --adapter`` turns that into a LoRA checkpoint, whose
adapted one-process model gives peft's logits; ``convert to-hf --adapter`` writes it
back as a PEFT adapter that ``PeftModel.from_pretrained`` loads onto the transformers
base with the same logits (and the same tensors as peft's own file), and ``convert
to-hf`` (merged) a plain Llama with those logits too. Settings mtcore's adapters do not
have (DoRA) are refused with exit status 2.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mtcore.cli.main import main
from mtcore.models.common.decoder.hf_lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mtcore.training.checkpoint import resolve_checkpoint
from mtcore.training.checkpoint.lora_weights import adapted_model, read_lora_weights

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
VOCAB, SEQ = 128, 12
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The transformers base on disk, peft's adapter of it, and mtcore's imports of both."""
    root = tmp_path_factory.mktemp("lora")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        initializer_range=0.1, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    base = transformers.LlamaForCausalLM.from_pretrained(root / "hf").eval()
    lora = peft.LoraConfig(
        r=4, lora_alpha=12, target_modules=MODULES, init_lora_weights=False, task_type="CAUSAL_LM"
    )
    torch.manual_seed(1)
    peft.get_peft_model(base, lora).save_pretrained(root / "peft")
    assert main(["convert", "from-hf", str(root / "hf"), str(root / "mt"), "--adapter", str(root / "peft")]) == 0  # fmt: skip
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    return root, tokens


def _peft_logits(root, adapter_dir, tokens) -> torch.Tensor:
    base = transformers.LlamaForCausalLM.from_pretrained(root / "hf").eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(tokens).logits


def test_a_peft_adapter_imports_with_peft_logits(setup):
    root, tokens = setup
    config, lora, adapters, weights = read_lora_weights(root / "mt" / "lora")
    assert (lora.rank, lora.alpha, lora.targets) == (4, 12.0, ("q", "k", "v", "o", "fc1", "fc2"))
    assert resolve_checkpoint(root / "mt" / "base").parent.name == "base"
    model = adapted_model(config, lora, adapters).eval()
    missing, _ = model.load_state_dict({**weights, **adapters}, strict=False)
    assert missing == []
    with torch.no_grad():
        mine = model(tokens)[..., :VOCAB]
    want = _peft_logits(root, root / "peft", tokens)
    assert (want - _base_logits(root, tokens)).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(mine, want, atol=1e-5, rtol=1e-5)


def _base_logits(root, tokens) -> torch.Tensor:
    with torch.no_grad():
        return transformers.LlamaForCausalLM.from_pretrained(root / "hf").eval()(tokens).logits


def test_export_as_peft_adapter_and_merged_model_give_peft_logits(setup):
    root, tokens = setup
    out = root / "exported"
    lora_ckpt = str(root / "mt" / "lora")
    assert main(["convert", "to-hf", lora_ckpt, str(out), "--adapter", "--dtype", "fp32"]) == 0
    saved = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (
        saved["r"] == 4
        and saved["lora_alpha"] == 12.0
        and sorted(saved["target_modules"]) == sorted(MODULES)
    )
    theirs, mine = load_file(root / "peft" / ADAPTER_WEIGHTS), load_file(out / ADAPTER_WEIGHTS)
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in mine
    assert set(mine) == set(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    want = _peft_logits(root, root / "peft", tokens)
    torch.testing.assert_close(_peft_logits(root, out, tokens), want, atol=1e-5, rtol=1e-5)

    merged = root / "merged"
    assert main(["convert", "to-hf", lora_ckpt, str(merged), "--dtype", "fp32"]) == 0
    model = transformers.LlamaForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        got = model(tokens).logits[..., :VOCAB]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unsupported_peft_settings_are_refused(setup, tmp_path, capsys):
    root, _ = setup
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / ADAPTER_WEIGHTS).write_bytes((root / "peft" / ADAPTER_WEIGHTS).read_bytes())
    config = json.loads((root / "peft" / ADAPTER_CONFIG).read_text())
    (dora / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_dora": True}))
    assert (
        main(["convert", "from-hf", str(root / "hf"), str(tmp_path / "mt"), "--adapter", str(dora)])
        == 2
    )
    assert "use_dora=True is not supported" in capsys.readouterr().err
    assert not (tmp_path / "mt").exists()  # nothing written
    plain = str(root / "mt" / "base")
    assert main(["convert", "to-hf", plain, str(tmp_path / "out"), "--adapter"]) == 2
    assert "is not a LoRA checkpoint" in capsys.readouterr().err
