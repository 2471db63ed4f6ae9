"""What published stacks keep for backward, against hand counts: Megatron-Core's
``--recompute-modules`` (layernorm, mla_up_proj, moe_act, core_attn), an fp8 expert
dispatch and router probabilities applied inside the expert (``Options``: issue 46, the
runs that ran and were planned as not fitting). One small model of each kind, bf16, one
rank of tp 1 and one pipeline stage, so a layer's bytes are counted by hand."""

from __future__ import annotations

import pytest

from mtcore.plan import Options, OptionsError, load_hardware, plan, timing
from mtcore.plan.layouts import parse_layout
from mtcore.plan.memory import FP8_SCALED_BYTES
from mtcore.training.config import TrainConfig

H100 = load_hardware("H100-SXM")
H, SEQ, LAYERS, E = 1024, 1024, 4, 2  # hidden, tokens, layers, bf16 bytes
EXPERTS, TOP_K, EXPERT_FFN = 8, 2, 512
Q_RANK, KV_RANK, NOPE, ROPE, V, HEADS = 256, 128, 64, 32, 64, 8


def config(gpus_ep=1, **model):
    return TrainConfig.model_validate(
        {
            "model": {"family": "gpt", "style": "llama", "hidden_size": H, "num_layers": LAYERS,
                      "num_heads": HEADS, "seq_len": SEQ, "vocab_size": 32768, **model},
            "parallel": {"ep": gpus_ep},
            "precision": {"dtype": "bf16"},
            "training": {"global_batch_size": 8, "micro_batch_size": 1},
        }
    )  # fmt: skip


MOE = {"moe": {"num_experts": EXPERTS, "top_k": TOP_K, "ffn_size": EXPERT_FFN}}
MLA = {"mla": {"q_lora_rank": Q_RANK, "kv_lora_rank": KV_RANK, "qk_nope_head_dim": NOPE,
               "qk_rope_head_dim": ROPE, "v_head_dim": V}}  # fmt: skip


def activations(cfg, gpus=1, **options) -> float:
    return plan(cfg, gpus, H100, Options(**options)).ranks[0].activations


def test_layernorm_module_keeps_the_norms_inputs_only():
    """Each layer's two norm outputs (the attention's and the MLP's inputs) are rebuilt:
    2 x e s h bytes a layer fewer, and their rebuilding costs twice those bytes of memory
    traffic a micro-batch."""
    cfg = config()
    dropped = LAYERS * 2 * E * SEQ * H
    assert activations(cfg) - activations(cfg, recompute_modules=("layernorm",)) == dropped
    base = plan(cfg, 1, H100)
    rebuilt = plan(cfg, 1, H100, Options(recompute_modules=("layernorm",)))
    per_microbatch = timing.memory_bound(H100, 2 * dropped)
    assert rebuilt.time.recompute - base.time.recompute == pytest.approx(
        base.microbatches * per_microbatch
    )
    assert rebuilt.assumed["recompute modules"] == "layernorm"
    assert "recompute modules" not in base.assumed  # mtcore's own: named only when set


def test_core_attn_module_is_selective_recompute():
    cfg, selective = config(), config(recompute="selective")
    kept = Options(recompute_modules=("core_attn",))
    assert plan(cfg, 1, H100, kept).ranks[0].activations == activations(selective)
    assert plan(cfg, 1, H100, kept).hardware_flops == plan(selective, 1, H100).hardware_flops


def test_expert_options_by_hand():
    """Per MoE layer, rows = s top_k routed rows: ``moe_act`` keeps fc1's and fc3's
    outputs, not silu(fc1) and the product (2 widths of the expert fewer); an fp8 dispatch
    keeps the dispatched input at 1 + 4/128 bytes an element; probabilities applied in the
    expert keep no expert output."""
    cfg = config(**MOE)
    rows = SEQ * TOP_K
    base = activations(cfg)
    assert (
        base - activations(cfg, recompute_modules=("moe_act",))
        == LAYERS * E * rows * 2 * EXPERT_FFN
    )
    fp8 = activations(cfg, moe_dispatch="fp8")
    assert base - fp8 == pytest.approx(LAYERS * rows * H * (E - FP8_SCALED_BYTES))
    assert base - activations(cfg, moe_probs="expert") == LAYERS * rows * H * E


