"""Multi-head latent attention's sizes (``MLASpec``) and softmax scale, apart from the
layer (``latent_attention``): a config holds them without torch."""

from __future__ import annotations

import math

from pydantic import Field

from mtcore.parallel.settings import Settings


class MLASpec(Settings):
    """The sizes of multi-head latent attention (names as DeepSeek's configs)."""

    q_lora_rank: int | None = Field(None, ge=1, description="None: a plain query projection")
    kv_lora_rank: int = Field(ge=1)
    qk_nope_head_dim: int = Field(ge=1)
    qk_rope_head_dim: int = Field(ge=2, multiple_of=2)
    v_head_dim: int = Field(ge=1)
    latent_norm_eps: float = Field(1e-6, gt=0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def num_params(self, hidden: int, heads: int) -> int:
        """Weights of one layer's attention (projections and latent norms)."""
        qk, r = self.qk_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            query = hidden * heads * qk
        else:
            query = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * qk
        kv = (
            hidden * (r + self.qk_rope_head_dim)
            + r
            + r * heads * (self.qk_nope_head_dim + self.v_head_dim)
        )
        return query + kv + heads * self.v_head_dim * hidden

    def cache_values_per_token(self) -> int:
        """Numbers a KV cache keeps per token and layer: the latent and the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def softmax_scale(spec: MLASpec, rope_scaling) -> float:
    """``1 / sqrt(qk_head_dim)``, times ``mscale^2`` under YaRN scaling with ``mscale_all_dim``
    (``mscale = 0.1 * mscale_all_dim * ln(factor) + 1``, DeepSeek-V2's long-context rule)."""
    scale = 1.0 / math.sqrt(spec.qk_head_dim)
    all_dim = getattr(rope_scaling, "mscale_all_dim", 0.0) or 0.0
    if all_dim and rope_scaling.factor > 1:
        mscale = 0.1 * all_dim * math.log(rope_scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale
