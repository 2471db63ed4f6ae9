"""The sampling loop every generating family shares: greedy, or top-k at a temperature.

``next_token`` picks one token per row from the last position's logits; ``continue_tokens``
is the loop of a decoder-only model (the decoder, the example family): each step reads
the whole (windowed) sequence, or, given a cached step, only the tokens not yet cached.
Families with more state per step (LLaVA's image mask, T5's encoder memory) run their
own loop around ``next_token``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def next_token(logits: Tensor, top_k: int | None = None, temperature: float = 1.0,
               generator: torch.Generator | None = None) -> Tensor:  # fmt: skip
    """``[b, vocab]`` logits -> ``[b, 1]`` token ids: the likeliest when ``top_k`` is None
    or 1, else one drawn (with ``generator``) among the ``top_k`` likeliest, their
    probabilities at ``temperature``."""
    if top_k is None or top_k <= 1:
        return logits.argmax(-1, keepdim=True)
    values, index = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
    probs = F.softmax(values / max(temperature, 1e-6), dim=-1)
    return index.gather(-1, torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def continue_tokens(logits_of: Callable[[Tensor], Tensor], tokens: Tensor, max_new_tokens: int,
                    window: int, top_k: int | None = None, temperature: float = 1.0,
                    generator: torch.Generator | None = None,
                    cached: Callable[..., Tensor] | None = None) -> Tensor:  # fmt: skip
    """``tokens [b, s]`` with ``max_new_tokens`` appended: each step reads the last
    ``window`` tokens (``logits_of`` maps them to ``[b, s, vocab]``).

    ``cached(new, offset=...)``: the logits ``[b, s, vocab]`` of tokens ``new`` at
    positions ``offset ..``, the model keeping what it needs of every token it was given
    (a KV cache). While the sequence fits ``window`` each step gives it only the tokens
    it has not seen; past that, positions shift each step, the cache no longer applies,
    and the steps read the window whole (as without a cache).
    """
    seen = 0
    for _ in range(max_new_tokens):
        if cached is not None and tokens.shape[1] <= window:
            logits = cached(tokens[:, seen:], offset=seen)[:, -1].float()
            seen = tokens.shape[1]
        else:
            logits = logits_of(tokens[:, -window:])[:, -1].float()
        nxt = next_token(logits, top_k, temperature, generator)
        tokens = torch.cat([tokens, nxt.to(tokens.device)], dim=1)
    return tokens
