"""The BERT model's configuration (Devlin et al. 2019): sizes, heads and pre-training task.

BERT-base is ``hidden_size=768, num_layers=12, num_heads=12, seq_len=512`` with a
30522-token WordPiece vocabulary; the defaults here are a small model for tests.
The architecture is fixed where BERT fixes it: LayerNorm after each residual add
(post-LN), exact (erf) GELU, learned absolute positions, a decoder tied to the
word embedding. ``pair_task`` picks the sentence-pair objective of the binary head
on the pooled ``[CLS]`` state: next-sentence prediction (BERT), sentence-order
prediction (ALBERT, Lan et al. 2019) or none (RoBERTa-style, MLM only: no pooler).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mtcore.models.common.layout_checks import check_block_split
from mtcore.models.family import FamilyConfig
from mtcore.parallel.layout import LayoutError, LayoutSpec

# Fields that decide which parameters exist and their shapes (the load-time check).
_STRUCTURE = (
    "family",
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "ffn_size",
    "seq_len",  # rows of the position table
    "type_vocab_size",
    "bias",
    "pair_head",
)


class BertConfig(FamilyConfig):
    """A bidirectional encoder with masked-LM and sentence-pair heads.

    ``vocab_size=None`` is filled in from the tokenizer; ``seq_len`` is the number of
    positions (BERT's ``max_position_embeddings``) and the training length.
    """

    family: Literal["bert"] = "bert"
    hidden_size: int = Field(256, ge=2)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    ffn_hidden_size: int | None = Field(None, ge=1, description="None: 4h")
    seq_len: int = Field(128, ge=1, description="positions (max_position_embeddings)")
    type_vocab_size: int = Field(2, ge=1, description="token types (segments A and B)")
    norm_eps: float = Field(1e-12, gt=0)
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="embedding and hidden dropout")
    attention_dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="attention-probability dropout (HF's 0.1)"
    )
    init_std: float = Field(0.02, gt=0)
    activation: Literal["gelu"] = Field("gelu", description="exact (erf) GELU, as BERT")
    bias: bool = Field(True, description="biases of the encoder blocks' linears")
    recompute: Literal["none", "full", "selective"] = "none"
    pair_task: Literal["nsp", "sop", "none"] = Field(
        "nsp", description="next-sentence, sentence-order, or no pair head"
    )
    mask_prob: float = Field(0.15, gt=0.0, lt=1.0, description="share of tokens masked for MLM")

    @model_validator(mode="after")
    def _check_shapes(self) -> BertConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        return self

    # -- what the shared layers (mtcore.models.common.layers) read --------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_heads  # BERT has no grouped-query attention

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def norm(self) -> str:
        return "layernorm"

    @property
    def gelu_approximate(self) -> str:
        return "none"  # BERT's GELU is the exact erf form, not GPT-2's tanh fit

    @property
    def scaled_init(self) -> bool:
        return False  # BERT draws every weight with init_std

    @property
    def pair_head(self) -> bool:
        """Whether the model has a pooler and a binary sentence-pair head."""
        return self.pair_task != "none"

    # -- the family's answers ----------------------------------------------------------
    def num_params(self, active: bool = False) -> int:
        """Parameters of the whole model; the decoder shares the word embedding's weight,
        so only its bias counts. ``active`` changes nothing (BERT is dense)."""
        h, f, v = self.hidden_size, self.ffn_size, self.vocab_size or 0
        embeddings = (v + self.seq_len + self.type_vocab_size) * h + 2 * h
        block = 4 * h * h + 2 * h * f + 4 * h  # qkv, proj, fc1, fc2 and two LayerNorms
        if self.bias:
            block += 3 * h + h + f + h
        mlm = h * h + h + 2 * h + v  # dense, LayerNorm, decoder bias
        pair = (h * h + h) + (2 * h + 2) if self.pair_head else 0  # pooler, binary head
        return embeddings + self.num_layers * block + mlm + pair

    def flops_per_step(self, global_batch: int) -> float:
        """Model FLOPs of one iteration (forward + backward, no recompute).

        6 FLOPs per token and weight it is multiplied by (2 forward, 4 backward):
        each block's ``4h^2 + 2hf``, the MLM head's dense ``h^2`` and decoder ``Vh``
        (logits at every position, as computed). Attention adds ``12 s h`` per token
        and layer (the ``QK^T`` and ``AV`` products). The pooler and pair head run
        once per sequence: ``6 (h^2 + 2h)`` each. Embedding lookups count nothing.
        """
        s, layers, h, v = self.seq_len, self.num_layers, self.hidden_size, self.vocab_size or 0
        tokens = global_batch * s
        weights = layers * (4 * h * h + 2 * h * self.ffn_size) + h * h + v * h
        attention = 12.0 * layers * s * h
        pair = 6.0 * global_batch * (h * h + 2 * h) if self.pair_head else 0.0
        return tokens * (6.0 * weights + attention) + pair

    def describe(self) -> str:
        return (
            f"BERT {self.num_params() / 1e6:.2f}M params, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, vocab {self.vocab_size}, seq {self.seq_len}, "
            f"pair task {self.pair_task}"
        )

    def structure(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _STRUCTURE}

    def numerics(self) -> dict[str, Any]:
        return {
            name: getattr(self, name)
            for name in ("norm_eps", "dropout", "attention_dropout", "pair_task", "mask_prob")
        }

    def check_layout(self, spec: LayoutSpec) -> None:
        """Reject a layout this model cannot be split by, naming the numbers (LayoutError)."""
        if spec.ep > 1:
            raise LayoutError(
                f"ep={spec.ep} splits mixture-of-experts layers, but BERT is dense; use ep=1"
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
        check_block_split(self.num_layers, self.ffn_size, spec)
