"""The decoder-only transformer's configuration: sizes and the architecture switches,
validated up front (the GPT family's ``GPTConfig`` and LLaVA's language model are it).

Two families share one model, chosen by ``style``, which fills in the switches the
user did not set:

=================  =========================  ==============================
switch             ``llama`` (default)        ``gpt2``
=================  =========================  ==============================
norm               RMSNorm                    LayerNorm
activation         SwiGLU                     GELU (tanh approximation)
position           rotary (RoPE)              learned absolute embeddings
tie_embeddings     False                      True
bias               False                      True
=================  =========================  ==============================

Grouped-query attention is ``num_kv_heads < num_heads`` in either style.

Mixture of experts (Mixtral-style): ``moe`` (a ``MoESpec``: experts, top-k, expert
size, router and dispatch settings) puts a MoE layer in place of the MLP of every
``moe_layer_freq``-th layer (layers 0, k, 2k, ...; 1: every layer). Its
``activation`` defaults to the model's.

DeepSeek-style models (DeepSeek-V2/V3): ``mtp`` (an ``MTPSpec``) adds multi-token
prediction modules on the last stage (``mtcore.models.common.decoder.mtp``); ``mla`` (an ``MLASpec``) puts multi-head latent
attention in place of grouped-query attention in every layer
(``mtcore.models.common.latent_attention``); ``first_dense_layers`` keeps a dense MLP
in the first k layers of a MoE model (DeepSeek's ``first_k_dense_replace``); the
DeepSeek router (sigmoid scores, group-limited choice, routed scaling, shared experts)
is ``moe``'s.

Pretrained-checkpoint switches (each off by default, which is the model above):
``head_size`` (a head size of its own, as Llama 3.2 / Mistral Nemo have; None:
hidden / heads), ``qkv_bias`` (biases on q, k and v only: Qwen2), ``qk_norm`` (an RMSNorm
over each query and key head before RoPE: Qwen3), ``rope_scaling`` (Llama 3.1's
``llama3`` frequency scaling, or YaRN's ``yarn``) and ``sliding_window`` (Mistral's:
each query attends the ``sliding_window`` keys ending at its own position; at
``seq_len <= sliding_window`` the window hides nothing).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_validator

from mtcore.models.common.decoder.mtp_spec import MTPSpec
from mtcore.models.common.latent_spec import MLASpec
from mtcore.models.common.layout_checks import check_block_split
from mtcore.models.family import FamilyConfig
from mtcore.parallel.layout import LayoutError, LayoutSpec
from mtcore.parallel.moe import MoESpec
from mtcore.parallel.settings import Settings

STYLES: dict[str, dict[str, Any]] = {
    "llama": dict(
        norm="rmsnorm", activation="swiglu", position="rope", tie_embeddings=False, bias=False
    ),
    "gpt2": dict(
        norm="layernorm", activation="gelu", position="learned", tie_embeddings=True, bias=True
    ),
}


# Fields that decide which parameters exist and their shapes (the load-time check).
_STRUCTURE = (
    "family",
    "style",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "kv_heads",
    "ffn_size",
    "norm",
    "activation",
    "position",
    "tie_embeddings",
    "bias",
    "moe_layer_freq",
    "head_dim",
    "qkv_bias",
    "qk_norm",
    "mla",
    "first_dense_layers",
    "mtp_depth",
)
_MOE_STRUCTURE = ("num_experts", "ffn_size", "shared_ffn_size", "activation")


class RopeScaling(Settings):
    """RoPE frequency scaling: Llama 3.1's (``rope_type: llama3``) or YaRN (``yarn``).

    llama3: wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor`` are stretched by ``factor``, those shorter than ``... /
    high_freq_factor`` kept, and the band between interpolated smoothly.
    yarn (Peng et al. 2023): frequencies that turn more than ``beta_fast`` times over
    the original length are kept, fewer than ``beta_slow`` times divided by
    ``factor``, a linear ramp between; cos/sin are multiplied by an attention factor
    from ``mscale``/``mscale_all_dim``, and multi-head latent attention multiplies its
    softmax scale by ``mscale(mscale_all_dim)^2`` (``mtcore.models.common.decoder.rope``).
    """

    rope_type: Literal["llama3", "yarn"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float | None = Field(None, gt=0, description="llama3 only")
    high_freq_factor: float | None = Field(None, gt=0, description="llama3 only")
    original_max_position_embeddings: int = Field(ge=1)
    beta_fast: float = Field(32.0, gt=0, description="yarn only")
    beta_slow: float = Field(1.0, gt=0, description="yarn only")
    mscale: float = Field(1.0, ge=0, description="yarn only")
    mscale_all_dim: float = Field(0.0, ge=0, description="yarn only")

    @model_validator(mode="after")
    def _bands(self) -> RopeScaling:
        if self.rope_type == "yarn":
            return self
        if self.low_freq_factor is None or self.high_freq_factor is None:
            raise ValueError(
                "rope_scaling of type llama3 needs low_freq_factor and high_freq_factor"
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling: high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        return self


class DecoderConfig(FamilyConfig):
    """A decoder-only transformer. ``vocab_size=None`` is filled in from the tokenizer.

    A family's config subclasses it with its ``family`` (the GPT family's ``GPTConfig``,
    LLaVA's ``LlavaConfig``)."""

    style: Literal["llama", "gpt2"] = "llama"
    hidden_size: int = Field(256, ge=2)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int | None = Field(None, ge=1, description="None: num_heads (no GQA)")
    ffn_hidden_size: int | None = Field(None, ge=1, description="None: 4h (gelu), ~8h/3 (swiglu)")
    seq_len: int = Field(256, ge=1, description="longest sequence (positions, RoPE table)")
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    norm_eps: float = Field(1e-5, gt=0)
    activation: Literal["swiglu", "gelu"] = "swiglu"
    gelu_approximate: Literal["tanh", "none"] = Field(
        "tanh", description="GELU: tanh approximation (GPT-2) or exact erf (Megatron's default)"
    )
    position: Literal["rope", "learned"] = "rope"
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = Field(None, description="None: plain RoPE")
    head_size: int | None = Field(None, ge=1, description="None: hidden_size / num_heads")
    qkv_bias: bool = Field(False, description="biases on q, k, v only (Qwen2)")
    qk_norm: bool = Field(False, description="RMSNorm of each q and k head before RoPE (Qwen3)")
    sliding_window: int | None = Field(None, ge=1, description="keys per query (Mistral)")
    tie_embeddings: bool = False
    bias: bool = False
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="on attention probs")
    init_std: float = Field(0.02, gt=0)
    scaled_init: bool = Field(True, description="output projections get std / sqrt(2 layers)")
    recompute: Literal["none", "full", "selective"] = "none"
    moe: MoESpec | None = Field(None, description="mixture of experts in place of the MLP")
    moe_layer_freq: int = Field(1, ge=1, description="MoE in layers 0, k, 2k, ... (1: all)")
    first_dense_layers: int = Field(0, ge=0, description="the first k layers keep a dense MLP")
    mla: MLASpec | None = Field(None, description="multi-head latent attention (DeepSeek)")
    mtp: MTPSpec | None = Field(None, description="multi-token prediction modules (DeepSeek-V3)")

    @model_validator(mode="before")
    @classmethod
    def _apply_style(cls, data: Any) -> Any:
        if isinstance(data, dict):
            style = data.get("style", "llama")
            if style in STYLES:
                data = {**STYLES[style], **data}
            moe = data.get("moe")
            if isinstance(moe, dict) and "activation" not in moe and "activation" in data:
                data = {**data, "moe": {**moe, "activation": data["activation"]}}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> DecoderConfig:
        if self.head_size is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads} "
                "(set head_size to give heads a size of their own)"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.kv_heads}"
            )
        if self.mla is not None and (self.position != "rope" or self.bias or self.qkv_bias):
            raise ValueError(
                "mla (multi-head latent attention) needs position='rope' and no biases"
            )
        if self.mla is not None and self.qk_norm:
            raise ValueError("qk_norm normalises grouped-query heads; mla has latent norms")
        if self.mla is not None and (self.attention_dropout or self.window_hides_keys):
            raise ValueError("mla has no attention_dropout nor a sliding_window < seq_len yet")
        if self.mla is None and self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {self.head_dim}")
        if self.rope_scaling is not None and self.position != "rope":
            raise ValueError(f"rope_scaling needs position='rope', got {self.position!r}")
        if self.moe is not None and not self.num_moe_layers:
            raise ValueError(
                f"model.moe is set but none of the {self.num_layers} layers is MoE "
                f"(first_dense_layers={self.first_dense_layers}, "
                f"moe_layer_freq={self.moe_layer_freq})"
            )
        if (
            self.moe is not None
            and self.moe.activation == "gelu"
            and self.gelu_approximate != "tanh"
        ):
            raise ValueError(
                "moe experts compute the tanh GELU: gelu_approximate 'none' is dense-only"
            )
        return self

    # -- derived sizes -------------------------------------------------------------
    @property
    def window_hides_keys(self) -> bool:
        """A ``sliding_window`` shorter than ``seq_len`` (a longer one hides nothing)."""
        return self.sliding_window is not None and self.sliding_window < self.seq_len

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_heads

    @property
    def mtp_depth(self) -> int:
        return 0 if self.mtp is None else self.mtp.depth

    @property
    def rope_dim(self) -> int:
        """The dims RoPE rotates per head: the head, or MLA's decoupled rope part."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "gelu":
            return 4 * self.hidden_size
        # Llama: 2/3 of 4h (SwiGLU has three matrices), rounded up to a multiple of 64.
        return 64 * math.ceil(8 * self.hidden_size / 3 / 64)

    # -- mixture of experts --------------------------------------------------------
    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (0-based) has a MoE layer in place of its MLP."""
        if self.moe is None or index < self.first_dense_layers:
            return False
        return index % self.moe_layer_freq == 0

    @property
    def experts(self) -> MoESpec | None:
        return self.moe

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def _mlp_params(self, ffn: int, activation: str, bias: bool) -> int:
        """Weights (and biases) of a feed-forward net of hidden size ``ffn``."""
        h, up = self.hidden_size, 2 if activation == "swiglu" else 1
        return h * ffn * up + ffn * h + (ffn * up + h if bias else 0)

    def _moe_params(self, experts: int) -> int:
        """A MoE layer's router, ``experts`` routed experts (no biases) and shared expert."""
        m = self.moe
        total = m.num_experts * self.hidden_size
        total += experts * self._mlp_params(m.ffn_size, m.activation, bias=False)
        if m.shared_ffn_size:
            total += self._mlp_params(m.shared_ffn_size, m.activation, self.bias)
        return total

    def num_params(self, active: bool = False) -> int:
        """Parameters of the whole model (a tied output weight counted once).

        active: count only what one token goes through: ``top_k`` routed experts of
        each MoE layer instead of all of them (the same number for a dense model).
        """
        h, v = self.hidden_size, self.vocab_size or 0
        qkv_rows = (self.num_heads + 2 * self.kv_heads) * self.head_dim
        norms = 2 if self.norm == "layernorm" else 1
        attention = h * qkv_rows + self.num_heads * self.head_dim * h + 2 * norms * h
        if self.mla is not None:
            attention = self.mla.num_params(h, self.num_heads) + 2 * norms * h
        if self.bias:
            attention += qkv_rows + h
        elif self.qkv_bias:
            attention += qkv_rows
        if self.qk_norm:
            attention += 2 * self.head_dim
        dense = self._mlp_params(self.ffn_size, self.activation, self.bias)
        depth = self.mtp.depth if self.mtp is not None else 0  # each a block, 3 norms, W_k
        layers = self.num_layers + depth
        moe_layers = sum(self.is_moe_layer(i) for i in range(layers))
        total = layers * attention + v * h + norms * h + depth * (3 * norms * h + 2 * h * h)
        if self.moe is not None:
            experts = self.moe.top_k if active else self.moe.num_experts
            total += moe_layers * self._moe_params(experts)
        total += (layers - moe_layers) * dense
        if self.position == "learned":
            total += self.seq_len * h
        if not self.tie_embeddings:
            total += v * h
        return total

    def flops_per_step(self, global_batch: int) -> float:
        """Model FLOPs of one iteration (forward + backward), no recompute, after
        Narayanan et al. 2021 (arXiv 2104.04473)::

            F = 72 B s l h^2 (1 + s / (6 h) + V / (12 l h))

        with B the global batch in sequences, s the sequence length, l layers, h the
        hidden size and V the vocabulary. The formula assumes a 4h MLP and as many
        key/value heads as query heads; for SwiGLU or grouped-query models it is the
        paper's count, not an exact one. A mixture-of-experts model counts the weights
        a token goes through (attention, router, top-k experts, shared expert): 6 FLOPs
        per token and weight, plus the attention scores and the logits as in the
        formula, to which this reduces for a dense 4h-MLP model.
        """
        s, layers, h, v = self.seq_len, self.num_layers, self.hidden_size, self.vocab_size
        if self.moe is None:
            return (
                72.0 * global_batch * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))
            )
        weights = self.num_params(active=True) - v * h * (1 if self.tie_embeddings else 2)
        return global_batch * s * (6.0 * weights + 12.0 * s * layers * h + 6.0 * v * h)

    def describe(self) -> str:
        return (
            f"GPT ({self.style}) {self.num_params() / 1e6:.2f}M params, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, vocab {self.vocab_size}, seq {self.seq_len}"
        )

    def structure(self) -> dict[str, Any]:
        fields = {name: getattr(self, name) for name in _STRUCTURE}
        if self.position == "learned":  # a learned position table has seq_len rows
            fields["seq_len"] = self.seq_len
        moe = self.moe
        fields["moe"] = None if moe is None else {k: getattr(moe, k) for k in _MOE_STRUCTURE}
        if self.mla is not None:
            fields["mla"] = self.mla.model_dump(exclude={"latent_norm_eps"})
        return fields

    def numerics(self) -> dict[str, Any]:
        names = (
            "rope_theta",
            "norm_eps",
            "dropout",
            "attention_dropout",
            "rope_scaling",
            "sliding_window",
            "gelu_approximate",
        )
        fields = {name: getattr(self, name) for name in names}
        if self.rope_scaling is not None:
            fields["rope_scaling"] = self.rope_scaling.model_dump()
        if self.moe is not None:  # routing options: reported, not refused
            fields["moe"] = self.moe.model_dump(exclude=set(_MOE_STRUCTURE))
        return fields

    @property
    def template_layers(self) -> int:
        """The dense first layers, then one MoE period (``is_moe_layer`` repeats every
        ``moe_layer_freq`` layers after them), then as many more as make the count
        congruent to ``num_layers``: the multi-token prediction blocks after the stack
        (layers ``num_layers + k``) are then MoE or dense as in the whole model."""
        if self.moe is None:
            return 1
        first, period = self.first_dense_layers, self.moe_layer_freq
        if self.num_layers < first + period:
            return self.num_layers
        return first + period + (self.num_layers - first - period) % period

    def template_layer(self, index: int) -> int:
        if self.moe is None:
            return 0
        first, period = self.first_dense_layers, self.moe_layer_freq
        return index if index < first + period else first + (index - first) % period

    def check_layout(self, spec: LayoutSpec) -> None:
        """Reject a layout this model cannot be split by, naming the numbers (LayoutError)."""
        if spec.ep > 1 and self.moe is None:
            raise LayoutError(
                f"ep={spec.ep} splits mixture-of-experts layers, but this model is dense "
                "(model.moe is unset); use ep=1 or set model.moe"
            )
        if spec.cp > 1 and self.attention_dropout > 0:
            raise LayoutError(
                f"attention_dropout={self.attention_dropout} under cp={spec.cp} is not built "
                "(the ring attends blocks without the op's dropout); use cp=1"
            )
        spec.check_model(
            num_heads=self.num_heads,
            num_kv_heads=self.kv_heads,
            vocab_size=self.vocab_size,
            seq_len=self.seq_len,
        )
        if self.moe is not None:
            try:
                self.moe.check(spec.ep, spec.tp, spec.cp)
            except ValueError as e:
                raise LayoutError(f"model.moe: {e}") from e
        if self.mtp is not None and spec.cp > 1:
            raise LayoutError(
                f"model.mtp (multi-token prediction) runs at cp=1 for now (it reads the whole "
                f"sequence's shifted tokens); got cp={spec.cp}"
            )
        if self.mtp is not None and spec.pp > 1 and self.tie_embeddings:
            raise LayoutError(
                f"model.mtp with tie_embeddings at pp={spec.pp}: the last stage would hold two "
                "copies of the embedding; untie it or use pp=1"
            )
        check_block_split(self.num_layers, self.ffn_size, spec)
