"""Top-k routing: scores, the k chosen experts and their weights, balancing losses.

Everything here is a pure function of the router logits of one micro-batch, so
a single process and any expert/tensor-parallel layout that sees the same
micro-batch make exactly the same choices (and drop the same tokens). Routing
runs in float32 whatever the activation dtype.

Losses (both returned unscaled; the layer multiplies by the coefficients):

* load balancing (Switch / GShard): ``E * sum_i f_i * P_i`` with ``f_i`` the
  fraction of the ``T * k`` assignments that chose expert ``i`` (not
  differentiable) and ``P_i`` the mean over tokens of expert ``i``'s score over
  *all* experts (sigmoid scores are first normalised to sum 1 per token, as in
  DeepSeek-V3's sequence-wise loss). It is 1 for a perfectly balanced router.
  "seq" computes it per sequence and averages over the sequences.
* z-loss (ST-MoE): ``mean_t logsumexp(logits_t)^2``, keeps logits small.

Under context parallelism a rank holds ``1/cp`` of every sequence's tokens. The
balancing losses then take the whole micro-batch's counts (``counts``, summed
over cp by the layer) with this rank's mean scores; the z-loss, a mean of
per-token terms over equal shares, needs nothing. Either way each rank's value
is its contribution: their mean over cp is the one-process loss and their
gradients, summed over cp, are ``cp`` times the one-process gradient, exactly
the factor the main loss carries on a cp rank (``dp_cp`` averaging removes it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mtcore.parallel.moe.spec import MoESpec


@dataclass
class Routing:
    """One micro-batch's routing decision over ``T`` tokens.

    probs: ``[T, k]`` combine weights (differentiable w.r.t. the logits).
    experts: ``[T, k]`` int64 expert ids, the top-k choice.
    scores: ``[T, E]`` scores over all experts (what the balancing loss averages).
    """

    probs: Tensor
    experts: Tensor
    scores: Tensor


def route(logits: Tensor, spec: MoESpec, bias: Tensor | None = None) -> Routing:
    """Choose ``spec.top_k`` experts per row of ``logits [T, E]``.

    bias: ``[E]`` aux-loss-free balancing bias, added to the scores for the
      choice only; the weights come from the unbiased scores (DeepSeek-V3).
    """
    logits = logits.float()
    k = spec.top_k
    if spec.score == "sigmoid":
        raw = torch.sigmoid(logits)
        scores = raw / raw.sum(-1, keepdim=True).clamp(min=1e-20)
        chooser = raw
    else:
        scores = torch.softmax(logits, dim=-1)
        chooser = logits if spec.topk_then_softmax else scores
    if bias is not None:
        chooser = chooser + bias.float()
    chooser = chooser.detach()
    if spec.top_groups is not None and spec.top_groups < spec.expert_groups:
        chooser = _best_groups_only(chooser, spec.expert_groups, spec.top_groups)
    experts = torch.topk(chooser, k, dim=-1).indices
    if spec.topk_then_softmax:
        probs = torch.softmax(logits.gather(-1, experts), dim=-1)
    else:
        probs = (raw if spec.score == "sigmoid" else scores).gather(-1, experts)
        if spec.norm_topk and k > 1:  # at k=1 it would make every weight 1: no gradient
            probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-20)
    if spec.routed_scale != 1.0:
        probs = probs * spec.routed_scale
    return Routing(probs, experts, scores)


def _best_groups_only(chooser: Tensor, groups: int, keep: int) -> Tensor:
    """``chooser [T, E]`` with ``-inf`` outside each token's ``keep`` best of ``groups``
    expert groups, a group scored by the sum of its (at most) two best entries."""
    grouped = chooser.view(chooser.shape[0], groups, -1)
    best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, groups]
    chosen = best.topk(keep, dim=-1).indices
    allowed = torch.zeros_like(best, dtype=torch.bool).scatter_(1, chosen, True)
    return grouped.masked_fill(~allowed[..., None], float("-inf")).view_as(chooser)


def tokens_per_expert(experts: Tensor, num_experts: int) -> Tensor:
    """``[E]`` int64: how many of the assignments ``experts [..., k]`` chose each expert."""
    return torch.bincount(experts.reshape(-1), minlength=num_experts)


def sequence_tokens_per_expert(experts: Tensor, num_experts: int, batch: int) -> Tensor:
    """``[batch, E]`` int64: assignments of each sequence (rows are ``[b, s]`` flattened)."""
    chosen = experts.reshape(batch, -1)
    counts = torch.zeros(batch, num_experts, dtype=torch.int64, device=experts.device)
    return counts.scatter_add_(1, chosen, torch.ones_like(chosen))


def load_balancing_loss(
    scores: Tensor, experts: Tensor, num_experts: int, counts: Tensor | None = None
) -> Tensor:
    """``E * sum_i f_i * P_i`` over the tokens of ``scores [T, E]`` / ``experts [T, k]``.

    counts: ``[E]`` assignments per expert over the *whole* micro-batch when this
      rank holds only part of its tokens (context parallel: ``tokens_per_expert``
      summed over cp); None: those of ``experts``. ``f = counts / counts.sum()``
      is then the micro-batch's, while ``P`` stays the mean over this rank's
      tokens: the result is this rank's contribution, and the mean of the
      contributions of ranks holding equal shares is the one-process loss (its
      gradient, summed over them, is ``cp`` times the one-process one, the scale
      the main loss's gradient has on each cp rank).
    """
    if counts is None:
        counts = tokens_per_expert(experts, num_experts)
    f = counts.to(scores.dtype) / counts.sum().clamp(min=1)
    p = scores.mean(0)
    return num_experts * (f * p).sum()


def sequence_load_balancing_loss(
    scores: Tensor, experts: Tensor, num_experts: int, batch: int, counts: Tensor | None = None
) -> Tensor:
    """The balancing loss of each of ``batch`` sequences (rows are ``[b, s]`` flattened), averaged.

    counts: ``[batch, E]`` per-sequence assignments over the whole sequences
      (``sequence_tokens_per_expert`` summed over cp) when this rank holds part of
      each; the same contribution rule as ``load_balancing_loss``.
    """
    if counts is None:
        counts = sequence_tokens_per_expert(experts, num_experts, batch)
    f = counts.to(scores.dtype) / counts.sum(-1, keepdim=True).clamp(min=1)  # [b, E]
    p = scores.reshape(batch, -1, num_experts).mean(1)  # [b, E]
    return num_experts * (f * p).sum(-1).mean()


def z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2``."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def capacity_keep_mask(experts: Tensor, num_experts: int, capacity: int) -> Tensor:
    """``[T, k]`` bool: which assignments fit in ``capacity`` slots per expert.

    Priority is deterministic and needs nothing but ``experts``: all first
    choices before any second choice (GShard), and within one choice rank,
    earlier tokens first. So any layout that routes the same micro-batch keeps
    the same assignments.
    """
    order = experts.t().reshape(-1)  # choice-major: slot 0 of every token, then slot 1, ...
    by_expert = torch.argsort(order, stable=True)  # grouped by expert, arrival order kept
    counts = torch.bincount(order, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    position = torch.empty_like(order)  # 0-based arrival index of each assignment at its expert
    position[by_expert] = (
        torch.arange(order.numel(), device=order.device) - starts[order[by_expert]]
    )
    return (position < capacity).reshape(experts.t().shape).t().contiguous()


@torch.no_grad()
def update_bias(bias: Tensor, load: Tensor, rate: float) -> None:
    """Aux-loss-free step: raise the bias of under-loaded experts, lower overloaded ones.

    ``bias += rate * sign(mean(load) - load)`` (DeepSeek-V3, section 2.1.2).
    """
    load = load.to(device=bias.device, dtype=torch.float64)
    bias.add_(rate * torch.sign(load.mean() - load).to(bias.dtype))


class AttachAuxLoss(torch.autograd.Function):
    """Returns ``x`` unchanged; in backward feeds ``scale`` as the gradient of ``loss``.

    This puts an auxiliary loss into the backward pass without adding it to the
    model's returned loss (Megatron's MoEAuxLossAutoScaler): ``d(total)/d(loss) = scale``.
    """

    @staticmethod
    def forward(ctx, x: Tensor, loss: Tensor, scale: float):
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (loss,) = ctx.saved_tensors
        return grad, torch.full_like(loss, ctx.scale), None
