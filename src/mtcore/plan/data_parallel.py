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

Under ZeRO-3, ``Fsdp`` says which of FSDP's behaviours run (torch's FSDP2
``reshard_after_forward``, ``set_requires_gradient_sync`` and prefetching): by default
(FULL_SHARD) the parameters are resharded after each forward and gathered again for
its backward, the gradients reduce-scattered every micro-batch, and one unit gathered
ahead. Without resharding a micro-batch gathers once (its forward); with the reduction
once a step the unsharded gradients accumulate and are reduce-scattered after the last
micro-batch; both together (torch's pipelining stage with both switches off until the
last micro-batch, as Llama 3 ran) gather once a step. A prefetch depth of 0 exposes
every gather.

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

FSDP_REDUCE = ("microbatch", "step")


@dataclass(frozen=True)
class Fsdp:
    """FSDP's switches under ZeRO-3: ``reshard`` after forward, ``reduce`` the gradients
    every ``microbatch`` or once a ``step``, ``prefetch`` units gathered ahead."""

    reshard: bool = True
    reduce: str = "microbatch"
    prefetch: int = 1

    def gathers(self, microbatches: int) -> int:
        """Layer-by-layer all-gathers of the parameters a step."""
        if not self.reshard and self.reduce == "step":
            return 1  # kept gathered from the first forward to the last backward
        return microbatches * (2 if self.reshard else 1)

    def reduces(self, microbatches: int) -> int:
        return microbatches if self.reduce == "microbatch" else 1


FULL_SHARD = Fsdp()


@dataclass(frozen=True)
class DpTraffic:
    """Seconds of each data-parallel collective of one step, for one rank."""

    per_step_reduce: float  # stages 0-1: the gradients' all-reduce / reduce-scatter
    per_microbatch_reduce: float  # stages 2-3: one micro-batch's reduce-scatter
    per_microbatch_gather: float  # stage 3: one pass's layer-by-layer all-gather
    after_step_gather: float  # stages 1-2: the updated parameters' all-gather
    last_bucket: float  # the reduction nothing can hide
    first_unit: float  # stage 3: the first layer's gather, before any compute

    def total(self, microbatches: int, zero: int, fsdp: Fsdp = FULL_SHARD) -> float:
        gathers = fsdp.gathers(microbatches) * self.per_microbatch_gather if zero == 3 else 0.0
        reduces = (fsdp.reduces(microbatches) if zero == 3 else microbatches) * (
            self.per_microbatch_reduce
        )
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
    fsdp: Fsdp = FULL_SHARD,
) -> float:
    """Seconds of ``t`` the step waits for; ``forward`` / ``backward``: one micro-batch's
    compute on the slowest stage."""
    if zero == 3:
        return _fsdp_exposed(t, overlap, microbatches, forward, backward, fsdp)
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


def _fsdp_exposed(t: DpTraffic, overlap, microbatches, forward, backward, fsdp: Fsdp) -> float:
    """ZeRO-3 with ``fsdp``'s switches: a forward's gather hides behind the forward (its
    first unit's exposed), a resharded backward's gather and a reduce-scatter behind the
    backward (the last bucket exposed); with no prefetch the gathers hide behind nothing;
    ``none`` exposes everything. FULL_SHARD gives ``exposed``'s stage-3 count."""
    m, gather, reduce = microbatches, t.per_microbatch_gather, t.per_microbatch_reduce
    if overlap == "none":
        return t.total(m, 3, fsdp)
    ahead = fsdp.prefetch > 0
    forwards = fsdp.gathers(m) if not fsdp.reshard else m  # forwards that gather
    out = forwards * max(gather - forward * ahead, t.first_unit)
    backward_gather = gather if fsdp.reshard else 0.0
    hides = backward * ahead  # what the backward hides of its gather

    def behind_backward(reduces: bool) -> float:
        if not reduces:
            return max(0.0, backward_gather - hides)
        if not ahead:
            return backward_gather + max(reduce - backward, t.last_bucket)
        return max(backward_gather + reduce - backward, t.last_bucket)

    reducing = fsdp.reduces(m)  # the last `reducing` backwards reduce-scatter
    return out + reducing * behind_backward(True) + (m - reducing) * behind_backward(False)
