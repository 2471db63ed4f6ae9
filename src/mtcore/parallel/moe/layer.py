"""The mixture-of-experts layer: router, dispatch over ep, grouped experts, combine.

Data flow for input ``x [b, s_local, h]`` (``s_local = s / tp`` under sequence
parallel, else ``s`` replicated over tp):

1. router logits ``x W_r^T`` (float32). Under SP they are computed on the
   sequence shard and all-gathered, so routing always sees the whole
   micro-batch and every tp rank makes the same choice;
2. top-k (``router.route``), capacity mask, balancing losses;
3. tokens enter the tp region (all-gather of the sequence under SP, else
   ``copy_to_tp``), are dispatched over the ep group, run through this
   rank's experts (a tp-partial sum), combined back in token order;
4. the partial sums are reduced over tp (reduce-scatter to the sequence
   shard under SP, else all-reduce); the shared expert, if any, is added.

The router's combine weights enter the tp region through ``copy_to_tp``: each
tp rank's gradient for them is partial (it sees its shard of each expert), so
their backward sums over tp. The aux and z losses join the backward through
``AttachAuxLoss`` with gradient ``aux_loss_scale``; the model's loss does not
contain them and ``pop_stats`` reports them.

Under context parallel (cp > 1) a rank routes only its share of each sequence.
The balancing loss's expert counts (no gradient) are summed over the cp group
and its scores kept local (Megatron-Core's rule), so each rank's loss is its
contribution: the cp mean of the recorded values is the micro-batch's loss and
the cp sum of the gradients is cp times one process's, as for the main loss
(see ``router``). Capacity dropping ranks assignments over the whole
micro-batch and is refused under cp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.parallel.layout import Axis
from mtcore.parallel.moe.dispatch import AllGatherDispatcher, AllToAllDispatcher
from mtcore.parallel.moe.dispatch_dedup import DedupAllToAllDispatcher
from mtcore.parallel.moe.experts import GroupedExperts
from mtcore.parallel.moe.router import (
    AttachAuxLoss,
    capacity_keep_mask,
    load_balancing_loss,
    route,
    sequence_load_balancing_loss,
    sequence_tokens_per_expert,
    tokens_per_expert,
    update_bias,
    z_loss,
)
from mtcore.parallel.moe.spec import MoESpec
from mtcore.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, normal_init
from mtcore.parallel.tensor.mappings import (
    TPGroup,
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
)
from mtcore.parallel.tensor.sharding import mark_sequence_parallel


def ep_group(layout, backend) -> TPGroup:
    """The expert-parallel group of ``layout`` as a group handle (single when ep == 1)."""
    if layout is None or layout.ep == 1:
        return TPGroup.single(backend)
    return TPGroup(backend, layout.group(Axis.EP), layout.ep, layout.coordinate(Axis.EP))


def cp_group(layout, backend) -> TPGroup:
    """The context-parallel group of ``layout`` as a group handle (single when cp == 1):
    the ranks holding the other parts of this rank's sequences."""
    if layout is None or layout.cp == 1:
        return TPGroup.single(backend)
    return TPGroup(backend, layout.group(Axis.CP), layout.cp, layout.coordinate(Axis.CP))


DISPATCHERS = {
    "alltoall": AllToAllDispatcher,
    "alltoall_dedup": DedupAllToAllDispatcher,
    "allgather": AllGatherDispatcher,
}


