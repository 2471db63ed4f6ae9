"""What the planner needs to know of a model: its transformer blocks, embedding and head.

Families are read through the seam only (a ``FamilyConfig`` instance, its fields and
its ``num_params``/``flops_per_step``); the per-family shape is written here, keyed by
``config.family``. A family with no entry here is "not modelled": ``model_shape``
raises ``NotModelled`` naming it, rather than guessing.

Parameters that do not train (a frozen part of a vision-language model) are held as
weights only: the trainer gives them no gradient buffer, master weight, optimizer
state or data-parallel reduction (``requires_grad`` is off). ``stage_params`` says
how many of each one tensor-parallel rank of a pipeline stage holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace


class NotModelled(ValueError):
    """The planner has no shape for this family (the message names it)."""


BACKWARDS = ("full", "input", "none")


@dataclass(frozen=True)
class Block:
    """One transformer layer, per sequence. ``seq``: its query tokens; ``kv_seq``: the
    keys each query attends to; ``cross_seq``: the encoder tokens a cross-attention
    reads (0: none). A mixture-of-experts layer has ``experts > 0`` and ``ffn == 0``
    unless it also has a dense shared expert (``shared_ffn``).

    ``backward``: what the layer's backward computes. ``full``: its weights' and its
    input's gradients; ``input``: its input's only (frozen weights that a trained part
    before them needs the gradient through); ``none``: nothing (frozen, and run under
    ``no_grad``: it keeps no activations)."""

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

    def __post_init__(self):
        if self.backward not in BACKWARDS:
            raise ValueError(f"Block.backward must be one of {BACKWARDS}, not {self.backward!r}")

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
        one = self.hidden * (self.q_width + 2 * self.kv_width) + self.q_width * self.hidden
        return one * (2 if self.cross_seq else 1)

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
        weights = 2.0 * self.seq * self.active_weights()
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
    model)."""

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

    def counts(self, pp: int, vpp: int) -> list[int]:
        """Layers per virtual stage, index ``chunk * pp + rank`` (the trainer's order)."""
        if self.stage_counts is not None:
            return list(self.stage_counts(pp, vpp))
        stages = pp * vpp
        return [len(self.blocks) // stages] * stages


def _even_counts(num_layers: int) -> Callable[[int, int], list[int]]:
    from mtcore.parallel.pipeline.split import layer_counts

    return lambda pp, vpp: layer_counts(num_layers, pp, vpp)


def _vocab(config) -> int:
    if config.vocab_size is None:
        raise NotModelled("model.vocab_size is unset; set it (or data.vocab_size) to plan")
    return config.vocab_size


def _gpt(config) -> ModelShape:
    h, s, v = config.hidden_size, config.seq_len, _vocab(config)
    moe = config.moe
    blocks = []
    for i in range(config.num_layers):
        common = dict(
            seq=s,
            kv_seq=s,
            hidden=h,
            heads=config.num_heads,
            kv_heads=config.kv_heads,
            head_dim=config.head_dim,
            gated=config.activation == "swiglu",
            dropout=config.dropout > 0,
        )
        if moe is not None and i % config.moe_layer_freq == 0:
            blocks.append(
                Block(
                    **{**common, "gated": moe.activation == "swiglu"},
                    ffn=0,
                    experts=moe.num_experts,
                    top_k=moe.top_k,
                    expert_ffn=moe.ffn_size,
                    shared_ffn=moe.shared_ffn_size,
                )
            )
        else:
            blocks.append(Block(**common, ffn=config.ffn_size))
    positions = s * h if config.position == "learned" else 0
    return ModelShape(
        family="gpt",
        blocks=tuple(blocks),
        vocab=v,
        hidden=h,
        seq_len=s,
        head_seq=s,
        embed_params=v * h + positions,
        head_params=0 if config.tie_embeddings else v * h,
        head_dense=0,
        tied=config.tie_embeddings,
        recompute=config.recompute,
        total_params=config.num_params(),
        stage_counts=_even_counts(config.num_layers),
    )


def _bert(config) -> ModelShape:
    h, s, v = config.hidden_size, config.seq_len, _vocab(config)
    block = Block(
        seq=s,
        kv_seq=s,
        hidden=h,
        heads=config.num_heads,
        kv_heads=config.kv_heads,
        head_dim=config.head_dim,
        ffn=config.ffn_size,
        gated=False,
        dropout=config.dropout > 0,
    )
    return ModelShape(
        family="bert",
        blocks=(block,) * config.num_layers,
        vocab=v,
        hidden=h,
        seq_len=s,
        head_seq=s,
        embed_params=(v + s + config.type_vocab_size) * h,
        head_params=h * h,
        head_dense=h,
        tied=True,
        recompute=getattr(config, "recompute", "none"),
        total_params=config.num_params(),
        stage_counts=_even_counts(config.num_layers),
    )


def _t5(config) -> ModelShape:
    h, v = config.hidden_size, _vocab(config)
    se, sd = config.seq_len, config.decoder_seq_len
    common = dict(
        hidden=h,
        heads=config.num_heads,
        kv_heads=config.num_heads,
        head_dim=config.kv_dim,
        ffn=config.ffn_size,
        gated=True,
        dropout=config.dropout > 0,
    )
    encoder = [Block(seq=se, kv_seq=se, **common)] * config.encoder_layers
    decoder = [Block(seq=sd, kv_seq=sd, cross_seq=se, **common)] * config.decoder_layers
    return ModelShape(
        family="t5",
        blocks=tuple(encoder + decoder),
        vocab=v,
        hidden=h,
        seq_len=se,
        head_seq=sd,
        embed_params=v * h,
        head_params=0 if config.tie_embeddings else v * h,
        head_dense=0,
        tied=config.tie_embeddings,
        recompute=getattr(config, "recompute", "none"),
        total_params=config.num_params(),
        stage_counts=config.stage_counts,
    )


def _llava(config) -> ModelShape:
    """LLaVA: the vision tower's ViT blocks, then the GPT's, the tower on the first stage.

    Each sample carries ``images.max_images`` image slots (unused ones are computed
    too), and each image is one sequence of patches (plus the class token) through
    the tower: a tower block has ``seq = max_images x tower tokens`` queries, each
    attending to one image's ``kv_seq`` tokens. The language model's ``seq_len``
    already counts the image tokens. The patch embedding, positions and projector
    are replicated over tp (``first_stage_params``, their products
    ``first_stage_flops``).
    """
    v = config.vision
    language = _gpt(config)
    frozen_vision, frozen_language = config.frozen("vision"), config.frozen("language")
    tower = Block(
        seq=config.images.max_images * v.seq_len,
        kv_seq=v.seq_len,
        hidden=v.hidden_size,
        heads=v.num_heads,
        kv_heads=v.kv_heads,
        head_dim=v.head_dim,
        ffn=v.ffn_size,
        gated=False,
        dropout=False,
        backward="none" if frozen_vision else "full",  # a frozen tower runs under no_grad
    )
    # A frozen language model still passes the gradient back to the projector (LLaVA's
    # stage 1); a whole frozen front is refused by the config.
    lm_backward = "input" if frozen_language else "full"
    h = v.hidden_size
    embedding = v.channels * v.patch_size**2 * h + (h if v.patch_bias else 0)
    embedding += v.seq_len * h + (h if v.class_token else 0) + (2 * h if v.pre_norm else 0)
    projector = config.projector_params()
    vision_params = embedding  # the blocks' biases and norms are left out, as for the GPT's
    frozen = (vision_params if frozen_vision else 0) + (
        projector if config.frozen("projector") else 0
    )
    # The patch embedding's and projector's products, per sequence: 3 passes trained, 2
    # frozen but passing the gradient back to a trained part before them, 1 under no_grad.
    images = config.images.max_images
    patch = images * v.seq_len * 2.0 * v.channels * v.patch_size**2 * h
    patch *= 1 if frozen_vision else 3
    projector_passes = 3 if not config.frozen("projector") else 1 if frozen_vision else 2
    projector_flops = images * v.num_features * 2.0 * projector * projector_passes
    split = _even_counts(config.num_layers)

    def counts(pp: int, vpp: int) -> list[int]:
        out = list(split(pp, vpp))
        out[0] += v.num_layers  # the tower sits on virtual stage 0, before the first layers
        return out

    return replace(
        language,
        family="llava",
        blocks=(tower,) * v.num_layers
        + tuple(replace(b, backward=lm_backward) for b in language.blocks),
        stage_counts=counts,
        first_stage_params=vision_params + projector,
        first_stage_frozen=frozen,
        first_stage_flops=patch + projector_flops,
        embed_frozen=frozen_language,
    )


SHAPES: dict[str, Callable] = {"gpt": _gpt, "bert": _bert, "t5": _t5, "llava": _llava}
"""family name -> ``config -> ModelShape``; families not here are not modelled."""


def model_shape(config) -> ModelShape:
    """The planner's view of a ``FamilyConfig``, or ``NotModelled`` naming the family."""
    make = SHAPES.get(config.family)
    if make is None:
        raise NotModelled(
            f"the planner does not model the {config.family!r} family yet (it models: "
            f"{', '.join(sorted(SHAPES))}); its memory and step time are not predicted"
        )
    return make(config)


@dataclass(frozen=True)
class StageParams:
    """Parameters one tp rank of a pipeline stage holds. ``trained``: dense weights with
    gradients, master weights and optimizer state, reduced over dp x cp; ``experts``:
    trained routed experts (over tp x ep, reduced over their edp group); ``frozen``:
    weights only."""

    trained: float
    experts: float
    frozen: float


def stage_params(shape: ModelShape, blocks, tp: int, ep: int, pp: int, first: bool, last: bool):
    """``StageParams`` of a pipeline rank whose chunks hold ``blocks`` (``((block, how
    many), ...)``, as the planner groups them): blocks sharded over tp (experts over
    tp x ep), the embedding on the first stage and the head on the last sharded over tp
    (a tied embedding on both when pp > 1), ``first_stage_params`` whole."""
    trained = sum(
        n * (b.attention_weights() + b.dense_mlp_weights()) for b, n in blocks if not b.frozen
    )
    frozen = sum(n * (b.attention_weights() + b.dense_mlp_weights()) for b, n in blocks if b.frozen)
    experts = sum(n * b.expert_weights() for b, n in blocks if not b.frozen) / (tp * ep)
    frozen_experts = sum(n * b.expert_weights() for b, n in blocks if b.frozen) / (tp * ep)
    ends = 0.0
    if first:
        ends += shape.embed_params
    if last:
        ends += shape.head_params + (shape.embed_params if shape.tied and pp > 1 else 0)
    trained, frozen = trained / tp, frozen / tp + frozen_experts
    if shape.embed_frozen:
        frozen += ends / tp
    else:
        trained += ends / tp
    if first:
        trained += shape.first_stage_params - shape.first_stage_frozen
        frozen += shape.first_stage_frozen
    return StageParams(trained=trained, experts=experts, frozen=frozen)
