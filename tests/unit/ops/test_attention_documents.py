"""Document masks in the attention ops: a packed sample attends each document as if alone.

The reference ops and the cpu backend's kernels (SDPA with a bool mask, torch's CPU
flash kernel with an additive one) against each document run by itself, forward and
backward; and the arguments' errors.
"""

from __future__ import annotations

import pytest
import torch

from mtcore.backend import KernelQuery, select_backend
from mtcore.data.documents import documents_from_separators, positions_in_documents
from mtcore.ops import attention, attention_lse
from mtcore.ops.flash_lse import cpu_flash_attention_lse
from mtcore.ops.torch_native import sdpa_attention

LENGTHS = (5, 1, 7, 3)  # one single-token document among them
SEQ = sum(LENGTHS)


def _documents(lengths=LENGTHS) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]


def _qkv(seed: int, hq: int = 4, hkv: int = 2, seq: int = SEQ, d: int = 8, batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, hq, seq, d), (batch, hkv, seq, d), (batch, hkv, seq, d))
    return [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def _alone(op, q, k, v, **kwargs):
    """Each document of the packed ``q, k, v`` through ``op`` by itself, concatenated."""
    outs, start = [], 0
    for n in LENGTHS:
        rows = slice(start, start + n)
        out = op(q[:, :, rows], k[:, :, rows], v[:, :, rows], **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
        start += n
    return torch.cat(outs, dim=2)


def _grads(out, tensors):
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return torch.autograd.grad((out * weights).sum(), tensors, retain_graph=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("op", [attention, attention_lse], ids=["attention", "attention_lse"])
def test_packed_documents_equal_each_document_alone(op, causal):
    q, k, v = _qkv(1)
    docs = _documents()
    packed = op(q, k, v, causal, query_documents=docs, key_documents=docs)
    packed = packed[0] if isinstance(packed, tuple) else packed
    alone = _alone(op, q, k, v, causal=causal)
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
    for got, want in zip(_grads(packed, (q, k, v)), _grads(alone, (q, k, v)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # Without the ids the documents see each other: the check above can fail.
    blind = op(q, k, v, causal)
    assert not torch.allclose(blind[0] if isinstance(blind, tuple) else blind, alone)


def test_documents_compose_with_windows_padding_and_a_cache():
    """Fewer queries than keys (the last tokens, as after a KV cache), a sliding window
    and a padding key: each query sees only the allowed keys of its own document."""
    q, k, v = _qkv(2)
    docs = _documents()
    pad = torch.ones(1, SEQ, dtype=torch.bool)
    pad[0, 9] = False
    tail = 6
    got = attention(q[:, :, -tail:], k, v, True, pad, window=4,
                    query_documents=docs[:, -tail:], key_documents=docs)  # fmt: skip
    full = attention(q, k, v, True, pad, window=4, query_documents=docs, key_documents=docs)
    torch.testing.assert_close(got, full[:, :, -tail:], rtol=1e-12, atol=1e-12)
    out, lse = attention_lse(q[:, :, -tail:], k, v, True, pad, None, 4, docs[:, -tail:], docs)
    torch.testing.assert_close(out, got, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_take_the_document_mask(dtype):
    """The cpu backend's SDPA and flash-LSE kernels against the reference, two rows
    with different packings, grouped-query heads, forward and backward."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _qkv(3, batch=2))
    docs = torch.cat([_documents(), _documents((2, 12, 2))])
    kwargs = dict(query_documents=docs, key_documents=docs)
    want = attention(q, k, v, True, **kwargs)
    want_lse = attention_lse(q, k, v, True, **kwargs)[1]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for out in (sdpa_attention(q, k, v, True, **kwargs),
                cpu_flash_attention_lse(q, k, v, True, **kwargs)[0]):  # fmt: skip
        torch.testing.assert_close(out, want, **tol)
        for got, ref in zip(_grads(out, (q, k, v)), _grads(want, (q, k, v)), strict=True):
            torch.testing.assert_close(got, ref, **tol)
    lse = cpu_flash_attention_lse(q, k, v, True, **kwargs)[1]
    torch.testing.assert_close(lse, want_lse, **tol)


def test_the_cpu_backend_serves_documents_without_the_reference():
    kernels = select_backend("cpu").kernels
    q, k, v = (t.detach().float() for t in _qkv(4))
    docs = _documents()
    for op in ("attention", "attention_lse"):
        chain = kernels[op].select(KernelQuery("cpu", torch.float32))
        assert chain[0].name != "reference", (op, [c.name for c in chain])
    out = kernels.attention(q, k, v, True, query_documents=docs, key_documents=docs)
    torch.testing.assert_close(out, attention(q, k, v, True, query_documents=docs,
                                              key_documents=docs), rtol=1e-5, atol=1e-5)


def test_document_ids_and_positions_from_separators():
    eod = 0
    tokens = torch.tensor([[5, 6, eod, 7, eod, eod, 8, 9]])
    docs = documents_from_separators(tokens, eod)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert positions_in_documents(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(query_documents=_documents()), "go together: pass both or neither"),
        (dict(query_documents=_documents(), key_documents=_documents()[:, :-1]),
         "key_documents must be an integer [1, 16]"),
        (dict(query_documents=_documents().float(), key_documents=_documents()),
         "query_documents must be an integer [1, 16]"),
    ],
)
def test_bad_document_ids_are_refused(kwargs, message):
    q, k, v = (t.detach() for t in _qkv(5))
    for op in (attention, attention_lse):
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            op(q, k, v, True, **kwargs)


def test_long_documents_run_one_call_each_on_the_host():
    """The cpu backend's attention runs long documents one SDPA call each (cheaper there,
    docs/results/document_masks.md) and short ones through one masked call: both equal
    the reference, forward and backward."""
    from mtcore.ops.torch_native import host_sdpa_attention, per_document_pays

    long_docs = torch.repeat_interleave(torch.arange(2), torch.tensor([150, 106]))[None]
    short_docs = torch.repeat_interleave(torch.arange(8), torch.tensor([32] * 8))[None]
    for docs, one_call_each in ((long_docs, True), (short_docs, False)):
        q, k, v = (t.detach().float().requires_grad_() for t in _qkv(6, seq=256))
        kwargs = dict(query_documents=docs, key_documents=docs)
        assert per_document_pays(q, k, v, True, None, None, docs, docs) is one_call_each
        got = host_sdpa_attention(q, k, v, True, **kwargs)
        want = attention(q, k, v, True, **kwargs)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for g, w in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v)), strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # Not for blocks of a longer sequence (keys beyond the queries) nor windows.
    q, k, v = (t.detach().float() for t in _qkv(7, seq=256))
    assert not per_document_pays(q[:, :, 100:], k, v, True, None, None, long_docs[:, 100:],
                                 long_docs)  # fmt: skip
    assert not per_document_pays(q, k, v, True, None, 8, long_docs, long_docs)
