"""The vision tower (a CLIP-style ViT, Dosovitskiy et al. 2021) and the projector.

The tower is tensor parallel like the language model: its blocks are the shared
``Attention`` (bidirectional) and ``MLP`` over mtcore's column/row-parallel linears,
heads and hidden units split over tp. The patch embedding, class token and positions
are small and replicated. Under sequence parallelism the tower's hidden states are
sequence shards between blocks when tp divides its sequence (patches plus class
token), and whole otherwise; either way it hands the projector the whole sequence.

The projector (LLaVA-1.5's ``mlp2x_gelu``: linear, GELU, linear; or one linear) is
replicated: every tp rank maps every image token, so the image embeddings and their
gradients are whole on each rank.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtcore.models.common.layers import MLP, Attention, Context, Norm
from mtcore.parallel.recompute import checkpoint
from mtcore.parallel.tensor import gather_from_sp, normal_init, scatter_to_sp


class _VisionView:
    """The vision config as the shared layers read it, with the language model's
    ``recompute`` (one switch for the whole model)."""

    def __init__(self, vision, recompute: str):
        self._vision, self.recompute = vision, recompute

    def __getattr__(self, name: str):
        return getattr(self._vision, name)


def _drawn(c: Context, name: str, shape: tuple[int, ...], std: float) -> nn.Parameter:
    weight = torch.empty(shape)
    normal_init(std)(weight, c.generator(name))
    return nn.Parameter(weight.to(c.device))


def quick_gelu(x: Tensor) -> Tensor:
    """CLIP's GELU approximation ``x * sigmoid(1.702 x)``."""
    return x * torch.sigmoid(1.702 * x)


class VisionMLP(MLP):
    """The shared MLP with GELU or CLIP's quick-GELU."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if self.c.config.activation == "quick_gelu":
            return self.fc2(quick_gelu(h))
        return self.fc2(F.gelu(h, approximate=self.gelu_approximate))


class VisionBlock(nn.Module):
    """Pre-LN encoder block: x + attn(norm(x)), then x + mlp(norm(x)); bidirectional."""

    def __init__(self, c: Context, index: int):
        super().__init__()
        self.c = c
        g = c.generator(f"vision.layers.{index}")
        self.attn_norm, self.attn = Norm(c), Attention(c, g, causal=False)
        self.mlp_norm, self.mlp = Norm(c), VisionMLP(c, g)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class PatchEmbedding(nn.Module):
    """Flattened ``p x p`` patches (channel, row, column order: a stride-p convolution's
    weight ``[h, C, p, p]`` flattened) times ``weight``, a class token in front, and
    learned positions."""

    def __init__(self, c: Context):
        super().__init__()
        v = c.config
        self.p, std = v.patch_size, v.init_std
        self.weight = _drawn(c, "vision.embed.patch", (v.hidden_size, v.channels * self.p**2), std)
        self.bias = (
            nn.Parameter(torch.zeros(v.hidden_size, device=c.device)) if v.patch_bias else None
        )
        self.cls = _drawn(c, "vision.embed.cls", (v.hidden_size,), std) if v.class_token else None
        self.pos = _drawn(c, "vision.embed.pos", (v.seq_len, v.hidden_size), std)

    def forward(self, pixels: Tensor) -> Tensor:
        """``[n, C, H, W]`` -> ``[n, class token + patches, h]``."""
        n, ch, height, width = pixels.shape
        p = self.p
        patches = pixels.reshape(n, ch, height // p, p, width // p, p)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(
            n, (height // p) * (width // p), ch * p * p
        )
        x = F.linear(patches.to(self.weight.dtype), self.weight, self.bias)
        if self.cls is not None:
            x = torch.cat([self.cls.expand(n, 1, -1), x], dim=1)
        return x + self.pos


class VisionTower(nn.Module):
    """Images ``[n, C, H, W]`` -> image features ``[n, num_features, vision hidden]``."""

    def __init__(self, c: Context, vision, recompute: str):
        super().__init__()
        sp = c.sequence_parallel and vision.seq_len % c.tp.size == 0
        # FP8 serves the language model's linears only; the tower runs in the model dtype.
        self.c = c = dataclasses.replace(
            c, config=_VisionView(vision, recompute), fp8=None, sequence_parallel=sp
        )
        self.keep_class_token = vision.keep_class_token or not vision.class_token
        self.embed = PatchEmbedding(c)
        self.pre_norm = Norm(c) if vision.pre_norm else None
        self.layers = nn.ModuleList(VisionBlock(c, i) for i in range(vision.num_layers))

    def forward(self, pixels: Tensor) -> Tensor:
        c = self.c
        x = self.embed(pixels)
        if c.sequence_parallel:
            x = scatter_to_sp(x, c.tp)
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        for block in self.layers:
            if c.config.recompute == "full":
                x = checkpoint(block, x, backend=c.backend, tracker=c.tracker)
            else:
                x = block(x)
        if c.sequence_parallel:  # the projector runs replicated: each rank's grad is whole
            x = gather_from_sp(x, c.tp, reduce_grad=False)
        return x if self.keep_class_token else x[:, 1:]


class Projector(nn.Module):
    """Vision width -> the language model's: linear, GELU, linear (``mlp2x_gelu``) or one
    linear; replicated over tp."""

    def __init__(self, c: Context, vision_size: int, kind: str):
        super().__init__()
        h, std = c.config.hidden_size, c.config.init_std
        self.fc1 = nn.Linear(vision_size, h, device=c.device)
        self.fc2 = nn.Linear(h, h, device=c.device) if kind == "mlp2x_gelu" else None
        with torch.no_grad():
            for name, layer in (("fc1", self.fc1), ("fc2", self.fc2)):
                if layer is not None:
                    layer.weight.copy_(
                        _drawn(c, f"projector.{name}", tuple(layer.weight.shape), std)
                    )
                    layer.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc1(x)
        return x if self.fc2 is None else self.fc2(F.gelu(x))
