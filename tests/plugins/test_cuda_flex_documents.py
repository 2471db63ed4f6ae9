"""mtcore-cuda's FlexAttention path for packed samples, on CPU: no GPU runs here.

FlexAttention runs eagerly on the CPU (forward only: it has no CPU backward), so what
is checked here is the adapter's mask: same document, the bottom-right causal mask,
the window, the key padding, and rows that may attend nothing. The fused kernel, its
backward and the compiled path are the conformance kit's on a GPU (docs/ci.md).
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("mtcore_cuda")
pytest.importorskip("torch.nn.attention.flex_attention")

from mtcore.backend.checks.kernel_cases import CASES, X, materialize
from mtcore.ops import attention
from mtcore_cuda.flex_documents import flex_document_attention, flex_documents_ok

DOCUMENT_CASES = [c for c in CASES["attention"]() if "documents" in c.name]


def _inputs(case):
    frozen = [X(a.value, grad=False, strided=a.strided) if isinstance(a, X) else a
              for a in case.args]  # fmt: skip
    return materialize(type(case)(case.name, frozen, case.kwargs), torch.float32, "cpu")


@pytest.mark.parametrize("case", DOCUMENT_CASES, ids=[c.name for c in DOCUMENT_CASES])
def test_flex_mask_is_the_ops_contract(case):
    args, kwargs = _inputs(case)
    # The kernel takes head sizes 16 .. 128; the mask is checked at every size (eagerly).
    assert flex_documents_ok(*args, **kwargs) == (args[0].shape[-1] in (16, 32, 64, 128))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention says it is not compiled
        got = flex_document_attention(*args, **kwargs)
    torch.testing.assert_close(got, attention(*args, **kwargs), rtol=1e-5, atol=1e-5)


def test_rows_with_no_key_are_zero_and_other_calls_go_to_sdpa():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    pad = torch.ones(1, 8, dtype=torch.bool)
    pad[0, 3] = False  # the first key of document 1: its first query sees nothing
    kwargs = dict(key_padding_mask=pad, query_documents=docs, key_documents=docs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flex_document_attention(q, k, v, True, **kwargs)
    assert torch.equal(got[:, :, 3], torch.zeros_like(got[:, :, 3]))
    torch.testing.assert_close(got, attention(q, k, v, True, **kwargs), rtol=1e-5, atol=1e-5)
    assert not flex_documents_ok(q, k, v)  # no documents: SDPA's plain path serves
    assert not flex_documents_ok(q, k, v, dropout_p=0.1, query_documents=docs,
                                 key_documents=docs)  # fmt: skip
    assert not flex_documents_ok(q[..., :12], k[..., :12], v[..., :12], query_documents=docs,
                                 key_documents=docs)  # fmt: skip
