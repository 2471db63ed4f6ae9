"""The T5 model's configuration (Raffel et al. 2020, the v1.1 architecture): sizes, the
relative position buckets, the LM head switch and the span-corruption task.

T5 v1.1 small is ``hidden_size=512, encoder_layers=8, decoder_layers=8, num_heads=6,
head_dim=64, ffn_hidden_size=1024``; the defaults here are a small model for tests.
The architecture is fixed where v1.1 fixes it: RMS norms without bias before each
sub-layer, no biases anywhere, a gated-GELU feed-forward (tanh GELU), relative
position biases (bidirectional buckets in the encoder, causal in the decoder) and
no absolute positions. ``tie_embeddings`` switches the LM head between v1.1's own
weight and the original T5's shared embedding (then the decoder output is scaled
by ``hidden_size ** -0.5`` first).

The encoder and decoder layers form one stack for the pipeline: ``num_layers`` is
their sum (it is derived; set ``encoder_layers`` and ``decoder_layers``), and the
encoder's layers come first (``layers.0`` .. ``layers.{E-1}``, then the decoder's).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mtcore.models.family import FamilyConfig
from mtcore.parallel.layout import LayoutError, LayoutSpec
from mtcore.parallel.pipeline.split import SplitError, encoder_decoder_counts

_STRUCTURE = (
    "family",
    "vocab_size",
    "hidden_size",
    "encoder_layers",
    "decoder_layers",
    "num_heads",
    "head_dim",
    "ffn_size",
    "relative_buckets",
    "tie_embeddings",
)


class T5Config(FamilyConfig):
    """An encoder-decoder trained on span corruption.

    ``seq_len`` is the encoder's input length and ``decoder_seq_len`` the decoder's
    (None: what span corruption of a ``seq_len`` input needs, see
    ``mtcore.models.t5.spans.span_lengths``).
    """

    family: Literal["t5"] = "t5"
    hidden_size: int = Field(128, ge=2, description="d_model")
    encoder_layers: int = Field(2, ge=1)
    decoder_layers: int = Field(2, ge=1)
    num_layers: int = Field(4, ge=2, description="derived: encoder_layers + decoder_layers")
    num_heads: int = Field(4, ge=1)
    head_dim: int | None = Field(None, ge=1, description="d_kv; None: hidden_size / num_heads")
    ffn_hidden_size: int | None = Field(None, ge=1, description="d_ff; None: 2h (v1.1 small)")
    seq_len: int = Field(128, ge=2, description="encoder input length")
    decoder_seq_len: int | None = Field(None, ge=2, description="None: span corruption's need")
    relative_buckets: int = Field(32, ge=2, description="relative_attention_num_buckets")
    relative_max_distance: int = Field(128, ge=2, description="relative_attention_max_distance")
    feed_forward: Literal["gated-gelu"] = Field("gated-gelu", description="v1.1's FFN only")
    tie_embeddings: bool = Field(False, description="original T5's tied head (d^-0.5 rescale)")
    norm_eps: float = Field(1e-6, gt=0)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    attention_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="attention-probability dropout (HF: dropout_rate)"
    )
    init_factor: float = Field(1.0, gt=0, description="HF's initializer_factor")
    recompute: Literal["none", "full", "selective"] = "none"
    pipeline_split_rank: int | None = Field(
        None, ge=1, description="virtual stages holding the encoder (None: an even split)"
    )
    noise_density: float = Field(0.15, gt=0.0, lt=1.0, description="share of tokens corrupted")
    mean_span_length: float = Field(3.0, ge=1.0, description="mean corrupted span length")

    @model_validator(mode="before")
    @classmethod
    def _derive_num_layers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        enc = data.get("encoder_layers", cls.model_fields["encoder_layers"].default)
        dec = data.get("decoder_layers", cls.model_fields["decoder_layers"].default)
        if isinstance(enc, int) and isinstance(dec, int) and not isinstance(enc, bool):
            given = data.get("num_layers")
            if given is not None and given != enc + dec:
                raise ValueError(
                    f"num_layers={given} is derived for T5: it must be encoder_layers + "
                    f"decoder_layers = {enc} + {dec} = {enc + dec} (set those two instead)"
                )
            data = {**data, "num_layers": enc + dec}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> T5Config:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "set head_dim"
            )
        from mtcore.data import DataError
        from mtcore.models.t5.spans import span_lengths

        try:  # lengths the data cannot fill are refused here, before any process starts
            need = span_lengths(
                self.seq_len, self.noise_density, self.mean_span_length, self.decoder_seq_len
            )
        except DataError as e:
            raise ValueError(str(e)) from None
        if self.decoder_seq_len is None:
            object.__setattr__(self, "decoder_seq_len", need.decoder_len)
        return self

    # -- what the shared layers (mtcore.models.common.layers) read --------------------------
    @property
    def kv_dim(self) -> int:
        """d_kv: the width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 2 * self.hidden_size

    @property
    def norm(self) -> str:
        return "rmsnorm"

    @property
    def bias(self) -> bool:
        return False

    @property
    def scaled_init(self) -> bool:
        return False

    @property
    def template_layers(self) -> int:
        """Encoder and decoder blocks differ: every layer stands for itself."""
        return self.num_layers

    def template_layer(self, index: int) -> int:
        return index

    # -- the family's answers ----------------------------------------------------------
    def num_params(self, active: bool = False) -> int:
        """Every parameter (a tied head counted once); ``active`` changes nothing."""
        h, f, v = self.hidden_size, self.ffn_size, self.vocab_size or 0
        inner = self.num_heads * self.kv_dim
        attention = 4 * h * inner
        ffn = 3 * h * f
        encoder = self.encoder_layers * (attention + ffn + 2 * h)
        decoder = self.decoder_layers * (2 * attention + ffn + 3 * h)
        biases = 2 * self.relative_buckets * self.num_heads
        head = 0 if self.tie_embeddings else v * h
        return v * h + encoder + decoder + 2 * h + biases + head

    def flops_per_step(self, global_batch: int) -> float:
        """Model FLOPs of one iteration (forward + backward, no recompute): 6 per token
        and weight it multiplies (encoder weights over the encoder tokens; decoder
        weights and the LM head over the decoder tokens; the cross-attention's key and
        value projections over the encoder tokens), plus the attention products
        (``12 s_q s_k d_inner`` per sequence and attention)."""
        h, f, v = self.hidden_size, self.ffn_size, self.vocab_size or 0
        se, sd, inner = self.seq_len, self.decoder_seq_len, self.num_heads * self.kv_dim
        attention, ffn = 4 * h * inner, 3 * h * f
        enc_tokens = self.encoder_layers * (attention + ffn) + self.decoder_layers * 2 * h * inner
        dec_tokens = self.decoder_layers * (2 * h * inner + attention + ffn) + v * h
        weights = 6.0 * (se * enc_tokens + sd * dec_tokens)
        products = (
            12.0
            * inner
            * (self.encoder_layers * se * se + self.decoder_layers * (sd * sd + sd * se))
        )
        return global_batch * (weights + products)

    def describe(self) -> str:
        head = "tied head" if self.tie_embeddings else "untied head"
        return (
            f"T5 {self.num_params() / 1e6:.2f}M params, {self.encoder_layers}+"
            f"{self.decoder_layers} layers, hidden {self.hidden_size}, vocab {self.vocab_size}, "
            f"seq {self.seq_len}->{self.decoder_seq_len}, {head}"
        )

    def structure(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _STRUCTURE}

    def numerics(self) -> dict[str, Any]:
        names = (
            "norm_eps",
            "dropout",
            "attention_dropout",
            "relative_max_distance",
            "noise_density",
            "mean_span_length",
        )
        return {name: getattr(self, name) for name in names}

    def stage_counts(self, pp: int, vpp: int = 1) -> list[int]:
        """Layers per virtual stage (the encoder's first), or SplitError naming the numbers."""
        return encoder_decoder_counts(
            self.encoder_layers, self.decoder_layers, pp, vpp, self.pipeline_split_rank
        )

    def _check_context_parallel(self, spec: LayoutSpec) -> None:
        """cp > 1: all-gather attention (the relative position bias is added to the scores
        outside the kernel op, which ring and a2a call), no attention dropout (its mask
        hashes local coordinates), and both lengths split into ``2 * cp`` chunks."""
        if spec.cp_method != "allgather":
            raise LayoutError(
                f"T5 under cp={spec.cp} attends by all-gather of K/V (its relative position "
                f"bias is not an argument of the kernel op that cp_method {spec.cp_method} "
                "calls); set parallel.cp_method: allgather"
            )
        if self.attention_dropout > 0:
            raise LayoutError(
                f"attention_dropout={self.attention_dropout} under cp={spec.cp} is not built "
                "(its mask hashes local query/key coordinates); use cp=1"
            )
        chunks = 2 * spec.cp
        for name, length in (("seq_len", self.seq_len), ("decoder_seq_len", self.decoder_seq_len)):
            if length % chunks:
                raise LayoutError(
                    f"{name}={length} is not divisible by 2*cp = {chunks} (context parallel "
                    "splits the encoder and decoder sequences into 2*cp chunks each); set "
                    f"model.{name}: {-(-length // chunks) * chunks}"
                )

    def check_layout(self, spec: LayoutSpec) -> None:
        """Reject a layout this model cannot be split by, naming the numbers (LayoutError)."""
        if spec.ep > 1:
            raise LayoutError(f"ep={spec.ep} splits mixture-of-experts layers, but T5 is dense")
        if spec.cp > 1:
            self._check_context_parallel(spec)
        if spec.uneven:
            raise LayoutError(
                "first_stage_layers / last_stage_layers: T5 splits its stages by "
                "model.pipeline_split_rank (encoder and decoder evenly), not by these"
            )
        spec.check_model(num_heads=self.num_heads, vocab_size=self.vocab_size, seq_len=self.seq_len)
        if spec.sequence_parallel and self.decoder_seq_len % (spec.tp * spec.cp):
            raise LayoutError(
                f"decoder sequence length {self.decoder_seq_len} is not divisible by "
                f"tp*cp = {spec.tp}*{spec.cp} (sequence parallel)"
            )
        if self.ffn_size % spec.tp:
            raise LayoutError(f"ffn_hidden_size={self.ffn_size} is not divisible by tp={spec.tp}")
        try:
            counts = self.stage_counts(spec.pp, spec.vpp)
        except SplitError as e:
            raise LayoutError(str(e)) from None
        stages = spec.pp * spec.vpp
        if self.pipeline_split_rank is not None and self.num_layers % stages:
            raise LayoutError(
                f"pipeline_split_rank={self.pipeline_split_rank} gives stages {counts} layers, "
                f"but the trainer's batch check needs the {self.num_layers} layers divisible by "
                f"pp*vpp = {spec.pp}*{spec.vpp} = {stages}"
            )
