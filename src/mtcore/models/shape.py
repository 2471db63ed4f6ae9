"""What the planner needs to know of a model: its transformer blocks, embedding and head.

Each family describes its model this way in its ``shape`` (``ModelFamily.shape``):
the planner (``mtcore.plan``) reads only these records, never a family's config
fields. A family without a shape is "not modelled": the default ``shape`` raises
``NotModelled`` naming it, rather than the planner guessing.

Parameters that do not train (a frozen part of a vision-language model) are held as
weights only: the trainer gives them no gradient buffer, master weight, optimizer
state or data-parallel reduction (``requires_grad`` is off).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mtcore.parallel.pipeline.split import layer_counts


class NotModelled(ValueError):
    """The planner has no shape for this family (the message names it)."""


BACKWARDS = ("full", "input", "none")


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention's widths (``mtcore.models.common.latent_attention``):
    ``q_rank`` 0 for a plain query projection. The down-projections and latent norms
    are whole on every tp rank; the up-projections and output are split over heads."""

    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    v_dim: int

    @property
    def qk_dim(self) -> int:
        return self.nope + self.rope

    def norm_weights(self) -> int:
        return self.q_rank + self.kv_rank

    def replicated_weights(self, hidden: int) -> int:
        """The down-projections and latent norms (every tp rank holds them whole)."""
        return hidden * (self.q_rank + self.kv_rank + self.rope) + self.norm_weights()

    def split_weights(self, hidden: int, heads: int) -> int:
        """The query (up-)projection, the key/value up-projection and the output."""
        query = (self.q_rank or hidden) * heads * self.qk_dim
        return query + self.kv_rank * heads * (self.nope + self.v_dim) + heads * self.v_dim * hidden

    def cache_values_per_token(self) -> int:
        """A generation cache's numbers per token and layer: the latent and the rope key."""
        return self.kv_rank + self.rope


@dataclass(frozen=True)
class Block:
    """One transformer layer, per sequence. ``seq``: its query tokens; ``kv_seq``: the
    keys each query attends to; ``cross_seq``: the encoder tokens a cross-attention
    reads (0: none). A mixture-of-experts layer has ``experts > 0`` and ``ffn == 0``
    unless it also has a dense shared expert (``shared_ffn``).

    ``backward``: what the layer's backward computes. ``full``: its weights' and its
    input's gradients; ``input``: its input's only (frozen weights that a trained part
    before them needs the gradient through); ``none``: nothing (frozen, and run under
    ``no_grad``: it keeps no activations). ``cp_split``: context parallelism splits its
    sequence (False: every cp rank runs it whole, as LLaVA's vision tower).
    ``biased_attention``: the attention adds a bias to its scores outside the kernel op
    (T5's relative positions), so it keeps its fp32 probabilities ``[heads, s, keys]``
    whatever kernel the backend has."""

    seq: int
    kv_seq: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool
    dropout: bool
    cross_seq: int = 0
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    backward: str = "full"
    latent: Latent | None = None  # multi-head latent attention (``head_dim``: its kernel's)
    cp_split: bool = True
    biased_attention: bool = False

    def __post_init__(self):
        if self.backward not in BACKWARDS:
            raise ValueError(f"Block.backward must be one of {BACKWARDS}, not {self.backward!r}")

    def cp_share(self, cp: int) -> int:
        """How many ways context parallelism divides this block's sequence."""
        return cp if self.cp_split else 1

    @property
    def frozen(self) -> bool:
        """Its weights get no gradient, master copy or optimizer state."""
        return self.backward != "full"

    @property
    def keeps_activations(self) -> bool:
        return self.backward != "none"

    @property
    def passes(self) -> int:
        """Matrix-product passes per step in units of the forward: the forward, then
        the input's and the weights' gradients (each as costly as the forward)."""
        return {"full": 3, "input": 2, "none": 1}[self.backward]

    @property
    def product_passes(self) -> int:
        """The same for the attention's score products (``QK^T``, ``AV``): they have no
        weights, so their backward is whole whenever the block has one."""
        return 1 if self.backward == "none" else 3

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_weights(self) -> int:
        if self.latent is not None:
            return self.replicated_weights() + self.latent.split_weights(self.hidden, self.heads)
        one = self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden
        return one * (2 if self.cross_seq else 1)

    def replicated_weights(self) -> int:
        """Weights every tp rank holds whole (latent attention's down-projections)."""
        return 0 if self.latent is None else self.latent.replicated_weights(self.hidden)

    def tp_rank_weights(self, tp: int) -> float:
        """Attention and dense MLP weights on one tp rank (routed experts aside)."""
        split = self.attention_weights() - self.replicated_weights() + self.dense_mlp_weights()
        return split / tp + self.replicated_weights()

    def cache_values_per_token(self) -> int:
        """Numbers a generation KV cache keeps per token for this layer: keys and values
        of every key/value head, or latent attention's latent and rope key."""
        if self.latent is not None:
            return self.latent.cache_values_per_token()
        return 2 * self.kv_width

    def _mlp(self, inner: int) -> int:
        return (3 if self.gated else 2) * self.hidden * inner

    def dense_mlp_weights(self) -> int:
        """The weights every tp rank shards and dp reduces (dense MLP, shared expert, router)."""
        router = self.hidden * self.experts
        return self._mlp(self.ffn) + self._mlp(self.shared_ffn) + router

    def expert_weights(self) -> int:
        """All routed experts' weights (sharded over ep and tp, reduced over edp)."""
        return self.experts * self._mlp(self.expert_ffn)

    def weights(self) -> int:
        return self.attention_weights() + self.dense_mlp_weights() + self.expert_weights()

    def active_weights(self) -> int:
        """Weights one token is multiplied by: top_k experts instead of all."""
        routed = self.top_k * self._mlp(self.expert_ffn)
        return self.attention_weights() + self.dense_mlp_weights() + routed

    def attention_product_flops(self) -> float:
        """``QK^T`` and ``AV`` of one sequence, forward: 4 s s_kv d per head (the whole
        score matrix, as Narayanan et al. count it)."""
        flops = 4.0 * self.seq * self.kv_seq * self.q_width
        if self.cross_seq:
            flops += 4.0 * self.seq * self.cross_seq * self.q_width
        return flops

    def forward_flops(self) -> float:
        """One sequence through this layer, forward (backward is twice this)."""
        norms = 0 if self.latent is None else self.latent.norm_weights()
        weights = 2.0 * self.seq * (self.active_weights() - norms)
        if self.cross_seq:  # the cross-attention's K/V projections read the encoder tokens
            kv = 2 * self.hidden * self.kv_width
            weights += 2.0 * (self.cross_seq - self.seq) * kv
        return weights + self.attention_product_flops()


