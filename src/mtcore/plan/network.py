"""Collectives priced on the network hierarchy: within a node, across nodes, across pods.

A group of ``ranks`` ranks placed ``stride`` apart (the layout's order, tp fastest:
``mtcore.parallel.layout``) is priced by the slowest level any such group crosses:

* it lies in one node when its span (``ranks * stride``) divides ``gpus_per_node``
  (every group then starts on a node's boundary); otherwise some group spans nodes
  (tp = 5 on 8-accelerator nodes: the second group holds ranks 5-9);
* a group that crosses nodes reaches the network through its members' own ports. Ring
  collectives (all-reduce, all-gather, reduce-scatter) run one ring per member that the
  fewest-populated node holds (NCCL-style parallel rings), so they get the network
  port's bandwidth times that many, at most the intra-node link's; an all-to-all sends
  each rank's share for other nodes through its own port and the rest over the
  intra-node link, at once; a point-to-point send crossing nodes gets one port;
* across pods (``nodes_per_pod``) with ``inter_pod_gbs``, the per-accelerator share of
  the oversubscribed layer above the pods: an all-to-all and a send pay it per rank (each
  rank's share crosses); a ring leaves each pod once, so the pod layer gives a group's
  rings the share of all its members in the pod (the fewest-populated pod's).

Every bandwidth is credited ``LINK_EFFICIENCY`` of its published figure; every ring
step, all-to-all peer or send pays the latency of the slowest level crossed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from mtcore.plan import constants
from mtcore.plan.hardware import Hardware

RANK_ORDERS = ("tp-cp-dp-pp", "tp-cp-pp-dp")
"""How ranks are numbered, fastest axis first: mtcore's (and Megatron-Core's default
without ep) nests dp inside pp, so a pipeline's stages sit farthest apart; Llama 3's
[TP, CP, PP, DP] (arXiv 2407.21783 sec. 3.3.2) nests pp inside dp, keeping each
pipeline within a pod and the data-parallel reduction across pods."""


def dp_stride(spec, order: str) -> int:
    """Ranks between neighbours of a dp x cp group: tp under ``tp-cp-dp-pp``; under
    ``tp-cp-pp-dp`` the group (cp ranks tp apart, their dp copies tp cp pp apart) is
    priced as its dp cp members spread evenly over its span, tp pp apart."""
    return spec.tp if order == "tp-cp-dp-pp" else spec.tp * spec.pp


def pp_stride(spec, order: str) -> int:
    """Ranks between a pipeline's neighbouring stages."""
    inner = spec.tp * spec.cp
    return inner * spec.dp if order == "tp-cp-dp-pp" else inner


@dataclass(frozen=True)
class Placement:
    """Where the worst-placed group of a kind sits: ``reach`` 0 (one node), 1 (nodes of
    one pod) or 2 (several pods); ``per_node`` / ``per_pod``: the fewest of its members
    on one node / in one pod that it touches."""

    reach: int
    per_node: int
    per_pod: int


def fits(ranks: int, stride: int, domain: int) -> bool:
    """Every group of ``ranks`` ranks ``stride`` apart lies in one block of ``domain``
    consecutive ranks (a node: ``domain = gpus_per_node``)."""
    span = ranks * stride
    return span <= domain and domain % span == 0


