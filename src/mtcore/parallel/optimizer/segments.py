"""The flat ranges an optimizer updates: runs of a gradient buffer with one set of
hyper-parameters.

``DataParallel`` keeps params and fp32 gradients in flat buffers. A rank's
optimizer owns, in every bucket, either the whole bucket (replicated
optimizer) or its 1/dp shard (ZeRO-1). Within that range, consecutive params
of the same param group (and the same tensor-parallel status, for the global
norm) merge into one ``Segment``, so AdamW runs on a few long tensors instead
of one small tensor per param. Padding belongs to no segment.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mtcore.parallel.clip import is_pipeline_copy, is_tensor_parallel
from mtcore.parallel.data.buffer import BufferRange


def default_no_decay(name: str, param: Tensor) -> bool:
    """Megatron's rule: no weight decay for biases and norm weights (tensors of rank < 2)."""
    return param.dim() < 2


def build_param_groups(
    named_params, lr: float, weight_decay: float, no_decay: Callable[[str, Tensor], bool]
) -> list[dict]:
    """Two groups like torch's optimizers: with weight decay, and without."""
    decay, plain = [], []
    for name, p in named_params:
        if p.requires_grad:
            (plain if no_decay(name, p) else decay).append(p)
    groups = [
        {"name": "decay", "params": decay, "lr": lr, "weight_decay": weight_decay},
        {"name": "no_decay", "params": plain, "lr": lr, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


@dataclass
class Segment(BufferRange):
    """One param group's run of a buffer range, with views of the optimizer state.

    state_offset: where the range starts in this buffer's flat optimizer state.
    """

    group: int = 0
    tensor_parallel: bool = False
    pipeline_copy: bool = False
    state_offset: int = 0
    master: Tensor | None = None
    exp_avg: Tensor | None = None
    exp_avg_sq: Tensor | None = None


def owned_segments(ddp, group_of: dict[int, int]) -> list[Segment]:
    """Segments of every buffer range this rank's optimizer owns, in buffer order."""
    segments: list[Segment] = []
    for buf in ddp.grad_buffers:
        offset = 0
        for bucket in buf.buckets:
            lo, hi = ddp.owned_ranges(bucket)
            for p in bucket.params:
                start, end = buf.range_of(p)
                start, end = max(start, lo), min(end, hi)
                if start >= end:
                    continue
                key = (group_of[id(p)], is_tensor_parallel(p), is_pipeline_copy(p))
                last = segments[-1] if segments else None
                if (
                    last is not None
                    and last.buffer is buf
                    and last.end == start
                    and (last.group, last.tensor_parallel, last.pipeline_copy) == key
                ):
                    last.end = end
                else:
                    segments.append(Segment(buf, start, end, *key, state_offset=offset))
                offset += end - start
    return segments


def allocate_state(segments: list[Segment]) -> dict[str, list[Tensor]]:
    """Flat fp32 state per buffer (exp_avg, exp_avg_sq and, for low-precision params,
    master weights); each segment gets views. fp32 params are their own master."""
    storage: dict[str, list[Tensor]] = {"master": [], "exp_avg": [], "exp_avg_sq": []}
    by_buffer: dict[int, list[Segment]] = {}
    for seg in segments:
        by_buffer.setdefault(id(seg.buffer), []).append(seg)
    for segs in by_buffer.values():
        buf = segs[0].buffer
        total = segs[-1].state_offset + segs[-1].numel
        m = torch.zeros(total, dtype=torch.float32, device=buf.device)
        v = torch.zeros(total, dtype=torch.float32, device=buf.device)
        storage["exp_avg"].append(m)
        storage["exp_avg_sq"].append(v)
        master = None
        if buf.dtype != torch.float32:
            master = torch.empty(total, dtype=torch.float32, device=buf.device)
            storage["master"].append(master)
        for seg in segs:
            lo, hi = seg.state_offset, seg.state_offset + seg.numel
            seg.exp_avg, seg.exp_avg_sq = m[lo:hi], v[lo:hi]
            if master is None:
                seg.master = seg.param_data
            else:
                seg.master = master[lo:hi]
                seg.master.copy_(seg.param_data)
    return storage
