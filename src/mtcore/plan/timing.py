"""Predicted step time of one rank's work: compute, memory-bound work, communication.

Matrix products run at ``GEMM_EFFICIENCY`` of the accelerator's peak (scaled by its
published maximum achievable matmul share relative to the fit accelerator's); everything
that moves bytes (element-wise kernels through memory, collectives over links)
at ``LINK_EFFICIENCY`` of the published bandwidth. Collectives are ring
algorithms: an all-reduce moves ``2 (n-1)/n`` of its buffer per rank, an
all-gather, reduce-scatter or all-to-all ``(n-1)/n``; each step pays the link's
latency. Tensor-, context- and expert-parallel communication is exposed (mtcore
runs it on the compute stream, between the products that need it). The loss over
the vocabulary is counted op by op, in fp32 (``cross_entropy_bytes``).
"""

from __future__ import annotations

from functools import cache

from mtcore.plan import constants
from mtcore.plan.hardware import Hardware, load_hardware

ELEMENTWISE_PASSES = 5
"""Memory traffic of the element-wise work (norms, activations, softmax, dropout,
residual adds) of one layer, in units of the bytes the layer keeps for backward:
forward reads each kept tensor's input and writes the tensor (2), backward reads
it, reads the incoming gradient and writes the outgoing one (3). Counted, not
fitted; a full recompute adds a forward (2)."""


def gemm_flops(hardware: Hardware, peak: float) -> float:
    """FLOP/s the model credits large matrix products whose dtype peaks at ``peak`` on
    ``hardware``: ``GEMM_EFFICIENCY`` of the peak (fitted on the accelerator named by
    ``constants.FIT_HARDWARE``), times the accelerator's published maximum achievable
    matmul share of its peak over the fit accelerator's (``matmul_share``). Without a
    published measurement an accelerator is credited the fit accelerator's share."""
    share, fitted = matmul_share(hardware), matmul_share(_fit_hardware())
    ratio = share / fitted if share and fitted else 1.0
    return peak * constants.GEMM_EFFICIENCY * ratio


def matmul_share(hardware: Hardware) -> float | None:
    """The hardware file's measured maximum achievable dense bf16 matmul TFLOP/s
    (``matmul_tflops``, a published measurement named in its [sources]) over its bf16
    peak; None when the file gives none. One figure per accelerator, for every dtype."""
    if not hardware.matmul_tflops or "bf16" not in hardware.peak_tflops:
        return None
    return hardware.matmul_tflops / hardware.peak_tflops["bf16"]


@cache
def _fit_hardware() -> Hardware:
    return load_hardware(constants.FIT_HARDWARE)


def cross_entropy_bytes(e: int) -> float:
    """Memory traffic per logit (one token, one vocabulary entry) of the loss, for
    logits of ``e`` bytes: the loss runs in fp32 over the whole vocabulary shard.

    Counted from Megatron's ``vocab_parallel_cross_entropy`` (2021, and Megatron-Core
    r0.8: ``calculate_logits_max`` casts the logits with ``.float()``), one op at a
    time. Forward: the head's product writes the logits (e); the cast reads them and
    writes fp32 (e + 4); the max reads (4); subtracting it reads and writes (8); the
    exponential reads and writes (8); the sum reads (4); dividing by it reads and
    writes the softmax kept for backward (8). Backward: scaling the softmax by the
    incoming gradient reads and writes (8); the cast back reads fp32 and writes e.
    ``F.cross_entropy`` on fp32 logits (mtcore's) moves about the same by this count
    (3e + 44). Counted, not fitted.
    """
    forward = e + (e + 4) + 4 + 8 + 8 + 4 + 8
    backward = 8 + (4 + e)
    return forward + backward


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
