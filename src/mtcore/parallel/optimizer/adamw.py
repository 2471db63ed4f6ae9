"""AdamW over ``DataParallel``'s flat buffers: replicated, or sharded over dp (ZeRO-1).

Both keep fp32 master weights (the param buffer itself when params are fp32)
and fp32 AdamW moments, and update through ``backend.kernels.adamw_step`` so a
plugin's fused kernel serves the step. A step is Megatron-Core's:

1. finish the gradient reduction (``DataParallel.finish_grad_sync``);
2. with a loss scaler: unscale, look for inf/nan, agree over the dp and
   model-parallel groups, and skip the step everywhere if any rank found one;
3. optionally clip by the global norm (``mtcore.parallel.clip``);
4. AdamW on the owned ranges, one kernel call per param group;
5. copy master weights into the params; ZeRO-1 then all-gathers every bucket
   so each rank has the full updated params again (but ZeRO-3's buckets, whose
   params stay sharded until a forward gathers them).

``DistributedAdamW`` (ZeRO-1) owns a contiguous 1/dp shard of every bucket;
its master weights and moments take 12/dp bytes per param instead of 12.
Expert params of a mixture-of-experts model are sharded over their own
replicas, the expert-data-parallel group ``edp`` (DataParallel's expert buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mtcore.parallel.clip import clip_by_total_norm_, global_norm
from mtcore.parallel.layout import Axis
from mtcore.parallel.optimizer.segments import (
    Segment,
    allocate_state,
    build_param_groups,
    default_no_decay,
    owned_segments,
)
from mtcore.precision import LossScaler, agree_found_inf, found_non_finite


@dataclass(frozen=True)
class StepResult:
    """stepped: False when the step was skipped for inf/nan gradients.
    grad_norm: the global norm before clipping (None without ``max_grad_norm``).
    loss_scale: the scale the gradients carried (None without a scaler)."""

    stepped: bool
    grad_norm: float | None = None
    loss_scale: float | None = None


class AdamW:
    """AdamW with fp32 master weights on every data-parallel rank (not sharded).

    ddp: the ``DataParallel`` that owns the params and gradient buffers.
    no_decay: ``(name, param) -> bool``; those params get no weight decay
    (default: biases and norm weights). ``param_groups`` is a list of dicts
    with "lr" and "weight_decay" that a schedule may change between steps.
    loss_scaler: for fp16 (``mtcore.precision.DynamicLossScaler``).
    max_grad_norm: clip by the global norm when set.
    chunk_size: the most elements of one tensor handed to the AdamW kernel.
    Long flat ranges are cut so that an unfused kernel's several passes over
    the data hit the cache (on CPU, 8M elements in one piece take ~3x longer
    than in 1M pieces); a fused multi-tensor kernel takes the list in one
    launch either way.
    """

    sharded = False

    def __init__(
        self,
        ddp,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        no_decay: Callable[[str, Tensor], bool] = default_no_decay,
        loss_scaler: LossScaler | None = None,
        max_grad_norm: float | None = None,
        chunk_size: int = 2**20,
    ):
        if ddp.config.shard_optimizer != self.sharded:
            want = "True" if self.sharded else "False"
            raise ValueError(
                f"{type(self).__name__} needs DataParallelConfig(shard_optimizer={want}): "
                "the gradient reduction (all-reduce or reduce-scatter) must match the optimizer"
            )
        self.ddp = ddp
        self.layout = ddp.layout
        self.collective = ddp.collective
        self.kernels = ddp.backend.kernels
        self.betas = betas
        self.eps = eps
        self.loss_scaler = loss_scaler
        self.max_grad_norm = max_grad_norm
        self.step_count = 0
        self.param_groups = build_param_groups(
            ddp.module.named_parameters(), lr, weight_decay, no_decay
        )
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self.segments: list[Segment] = owned_segments(ddp, group_of)
        self._state = allocate_state(self.segments)
        self._kernel_args = [
            _chunked([s for s in self.segments if s.group == i], chunk_size)
            for i in range(len(self.param_groups))
        ]
        dp_group, mp_group = self.layout.dp_cp.group, self.layout.mp.group
        self._found_inf_groups = [dp_group, mp_group]
        self._norm_groups = [dp_group, mp_group] if self.sharded else [mp_group]
        tp_rank = self.layout.tp_rank
        counted = [
            s for s in self.segments if (tp_rank == 0 or s.tensor_parallel) and not s.pipeline_copy
        ]
        # Expert weights differ across the ep ranks: their squares add up over ep (under
        # ZeRO-1 the dp_cp reduction, which spans ep x edp, already does that).
        self._norm_segments = [s for s in counted if s.buffer.reduce_group is not Axis.EDP]
        self._expert_norm_segments = [s for s in counted if s.buffer.reduce_group is Axis.EDP]
        has_experts = Axis.EDP in ddp.reductions
        self._expert_norm_groups = (
            [self.layout.group(Axis.EP)] if has_experts and not self.sharded else []
        )

    # -- the training-loop API ----------------------------------------------------
    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss to call backward on (multiplied by the loss scale, if any)."""
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()

    @torch.no_grad()
    def step(self) -> StepResult:
        self.ddp.finish_grad_sync()
        grads = [s.grad for s in self.segments]
        scale = None
        if self.loss_scaler is not None:
            scale = self.loss_scaler.scale
            self.loss_scaler.unscale_(grads)
            found_inf = agree_found_inf(
                found_non_finite(grads, device=self.ddp.device),
                self.collective,
                self._found_inf_groups,
            )
            self.loss_scaler.update(found_inf)
            if found_inf:
                return StepResult(False, None, scale)
        norm = None
        if self.max_grad_norm is not None:
            total = self.grad_norm()
            clip_by_total_norm_(grads, self.max_grad_norm, total)
            norm = float(total.item())
        self.step_count += 1
        self._update()
        for s in self.segments:
            if s.master.data_ptr() != s.param_data.data_ptr():
                s.param_data.copy_(s.master)
        self._gather_params()
        return StepResult(True, norm, scale)

    def _update(self) -> None:
        """AdamW on the owned ranges' master weights (``step_count`` already counts
        this step), one kernel call per param group."""
        beta1, beta2 = self.betas
        for group, (params, grads_, exp_avgs, exp_avg_sqs) in zip(
            self.param_groups, self._kernel_args, strict=True
        ):
            if not params:
                continue
            self.kernels.adamw_step(
                params,
                grads_,
                exp_avgs,
                exp_avg_sqs,
                step=self.step_count,
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=self.eps,
                weight_decay=group["weight_decay"],
            )

    def grad_norm(self) -> Tensor:
        """The global gradient norm (fp32 scalar) over tp, pp and, for ZeRO, dp ranks."""
        return global_norm(
            [s.grad for s in self._norm_segments],
            self.collective,
            self._norm_groups,
            device=self.ddp.device,
            expert_grads=[s.grad for s in self._expert_norm_segments],
            expert_groups=self._expert_norm_groups,
        )

    def _gather_params(self) -> None:
        """Replicated optimizer: every rank already has every updated param."""

    # -- inspection and checkpoints -----------------------------------------------
    def state_tensors(self) -> dict[str, list[Tensor]]:
        """The flat tensors this optimizer allocated (master weights, moments), by kind."""
        return {k: list(v) for k, v in self._state.items()}

    def state_dict(self) -> dict:
        """This rank's state (valid for the same layout and bucket size)."""
        return {
            "step": self.step_count,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
            "state": {k: [t.clone() for t in v] for k, v in self._state.items()},
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step"])
        for group, saved in zip(self.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        for kind, tensors in self._state.items():
            for mine, saved in zip(tensors, state["state"][kind], strict=True):
                mine.copy_(saved)
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for s in self.segments:
            if s.master.data_ptr() != s.param_data.data_ptr():
                s.param_data.copy_(s.master)
        self._gather_params()


def _chunked(segments: list[Segment], chunk_size: int) -> tuple[list[Tensor], ...]:
    """(masters, grads, exp_avgs, exp_avg_sqs): views of at most ``chunk_size`` elements."""
    out: tuple[list[Tensor], ...] = ([], [], [], [])
    for s in segments:
        for i, t in enumerate((s.master, s.grad, s.exp_avg, s.exp_avg_sq)):
            out[i].extend(t.split(chunk_size))
    return out


class DistributedAdamW(AdamW):
    """ZeRO-1: master weights and moments sharded over the data-parallel group.

    Needs ``DataParallelConfig(shard_optimizer=True)``: gradients arrive
    reduce-scattered, each rank updates its shard of every bucket, and the
    updated params are all-gathered back into every rank's param buffer.
    """

    sharded = True

    def _gather_params(self) -> None:
        ddp = self.ddp
        handles = []
        for bucket in ddp.buckets:
            group, size, rank = ddp.reduction_of(bucket)  # dp_cp, or edp for expert params
            if size == 1 or bucket.buffer.shard_params:
                continue
            lo, hi = bucket.shard(rank, size)
            shard = bucket.buffer.param_data[lo:hi]
            handles.append(
                self.collective.all_gather(bucket.param_data, shard, group=group, async_op=True)
            )
        for handle in handles:
            handle.wait()
