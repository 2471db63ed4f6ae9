"""The LLaVA-style model's configuration: a GPT language model plus a vision tower.

The language model's keys are the shared decoder's (the GPT family's too), at the top of
the ``model`` section (``LlavaConfig`` is a ``DecoderConfig``, so the decoder's blocks,
pipeline split and layout checks serve it unchanged); the vision tower is ``vision:``, the projector
``projector:``, what stays fixed ``freeze:``, and how images become pixels and
records samples ``images:`` (``mtcore.models.vlm.data.ImageDataConfig``)::

    model:
      family: llava
      hidden_size: 64
      num_layers: 4
      vision: {image_size: 32, patch_size: 8, hidden_size: 64, num_layers: 2}
      projector: mlp2x_gelu
      freeze: [vision]          # LLaVA stage 2; stage 1 is [vision, language]

The vision tower is CLIP's ViT (Radford et al. 2021) as LLaVA uses it: a patch
embedding (a linear map of flattened patches, CLIP's stride-p convolution without a
bias), a class token and learned positions, an optional LayerNorm before the blocks
(CLIP's ``pre_layrnorm``), pre-LN blocks with bidirectional attention; its last
block's output, without the class token unless ``keep_class_token`` (LLaVA's
``default`` and ``full`` feature strategies), is what the projector maps.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from mtcore.models.common.decoder.config import DecoderConfig
from mtcore.models.vlm.image_samples import ImageDataConfig
from mtcore.parallel.layout import LayoutError, LayoutSpec
from mtcore.parallel.settings import Settings

PARTS = ("vision", "projector", "language")
_VISION_STRUCTURE = (
    "image_size", "patch_size", "channels", "hidden_size", "num_layers", "num_heads",
    "ffn_size", "class_token", "pre_norm", "patch_bias",
)  # fmt: skip


class VisionConfig(Settings):
    """A ViT: sizes and switches (the shared blocks read the usual field names)."""

    image_size: int = Field(32, ge=1)
    patch_size: int = Field(8, ge=1)
    channels: int = Field(3, ge=1)
    hidden_size: int = Field(64, ge=2)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    ffn_hidden_size: int | None = Field(None, ge=1, description="None: 4h")
    activation: Literal["gelu", "quick_gelu"] = Field("quick_gelu", description="CLIP's")
    class_token: bool = True
    keep_class_token: bool = False
    pre_norm: bool = Field(True, description="LayerNorm after the embeddings (CLIP)")
    patch_bias: bool = False
    norm_eps: float = Field(1e-5, gt=0)
    init_std: float = Field(0.02, gt=0)

    @model_validator(mode="after")
    def _check(self) -> VisionConfig:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"vision.image_size={self.image_size} is not divisible by "
                f"vision.patch_size={self.patch_size}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"vision.hidden_size={self.hidden_size} is not divisible by "
                f"vision.num_heads={self.num_heads}"
            )
        if self.keep_class_token and not self.class_token:
            raise ValueError("vision.keep_class_token needs vision.class_token")
        return self

    # -- what the shared layers (mtcore.models.common.layers) read --------------------------
    kv_heads = property(lambda self: self.num_heads)
    head_dim = property(lambda self: self.hidden_size // self.num_heads)
    ffn_size = property(lambda self: self.ffn_hidden_size or 4 * self.hidden_size)
    norm = property(lambda self: "layernorm")
    bias = property(lambda self: True)
    gelu_approximate = property(lambda self: "none")
    scaled_init = property(lambda self: False)
    dropout = property(lambda self: 0.0)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens inside the tower: the patches and the class token."""
        return self.num_patches + int(self.class_token)

    @property
    def num_features(self) -> int:
        """Image tokens the tower hands the projector (and the language model)."""
        return self.num_patches + int(self.keep_class_token)

    def num_params(self) -> int:
        h, f = self.hidden_size, self.ffn_size
        patch = self.channels * self.patch_size**2 * h + (h if self.patch_bias else 0)
        embed = patch + self.seq_len * h + (h if self.class_token else 0)
        embed += 2 * h if self.pre_norm else 0
        block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        return embed + self.num_layers * block

    def flops_per_image(self) -> float:
        """Forward + backward FLOPs of one image (6 per token and weight, plus attention)."""
        s, h, f = self.seq_len, self.hidden_size, self.ffn_size
        weights = self.channels * self.patch_size**2 * h + self.num_layers * (4 * h * h + 2 * h * f)
        return s * (6.0 * weights + 12.0 * self.num_layers * s * h)


