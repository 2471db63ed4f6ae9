"""Per-layer FP8 state: the quantizer of each role, and the delayed-scaling buffers.

``FP8Scaling`` is an ``nn.Module`` so that the amax history and the scales are
buffers of the layer that owns it: persistent (a checkpoint carries them), moved
with the model, and kept in float32 when the model is cast to bf16 (a rounded
amax would push the largest values past the format's maximum).

Delayed scaling, per role (input, weight, grad), on every quantization:

1. quantize with ``scale`` (computed from the history before this call);
2. all-reduce (max) this call's amax over ``amax_group`` (the tensor-parallel
   group), so every rank records the amax of the whole logical tensor, and over
   ``replica_group`` (data parallel), so replicas record the same;
3. roll the history by one, write the amax into slot 0;
4. ``scale = fp8_max / (max(history) * 2**margin)`` for the next call.

The first call of a role (empty history) has no past to go on: it is scaled
just in time from its own (reduced) amax instead of saturating at scale 1.

Per-step bookkeeping (``per_step``, set by ``FP8StepBookkeeping`` for the
trainer's engine): steps 2-4 above move to the end of the optimizer step. Every
quantization of the step uses the scale the step started with and only notes its
local amax (the max over the step's micro-batches); ``FP8StepBookkeeping.finish_step``
then reduces the noted amaxes of every FP8 linear in one all-reduce per group
and rolls each history once. The FP8 weight is quantized by the step's first
training forward and reused by the later micro-batches (the weight only changes
at the optimizer step). A first call (empty history) is still scaled just in time
from its own reduced amax (one collective per linear, on the first step only);
the step's later passes use that scale, and the history gets one entry per step
and role like any other step.
Forward passes replayed by activation recomputation inside backward record
nothing, so a recomputed step does not advance the history twice, and quantize
with the scales their original forward used (``snapshot_delayed_scales`` /
``replay_delayed_scales``, called by ``mtcore.parallel.recompute``), so they
reproduce the forward exactly: by then that forward and later micro-batches
have moved the scales, and a MoE router fed other activations would choose
other experts. Forward passes without autograd (evaluation) record nothing
either: evaluating must not change how training quantizes.

Checkpoints cross the FP8 boundary both ways: a model built without FP8 accepts
and drops the FP8 state of an FP8-trained checkpoint (``accept_fp8_state``), and
an FP8 model loading a checkpoint without it starts with a fresh history.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from mtcore.precision.fp8.recipes import ROLES, FP8Recipe

_BUFFERS = ("amax_history", "scale")
_FP32_MAX = torch.finfo(torch.float32).max


def _in_backward() -> bool:
    """True while autograd runs a backward pass (e.g. a checkpoint recomputing forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class FP8Scaling(nn.Module):
    """Quantizes the roles of one FP8 linear according to ``recipe``.

    fp8: the backend's FP8 interface (``backend.fp8``).
    amax_group: ``(collective, group)`` whose ranks must agree on the delayed
      scales (the tensor-parallel group), or None in one process.
    replica_group: ``(collective, group)`` of the data-parallel replicas of this
      layer, or None: the amax is reduced over it too (as TransformerEngine reduces
      over dp x tp), so replicas keep one history and a checkpoint, which stores one
      replica's, resumes every replica exactly.
    """

    def __init__(self, recipe: FP8Recipe, fp8, amax_group=None, device=None, replica_group=None):
        super().__init__()
        self.recipe, self.fp8 = recipe, fp8
        self.amax_groups = [g for g in (amax_group, replica_group) if g is not None]
        self._fresh = [True] * len(ROLES)
        self.per_step = False  # FP8StepBookkeeping: amaxes reduced once per step, weight cached
        self.weight_quantizations = 0  # how often the weight was quantized (a statistic)
        self._noted = [False] * len(ROLES)
        self._pending: Tensor | None = None  # per role: max local amax noted this step
        self._weight_cache = None  # per_step: this step's FP8 weight
        if recipe.delayed:
            n = len(ROLES)
            history = torch.zeros(n, recipe.amax_history_len, device=device)
            self.register_buffer("amax_history", history, persistent=True)
            self.register_buffer("scale", torch.ones(n, device=device), persistent=True)

    @staticmethod
    def records_now() -> bool:
        """Whether a forward called now advances the history: autograd on (training),
        outside a backward pass (not a checkpoint's recomputation)."""
        return torch.is_grad_enabled() and not _in_backward()

    def quantize(self, x: Tensor, role: str, record: bool | None = None):
        """``x`` [M, K] quantized along K as ``role`` ("input", "weight" or "grad").

        record: delayed scaling: advance the history (default: ``records_now()``;
        always for "grad"). Inside an ``autograd.Function`` grad mode is off, so the
        caller decides before entering it.
        """
        recipe = self.recipe
        dtype, granularity = recipe.dtype(role), recipe.granularity(role)
        if not recipe.delayed:
            return self.fp8.quantize(x, dtype, granularity)
        i = ROLES.index(role)
        if role == "grad":
            record = True  # a gradient only exists in backward
        elif record is None:
            record = self.records_now()
        if self._fresh[i]:
            amax = self._reduce(x.detach().abs().amax().float())
            scale = self._scale_from(amax, self.fp8.max_value(dtype))
            q = self.fp8.quantize(x, dtype, granularity, scale=scale)
            if record and self.per_step:  # the step's later passes use this scale
                self._note(i, amax)
                with torch.no_grad():
                    self.scale[i] = scale
                self._fresh[i] = False
                return q
        else:
            q = self.fp8.quantize(x, dtype, granularity, scale=self.scale[i])
            if record and self.per_step:
                self._note(i, q.amax)
                return q
            amax = self._reduce(q.amax) if record else None
        if record:
            self._record(i, amax, self.fp8.max_value(dtype))
        return q

    def quantize_weight(self, weight: Tensor, record: bool | None = None):
        """The weight as the forward GEMM takes it. Under ``per_step`` the first
        training forward of a step quantizes it and later micro-batches (and a
        recomputed forward) reuse that copy."""
        if self._weight_cache is not None:
            return self._weight_cache
        record = self.records_now() if record is None else record
        q = self.quantize(weight, "weight", record)
        self.weight_quantizations += 1
        if self.per_step and record:
            self._weight_cache = q
        return q

    def quantize_forward(self, x: Tensor, weight: Tensor, record: bool):
        """Input and weight of one forward GEMM; delayed scaling reduces both amaxes
        over the tp group in one all-reduce once past the first call (per quantization),
        or at the end of the step with every other linear's (``per_step``)."""
        if self.per_step or not self.recipe.delayed or not record or any(self._fresh[:2]):
            return self.quantize(x, "input", record), self.quantize_weight(weight, record)
        self.weight_quantizations += 1
        recipe = self.recipe
        qx, qw = (
            self.fp8.quantize(t, recipe.dtype(role), recipe.granularity(role), scale=self.scale[i])
            for i, (t, role) in enumerate(((x, "input"), (weight, "weight")))
        )
        amax = self._reduce(torch.stack([qx.amax.reshape(()), qw.amax.reshape(())]))
        self._record(0, amax[0], self.fp8.max_value(recipe.dtype("input")))
        self._record(1, amax[1], self.fp8.max_value(recipe.dtype("weight")))
        return qx, qw

    def _note(self, i: int, amax: Tensor) -> None:
        """Per-step bookkeeping: keep the largest local amax of role ``i`` this step."""
        amax = amax.detach().float().reshape(())
        if self._pending is None:
            self._pending = torch.zeros(len(ROLES), device=amax.device)
        self._pending[i] = torch.maximum(self._pending[i], amax)
        self._noted[i] = True

    def noted_amaxes(self) -> Tensor | None:
        """This step's noted local amaxes, one per role (0 where none), or None."""
        return self._pending if any(self._noted) else None

    @torch.no_grad()
    def record_noted(self, reduced: Tensor) -> None:
        """Roll the history of every role noted this step with its ``reduced`` amax
        (already reduced over the groups; non-finite ones made 0), then start anew."""
        for i, noted in enumerate(self._noted):
            if noted:
                self._record(i, reduced[i], self.fp8.max_value(self.recipe.dtype(ROLES[i])))
        self._noted = [False] * len(ROLES)
        self._pending = None

    def reduce_amaxes(self, amaxes: Tensor) -> Tensor:
        """``amaxes`` (any shape) reduced (max) over this layer's groups, one collective
        per group; non-finite entries become 0."""
        return self._reduce(amaxes)

    def new_step(self) -> None:
        """Drop the cached FP8 weight (the optimizer step is about to change it)."""
        self._weight_cache = None

    def _reduce(self, amax: Tensor) -> Tensor:
        """Max over the tp group, then the replicas (a scalar, or several stacked: one
        collective per group)."""
        amax = amax.detach().float().clone()
        if amax.numel() == 1:
            amax = amax.reshape(())
        for collective, group in self.amax_groups:
            collective.all_reduce(amax, op="max", group=group)
        # A non-finite amax (an overflowing step the trainer will skip) must not
        # poison the history for the next amax_history_len steps.
        return torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))

    def _scale_from(self, amax: Tensor, fp8_max: float) -> Tensor:
        top = amax * 2.0**self.recipe.margin
        # Capped like the just-in-time scale of ``fp8_quantize``: an amax below
        # fp8_max / float32_max would give inf (zeros -> NaN, the rest -> 0).
        scale = torch.where(top > 0, fp8_max / top, torch.ones_like(top))
        return scale.clamp(max=_FP32_MAX)

    @torch.no_grad()
    def _record(self, i: int, amax: Tensor, fp8_max: float) -> None:
        row = self.amax_history[i]
        row.copy_(torch.roll(row, 1))
        row[0] = amax
        self.scale[i] = self._scale_from(row.max(), fp8_max)
        self._fresh[i] = False

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
    ):
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors
        )
        self._weight_cache = None  # loading a checkpoint may change the weight too
        if not self.recipe.delayed:
            return
        self._noted, self._pending = [False] * len(ROLES), None
        keys = [prefix + name for name in _BUFFERS]
        if not any(key in state_dict for key in keys):  # saved without FP8: start fresh
            missing_keys[:] = [k for k in missing_keys if k not in keys]
            return
        # A loaded history is the past to go on (one host sync, at load time).
        self._fresh = [not bool(row.any()) for row in self.amax_history]

    def _apply(self, fn, recurse=True):
        """Move the buffers with the model but keep them float32 under a dtype cast."""
        for name, buf in self._buffers.items():
            if buf is not None:
                device = fn(torch.empty(0, device=buf.device)).device
                self._buffers[name] = buf.to(device=device, dtype=torch.float32)
        return self

    def extra_repr(self) -> str:
        return self.recipe.describe()


