"""The network hierarchy (node, pod, across pods) and each collective kind's cost, by hand;
tp and ep x tp groups that span nodes are refused unless asked for."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mtcore.cli.main import main
from mtcore.plan import Options, constants, load_hardware, network, plan
from mtcore.plan.planner import PlacementError
from mtcore.training.overrides import load_config

A100 = load_hardware("A100-80GB")  # 8 per node, NVLink 300 GB/s, 25 GB/s per port
# two nodes a pod, 2.5 GB/s per accelerator across pods (a 1:10 oversubscribed layer)
PODS = replace(A100, nodes_per_pod=2, inter_pod_gbs=2.5, inter_pod_latency_us=20.0)
EFF = constants.LINK_EFFICIENCY


@pytest.mark.parametrize(
    ("ranks", "stride", "fewest"),
    [
        (8, 1, 8),  # a whole node
        (4, 2, 4),  # span 8: fits
        (5, 1, 1),  # tp = 5: the group 7-11 has one member on its first node
        (12, 1, 4),  # 0-11: 8 + 4
        (48, 2, 4),  # dp over tp = 2: four of a node's eight
        (64, 8, 1),  # one per node
        (3, 2, 1),  # 6, 8, 10: one on the first node
    ],
)
def test_fewest_members_on_a_node(ranks, stride, fewest):
    assert network.fewest_members(ranks, stride, 8) == fewest


def test_ring_bandwidth_by_level():
    assert network.ring_bandwidth(A100, 8, 1) == 300e9
    assert network.ring_bandwidth(A100, 5, 1) == 25e9  # spans nodes through one port
    assert network.ring_bandwidth(A100, 16, 1) == 200e9  # 8 rings over 8 ports
    assert network.ring_bandwidth(PODS, 16, 1) == 200e9  # one pod: no pod layer
    # 32 ranks over two pods: the rings leave each pod once, sharing the uplink of the
    # pod's 16 members at 2.5 GB/s each (40 GB/s; a one-port-per-ring count said 20)
    assert network.ring_bandwidth(PODS, 32, 1) == pytest.approx(40e9)
    # one rank a node (stride 8) over four pods of 16 ranks: 2 members a pod, 5 GB/s
    assert network.ring_bandwidth(PODS, 8, 8) == pytest.approx(5e9)


def test_each_collective_kind_by_hand():
    size, n = 1e9, 32  # over two pods, 8 a node, 16 a pod
    ring = size * (n - 1) / n / (40e9 * EFF)
    latency = 20e-6  # the pod layer's
    assert network.all_gather(PODS, size, n, 1) == pytest.approx(ring + (n - 1) * latency)
    assert network.reduce_scatter(PODS, size, n, 1) == network.all_gather(PODS, size, n, 1)
    assert network.all_reduce(PODS, size, n, 1) == pytest.approx(2 * ring + 2 * (n - 1) * latency)
    # all-to-all: 7/32 over NVLink, 24/32 through the own port, 16/32 across pods, at once
    on_node = size * 7 / 32 / (300e9 * EFF)
    off_node = size * 24 / 32 / (25e9 * EFF)
    off_pod = size * 16 / 32 / (2.5e9 * EFF)
    assert max(on_node, off_node, off_pod) == off_pod
    assert network.all_to_all(PODS, size, n, 1) == pytest.approx(off_pod + (n - 1) * latency)
    # in one node the all-to-all is the intra-node link's, the ring's traffic
    assert network.all_to_all(A100, size, 8, 1) == pytest.approx(
        size * 7 / 8 / (300e9 * EFF) + 7 * 3e-6
    )
    # a pipeline of 4 stages 8 apart crosses nodes; of 4 stages 16 apart, pods
    assert network.p2p(PODS, size, 2, 8) == pytest.approx(size / (25e9 * EFF) + 5e-6)
    assert network.p2p(PODS, size, 4, 16) == pytest.approx(size / (2.5e9 * EFF) + 20e-6)
    assert network.p2p(PODS, size, 2, 1) == pytest.approx(size / (300e9 * EFF) + 3e-6)


SMALL = ["--model.hidden_size", "640", "--model.num_heads", "10", "--model.num_kv_heads", "5"]
SMALL += ["--model.vocab_size", "4000", "--model.ffn_hidden_size", "1280"]


def test_a_tp_group_that_spans_nodes_is_refused_unless_asked_for():
    config = load_config("configs/default.yaml", [*SMALL, "--parallel.tp", "5"])
    with pytest.raises(PlacementError, match="tp = 5 does not fit the 8-accelerator nodes"):
        plan(config, 10, A100)
    crossing = plan(config, 10, A100, Options(cross_node=True))
    inside = plan(config, 10, replace(A100, gpus_per_node=10))
    # the same all-reduces of one micro-batch's activations (fp32, 4 x 128 tokens of 640),
    # on one network port (25 GB/s, 5 us) where a 10-accelerator node has NVLink (300, 3)
    size = 4 * 4 * 128 * 640
    one_port = 2 * size * 4 / 5 / (25e9 * EFF) + 8 * 5e-6
    nvlink = 2 * size * 4 / 5 / (300e9 * EFF) + 8 * 3e-6
    assert crossing.time.tp_comm / inside.time.tp_comm == pytest.approx(one_port / nvlink)
    assert crossing.assumed["cross-node groups"] == "allowed"


def test_an_ep_by_tp_block_must_fit_a_node():
    args = ["--parallel.tp", "2", "--parallel.ep", "8", "--training.global_batch_size", "64"]
    config = load_config("configs/moe.yaml", args)
    with pytest.raises(PlacementError, match="ep x tp = 16 does not fit"):
        plan(config, 16, A100)


def test_the_cli_refuses_in_one_line(capsys):
    args = ["plan", "configs/default.yaml", "--gpus", "10", "--hardware", "A100-80GB", *SMALL]
    assert main([*args, "--parallel.tp", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--cross-node" in err
    assert main([*args, "--parallel.tp", "5", "--cross-node"]) == 0


def test_node_limited_all_to_all_by_hand():
    """ep 64 over 8 A100 nodes, 4096 tokens of 7168 bf16 values, top 8 on at most 4
    nodes: a token crosses the network to 4 x 7/8 other nodes on average (3.5 sends of
    its bytes through its port), its 8 rows cross NVLink 7/8 of the time."""
    token, tokens = 2 * 7168, 4096
    network_s = token * tokens * 4 * 7 / 8 / (25e9 * EFF)
    node_s = token * tokens * 8 * 7 / 8 / (300e9 * EFF)
    assert network.node_limited_all_to_all(A100, token, tokens, 8, 4, 64, 1) == pytest.approx(
        max(network_s, node_s) + 63 * 5e-6
    )
    # unlimited is every routed row at its expert's rank: 56 of 64 shares off the node
    plain = network.all_to_all(A100, token * tokens * 8, 64, 1)
    assert plain == pytest.approx(token * tokens * 8 * 56 / 64 / (25e9 * EFF) + 63 * 5e-6)
    # one node: the plain all-to-all
    assert network.node_limited_all_to_all(A100, token, tokens, 8, 4, 8, 1) == (
        network.all_to_all(A100, token * tokens * 8, 8, 1)
    )
