"""A packed sample with document masks trains each of its documents as if it were alone.

One process, fp64: the GPT's per-token logits of a packed sample (``documents`` and
``positions`` in the batch, ``mtcore.data.documents``) equal those of each document
run by itself, and the gradients of the packed token losses' sum equal the sum of the
documents' own; for Llama (RoPE), GPT-2 (learned positions), a sliding window,
multi-head latent attention with experts, and full recompute. The layouts' side
(tp x pp, cp, ep against this one process) is tests/distributed/test_document_masks.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtcore.data.documents import documents_from_separators, positions_in_documents
from mtcore.models.gpt import FAMILY, GPTConfig

SIZES = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, seq_len=16,
             init_std=0.1)  # fmt: skip
MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
CONFIGS = {
    "llama": dict(style="llama"),
    "gpt2": dict(style="gpt2"),
    "window": dict(style="llama", sliding_window=3),
    "mla": dict(mla=MLA, num_kv_heads=4),
    # No load-balancing loss: it is over the batch's tokens, whatever their documents.
    "moe": dict(style="llama", moe=dict(num_experts=4, top_k=2, ffn_size=16, aux_loss_coeff=0.0)),
    "recompute": dict(style="llama", recompute="full"),
}
# The router scores in float32 whatever the model's dtype, so a token's routing
# rounds differently in a 1-token matmul than in a 16-token one: fp32 order there.
TOLERANCES = {"moe": dict(rtol=1e-5, atol=1e-6)}
EOD = 0
# Documents of 5, 1, 6 and 4 tokens, each ending with EOD, packed into one sample.
TOKENS = torch.tensor([[7, 3, 9, 4, EOD, EOD, 5, 6, 8, 2, 11, EOD, 12, 13, 14, EOD]])


def _model(name: str):
    torch.manual_seed(0)
    config = GPTConfig(**{**SIZES, **CONFIGS[name]})
    return FAMILY.one_process(config).double()


def _add(total, grad):
    """Gradient sums where a parameter may have none (None) for some documents."""
    if grad is None or total is None:
        return grad if total is None else total
    return total + grad


def _token_losses(model, tokens, **batch):
    logits = model(tokens, **batch)
    labels = torch.roll(tokens, -1, dims=1)  # any fixed targets will do
    losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    return logits, losses


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_documents_train_as_each_document_alone(name):
    model = _model(name)
    documents = documents_from_separators(TOKENS, EOD)
    positions = positions_in_documents(documents)
    packed_logits, packed_losses = _token_losses(model, TOKENS, documents=documents,
                                                 positions=positions)  # fmt: skip
    packed_grads = torch.autograd.grad(packed_losses.sum(), list(model.parameters()),
                                       allow_unused=True)  # fmt: skip

    alone_logits, alone_grads = [], None
    bounds = torch.nonzero(TOKENS[0] == EOD).flatten().tolist()
    start = 0
    for end in bounds:
        piece = TOKENS[:, start : end + 1]
        logits = model(piece)
        labels = torch.roll(TOKENS, -1, dims=1)[:, start : end + 1]
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        alone_grads = grads if alone_grads is None else [
            _add(total, grad) for total, grad in zip(alone_grads, grads, strict=True)
        ]
        alone_logits.append(logits)
        start = end + 1

    logits_tol = TOLERANCES.get(name, dict(rtol=1e-9, atol=1e-9))
    grads_tol = TOLERANCES.get(name, dict(rtol=1e-8, atol=1e-9))
    torch.testing.assert_close(packed_logits, torch.cat(alone_logits, 1), **logits_tol)
    names = [n for n, _ in model.named_parameters()]
    for pname, got, want in zip(names, packed_grads, alone_grads, strict=True):
        if got is None or want is None:
            assert got is None and want is None, pname
            continue
        torch.testing.assert_close(got, want, **grads_tol, msg=lambda m, p=pname: f"{p}: {m}")
    # Without the documents the later documents see the earlier ones: this can fail.
    blind = model(TOKENS)
    assert not torch.allclose(blind[:, bounds[0] + 1 :], packed_logits[:, bounds[0] + 1 :])


def test_documents_with_positions_that_do_not_restart():
    """Document masks alone (Megatron's --reset-attention-mask without
    --reset-position-ids): a later document sees only itself, at its packed positions."""
    model = _model("llama")
    documents = documents_from_separators(TOKENS, EOD)
    packed = model(TOKENS, documents=documents)
    start = 5  # the second document, "EOD": alone it is the first token of a sample
    shifted = torch.cat([torch.full((1, start), 63), TOKENS[:, start:start + 1]], 1)
    alone = model(shifted, documents=torch.tensor([[0] * start + [1]]))
    torch.testing.assert_close(packed[:, start], alone[:, start], rtol=1e-9, atol=1e-9)
