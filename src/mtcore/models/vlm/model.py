"""LLaVA (Liu et al. 2023, arXiv 2304.08485): a vision tower, a projector and a GPT.

One class serves the whole model and each pipeline chunk of it, as the GPT does (it
is a ``GPT``): the first chunk holds the vision tower and the projector beside the
token embedding and its first language-model layers; parameter names are the whole
model's at any layout (``vision.layers.0.attn.qkv.weight``, ``projector.fc1.weight``,
``layers.3.mlp.fc1.weight``).

A micro-batch carries ``tokens [b, s]`` in which every image already stands as
``image_tokens`` copies of the ``<image>`` id (the data pipeline expands each
placeholder, so ``s`` is known before the step), ``image_mask [b, s]`` (True at
those positions), ``pixel_values [b, max_images, C, H, W]`` and ``labels``. The first
stage embeds the tokens and puts the projected features of sample ``i``'s images, in
order, at its image positions: the ``k``-th image position of a sample takes the
``k``-th feature of its images laid end to end. Image slots a sample does not use
are computed and ignored (they get no gradient).

Under sequence parallelism the token embedding is a sequence shard and each rank
fills in the image positions of its shard; the features enter through
``copy_to_tp``, whose backward sums the ranks' partial gradients, so the projector
and the tower get whole gradients on every rank.

Under context parallelism the image tokens are ordinary positions of the sharded
sequence: each cp rank holds two of ``2 * cp`` chunks (the load-balanced split), so an
image may straddle ranks. Every cp rank runs the whole vision tower and projector on
every image of its micro-batch (replicated, not sharded over cp), gathers the image
mask over cp to number the image positions globally, and places the features that
fall on its own positions; RoPE and learned positions use the global positions
(``Context.positions``). Each rank's tower gradient comes from its own positions'
loss; the dp x cp gradient reduction sums them, as for the token embedding.

Freezing (``config.freeze``) turns off ``requires_grad`` of a part's parameters, so
data parallelism and the optimizer never see them (no gradient, no optimizer state,
no ZeRO shard); a frozen tower (and projector) runs under ``no_grad``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from mtcore.models.common.chunks import build_chunks
from mtcore.models.common.decoder.model import GPT, IGNORE_INDEX
from mtcore.models.common.layers import Context
from mtcore.models.common.sampling import next_token
from mtcore.models.family import BuiltModel
from mtcore.models.vlm.config import LlavaConfig
from mtcore.models.vlm.vision import Projector, VisionTower
from mtcore.parallel.context import cp_to_global, gather_key_mask
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import column_parallel_matmul, copy_to_tp, vocab_parallel_argmax
from mtcore.precision.fp8 import FP8Recipe


def place_images(x: Tensor, features: Tensor, image_mask: Tensor, start: int | Tensor) -> Tensor:
    """``x [b, s_local, h]`` (positions ``start ..`` of the sequence, or the global
    positions ``start`` lists: a cp rank's chunks) with its image positions replaced by
    ``features [b, n, h]``: the ``k``-th image position of a row (counted over the whole
    sequence of ``image_mask [b, s]``) takes feature ``k``."""
    order = image_mask.long().cumsum(dim=1) - 1  # k at each image position
    local = slice(start, start + x.shape[1]) if isinstance(start, int) else start
    order, mask = order[:, local].clamp(min=0), image_mask[:, local]
    order = order.clamp(max=features.shape[1] - 1)
    picked = features.gather(1, order.unsqueeze(-1).expand(-1, -1, features.shape[-1]))
    return torch.where(mask.unsqueeze(-1), picked.to(x.dtype), x)


class Llava(GPT):
    """The whole model (default) or one pipeline chunk; the first holds the vision tower."""

    def __init__(
        self,
        config: LlavaConfig,
        context: Context | None = None,
        layers: range | None = None,
        first: bool = True,
        last: bool = True,
    ):
        super().__init__(config, context, layers, first, last)
        self.vision = self.projector = None
        if first:
            self.vision = VisionTower(self.c, config.vision, config.recompute)
            self.projector = Projector(self.c, config.vision.hidden_size, config.projector)
        for name, p in self.named_parameters():
            if config.frozen(self.part_of(name)):
                p.requires_grad_(False)

    @staticmethod
    def part_of(name: str) -> str:
        """``vision``, ``projector`` or ``language``: which part a parameter belongs to."""
        head = name.split(".", 1)[0]
        return head if head in ("vision", "projector") else "language"

    def image_features(self, pixels: Tensor) -> Tensor:
        """``[b, max_images, C, H, W]`` -> ``[b, max_images * image_tokens, h]``."""
        cfg = self.config
        frozen = cfg.frozen("vision") and cfg.frozen("projector")
        with torch.no_grad() if cfg.frozen("vision") else contextlib.nullcontext():
            x = self.vision(pixels.flatten(0, 1))
        with torch.no_grad() if frozen else contextlib.nullcontext():
            x = self.projector(x)
        return x.reshape(pixels.shape[0], -1, x.shape[-1])

    def embed_multimodal(self, batch: dict[str, Tensor]) -> Tensor:
        """Token embeddings with the image features in place (a sequence shard under sp)."""
        e = self.embed
        x = e.tok(batch["tokens"])
        s, start = x.shape[1], self.tp.rank * x.shape[1] if self.c.sequence_parallel else 0
        image_mask = batch.get("image_mask")
        if image_mask is not None and "pixel_values" in batch:
            features = self.image_features(batch["pixel_values"])
            if self.c.sequence_parallel:
                features = copy_to_tp(features, self.tp)
            positions = start
            if self.c.cp is not None:  # image k is counted over the whole sequence
                image_mask = self.whole_sequence(image_mask)
                positions = self.c.positions(start, s)
            x = place_images(x, features, image_mask, positions)
        if e.pos is not None:
            x = x + e.pos[self.c.positions(start, s)].to(x.dtype)  # global positions under cp
        return self.c.dropout(x, self.training)

    def whole_sequence(self, mask: Tensor) -> Tensor:
        """This cp rank's share of a ``[b, s / cp]`` bool mask -> the whole ``[b, s]`` in
        global order (gathered over cp, no gradient)."""
        gathered = gather_key_mask(mask, self.c.cp)  # cp order
        return gathered.index_select(
            1, cp_to_global(gathered.shape[1], self.c.cp.size, mask.device)
        )

    # -- the pipeline-stage contract (mtcore.models.family) --------------------------
    def stage(self, inputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``batch`` (tokens, image_mask, pixel_values) on the first stage, ``{"hidden"}``
        on the others -> ``{"hidden"}``, or ``{"logits"}`` on the last."""
        x = self.embed_multimodal(batch) if self.first else inputs["hidden"]
        for block in self.layers.values():
            if self.config.recompute == "full":
                x = checkpoint(block, x, self.rope, backend=self.c.backend, tracker=self.c.tracker)
            else:
                x = block(x, self.rope)
        if not self.last:
            return {"hidden": x}
        x = self.norm(x)
        if self.output is not None:
            return {"logits": self.output(x)}
        weight = self.embed.tok.weight
        return {
            "logits": column_parallel_matmul(x, weight, None, self.tp, self.c.sequence_parallel)
        }

    def forward(self, batch: dict[str, Tensor]) -> Tensor:  # type: ignore[override]
        """The whole model: logits ``[b, s, vocab / tp]`` of a micro-batch."""
        if not (self.first and self.last):
            raise ValueError("forward() runs the whole model; a pipeline chunk runs stage()")
        return self.stage({}, batch)["logits"]

    def metrics(self, outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> dict[str, tuple]:
        """``caption_accuracy``: the share of target tokens (caption or answer) whose
        argmax over the vocabulary shards is right, as ``(correct, count)``."""
        labels = batch["labels"]
        predicted = vocab_parallel_argmax(outputs["logits"].detach(), self.tp)
        valid = labels != IGNORE_INDEX
        return {"caption_accuracy": (((predicted == labels) & valid).sum(), valid.sum())}

    @torch.no_grad()
    def generate(self, batch: dict[str, Tensor], max_new_tokens: int, top_k: int | None = None,
                 temperature: float = 1.0, generator: torch.Generator | None = None,
                 stop_id: int | None = None, use_cache: bool = True) -> Tensor:  # fmt: skip
        """``batch["tokens"] [1, s]`` (images expanded) continued by up to
        ``max_new_tokens`` tokens (one process, tp=1), stopping after ``stop_id``.
        With ``use_cache`` the prompt (its images in place) fills each layer's KV cache
        once and every later step runs one token (``GPT.cached_logits``)."""
        if self.tp.size != 1 or not (self.first and self.last):
            raise ValueError("generate() runs on the whole model in one process (tp=1, pp=1)")
        tokens, image_mask = batch["tokens"], batch["image_mask"]
        caches = [{} for _ in self.layers] if use_cache else None
        for _ in range(max_new_tokens):
            if tokens.shape[1] >= self.config.seq_len:
                break
            step = {**batch, "tokens": tokens, "image_mask": image_mask}
            if caches is None:
                logits = self.stage({}, step)["logits"][:, -1].float()
            elif "k" not in caches[0]:  # the prompt, images included
                embedded = self.embed_multimodal(step)
                logits = self.cached_logits(tokens, caches, 0, embedded)[:, -1].float()
            else:
                logits = self.cached_logits(tokens[:, -1:], caches, tokens.shape[1] - 1)
                logits = logits[:, -1].float()
            nxt = next_token(logits, top_k, temperature, generator)
            tokens = torch.cat([tokens, nxt], dim=1)
            image_mask = torch.cat([image_mask, torch.zeros_like(nxt, dtype=torch.bool)], dim=1)
            if stop_id is not None and int(nxt) == stop_id:
                break
        return tokens


def build(
    config: LlavaConfig, layout, backend, seed: int = 0, fp8: FP8Recipe | None = None
) -> BuiltModel:
    """This rank's chunks (the vision tower on virtual stage 0) and their RNG tracker."""
    return build_chunks(Llava, config, layout, backend, seed, fp8)