def test_fp8_dispatch_narrows_the_dispatch_direction_only():
    """ep 2 on 2 accelerators of one node: of a micro-batch's four all-to-alls a layer
    (dispatch and combine forward, their gradients backward) the two in the dispatch
    direction move fp8 with its scales, the combines bf16."""
    from mtcore.plan import network

    cfg = config(gpus_ep=2, **MOE)
    rows = SEQ * TOP_K * H
    one = {b: network.all_to_all(H100, b * rows, 2, 1) for b in (E, FP8_SCALED_BYTES)}
    bf16 = plan(cfg, 2, H100)
    fp8 = plan(cfg, 2, H100, Options(moe_dispatch="fp8"))
    m = bf16.microbatches
    assert bf16.time.ep_comm == pytest.approx(m * LAYERS * 4 * one[E])
    assert fp8.time.ep_comm == pytest.approx(m * LAYERS * 2 * (one[E] + one[FP8_SCALED_BYTES]))


def test_mla_up_proj_module_rebuilds_q_k_v():
    """Latent attention keeps its kernel's Q, K and V (each heads x (nope + rope) wide
    a token) unless the up-projections are rebuilt; rebuilding them is two products a
    layer more: tokens x q_rank x heads (nope + rope) and tokens x kv_rank x heads (nope + v)."""
    cfg = config(**MLA)
    q_width = HEADS * (NOPE + ROPE)
    dropped = activations(cfg) - activations(cfg, recompute_modules=("mla_up_proj",))
    assert dropped == LAYERS * 3 * E * SEQ * q_width
    extra = plan(cfg, 1, H100, Options(recompute_modules=("mla_up_proj",))).hardware_flops
    up = 2 * SEQ * (Q_RANK * q_width + KV_RANK * HEADS * (NOPE + V))
    assert extra - plan(cfg, 1, H100).hardware_flops == pytest.approx(8 * LAYERS * up)


def test_bad_values_are_refused_and_compare_keys_parse():
    with pytest.raises(OptionsError, match="recompute modules take distinct names"):
        Options(recompute_modules=("mlp",))
    with pytest.raises(OptionsError, match="moe dispatch must be one of compute, fp8"):
        Options(moe_dispatch="fp4")
    with pytest.raises(OptionsError, match="moe probs must be one of combine, expert"):
        Options(moe_probs="router")
    _, options = parse_layout(
        "tp=1,recompute_modules=layernorm+moe_act,moe_dispatch=fp8,moe_probs=expert"
    )
    assert options == {
        "recompute_modules": ("layernorm", "moe_act"),
        "moe_dispatch": "fp8",
        "moe_probs": "expert",
    }


def test_the_cli_takes_the_new_options_and_refuses_bad_ones_in_one_line(capsys):
    from mtcore.cli.main import main

    args = ["plan", "configs/moe.yaml", "--gpus", "4", "--hardware", "H100-SXM"]
    for bad in (["--moe-dispatch", "fp4"], ["--fsdp-prefetch", "x"], ["--rank-order", "pp-dp"],
                ["--recompute-modules", "mlp"], ["--moe-node-limit", "0"]):  # fmt: skip
        assert main([*args, *bad]) == 2, bad
        assert len(capsys.readouterr().err.strip().splitlines()) == 1, bad
    good = ["--recompute-modules", "layernorm,moe_act", "--moe-dispatch", "fp8", "--moe-probs",
            "expert", "--moe-node-limit", "2", "--fp8-experts", "--json"]  # fmt: skip
    assert main([*args, *good]) == 0
    assumed = __import__("json").loads(capsys.readouterr().out)["assumed"]
    assert assumed["recompute modules"] == "layernorm,moe_act"
    assert assumed["moe dispatch"] == "fp8" and assumed["moe node limit"] == "2"