def accept_fp8_state(module: nn.Module) -> None:
    """Let ``module`` (a linear built without FP8) load a state dict that carries FP8
    state under ``<prefix>fp8.``: the state is dropped, strict loading still checks
    every other key."""

    def drop(state_dict, prefix, *args):
        for name in _BUFFERS:
            state_dict.pop(f"{prefix}fp8.{name}", None)

    module._register_load_state_dict_pre_hook(drop)


def snapshot_delayed_scales(module: nn.Module) -> list:
    """The scales (and first-call flags) that every delayed-scaling FP8 linear in
    ``module`` quantizes its next forward with. Taken when a checkpointed forward
    starts, so that its recomputation can quantize the same (``replay_delayed_scales``)."""
    return [
        (m, m.scale.clone(), list(m._fresh))
        for m in module.modules()
        if isinstance(m, FP8Scaling) and m.recipe.delayed
    ]


@contextlib.contextmanager
def replay_delayed_scales(snapshot: list):
    """Quantize with the ``snapshot``'s scales inside the block (a recomputation, which
    records nothing), then put the current scales back."""
    current = [(m, m.scale.clone(), list(m._fresh)) for m, _, _ in snapshot]
    try:
        with torch.no_grad():
            for m, scale, fresh in snapshot:
                m.scale.copy_(scale)
                m._fresh = list(fresh)
        yield
    finally:
        with torch.no_grad():
            for m, scale, fresh in current:
                m.scale.copy_(scale)
                m._fresh = fresh
