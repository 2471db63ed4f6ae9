"""Predicted step time of one rank's work: compute, memory-bound work, communication.

Matrix products run at ``GEMM_EFFICIENCY`` of the accelerator's peak; everything
that moves bytes (element-wise kernels through memory, collectives over links)
at ``LINK_EFFICIENCY`` of the published bandwidth. Collectives are ring
algorithms: an all-reduce moves ``2 (n-1)/n`` of its buffer per rank, an
all-gather, reduce-scatter or all-to-all ``(n-1)/n``; each step pays the link's
latency. Tensor-, context- and expert-parallel communication is exposed (mtcore
runs it on the compute stream, between the products that need it).
"""

from __future__ import annotations

from mtcore.plan import constants
from mtcore.plan.hardware import Hardware

ELEMENTWISE_PASSES = 5
"""Memory traffic of the element-wise work (norms, activations, softmax, dropout,
residual adds) of one layer, in units of the bytes the layer keeps for backward:
forward reads each kept tensor's input and writes the tensor (2), backward reads
it, reads the incoming gradient and writes the outgoing one (3). Counted, not
fitted; a full recompute adds a forward (2)."""


def all_reduce(hardware: Hardware, size_bytes: float, ranks: int, stride: int) -> float:
    """``ranks`` ranks ``stride`` apart all-reduce a buffer of ``size_bytes``."""
    return _ring(hardware, 2 * size_bytes, ranks, stride, steps=2 * (ranks - 1))


def all_gather(hardware: Hardware, size_bytes: float, ranks: int, stride: int) -> float:
    """Also a reduce-scatter or an all-to-all: ``size_bytes`` is the whole buffer."""
    return _ring(hardware, size_bytes, ranks, stride, steps=ranks - 1)


def _ring(hardware: Hardware, size_bytes: float, ranks: int, stride: int, steps: int) -> float:
    if ranks <= 1:
        return 0.0
    bandwidth, latency = hardware.link(ranks, stride)
    moved = size_bytes * (ranks - 1) / ranks
    return moved / (bandwidth * constants.LINK_EFFICIENCY) + steps * latency


def p2p(hardware: Hardware, size_bytes: float, stride: int) -> float:
    """One rank sends ``size_bytes`` to the rank ``stride`` away (each uses its own port)."""
    bandwidth, latency = hardware.link(2, stride)
    if stride >= hardware.gpus_per_node:
        bandwidth = hardware.inter_node_gbs * 1e9
    return size_bytes / (bandwidth * constants.LINK_EFFICIENCY) + latency


def memory_bound(hardware: Hardware, size_bytes: float) -> float:
    return size_bytes / (hardware.memory_bandwidth_gbs * 1e9 * constants.LINK_EFFICIENCY)