def fewest_members(ranks: int, stride: int, domain: int) -> int:
    """The fewest members any group of ``ranks`` ranks ``stride`` apart has in one block
    of ``domain`` ranks it touches. Groups start at ``k * ranks * stride + j`` (j <
    stride), so their offsets in a block are the residues ``o`` with
    ``o mod gcd(ranks * stride, domain) < stride``; each is counted in closed form."""
    if fits(ranks, stride, domain):
        return ranks
    if stride >= domain:
        return 1
    step = math.gcd(ranks * stride, domain)
    fewest = ranks
    for offset in range(domain):
        if offset % step >= stride:
            continue
        head = min(ranks, -(-(domain - offset) // stride))  # members in the first block
        if head == ranks:
            continue
        end = (offset + (ranks - 1) * stride) // domain  # the last block it touches
        tail = ranks - -(-(end * domain - offset) // stride)
        inner = domain // stride if end >= 2 else ranks
        fewest = min(fewest, head, tail, inner)
    return max(1, fewest)


@cache
def placement(ranks: int, stride: int, gpus_per_node: int, pod_size: int | None) -> Placement:
    per_node = fewest_members(ranks, stride, gpus_per_node)
    if fits(ranks, stride, gpus_per_node):
        return Placement(0, ranks, ranks)
    if pod_size is None or fits(ranks, stride, pod_size):
        return Placement(1, per_node, ranks)
    return Placement(2, per_node, fewest_members(ranks, stride, pod_size))


def _place(hardware: Hardware, ranks: int, stride: int) -> Placement:
    return placement(ranks, stride, hardware.gpus_per_node, hardware.pod_size)


def _latency(hardware: Hardware, reach: int) -> float:
    microseconds = (
        hardware.intra_node_latency_us,
        hardware.inter_node_latency_us,
        hardware.inter_pod_latency_us
        if hardware.inter_pod_latency_us is not None
        else hardware.inter_node_latency_us,
    )[reach]
    return microseconds * 1e-6


def ring_bandwidth(hardware: Hardware, ranks: int, stride: int) -> float:
    """Bytes/s per rank of a ring collective over the group (before ``LINK_EFFICIENCY``)."""
    where = _place(hardware, ranks, stride)
    bandwidth = hardware.intra_node_gbs
    if where.reach >= 1:
        bandwidth = min(bandwidth, hardware.inter_node_gbs * where.per_node)
    if where.reach == 2:
        # the pod layer is the pod's accelerators' shared uplink (inter_pod_gbs each); a
        # ring leaves a pod once per pod it visits, so a group's rings together get the
        # uplink share of its members in the pod, not of one port per ring
        bandwidth = min(bandwidth, hardware.inter_pod_gbs * where.per_pod)
    return bandwidth * 1e9


def _ring(hardware: Hardware, size_bytes: float, ranks: int, stride: int, steps: int) -> float:
    if ranks <= 1:
        return 0.0
    bandwidth = ring_bandwidth(hardware, ranks, stride) * constants.LINK_EFFICIENCY
    moved = size_bytes * (ranks - 1) / ranks
    reach = _place(hardware, ranks, stride).reach
    return moved / bandwidth + steps * _latency(hardware, reach)


def all_reduce(hardware: Hardware, size_bytes: float, ranks: int, stride: int) -> float:
    """A ring all-reduce of ``size_bytes``: each rank moves ``2 (n-1)/n`` of it."""
    return _ring(hardware, 2 * size_bytes, ranks, stride, steps=2 * (ranks - 1))


def all_gather(hardware: Hardware, size_bytes: float, ranks: int, stride: int) -> float:
    """A ring all-gather whose result is ``size_bytes``: each rank moves ``(n-1)/n``."""
    return _ring(hardware, size_bytes, ranks, stride, steps=ranks - 1)


def reduce_scatter(hardware: Hardware, size_bytes: float, ranks: int, stride: int) -> float:
    """A ring reduce-scatter of an input of ``size_bytes``: the all-gather's traffic."""
    return all_gather(hardware, size_bytes, ranks, stride)


def all_to_all(hardware: Hardware, size_bytes: float, ranks: int, stride: int) -> float:
    """Each rank sends ``size_bytes / n`` to every other: its share for other nodes
    through its own network port (for other pods, also through the pod layer), the rest
    over the intra-node link, at the same time."""
    if ranks <= 1:
        return 0.0
    where = _place(hardware, ranks, stride)
    efficiency = constants.LINK_EFFICIENCY
    share = size_bytes / ranks
    on_node = share * (min(where.per_node, ranks) - 1)
    seconds = on_node / (hardware.intra_node_gbs * 1e9 * efficiency)
    if where.reach >= 1:
        off_node = share * (ranks - where.per_node)
        seconds = max(seconds, off_node / (hardware.inter_node_gbs * 1e9 * efficiency))
    if where.reach == 2:
        off_pod = share * (ranks - where.per_pod)
        seconds = max(seconds, off_pod / (hardware.inter_pod_gbs * 1e9 * efficiency))
    return seconds + (ranks - 1) * _latency(hardware, where.reach)


def node_limited_all_to_all(
    hardware: Hardware,
    token_bytes: float,
    tokens: float,
    top_k: int,
    node_limit: int,
    ranks: int,
    stride: int,
) -> float:
    """An expert dispatch (or combine) of ``tokens`` tokens of ``token_bytes`` each, every
    one routed to ``top_k`` experts on at most ``node_limit`` of the nodes the group spans
    (DeepSeek-V3's node-limited routing, arXiv 2412.19437 sec. 2.1.2 and 3.2.2): a token
    crosses the network once per other node it goes to, through its rank's port, and is
    forwarded to that node's experts over the intra-node link. With the nodes chosen
    evenly, a token reaches ``min(node_limit, top_k, nodes) (nodes - 1) / nodes`` other
    nodes; each of its ``top_k`` rows crosses the link ``(per_node - 1) / per_node`` of
    the time. A group in one node is the plain ``all_to_all``; across pods the network
    part goes at the pod layer's share."""
    where = _place(hardware, ranks, stride)
    if ranks <= 1 or where.reach == 0:
        return all_to_all(hardware, token_bytes * tokens * top_k, ranks, stride)
    efficiency = constants.LINK_EFFICIENCY
    nodes = ranks / where.per_node
    remote = min(node_limit, top_k, nodes) * (nodes - 1) / nodes
    port = hardware.inter_node_gbs if where.reach == 1 else hardware.inter_pod_gbs
    network_s = token_bytes * tokens * remote / (port * 1e9 * efficiency)
    forwarded = token_bytes * tokens * top_k * (where.per_node - 1) / where.per_node
    node_s = forwarded / (hardware.intra_node_gbs * 1e9 * efficiency)
    return max(network_s, node_s) + (ranks - 1) * _latency(hardware, where.reach)


def p2p(hardware: Hardware, size_bytes: float, ranks: int, stride: int) -> float:
    """One rank of a group of ``ranks`` ranks ``stride`` apart (a pipeline) sends
    ``size_bytes`` to the next: over one port when the group crosses nodes."""
    where = _place(hardware, ranks, stride)
    bandwidth = (hardware.intra_node_gbs, hardware.inter_node_gbs, hardware.inter_node_gbs)
    gbs = bandwidth[where.reach]
    if where.reach == 2:
        gbs = min(gbs, hardware.inter_pod_gbs)
    return size_bytes / (gbs * 1e9 * constants.LINK_EFFICIENCY) + _latency(hardware, where.reach)
