"""The GPT model in one process: configuration, math, initialisation, generation."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from mtcore.backend import select_backend
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.parallel.layout import LayoutError, LayoutSpec

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, seq_len=16)
BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_trainer.py"


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _model(seed: int = 0, **kw) -> GPT:
    config = GPTConfig(**{**SIZES, **kw})
    return GPT(config, single_context(config, select_backend("cpu"), seed))


def _batch(seed: int = 0, b: int = 2, s: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (b, s), generator=g), torch.randint(0, 64, (b, s), generator=g)


def test_styles_fill_unset_switches_and_keep_set_ones():
    gpt2 = GPTConfig(style="gpt2", **SIZES)
    switches = (gpt2.norm, gpt2.activation, gpt2.position, gpt2.tie_embeddings, gpt2.bias)
    assert switches == ("layernorm", "gelu", "learned", True, True)
    assert gpt2.ffn_size == 4 * 32
    llama = GPTConfig(style="llama", tie_embeddings=True, **SIZES)
    assert (llama.norm, llama.activation, llama.tie_embeddings) == ("rmsnorm", "swiglu", True)
    assert GPTConfig(hidden_size=96, num_heads=4).ffn_size == 256  # 8h/3, up to a multiple of 64
    assert GPTConfig(hidden_size=96, num_heads=4, ffn_hidden_size=100).ffn_size == 100


def test_config_rejects_bad_shapes_and_unknown_keys():
    with pytest.raises(ValidationError, match="not divisible by num_heads"):
        GPTConfig(hidden_size=30, num_heads=4)
    with pytest.raises(ValidationError, match="multiple of num_kv_heads"):
        GPTConfig(hidden_size=32, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValidationError, match="hidden_sise"):
        GPTConfig(hidden_sise=32)
    with pytest.raises(ValidationError, match="recompute"):
        GPTConfig(recompute="some")


def test_vocab_from_tokenizer_is_padded_and_a_small_vocab_is_an_error():
    assert GPTConfig().with_vocab(4000).vocab_size == 4096
    assert GPTConfig(vocab_size=5000).with_vocab(4000).vocab_size == 5000
    with pytest.raises(ValueError, match=r"tokenizer has 4000 token ids but model\.vocab_size is 300"):
        GPTConfig(vocab_size=300).with_vocab(4000)


def test_layout_checks_name_the_numbers():
    config = GPTConfig(**SIZES)
    config.check_layout(LayoutSpec(tp=2, pp=2, vpp=2).resolve(4))
    with pytest.raises(LayoutError, match="4 layers are not divisible by pp\\*vpp = 2\\*3"):
        config.check_layout(LayoutSpec(pp=2, vpp=3).resolve(2))
    with pytest.raises(LayoutError, match="key/value heads are not divisible by tp=4"):
        config.check_layout(LayoutSpec(tp=4).resolve(4))
    config.check_layout(LayoutSpec(cp=2).resolve(2))  # context parallel: seq_len 16
    with pytest.raises(LayoutError, match="sequence length 16 is not divisible by 2\\*cp = 2\\*3 = 6"):
        config.check_layout(LayoutSpec(cp=3).resolve(3))
    with pytest.raises(LayoutError, match=r"a2a splits each tp rank's 2 key/value heads .* cp=4"):
        GPTConfig(**{**SIZES, "seq_len": 32}).check_layout(
            LayoutSpec(cp=4, cp_method="a2a").resolve(4)
        )


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_parameter_count_and_names(style):
    model = _model(style=style)
    assert sum(p.numel() for p in model.parameters()) == model.config.num_params()
    names = {n for n, _ in model.named_parameters()}
    assert ("output.weight" in names) == (style == "llama")  # gpt2 ties the output layer
    assert ("embed.pos" in names) == (style == "gpt2")
    assert {"embed.tok.weight", "layers.3.mlp.fc2.weight", "norm.weight"} <= names


def test_init_is_deterministic_per_layer_so_a_pipeline_stage_matches_the_whole_model():
    whole, again, other = _model(seed=3), _model(seed=3), _model(seed=4)
    config = whole.config
    stage = GPT(config, single_context(config, select_backend("cpu"), 3), range(2, 4), first=False)
    full = dict(whole.named_parameters())
    for name, p in stage.named_parameters():
        assert torch.equal(p, full[name]), name
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), again.parameters(), strict=True))
    assert not torch.equal(whole.embed.tok.weight, other.embed.tok.weight)
    assert not torch.equal(whole.embed.tok.weight, whole.output.weight)  # untied: own draw


def test_tied_output_copy_starts_equal_to_the_embedding():
    config = GPTConfig(style="gpt2", **SIZES)
    c = single_context(config, select_backend("cpu"), 0)
    first, last = GPT(config, c, range(0, 2), last=False), GPT(config, c, range(2, 4), first=False)
    assert torch.equal(first.embed.tok.weight, last.output.weight)
    assert first.tied_copies() == [first.embed.tok.weight]
    assert last.tied_copies() == [last.output.weight]
    assert "output.weight" not in last.own_parameter_names()


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_grads(recompute):
    x, y = _batch()
    plain, again = _model(), _model(recompute=recompute)
    plain(x, y).backward()
    again(x, y).backward()
    for (n, p), q in zip(plain.named_parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-8, msg=n)


def test_same_math_as_the_plain_pytorch_model_of_the_benchmark(monkeypatch):
    """bench_trainer.py's PlainGPT is a line-by-line PyTorch Llama: equal loss and grads."""
    monkeypatch.syspath_prepend(str(BENCH.parent))  # the benchmarks' shared _timing module
    spec = importlib.util.spec_from_file_location("bench_trainer", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = _model(init_std=0.1)
    plain = bench.PlainGPT(model.config)
    plain.load_state_dict(dict(model.named_parameters()))
    x, y = _batch()
    a, b = model(x, y), plain(x, y)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    a.backward()
    b.backward()
    grads = dict(plain.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-4, atol=1e-7, msg=n)


def test_generate_greedy_is_deterministic_and_crops_to_seq_len():
    model = _model(style="gpt2")
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 20)
    assert out.shape == (1, 23) and torch.equal(out[:, :3], prompt)
    assert torch.equal(out, model.generate(prompt, 20))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    sampled = model.generate(prompt, 5, top_k=5, generator=g1)
    assert torch.equal(sampled, model.generate(prompt, 5, top_k=5, generator=g2))


def test_a_model_without_vocab_size_is_rejected():
    with pytest.raises(ValueError, match="vocab_size is unset"):
        GPT(GPTConfig())
