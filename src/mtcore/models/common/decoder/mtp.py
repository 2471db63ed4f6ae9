"""Multi-token prediction (MTP, DeepSeek-V3 section 2.2): ``depth`` sequential modules on
the last stage, module k predicting the token k + 1 places past the next one.

Module k reads the previous module's hidden states (the main model's, before its final
norm, for k = 1) and the embedding of the token k places ahead, and runs one more
transformer block::

    h'_i = W_k [RMSNorm(h_i^{k-1}) ; RMSNorm(Emb(t_{i+k}))]
    h^k  = Block_k(h')                      (causal over the sequence)
    logits^k_i = Head(Norm_k(h^k_i))        -> target t_{i+k+1} = labels[i + k]

The token embedding and the output head are the main model's (shared weights). The
sequence keeps its length: the last k positions read a padding token and have no
target (``IGNORE_INDEX``); causal attention keeps them from every earlier position,
so they change nothing. Each module's loss is its own term ``mtp_k`` of weight
``loss_weight / depth``; generation ignores the modules. Under pp > 1 the last stage
reads a copy of the embedding (``GPT.mtp_embed``, a tied copy).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mtcore.models.common.latent_attention import ReplicatedLinear
from mtcore.models.common.layers import Context, Norm

IGNORE_INDEX = -100


def mtp_term(k: int) -> str:
    return f"mtp_{k}"


def shifted(x: Tensor, k: int, fill: int) -> Tensor:
    """``x [b, s]`` moved ``k`` places left, the last ``k`` places ``fill``."""
    return torch.cat([x[:, k:], torch.full_like(x[:, :k], fill)], dim=1)


def mtp_targets(labels: Tensor, k: int) -> Tensor:
    """Module ``k``'s targets: ``labels[i + k]``, IGNORE_INDEX past the end."""
    return shifted(labels, k, IGNORE_INDEX)


class PredictionModule(nn.Module):
    """One MTP module: the two norms, the projection ``W_k`` and its block."""

    def __init__(self, c: Context, index: int, block: nn.Module):
        super().__init__()
        cfg = c.config
        self.c, self.index = c, index
        self.hidden_norm, self.embed_norm = Norm(c), Norm(c)
        # Whole on every tp rank, on the block's input layout (the sequence shard under
        # sequence parallel, where the embedding of the shifted tokens is a shard too).
        self.proj = ReplicatedLinear(
            c, 2 * cfg.hidden_size, cfg.hidden_size, c.generator(f"mtp.{index}"), cfg.init_std
        )
        self.block = block
        self.norm = Norm(c)

    def forward(self, hidden: Tensor, ahead: Tensor, rope, documents=None) -> Tensor:
        """``hidden [b, s, h]`` (the previous module's) and ``ahead`` (the embeddings of the
        tokens ``k`` places ahead) -> this module's hidden states (before ``norm``);
        ``documents``: the batch's ``DocumentIds`` (packed samples) or None."""
        x = self.proj(torch.cat([self.hidden_norm(hidden), self.embed_norm(ahead)], dim=-1))
        return self.block(x, rope, documents=documents)