def _in_backward() -> bool:
    """True while the autograd engine runs (activation recompute calls forward from there)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


@dataclass
class MoEStats:
    """Load statistics summed over forwards since the last ``MoELayer.pop_stats``.

    tokens_per_expert: ``[num_experts]`` int64, assignments routed (before dropping)
      by this rank's forwards. Every tp rank of a group counts the same tokens.
    dropped: assignments dropped by the capacity limit.
    aux_loss, z_loss: sums of the unscaled loss values (divide by ``forwards``); under
    cp, this rank's contributions: their mean over cp is the micro-batch's loss.
    """

    tokens_per_expert: torch.Tensor
    dropped: int = 0
    aux_loss: float = 0.0
    z_loss: float = 0.0
    forwards: int = 0

    @classmethod
    def zeros(cls, num_experts: int) -> MoEStats:
        return cls(torch.zeros(num_experts, dtype=torch.int64))


class Router(nn.Module):
    """``weight [E, h]``, replicated; ``expert_bias [E]`` buffer for aux-loss-free balancing."""

    def __init__(self, hidden_size, num_experts, generator, init_std, sequence_parallel, device):
        super().__init__()
        full = torch.empty(num_experts, hidden_size).normal_(0.0, init_std, generator=generator)
        self.weight = nn.Parameter(full.to(device))
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device))
        if sequence_parallel:  # sees a sequence shard: partial grads, summed over tp later
            mark_sequence_parallel(self, "weight")

    def _apply(self, fn, *args, **kwargs):
        # Casting the model (``.to(bfloat16)``) must not round the bias: its
        # updates are tiny steps (rate ~1e-3) that bf16 would swallow.
        super()._apply(fn, *args, **kwargs)
        self.expert_bias = self.expert_bias.float()
        return self

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.float(), self.weight.float())


class SharedExpert(nn.Module):
    """A dense tp-parallel MLP every token goes through (DeepSeek-MoE's shared expert)."""

    def __init__(
        self, hidden, ffn, activation, tp, sp, backend, generator, init_std, out_std, bias, device
    ):
        super().__init__()
        self.kernels, self.swiglu = backend.kernels, activation == "swiglu"
        sections = (ffn, ffn) if self.swiglu else (ffn,)
        common = dict(bias=bias, sequence_parallel=sp, generator=generator, device=device)
        self.fc1 = ColumnParallelLinear(
            hidden,
            sum(sections),
            tp,
            sections=sections,
            init_method=normal_init(init_std),
            **common,
        )
        self.fc2 = RowParallelLinear(ffn, hidden, tp, init_method=normal_init(out_std), **common)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        h = self.kernels.swiglu(h) if self.swiglu else F.gelu(h, approximate="tanh")
        return self.fc2(h)


class MoELayer(nn.Module):
    """Top-k routed experts, split over the ep group (experts) and tp (each expert's width).

    Parameters: ``router.weight [E, h]`` (replicated; flagged sequence_parallel
    under SP), ``experts.fc1`` / ``experts.fc2`` (see ``experts``; flagged
    ``expert_parallel``), and ``shared.fc1`` / ``shared.fc2`` (ordinary tp
    layers) when ``spec.shared_ffn_size > 0``. Buffer ``router.expert_bias``.

    Weights are drawn from ``generator`` in a fixed order (router, fc1, fc2,
    shared fc1, shared fc2), whole, so any layout matches one process.
    ``bias`` applies to the shared expert only; routed experts have no biases.
    ``layout``: a ``ParallelLayout``; its ``ep`` group holds the experts (None: ep=1).
    """

    aux_loss_scale: float = 1.0

    def __init__(
        self,
        hidden_size: int,
        spec: MoESpec,
        *,
        tp: TPGroup,
        layout,
        backend,
        sequence_parallel: bool,
        generator: torch.Generator,
        init_std: float,
        out_std: float,
        bias: bool = False,
        device=None,
    ):
        super().__init__()
        spec.check(1 if layout is None else layout.ep, tp.size, 1 if layout is None else layout.cp)
        self.spec, self.tp, self.hidden = spec, tp, hidden_size
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.ep = ep_group(layout, backend)
        self.cp = cp_group(layout, backend)
        self.router = Router(
            hidden_size, spec.num_experts, generator, init_std, self.sequence_parallel, device
        )
        self.experts = GroupedExperts(
            hidden_size,
            spec.ffn_size,
            spec.num_experts,
            activation=spec.activation,
            tp=tp,
            ep_size=self.ep.size,
            ep_rank=self.ep.rank,
            backend=backend,
            generator=generator,
            init_std=init_std,
            out_std=out_std,
            device=device,
        )
        self.shared = None
        if spec.shared_ffn_size:
            self.shared = SharedExpert(
                hidden_size,
                spec.shared_ffn_size,
                spec.activation,
                tp,
                self.sequence_parallel,
                backend,
                generator,
                init_std,
                out_std,
                bias,
                device,
            )
        self.dispatcher = DISPATCHERS[spec.dispatcher](spec.num_experts, self.ep)
        self._stats = MoEStats.zeros(spec.num_experts)
        self.last_keep: Tensor | None = None  # [T, k] kept assignments of the last forward

    @property
    def expert_bias(self) -> Tensor:
        return self.router.expert_bias

    def forward(self, x: Tensor) -> Tensor:
        spec, tp, sp = self.spec, self.tp, self.sequence_parallel
        logits = self.router(x)
        if sp:  # every downstream use of the logits is replicated: full grads, keep our shard
            logits = gather_from_sp(logits, tp, reduce_grad=False)
        b, s, _ = logits.shape
        logits = logits.reshape(b * s, spec.num_experts)
        bias = self.router.expert_bias if spec.bias_update_rate > 0 else None
        r = route(logits, spec, bias)
        keep = None
        capacity = spec.capacity(b * s)
        if capacity is not None:
            keep = capacity_keep_mask(r.experts, spec.num_experts, capacity)
        self.last_keep = keep
        recomputing = _in_backward()  # a checkpointed forward run again: count it once
        aux = self._losses(logits, r, b, record=not recomputing)

        tokens = gather_from_sp(x, tp) if sp else copy_to_tp(x, tp)
        probs = copy_to_tp(r.probs, tp).to(x.dtype)
        rows, counts = self.dispatcher.dispatch(tokens.reshape(b * s, -1), r.experts, probs, keep)
        out = self.dispatcher.combine(self.experts(rows, counts)).view(b, s, -1)
        y = reduce_scatter_to_sp(out, tp) if sp else reduce_from_tp(out, tp)
        if self.shared is not None:
            y = y + self.shared(x)
        if aux is not None and torch.is_grad_enabled():
            y = AttachAuxLoss.apply(y, aux, float(self.aux_loss_scale))
        if not recomputing:
            self._record(r.experts, keep)
        return y

    def _losses(self, logits: Tensor, r, batch: int, record: bool) -> Tensor | None:
        """Coefficient-weighted sum of the balancing and z losses (None if both are off)."""
        spec, total = self.spec, None
        if spec.aux_loss != "none":
            e = spec.num_experts
            if spec.aux_loss == "seq":
                counts = self._whole_counts(sequence_tokens_per_expert(r.experts, e, batch))
                aux = sequence_load_balancing_loss(r.scores, r.experts, e, batch, counts)
            else:
                counts = self._whole_counts(tokens_per_expert(r.experts, e))
                aux = load_balancing_loss(r.scores, r.experts, e, counts)
            if record:
                self._stats.aux_loss += aux.item()
            if spec.aux_loss_coeff > 0:
                total = spec.aux_loss_coeff * aux
        if spec.z_loss_coeff > 0:
            z = z_loss(logits)
            if record:
                self._stats.z_loss += z.item()
            total = spec.z_loss_coeff * z if total is None else total + spec.z_loss_coeff * z
        return total

    def _whole_counts(self, counts: Tensor) -> Tensor:
        """Assignment counts of the whole micro-batch: summed over cp (no gradient)."""
        return self.cp.all_reduce(counts) if self.cp.size > 1 else counts

    def _record(self, experts: Tensor, keep: Tensor | None) -> None:
        self._stats.tokens_per_expert += tokens_per_expert(experts, self.spec.num_experts).cpu()
        if keep is not None:
            self._stats.dropped += int(keep.numel() - keep.sum())
        self._stats.forwards += 1

    def pop_stats(self) -> MoEStats:
        """Load statistics summed since the last call (then reset)."""
        stats, self._stats = self._stats, MoEStats.zeros(self.spec.num_experts)
        return stats

    def update_expert_bias(self, tokens_per_expert: Tensor) -> None:
        """Aux-loss-free balancing step from the load of the last step (``[E]`` counts)."""
        if self.spec.bias_update_rate > 0:
            update_bias(self.router.expert_bias, tokens_per_expert, self.spec.bias_update_rate)

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"experts={s.num_experts}, top_k={s.top_k}, ep={self.ep.size}, tp={self.tp.size}, "
            f"dispatcher={s.dispatcher}, capacity_factor={s.capacity_factor}"
        )
