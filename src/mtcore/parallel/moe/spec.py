"""What a mixture-of-experts layer is: its settings (``MoESpec``), read with a config
without torch (the layer's load statistics, ``MoEStats``, are ``layer``'s).

The spec is a frozen pydantic model so a bad setting fails when the config is
read, naming the number, not deep inside a forward. ``check(ep, tp)`` adds the
layout-dependent checks (experts over ep, hidden sizes over tp).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from mtcore.parallel.settings import Settings


class MoESpec(Settings):
    """Settings of one MoE layer (router, dispatch, experts).

    num_experts, top_k: routed experts and how many each token picks.
    ffn_size: hidden size of each routed expert; shared_ffn_size: of the shared
      expert (0: none), a dense MLP every token goes through, added to the output.
    score: "softmax" (Mixtral, Switch) or "sigmoid" (DeepSeek-V3) router scores.
    topk_then_softmax: softmax over the k chosen logits only (Mixtral's order);
      otherwise scores over all experts first, then top-k (Switch/GShard order).
    norm_topk: rescale the k chosen weights to sum to 1 (only when top_k > 1: a
      single weight rescaled to 1 would leave the router no gradient from the loss).
    aux_loss: load-balancing loss E * sum_i f_i P_i over the micro-batch ("batch")
      or averaged over its sequences ("seq"), or "none".
    z_loss_coeff: router z-loss mean(logsumexp(logits)^2) (ST-MoE).
    bias_update_rate: > 0 turns on auxiliary-loss-free balancing: a per-expert
      bias added to the scores for the top-k choice only (DeepSeek-V3).
    expert_groups, top_groups: group-limited routing (DeepSeek-V3's n_group,
      topk_group): the experts form ``expert_groups`` equal groups, each scored by
      the sum of its two best choice scores, and a token picks its ``top_k`` among
      the ``top_groups`` best groups only (None: all groups).
    routed_scale: multiplies the routed experts' combine weights (DeepSeek's
      routed_scaling_factor), after ``norm_topk``.
    capacity_factor: None is dropless; otherwise each expert takes at most
      ceil(factor * tokens * top_k / num_experts) assignments per micro-batch.
    dispatcher: how tokens reach experts on other ranks of the expert group:
      "alltoall" (one row per assignment), "alltoall_dedup" (one row per token
      and destination rank) or "allgather".
    """

    num_experts: int = Field(ge=1)
    top_k: int = Field(2, ge=1)
    ffn_size: int = Field(ge=1)
    activation: Literal["swiglu", "gelu"] = "swiglu"
    score: Literal["softmax", "sigmoid"] = "softmax"
    topk_then_softmax: bool = False
    norm_topk: bool = True
    aux_loss: Literal["none", "batch", "seq"] = "batch"
    aux_loss_coeff: float = Field(1e-2, ge=0.0)
    z_loss_coeff: float = Field(0.0, ge=0.0)
    bias_update_rate: float = Field(0.0, ge=0.0)
    expert_groups: int = Field(1, ge=1)
    top_groups: int | None = Field(None, ge=1)
    routed_scale: float = Field(1.0, gt=0.0)
    capacity_factor: float | None = Field(None, gt=0.0)
    dispatcher: Literal["alltoall", "alltoall_dedup", "allgather"] = "alltoall"
    shared_ffn_size: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _consistent(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} is larger than num_experts={self.num_experts}")
        if self.topk_then_softmax and self.score != "softmax":
            raise ValueError("topk_then_softmax needs score='softmax'")
        if self.num_experts % self.expert_groups:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by expert_groups={self.expert_groups}"
            )
        groups = self.top_groups or self.expert_groups
        if groups > self.expert_groups:
            raise ValueError(
                f"top_groups={groups} is larger than expert_groups={self.expert_groups}"
            )
        if groups * (self.num_experts // self.expert_groups) < self.top_k:
            raise ValueError(
                f"top_groups={groups} groups of {self.num_experts // self.expert_groups} experts "
                f"hold fewer than top_k={self.top_k}"
            )
        return self

    def check(self, ep: int, tp: int, cp: int = 1) -> None:
        """Raise ValueError if this layer cannot be split over ``ep`` x ``tp`` ranks with
        its sequences split over ``cp`` ranks."""
        if cp > 1 and self.capacity_factor is not None:
            raise ValueError(
                f"capacity_factor={self.capacity_factor} with context parallel cp={cp}: "
                "capacity dropping ranks the assignments of the whole micro-batch, but a cp "
                "rank routes only its share of each sequence, so it would drop other "
                "assignments than one process; use capacity_factor=None (dropless) with cp"
            )
        if self.num_experts % ep:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel "
                f"size ep={ep}"
            )
        if self.ffn_size % tp:
            raise ValueError(f"expert ffn_size={self.ffn_size} is not divisible by tp={tp}")
        if self.shared_ffn_size % tp:
            raise ValueError(f"shared_ffn_size={self.shared_ffn_size} is not divisible by tp={tp}")

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert may take from ``tokens`` tokens (None: dropless)."""
        return expert_capacity(tokens, self.num_experts, self.top_k, self.capacity_factor)


def expert_capacity(tokens: int, num_experts: int, top_k: int, factor: float | None) -> int | None:
    """``ceil(factor * tokens * top_k / num_experts)``; None when ``factor`` is None."""
    if factor is None:
        return None
    return math.ceil(factor * tokens * top_k / num_experts)
