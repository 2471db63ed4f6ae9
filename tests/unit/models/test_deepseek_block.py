"""bench_deepseek_block.py's PlainBlock (latent attention and DeepSeek's grouped sigmoid
experts written plainly in PyTorch) computes what mtcore's Block computes, forward and
backward, from the same weights: the benchmark times one function."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mtcore.backend import select_backend
from mtcore.models.common.decoder.model import Block
from mtcore.models.common.decoder.rope import gpt_rope_tables
from mtcore.models.gpt import GPTConfig, single_context

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_deepseek_block.py"


def test_plain_block_of_the_benchmark_equals_mtcores(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH.parent))  # the benchmarks' shared _timing module
    spec = importlib.util.spec_from_file_location("bench_deepseek_block", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = GPTConfig(vocab_size=128, hidden_size=bench.HIDDEN, num_layers=2, seq_len=32,
                       num_heads=bench.HEADS, init_std=0.05, mla=bench.MLA, moe=bench.MOE)  # fmt: skip
    mine = Block(single_context(config, select_backend("cpu")), 1)
    plain = bench.PlainBlock(bench.HIDDEN, bench.HEADS, bench.MLA, bench.MOE, config.norm_eps)
    bench.copy_weights(plain, mine.state_dict())
    cos, sin = gpt_rope_tables(config)
    x = torch.randn(2, 32, bench.HIDDEN, generator=torch.Generator().manual_seed(1))
    outs, grads = [], []
    for run in (lambda t: mine(t, (cos, sin)), lambda t: plain(t, cos, sin)):
        t = x.clone().requires_grad_()
        out = run(t)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append(t.grad)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-7, rtol=1e-4)
    assert grads[0].abs().max() > 1e-5  # the gradient is not vanishing: the check bites
