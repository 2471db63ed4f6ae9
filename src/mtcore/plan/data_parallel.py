"""The data-parallel side of a step: gradient reduction and ZeRO's parameter gathers.

By ZeRO stage (``Options.zero``), over the dp x cp ranks of a stage (experts over their
expert-data-parallel group), for the slowest pipeline stage's parameters:

* 0: one all-reduce of the gradient buffers per step;
* 1: one reduce-scatter of them per step, and one all-gather of the updated
  parameters (in the compute dtype) after the optimizer step;
* 2: gradients are kept sharded, so each micro-batch's are reduce-scattered as its
  backward produces them; the updated parameters are all-gathered after the step;
* 3: parameters are kept sharded too: each micro-batch all-gathers every layer's
  parameters for its forward and again for its backward (FSDP's FULL_SHARD, resharding
  after forward), beside the gradients' reduce-scatter; nothing is gathered after the
  step.

How much of it is exposed (``exposed``): stages 0 and 1 follow ``Options.dp_overlap``
(mtcore's own: the reduction overlaps the last micro-batch's backward at pp = 1 and
follows the pipeline at pp > 1). Stages 2 and 3 run layer by layer beside the
compute, as DeepSpeed and FSDP do (``mtcore`` counts as ``full`` for them): each
micro-batch's gathers hide behind its forward and backward and its reduce-scatter
behind its backward, except the first layer's gather and the last bucket's reduction,
which nothing can hide; ``none`` exposes all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtcore.plan import network


@dataclass(frozen=True)
class DpTraffic:
    """Seconds of each data-parallel collective of one step, for one rank."""

    per_step_reduce: float  # stages 0-1: the gradients' all-reduce / reduce-scatter
    per_microbatch_reduce: float  # stages 2-3: one micro-batch's reduce-scatter
    per_microbatch_gather: float  # stage 3: one pass's layer-by-layer all-gather
    after_step_gather: float  # stages 1-2: the updated parameters' all-gather
    last_bucket: float  # the reduction nothing can hide
    first_unit: float  # stage 3: the first layer's gather, before any compute

    def total(self, microbatches: int, zero: int) -> float:
        gathers = 2 * microbatches * self.per_microbatch_gather if zero == 3 else 0.0
        reduces = microbatches * self.per_microbatch_reduce
        return self.per_step_reduce + reduces + gathers + self.after_step_gather


def traffic(
    params: float,
    expert_params: float,
    largest_unit: float,
    spec,
    hw,
    e: int,
    grad_bytes: int,
    bucket_size: int,
    zero: int,
    order: str = network.RANK_ORDERS[0],
) -> DpTraffic:
    """``DpTraffic`` for a rank holding ``params`` dense and ``expert_params`` expert
    parameters; ``largest_unit``: the most parameters one gathered unit (a layer, the
    embedding or head) holds on it; ``order``: the rank order (``network.RANK_ORDERS``)."""
    d = spec.dp * spec.cp
    span = network.dp_stride(spec, order)  # tp ranks apart in mtcore's order
    edp = max(1, d // spec.ep)

    def both(collective, per_param: float) -> float:
        """The dense parameters over dp x cp and the experts' over their group."""
        dense = collective(hw, per_param * params, d, span) if params else 0.0
        return dense + (
            collective(hw, per_param * expert_params, edp, span) if expert_params else 0.0
        )

    bucket = min(grad_bytes * bucket_size, grad_bytes * params)
    last = network.all_reduce(hw, bucket, d, span) if zero == 0 else 0.0
    if zero >= 1:
        last = network.reduce_scatter(hw, bucket, d, span)
    if zero == 0:
        step_reduce = both(network.all_reduce, grad_bytes)
    else:
        step_reduce = both(network.reduce_scatter, grad_bytes) if zero == 1 else 0.0
    return DpTraffic(
        per_step_reduce=step_reduce,
        per_microbatch_reduce=both(network.reduce_scatter, grad_bytes) if zero >= 2 else 0.0,
        per_microbatch_gather=both(network.all_gather, e) if zero == 3 else 0.0,
        after_step_gather=both(network.all_gather, e) if zero in (1, 2) else 0.0,
        last_bucket=last if d > 1 else 0.0,
        first_unit=network.all_gather(hw, e * largest_unit, d, span) if zero == 3 else 0.0,
    )


def exposed(
    t: DpTraffic,
    zero: int,
    overlap: str,
    pp: int,
    microbatches: int,
    forward: float,
    backward: float,
) -> float:
    """Seconds of ``t`` the step waits for; ``forward`` / ``backward``: one micro-batch's
    compute on the slowest stage."""
    if zero <= 1:
        reduce, gather = t.per_step_reduce, t.after_step_gather
        if overlap == "mtcore":  # reduce from backward at pp=1; the ZeRO-1 gather after the step
            return (max(reduce - backward, t.last_bucket) if pp == 1 else reduce) + gather
        if overlap == "full":  # reduce behind the last backward, gather behind the first forward
            return max(reduce - backward, t.last_bucket) + max(0.0, gather - forward)
        return reduce + gather
    if overlap == "none":
        return t.total(microbatches, zero)
    gather = t.per_microbatch_gather
    per_microbatch = max(t.per_microbatch_reduce + gather - backward, t.last_bucket)
    if zero == 3:
        per_microbatch += max(gather - forward, t.first_unit)
    return microbatches * per_microbatch + max(0.0, t.after_step_gather - forward)
