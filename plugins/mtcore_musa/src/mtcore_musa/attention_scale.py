"""``attention`` through SDPA on musa: the head dims muDNN takes, whether this build
honours an explicit ``scale`` (probed once on the device), and the predicate that
follows from both.

torch_musa's csrc/aten/ops/attention/mudnn/SDP.cpp: ``MaybeSetScale`` passes ``scale``
to muDNN under ``REAL_MUSA_VERSION >= 4020``; ``CheckScale`` raises "Not support
explicit `scale` parameter" under ``REAL_MUSA_VERSION < 4020`` unless the scale is
1/sqrt(head dim) (then it warns and ignores it); a build whose REAL_MUSA_VERSION is
undefined compiles neither, and ignores any scale silently. The version a wheel was built with is not
exposed reliably, so one small product says which: a scale four times the default
must give the attention computed with that scale, not the default's. Where it does,
a non-default scale (multi-head latent attention's mscale, T5's 1.0) runs on the
device; elsewhere it takes the reference.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mtcore.ops import torch_native
from mtcore.ops.flash_lse import default_scale

_HEAD_DIM, _PROBE_SCALE = 64, 0.5  # the default for 64 is 0.125


def _attention(q, k, v, scale: float) -> torch.Tensor:
    return torch.softmax((q @ k.transpose(-1, -2)) * scale, dim=-1) @ v


def sdpa_honours_scale(device, sdpa: Callable = F.scaled_dot_product_attention) -> bool:
    """One bfloat16 ``sdpa(q, k, v, scale=0.5)`` on ``device`` (a head dim of 64, which
    muDNN's flash path takes) against float32 attention at that scale and at the default."""
    where = device.torch_device()
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, _HEAD_DIM, generator=generator) for _ in range(3))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an old build warns as it drops a scale
            got = sdpa(*(t.to(where, torch.bfloat16) for t in (q, k, v)), scale=_PROBE_SCALE)
        got = got.float().cpu()
    except Exception:  # an old build refuses the scale
        return False
    want = _attention(q, k, v, _PROBE_SCALE)
    ignored = _attention(q, k, v, 1 / math.sqrt(_HEAD_DIM))
    # bfloat16 rounding is far below the distance between the two attentions
    return bool((got - want).abs().max() < 0.25 * (ignored - want).abs().max())


def attention_ok(honours_scale: Callable[[], bool], shapes_ok: Callable) -> Callable:
    """``attention``'s fallback predicate: ``shapes_ok`` (muDNN's head dims) and no
    dropout, with the default scale, or any scale where ``honours_scale()`` (probed once,
    on the first call that needs it)."""
    probed: list[bool] = []

    def honours() -> bool:
        if not probed:
            probed.append(bool(honours_scale()))
        return probed[0]

    def ok(q, k, v, causal=True, key_padding_mask=None, scale=None, window=None,
           dropout_p=0.0, dropout_seeds=None, query_documents=None,
           key_documents=None) -> bool:  # fmt: skip
        if not shapes_ok(q, k, v) or dropout_p != 0:
            return False
        return default_scale(q, scale) or honours()

    return ok


def flash_head_dims_ok(q, k, v, *args, **kwargs) -> bool:
    """Head sizes muDNN flash attention takes (csrc/aten/ops/attention/mudnn/SDPUtils.h,
    ``check_musa_attention_input``): qk and v <= 128, or (qk, v) = (192, 128) / (160, 160).
    Other sizes would run SDPA's math path on the device; the reference serves them.
    """
    qk, vd = q.shape[-1], v.shape[-1]
    return (qk <= 128 and vd <= 128) or (qk, vd) in ((192, 128), (160, 160))


# SDPA's ``scale`` on musa (csrc/aten/ops/attention/mudnn/SDP.cpp, ``CheckScale`` and
# ``MaybeSetScale``, flash and math paths alike): a build with MUSA >= 4.2 passes it to
# muDNN; an older build raises "Not support explicit `scale` parameter" unless it equals
# 1/sqrt(head dim) (then it warns and ignores it); a build whose REAL_MUSA_VERSION is
# undefined ignores it silently, so attention runs with the default scale. The default
# is sent as None; another (T5's 1.0, MLA's mscale) only where a probe found the build
# honours it (sdpa_honours_scale, above), else it goes to the reference.
def musa_sdpa_attention(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, dropout_p=0.0,
    dropout_seeds=None, query_documents=None, key_documents=None,
):  # fmt: skip
    """``mtcore.ops.attention`` through SDPA on musa: the default scale as None (see
    above), another only where the build honours it (``sdpa_honours_scale``); a sliding
    window and document ids reach muDNN as a bool mask (it takes neither of its own;
    SDPUtils.h's check_musa_attn_mask refuses only masks that need a gradient)."""
    scale = None if default_scale(q, scale) else scale
    return torch_native.sdpa_attention(
        q, k, v, causal, key_padding_mask, scale, window,
        query_documents=query_documents, key_documents=key_documents,
    )  # fmt: skip
