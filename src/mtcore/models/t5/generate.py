"""T5 generation: the encoder runs once over an input with sentinels, the decoder writes
the target one token at a time, greedily or by top-k sampling.

With the cache (the default) each decoder layer keeps its self-attention keys and
values, grown by one position per step, and the cross-attention's keys and values of
the encoder output, computed at the first step only; a step then costs one position.
``use_cache=False`` runs the whole decoder over every token so far at each step: the
same tokens, the reference the cache is tested against.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from mtcore.models.common.sampling import next_token
from mtcore.models.t5.model import T5

_SENTINEL = re.compile(r"(<extra_id_\d+>)")


@torch.no_grad()
def encode(model: T5, tokens: Tensor, padding_mask: Tensor | None) -> Tensor:
    """The encoder output ``[b, s, h]`` of ``tokens`` (whole model, one process)."""
    e, s = model.config.encoder_layers, tokens.shape[1]
    x, bias = model.embed_tokens(tokens), model.encoder_bias(s, s)
    for i in range(e):
        x = model.layers[str(i)](x, bias, padding_mask)
    return model.encode_final(x)


@torch.no_grad()
def decode_logits(
    model: T5, new: Tensor, memory: Tensor, memory_mask, caches: list | None, offset: int
) -> Tensor:
    """Logits of the last of the decoder tokens ``new`` (positions ``offset`` onward;
    with ``caches`` the earlier ones are in the caches, else ``offset`` is 0)."""
    cfg = model.config
    x = model.embed_tokens(new)
    length = offset + new.shape[1]
    bias = model.decoder_bias(new.shape[1], length, query_offset=offset)
    for j in range(cfg.decoder_layers):
        cache = caches[j] if caches is not None else None
        x = model.layers[str(cfg.encoder_layers + j)](x, memory, bias, memory_mask, cache)
    return model.logits(x[:, -1:])[:, -1].float()


@torch.no_grad()
def generate_ids(
    model: T5,
    tokens: Tensor,
    max_new_tokens: int,
    start_id: int,
    eos_id: int | None = None,
    top_k: int | None = None,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    padding_mask: Tensor | None = None,
    use_cache: bool = True,
) -> Tensor:
    """The decoder's tokens ``[b, 1 + n]`` (``start_id`` first) for the encoder input
    ``tokens [b, s]``: greedy when ``top_k`` is None or 1, else sampling among the
    ``top_k`` likeliest; it stops early once every row has written ``eos_id``."""
    if model.tp.size != 1 or not (model.first and model.last):
        raise ValueError("generate runs on the whole model in one process (tp=1, pp=1)")
    memory = encode(model, tokens, padding_mask)
    out = torch.full((tokens.shape[0], 1), start_id, dtype=torch.long, device=tokens.device)
    caches = [{} for _ in range(model.config.decoder_layers)] if use_cache else None
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for step in range(max_new_tokens):
        if use_cache:
            logits = decode_logits(model, out[:, -1:], memory, padding_mask, caches, step)
        else:
            logits = decode_logits(model, out, memory, padding_mask, None, 0)
        nxt = next_token(logits, top_k, temperature, generator)
        out = torch.cat([out, nxt], dim=1)
        if eos_id is not None:
            done |= nxt[:, 0] == eos_id
            if done.all():
                break
    return out


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    """The prompt's ids, ``<extra_id_k>`` as the sentinel tokens (a trained tokenizer
    reads special-token text literally), then ``</s>``, as the training inputs end."""
    ids: list[int] = []
    for part in _SENTINEL.split(prompt):
        if _SENTINEL.fullmatch(part):
            ids.append(tokenizer.token_id(part))
        elif part:
            ids += tokenizer.encode(part)
    return [*ids, tokenizer.token_id("</s>")]


def generate_text(
    model: T5, tokenizer, prompt: str, max_new_tokens: int, top_k=None, temperature: float = 1.0,
    generator=None,
) -> str:  # fmt: skip
    """The family's ``generate``: the target the model writes for ``prompt`` (an input
    with sentinels such as ``"def <extra_id_0>(self):"``), sentinels included, up to
    ``</s>``."""
    device = next(model.parameters()).device
    tokens = torch.tensor([encode_prompt(tokenizer, prompt)], device=device)
    eos = tokenizer.token_id("</s>")
    out = generate_ids(
        model,
        tokens,
        max_new_tokens,
        tokenizer.token_id("<pad>"),
        eos,
        top_k,
        temperature,
        generator,
    )[0, 1:].tolist()
    if eos in out:
        out = out[: out.index(eos)]
    return tokenizer.decode(out)
