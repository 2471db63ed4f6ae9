"""`mtcore convert` both ways, as a user runs it: subprocesses, real files.

A random tiny Llama saved by transformers (with a tokenizer.json) goes through
`convert from-hf` into an mtcore checkpoint (checked with ``read_model_weights``) and
back through `convert to-hf` into a directory that ``LlamaForCausalLM`` loads with the
original logits. A GPT-2-style checkpoint and a Llama with RoPE scaling are refused with
exit status 2 and a message that names the reason (in process: no model is built).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.cli.main import main
from mtcore.data.tokenizer import train_tokenizer
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.models.gpt.hf import import_llama
from mtcore.training.checkpoint import read_model_weights, resolve_checkpoint, write_model_weights

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 16


def _json(path: Path):
    return json.loads(path.read_text())


def _hf_llama(directory: Path):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    tok = train_tokenizer(
        ["def alpha(self, x):\n    return self.beta + x\n"] * 30, vocab_size=VOCAB
    )
    tok.save(str(directory / "tokenizer.json"))
    return model


@pytest.mark.extended
def test_convert_from_hf_and_back(tmp_path, run_mtcore):
    hf_dir, root, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    model = _hf_llama(hf_dir)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
    good = run_mtcore("convert", "from-hf", hf_dir, root, "--seq-len", SEQ)
    assert good.returncode == 0, good.stderr
    directory = resolve_checkpoint(root)
    assert good.stdout.strip() == str(directory)
    assert f"checkpoint:\n  load: {directory}\n" in good.stderr  # the training hint
    assert "  hidden_size: 64\n" in good.stderr and "  num_kv_heads: 2\n" in good.stderr
    config, weights, step = read_model_weights(root)
    want_config, want_weights = import_llama(hf_dir, seq_len=SEQ)
    assert (config, step) == (want_config, 0)
    assert weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[k], want_weights[k]) for k in weights)
    assert _json(directory / "tokenizer.json") == _json(hf_dir / "tokenizer.json")

    back = run_mtcore("convert", "to-hf", root, out, "--dtype", "fp32")
    assert back.returncode == 0, back.stderr
    assert back.stdout.strip() == str(out)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == SEQ
    assert _json(out / "tokenizer.json") == _json(hf_dir / "tokenizer.json")
    reloaded, info = transformers.LlamaForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager"
    )
    assert not any(info.values()), info
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(tokens).logits, expected, atol=1e-5, rtol=1e-5)
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert fast.eos_token == "<|endoftext|>"


def test_convert_refuses_what_does_not_map(tmp_path, capsys):
    """In process (the exit path is the same as above): a GPT-2 checkpoint to-hf, a
    Llama with RoPE scaling from-hf; neither leaves an output behind."""
    gpt2 = GPTConfig(style="gpt2", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4)
    gpt2_weights = GPT(gpt2, single_context(gpt2, select_backend("cpu"))).state_dict()
    write_model_weights(tmp_path / "gpt2", gpt2_weights, gpt2)
    assert main(["convert", "to-hf", str(tmp_path / "gpt2"), str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert "mtcore convert to-hf: error:" in err
    assert "style='gpt2'" in err and "norm='layernorm'" in err
    assert not (tmp_path / "no").exists()

    scaled = tmp_path / "scaled"
    scaled.mkdir()
    hf_config = {
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 16,
        "rope_scaling": {"rope_type": "longrope", "factor": 8.0},
    }
    (scaled / "config.json").write_text(json.dumps(hf_config))
    assert main(["convert", "from-hf", str(scaled), str(tmp_path / "no-ckpt")]) == 2
    assert "rope_type='longrope'" in capsys.readouterr().err
    assert not (tmp_path / "no-ckpt").exists()
    # Into a root that holds checkpoints: the import would become its latest.
    assert main(["convert", "from-hf", str(scaled), str(tmp_path / "gpt2")]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: a direction is required
        main(["convert"])
