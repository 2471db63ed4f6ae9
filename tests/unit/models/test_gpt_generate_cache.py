"""GPT generation with a KV cache: greedy tokens equal transformers' ``generate`` on
imported tiny Llama and Mistral (a window shorter than the text), and equal the uncached
loop, also past ``seq_len`` (where the cache gives way to the window) and when sampling."""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.gpt import GPT, GPTConfig, single_context
from mtcore.models.gpt.hf import import_hf

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB, SEQ = 128, 32
SIZES = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
    initializer_range=0.2,
)  # fmt: skip


def _mtcore(config: GPTConfig, weights=None) -> GPT:
    model = GPT(config, single_context(config, select_backend("cpu"))).eval()
    if weights is not None:
        model.load_state_dict(weights)
    return model


@pytest.mark.parametrize(
    "class_name, changes",
    [("LlamaConfig", {}), ("MistralConfig", dict(sliding_window=6))],
    ids=["llama", "mistral_window6"],
)
def test_greedy_generation_equals_transformers(tmp_path, class_name, changes):
    config = getattr(transformers, class_name)(**SIZES, **changes)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=SEQ - 5,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    assert len(set(want[0, 5:].tolist())) > 3  # not a degenerate repetition
    model = _mtcore(*import_hf(tmp_path))
    got = model.generate(prompt, SEQ - 5)
    assert torch.equal(got, want)
    assert torch.equal(model.generate(prompt, SEQ - 5, use_cache=False), got)


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_cached_generation_equals_the_uncached_loop_past_seq_len(style):
    config = GPTConfig(style=style, vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                       seq_len=16, init_std=0.3)  # fmt: skip
    model = _mtcore(config)
    prompt = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(2))
    greedy = model.generate(prompt, 20)  # 24 tokens: 12 cached steps, then windowed ones
    assert torch.equal(greedy, model.generate(prompt, 20, use_cache=False))
    assert len(set(greedy[0, 4:].tolist())) > 1  # the model says more than one token
    sampled = [
        model.generate(prompt, 10, top_k=5, generator=torch.Generator().manual_seed(3), use_cache=c)
        for c in (True, False)
    ]
    assert torch.equal(*sampled)