class LlavaConfig(DecoderConfig):
    """A vision-language model: the GPT keys for the language model, plus ``vision``,
    ``projector``, ``freeze`` and ``images``. ``seq_len`` counts the image tokens."""

    family: Literal["llava"] = "llava"  # type: ignore[assignment]
    vision: VisionConfig = VisionConfig()
    projector: Literal["mlp2x_gelu", "linear"] = "mlp2x_gelu"
    freeze: tuple[Literal["vision", "projector", "language"], ...] = ()
    images: ImageDataConfig = ImageDataConfig()

    @model_validator(mode="after")
    def _check(self) -> LlavaConfig:
        if set(self.freeze) == set(PARTS):
            raise ValueError(
                f"model.freeze names every part ({', '.join(PARTS)}): nothing would train"
            )
        v, channels = self.vision, len(self.images.mean)
        if v.channels != channels:  # the patch embedding would not match the pixels
            raise ValueError(
                f"model.vision.channels={v.channels}, but images reach the model with "
                f"{channels} channels (every image is read as RGB, greyscale and RGBA ones "
                f"too; model.images.mean and std have {channels} entries): set "
                f"vision.channels: {channels}"
            )
        if self.image_tokens >= self.seq_len:
            extra = " and the class token (keep_class_token)" if v.keep_class_token else ""
            raise ValueError(
                f"an image is {self.image_tokens} tokens ((vision.image_size={v.image_size} / "
                f"vision.patch_size={v.patch_size})^2 patches{extra}), which leaves no room "
                f"for text in model.seq_len={self.seq_len}: raise seq_len or patch_size, or "
                "lower image_size"
            )
        return self

    @property
    def image_tokens(self) -> int:
        return self.vision.num_features

    def frozen(self, part: str) -> bool:
        return part in self.freeze

    def projector_params(self) -> int:
        v, h = self.vision.hidden_size, self.hidden_size
        return v * h + h + (h * h + h if self.projector == "mlp2x_gelu" else 0)

    def num_params(self, active: bool = False) -> int:
        return super().num_params(active) + self.vision.num_params() + self.projector_params()

    def flops_per_step(self, global_batch: int) -> float:
        """The language model's (over ``seq_len``, image tokens included), plus the vision
        tower's and the projector's for ``max_images`` images per sample: the FLOPs the
        step computes. A frozen part skips its weights' gradients (a third of their
        products); the frozen tower, with nothing trained before it, runs under
        ``no_grad`` (its forward only), as does a frozen projector behind it. Attention's
        score products have no weights: a frozen language model still runs their whole
        backward, to pass the gradient to the projector."""
        images = global_batch * self.images.max_images
        vision_trains = not self.frozen("vision")
        projector_trains = not self.frozen("projector")
        tower = images * self.vision.flops_per_image()
        projector = images * 6.0 * self.vision.num_features * self.projector_params()
        language = super().flops_per_step(global_batch)
        scores = 12.0 * global_batch * self.seq_len**2 * self.num_layers * self.hidden_size
        if not vision_trains:
            tower /= 3
        if not projector_trains:
            projector *= 2 / 3 if vision_trains else 1 / 3
        if self.frozen("language"):  # the config refuses a wholly frozen model
            language = (language - scores) * 2 / 3 + scores
        return language + tower + projector

    def describe(self) -> str:
        v = self.vision
        frozen = f", frozen: {', '.join(self.freeze)}" if self.freeze else ""
        return (
            f"LLaVA {self.num_params() / 1e6:.2f}M params: ViT {v.num_layers} layers, hidden "
            f"{v.hidden_size}, {v.image_size}px / {v.patch_size} = {self.image_tokens} image tokens; "
            f"{self.projector} projector; GPT ({self.style}) {self.num_layers} layers, hidden "
            f"{self.hidden_size}, vocab {self.vocab_size}, seq {self.seq_len}{frozen}"
        )

    def structure(self) -> dict[str, Any]:
        fields = super().structure()
        fields["vision"] = {name: getattr(self.vision, name) for name in _VISION_STRUCTURE}
        fields["projector"] = self.projector
        return fields

    def numerics(self) -> dict[str, Any]:
        fields = super().numerics()
        v = self.vision
        fields["vision"] = {"activation": v.activation, "norm_eps": v.norm_eps,
                            "keep_class_token": v.keep_class_token}  # fmt: skip
        return fields

    def check_layout(self, spec: LayoutSpec) -> None:
        """The language model's checks (cp among them: image tokens are positions of the
        sharded sequence), and the vision tower's heads and MLP over tp."""
        super().check_layout(spec)
        v = self.vision
        if v.num_heads % spec.tp:
            raise LayoutError(f"vision.num_heads={v.num_heads} is not divisible by tp={spec.tp}")
        if v.ffn_size % spec.tp:
            raise LayoutError(
                f"vision.ffn_hidden_size={v.ffn_size} is not divisible by tp={spec.tp}"
            )