@dataclass(frozen=True)
class ModelShape:
    """A model as the planner sees it. ``blocks`` in pipeline order; ``embed_params``
    on the first stage, ``head_params`` (its weights beyond a tied embedding) on the
    last; ``head_seq`` tokens reach the head per sequence; ``recompute`` is the model's
    setting (``none`` for families that have none).

    ``first_stage_params``: more parameters on the first stage, held whole by every
    tp rank and never tied (a vision tower's patch embedding and positions, a
    projector), ``first_stage_frozen`` of them frozen; ``first_stage_flops``: their
    products' FLOPs per sequence over the whole step (forward and whatever backward they
    run); ``embed_frozen``: the embedding and head do not train (a frozen language
    model).

    ``last_blocks``: blocks the last stage runs after the pipeline's layers (DeepSeek's
    multi-token prediction modules), ``last_stage_params`` more weights there whole on
    every tp rank (their projections and norms; when pp > 1 they also read a copy of the
    embedding), ``head_passes``: how many times the output layer and loss run (once
    more per prediction module)."""

    family: str
    blocks: tuple[Block, ...]
    vocab: int
    hidden: int
    seq_len: int
    head_seq: int
    embed_params: int
    head_params: int
    head_dense: int  # an h x h transform before the output layer (BERT's MLM head)
    tied: bool
    recompute: str
    total_params: int
    stage_counts: Callable[[int, int], list[int]] = field(repr=False, default=None)
    first_stage_params: int = 0
    first_stage_frozen: int = 0
    first_stage_flops: float = 0.0
    embed_frozen: bool = False
    last_blocks: tuple[Block, ...] = ()
    last_stage_params: int = 0
    head_passes: int = 1

    def counts(
        self, pp: int, vpp: int, first: int | None = None, last: int | None = None
    ) -> list[int]:
        """Layers per virtual stage, index ``chunk * pp + rank`` (the trainer's order);
        ``first`` / ``last``: the layout's first and last stage layer counts."""
        uneven = () if first is None and last is None else (first, last)
        if self.stage_counts is not None:
            return list(self.stage_counts(pp, vpp, *uneven))
        stages = pp * vpp
        return [len(self.blocks) // stages] * stages


def even_counts(num_layers: int) -> Callable[..., list[int]]:
    """The trainer's split (``layer_counts``): even, or the layout's first/last counts."""
    return lambda pp, vpp, first=None, last=None: layer_counts(
        num_layers, pp, vpp, first=first, last=last
    )


def planned_vocab(config) -> int:
    """The vocabulary a shape is planned with (the planner fills it in from the data
    config; unset here is an error naming the key)."""
    if config.vocab_size is None:
        raise NotModelled("model.vocab_size is unset; set it (or data.vocab_size) to plan")
    return config.vocab_size
