"""``attention`` of packed samples (document ids) through FlexAttention on cuda.

SDPA takes a document mask only as a dense ``[b, 1, sq, sk]`` bool mask, which its
kernels read whole; FlexAttention (``torch.nn.attention.flex_attention``, torch >= 2.5,
what torchtitan runs document masks with) takes the mask as a function of (batch,
query, key) and builds a block mask from it, so blocks of queries and keys in
different documents are skipped, not computed and masked. The mask function here is
the op's contract: the same document, the bottom-right causal mask, the sliding
window, the key padding mask.

On cuda the function is compiled (``torch.compile(flex_attention)``, once per process),
as FlexAttention needs to be to run its fused kernel; elsewhere (the tests on CPU) it
runs eagerly, with the same numbers and none of the speed. Not run on a GPU in this
project yet: the conformance kit's ``*-documents-*`` cases check it where one is.
A call without document ids, with dropout, or with a head size FlexAttention's kernel
does not take goes to SDPA (``flex_documents_ok``).
"""

from __future__ import annotations

import functools

import torch

# FlexAttention's fused kernel tiles the head dimension; these it takes on every GPU
# generation torch supports (its own tests' sizes).
_HEAD_DIMS = (16, 32, 64, 128)


@functools.cache
def _flex(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


def flex_documents_ok(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, dropout_p=0.0,
    dropout_seeds=None, query_documents=None, key_documents=None,
) -> bool:  # fmt: skip
    """``fallback_ok``: document ids, no dropout, a head size the kernel takes."""
    return (
        query_documents is not None
        and dropout_p == 0
        and q.shape[-1] == v.shape[-1]
        and q.shape[-1] in _HEAD_DIMS
    )


def flex_document_attention(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, dropout_p=0.0,
    dropout_seeds=None, query_documents=None, key_documents=None,
):  # fmt: skip
    """``mtcore.ops.attention`` with document ids through FlexAttention's block mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    if dropout_p > 0:
        raise ValueError("flex_document_attention has no dropout: see flex_documents_ok")
    batch, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    corner = sk - sq  # the causal mask is aligned to the bottom-right corner
    queries, keys = query_documents, key_documents

    def allowed(b, h, query, key):
        keep = queries[b, query] == keys[b, key]
        if causal:
            keep = keep & (query + corner >= key)
            if window is not None:
                keep = keep & (query + corner - key < window)
        if key_padding_mask is not None:
            keep = keep & key_padding_mask[b, key]
        return keep

    block = create_block_mask(allowed, batch, None, sq, sk, device=q.device)
    out, lse = _flex(q.device.type)(
        q, k, v, block_mask=block, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
        return_lse=True,
    )  # fmt: skip
    # The contract's output for a query that may attend no key is 0: its LSE is -inf.
    return torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(out), out)
