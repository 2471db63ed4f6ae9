"""The rank order as a planner option (issue 46.2), by hand: on 32 A100s in pods of two
8-accelerator nodes, tp 8 x pp 2 x dp 2. mtcore's tp-cp-dp-pp puts a stage's two dp
copies 8 ranks apart (one pod, over the nodes' ports) and the pipeline's stages 16
apart (across pods); Llama 3's tp-cp-pp-dp swaps them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mtcore.plan import Options, constants, load_hardware, network, plan
from mtcore.plan.planner import PlacementError
from mtcore.training.overrides import load_config

A100 = load_hardware("A100-80GB")  # 25 GB/s a port, 5 us across nodes
PODS = replace(A100, nodes_per_pod=2, inter_pod_gbs=2.5, inter_pod_latency_us=20.0)
EFF = constants.LINK_EFFICIENCY
ARGS = ["--model.hidden_size", "1024", "--model.num_heads", "16", "--model.num_kv_heads", "16", "--model.num_layers", "8",
        "--model.vocab_size", "32768", "--model.seq_len", "1024", "--parallel.tp", "8",
        "--parallel.pp", "2", "--parallel.zero1", "true", "--precision.dtype", "bf16",
        "--training.global_batch_size", "8", "--training.micro_batch_size", "1"]  # fmt: skip


def test_rank_order_moves_dp_and_pp_between_network_levels():
    config = load_config("configs/default.yaml", ARGS)
    nested = plan(config, 32, PODS)
    swapped = plan(config, 32, PODS, Options(rank_order="tp-cp-pp-dp"))
    grads = 4 * nested.ranks[0].params  # fp32 buffers, ZeRO-1's reduce-scatter of them
    half = grads / 2  # a ring of 2 moves (n - 1) / n of it
    assert nested.time.dp_comm - swapped.time.dp_comm == pytest.approx(
        (half / (25e9 * EFF) + 5e-6)
        - (half / (2.5e9 * EFF) + 20e-6)  # reduce-scatter
        + (2 * half / 4 / (25e9 * EFF) + 5e-6)
        - (2 * half / 4 / (2.5e9 * EFF) + 20e-6),  # bf16 gather
        rel=1e-9,
    )
    boundary = 2 * 1024 * 1024  # bf16 activations of one micro-batch, no sp
    per_send = {8: boundary / (25e9 * EFF) + 5e-6, 16: boundary / (2.5e9 * EFF) + 20e-6}
    m = nested.microbatches
    assert nested.time.pp_comm == pytest.approx(m * 2 * per_send[16])
    assert swapped.time.pp_comm == pytest.approx(m * 2 * per_send[8])
    assert network.pp_stride(config.parallel.resolve(32), "tp-cp-pp-dp") == 8
    assert swapped.assumed["rank order"] == "tp-cp-pp-dp"
    assert "rank order" not in nested.assumed


def test_expert_parallel_is_refused_under_the_swapped_order():
    config = load_config("configs/moe.yaml", ["--parallel.tp", "1", "--parallel.ep", "2"])
    with pytest.raises(PlacementError, match="rank order tp-cp-pp-dp is planned without expert"):
        plan(config, 4, A100, Options(rank_order="tp-cp-pp-dp"))
