"""FP8 products in the time model (issue 46.5), by hand: under ``precision.fp8`` the
blocks' column- and row-parallel linears run at the fp8 rate and pay their
quantization's memory traffic (by recipe); the experts stay at the model dtype's rate
unless ``fp8_experts`` (DeepSeek-V3's recipe). One rank of H100 (no GEMM-shape table:
every product at the constant share of its dtype's peak), bf16, one pipeline stage."""

from __future__ import annotations

import pytest

from mtcore.plan import Options, load_hardware, plan, timing
from mtcore.training.config import TrainConfig

H100 = load_hardware("H100-SXM")
H, F, SEQ, LAYERS, E = 1024, 2048, 1024, 4, 2
EXPERTS, TOP_K, EXPERT_FFN = 8, 2, 512


def config(fp8=None, recipe="delayed", **model):
    precision = {"dtype": "bf16", **({"fp8": fp8, "fp8_recipe": recipe} if fp8 else {})}
    return TrainConfig.model_validate(
        {
            "model": {"family": "gpt", "style": "llama", "hidden_size": H, "num_layers": LAYERS,
                      "num_heads": 8, "ffn_hidden_size": F, "seq_len": SEQ,
                      "vocab_size": 32768, **model},
            "precision": precision,
            "training": {"global_batch_size": 1, "micro_batch_size": 1},
        }
    )  # fmt: skip


def per_flop(dtype: str) -> float:
    return 1 / timing.gemm_flops(H100, H100.peak_flops(dtype))


def test_block_linears_at_the_fp8_rate_with_their_quantization():
    # q, k, v and the output (4 h^2) and the gated MLP (3 h F) a layer, three passes
    flops = 3 * LAYERS * 2 * SEQ * (4 * H * H + 3 * H * F)
    bf16, fp8 = plan(config(), 1, H100), plan(config("hybrid"), 1, H100)
    assert bf16.time.compute - fp8.time.compute == pytest.approx(
        flops * (per_flop("bf16") - per_flop("fp8")), rel=1e-9
    )
    # each linear quantizes its input (M K), its weight (K N) and backward dy (M N):
    # qkv (SEQ, H, 3H), proj (SEQ, H, H), fc1+fc3 (SEQ, H, 2F), fc2 (SEQ, F, H)
    shapes = [(SEQ, H, 3 * H), (SEQ, H, H), (SEQ, H, 2 * F), (SEQ, F, H)]
    elements = LAYERS * sum(m * k + k * n + m * n for m, k, n in shapes)
    for recipe, per_element in (("delayed", E + 1), ("current", 2 * E + 1), ("blockwise", E + 2)):
        quantized = plan(config("hybrid", recipe), 1, H100)
        assert quantized.time.memory_bound - bf16.time.memory_bound == pytest.approx(
            timing.memory_bound(H100, elements * per_element), rel=1e-9
        ), recipe


def test_experts_follow_the_recipe():
    """mtcore's recipe leaves the router and the routed experts in bf16; with
    fp8_experts the experts' products (s top_k rows through 3 E_ffn h a row, three
    passes) move to the fp8 rate."""
    moe = {"moe": {"num_experts": EXPERTS, "top_k": TOP_K, "ffn_size": EXPERT_FFN}}
    attention_only = plan(config("hybrid", **moe), 1, H100)
    with_experts = plan(config("hybrid", **moe), 1, H100, Options(fp8_experts=True))
    expert_flops = 3 * LAYERS * 2 * SEQ * TOP_K * 3 * EXPERT_FFN * H
    assert attention_only.time.compute - with_experts.time.compute == pytest.approx(
        expert_flops * (per_flop("bf16") - per_flop("fp8")), rel=1e-9
    )
    assert with_experts.assumed["fp8 experts"] == "on"
