"""Kernel implementations for the 'musa' backend, and the probes that choose them.

Every op here is reached through a public torch_musa entry point; the facts each
adapter relies on are cited from the torch_musa source (MooreThreads/torch_musa).
Probes run when the backend is built (``musa_kernels``), never at import: on a
machine without torch_musa, importing this module must not touch it.
"""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.nn.functional as F

from mtcore.backend import KernelImpl, KernelQuery, TorchModuleDevice
from mtcore.ops import torch_native
from mtcore.ops.flash_lse import FlashKernels, default_scale, flash_attention_lse
from mtcore_musa.attention_scale import (
    attention_ok,
    flash_head_dims_ok,
    musa_sdpa_attention,
    sdpa_honours_scale,
)
from mtcore_musa.devices import MUDNN_MIN_CAPABILITY, TORCH_MUSA
from mtcore_musa.loss import FUSED_CROSS_ENTROPY_MIN_CAPABILITY, FUSED_CROSS_ENTROPY_OP

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# -- attention ------------------------------------------------------------------------
# SDPA (``attention``) on musa: mtcore_musa.attention_scale.


# attention_lse (context parallelism's per-block attention) through muDNN flash, whose
# forward returns the log-sum-exp: aten::_scaled_dot_product_attention_flash_musa(q, k, v,
# attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None) -> (output, logsumexp
# float32 [N, H, L], dropout_mask), defined by torch_musa's patched native_functions.yaml
# and registered for PrivateUse1 as MuDNNFlashSDPAFwd (SDP.cpp); its backward op takes
# (grad_out, q, k, v, output, logsumexp, dropout_mask, is_causal, attn_mask, *, scale).
# The LSE's gradient rides 8 extra head-dim columns (mtcore.ops.flash_lse); the padded
# head dim must stay within flash's sizes (<= 128). The scale is never passed (above):
# flash_lse rescales q in backward instead. Masks are boolean (SDPUtils.h takes them).
FLASH_MUSA_OP = "aten::_scaled_dot_product_attention_flash_musa"
_LSE_PAD = 8


def _flash_forward(q, k, v, is_causal, mask, scale):
    out, lse, dropout_mask = torch.ops.aten._scaled_dot_product_attention_flash_musa(
        q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=is_causal
    )
    return out, lse, dropout_mask


def _flash_backward(grad_out, q, k, v, out, lse, dropout_mask, is_causal, mask, scale):
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_attention_flash_musa_backward(
        grad_out, q, k, v, out, lse, dropout_mask, is_causal, attn_mask=mask
    )
    return dq, dk, dv


MUSA_FLASH = FlashKernels(_flash_forward, _flash_backward, "bool", _LSE_PAD, takes_scale=False)


# The lower bound: MT-TransformerEngine sends this op only head dims of at least 64
# (MooreThreads/MT-TransformerEngine, transformer_engine/musa/pytorch/attention.py,
# ``_MIN_MUSA_DIM = 64`` in ``flash_attn_varlen_func_variance``; smaller ones raise), and
# torch_musa's own tests of it use 64 and 128 only. The forward sees d, the backward d + 8.
_LSE_MIN_HEAD_DIM = 64


def flash_lse_ok(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, query_documents=None,
    key_documents=None,
) -> bool:  # fmt: skip
    """Same head dims for q, k and v (the padding widens them together), at least 64,
    at most 128 once padded, and the default scale."""
    d = q.shape[-1]
    return (
        v.shape[-1] == d
        and d >= _LSE_MIN_HEAD_DIM
        and d + _LSE_PAD <= 128
        and default_scale(q, scale)
    )


def musa_flash_attention_lse(
    q, k, v, causal=True, key_padding_mask=None, scale=None, window=None, query_documents=None,
    key_documents=None,
):  # fmt: skip
    """``mtcore.ops.attention_lse`` through muDNN flash attention (a window and document
    ids as part of its bool mask)."""
    return flash_attention_lse(
        MUSA_FLASH, q, k, v, causal, key_padding_mask, scale, window, query_documents,
        key_documents,
    )  # fmt: skip


# Not used, on purpose (docs/musa.md, section 7):
#   * variable-length flash attention (aten::_flash_attention_forward with cu_seqlens,
#     muDNN >= 3000, Attention.cpp): mtcore.ops.attention takes dense [b, h, s, d] with a
#     key_padding_mask of any pattern and defines outputs for padded queries; varlen
#     needs packed, right-padded tokens and host-side max lengths (a sync per call), and
#     drops padded queries. Padded batches already run muDNN flash through SDPA's
#     boolean attn_mask (SDPUtils.h, check_musa_attn_mask refuses only masks needing grad).
#   * torch_musa.distributed.loss.parallel_fused_cross_entropy: mean/sum only, no
#     ignore_index (a TODO in FusedCrossEntropyLoss.mu), float32 DTensor logits, its own
#     all-gather; the vocab-parallel loss (mtcore.parallel) is no kernel op. The one-rank
#     loss does take muDNN's fused kernel (mtcore_musa.loss).


# -- RMSNorm --------------------------------------------------------------------------
# F.rms_norm reaches muDNN only through aten::_fused_rmsnorm_forward, an op that exists
# only in torch_musa's patched torch: torch_patches/aten_src_ATen_native_native_functions
# .yaml.patch defines it, torch_patches/aten_src_ATen_native_layer_norm.cpp.patch makes
# rms_norm call it for PrivateUse1 inputs, and csrc/aten/ops/musa_functions.yaml
# registers muDNN's FusedRMSNormForward for it (v1.3.0 to v2.7.1). torch's own
# aten::_fused_rms_norm (torch >= 2.8) appears in no torch_musa tag: a PrivateUse1
# kernel for it says nothing about muDNN. Without the op, F.rms_norm is torch's
# composite: correct, but not muDNN, so not registered.
FUSED_RMSNORM_OP = "aten::_fused_rmsnorm_forward"


def has_musa_kernel(op: str) -> bool:
    """Whether the dispatcher holds a MUSA (PrivateUse1) kernel for ``op``."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, "PrivateUse1"))
    except Exception:  # the op does not exist in this torch build
        return False


def mudnn_rms_norm_registered() -> bool:
    """Whether torch_musa registered muDNN's fused RMSNorm (see FUSED_RMSNORM_OP)."""
    return has_musa_kernel(FUSED_RMSNORM_OP)


def rms_norm_weight_ok(x, weight, eps=1e-6) -> bool:
    """torch_musa's fused RMSNorm TORCH_CHECKs that weight and input share dtype and device
    (csrc/aten/ops/RMSNorm.cpp, ``CheckDType``/``CheckDevice``); the reference upcasts a
    weight of another dtype, so such calls (fp32 weight, bf16 activations) go there."""
    return weight.dtype == x.dtype and weight.device == x.device


# -- LayerNorm ------------------------------------------------------------------------
# F.layer_norm on musa tensors runs muDNN's LayerNorm: musa_functions.yaml registers
# NativeLayerNorm (csrc/aten/ops/LayerNorm.cpp) for aten::native_layer_norm. It takes
# float32/float16/bfloat16, keeps mean and rstd in the accumulate type (float32 for half
# inputs), and TORCH_CHECKs "Dtypes of output/weight must be same" (and bias).
NATIVE_LAYER_NORM_OP = "aten::native_layer_norm"


def layer_norm_affine_ok(x, weight, bias, eps=1e-5) -> bool:
    """Weight and bias in the input's dtype and on its device, as LayerNorm.cpp checks;
    the reference takes an fp32 weight beside bf16 activations, so those calls go there."""
    return all(t.dtype == x.dtype and t.device == x.device for t in (weight, bias) if t is not None)


# -- AdamW ----------------------------------------------------------------------------
def adamw_fast_path_ok(
    params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay
) -> bool:
    """Fused multi-tensor AdamW kernels need every tensor float32 on one device.

    torch_musa's kernel TORCH_CHECKs ``check_fast_path_restrictions`` (same dtype, device
    and layout across params, grads and moments; csrc/extension/FusedAdam.mu), and the
    reference requires float32 moments, so only all-float32 lists take it. Anything
    else (bf16 params, bad input) goes to the reference, which also raises its errors.
    """
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    if step < 1 or len({len(t) for t in lists}) != 1 or not params:
        return False
    device = params[0].device
    for group in zip(*lists, strict=True):
        if any(t.dtype != torch.float32 or t.device != device for t in group):
            return False
        if any(t.shape != group[0].shape for t in group):
            return False
    return True


def musa_fused_adamw_step(
    params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps, weight_decay
):
    """``mtcore.ops.adamw_step`` through torch_musa's ``torch.ops.musa._fused_adamw_``.

    The op (torch_musa/optim/fused_adamw.py, a ``torch.library.custom_op``) takes
    ``state_steps`` as float32 *CPU* tensors and its kernel adds 1 to each of them on
    the host before computing the bias corrections (FusedAdam.mu,
    ``multi_tensor_apply_for_fused_adam``). The reference's ``step`` is the count
    after incrementing, so each tensor starts at ``step - 1``; one tensor per
    parameter, since a shared one would be incremented once per parameter.
    """
    if not params:
        return
    state_steps = [torch.full((), float(step - 1), dtype=torch.float32) for _ in params]
    torch.ops.musa._fused_adamw_(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],  # max_exp_avg_sqs: amsgrad is off
        state_steps,
        float(lr),
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )


def musa_fused_adamw_available() -> bool:
    """Whether torch_musa registered ``musa::_fused_adamw_`` (importing its optim module
    registers it; that import may fail on a partial build, which only means 'no')."""
    with contextlib.suppress(Exception):
        importlib.import_module(f"{TORCH_MUSA}.optim")
    try:
        return hasattr(torch.ops.musa, "_fused_adamw_")
    except Exception:
        return False


# -- RoPE -----------------------------------------------------------------------------
# F.rope(input, freq_cis, rotary_interleaved=False, batch_first=False) exists only in
# torch_musa's patched torch. Its convention, from torch_musa's own test
# (tests/unittest/operator/test_rope_apply.py, apply_rotary_pos_emb_bshd) and kernel
# (csrc/aten/ops/RoPE.cpp, RopeOut):
#   * input [seq, batch, heads, dim] when batch_first=False. The kernel makes only the
#     last dim contiguous and hands the other strides to muDNN; the test runs contiguous
#     inputs and head slices of them (its "qkv_merge" and "dist_split" cases), never
#     seq and batch strides in swapped order. So the adapter passes a contiguous
#     [seq, batch, heads, dim] copy: the layout that is tested, at the cost of a copy.
#   * freq_cis holds *angles* [seq, dim]; the kernel takes cos/sin of them;
#   * rotary_interleaved=False rotates halves: out = x * cos + rotate_half(x) * sin,
#     rotate_half(x) = cat(-x2, x1). With freq_cis = cat(theta, theta) this is exactly
#     mtcore.ops.rope's cat(x1 cos - x2 sin, x2 cos + x1 sin).
#   * RoPE.cpp checks only the input's dtype (float32, float16, bfloat16; freq_cis is
#     not checked), so every float input is offered. The angles stay float32 whatever
#     the input's dtype: a bf16 angle near position 4096 is off by up to 16 rad.
# batch_first=True would avoid the copies, but no test in the source exercises it.
def rope_inputs_ok(x, cos, sin) -> bool:
    """Shapes and tables F.rope is known to take; anything else goes to the reference."""
    if x.dim() != 4 or x.shape[-1] % 2:
        return False
    want = (x.shape[1], x.shape[-1] // 2)
    return all(
        tuple(t.shape) == want
        and t.dtype == torch.float32
        and t.device == x.device
        and not t.requires_grad  # F.rope differentiates the input only
        for t in (cos, sin)
    )


def musa_rope(x, cos, sin):
    """``mtcore.ops.rope`` ([batch, seq, heads, dim]) through torch_musa's ``F.rope``."""
    theta = torch.atan2(sin, cos)  # back to angles: cos(theta) = cos up to rounding
    freq_cis = torch.cat((theta, theta), dim=-1)
    out = F.rope(
        input=x.transpose(0, 1).contiguous(),  # [seq, batch, heads, dim], as tested
        freq_cis=freq_cis,
        rotary_interleaved=False,
        batch_first=False,
    )
    return out.transpose(0, 1).contiguous()


# -- SwiGLU ---------------------------------------------------------------------------
# F.swish_glu(input) exists only in torch_musa's patched torch. Its convention, from
# torch_musa's test (its swish_glu test, swish_glu_cpu; csrc/aten/ops/SwiGlu.cpp):
# chunk(2, dim=-1) -> silu(first) * second, compared against a float32 computation,
# float32/float16/bfloat16, arch >= 2.2. That is mtcore.ops.swiglu's [gate | up].
def swiglu_input_ok(x) -> bool:
    return x.dim() > 0 and x.shape[-1] % 2 == 0


def musa_swiglu(x):
    """``mtcore.ops.swiglu`` through torch_musa's ``F.swish_glu``."""
    return F.swish_glu(x)


# -- the kernel list ------------------------------------------------------------------
MUDNN_FUSED_MIN_VERSION = (
    2800  # Rope and SwiGlu raise "not supported" below it (RoPE.cpp, SwiGlu.cpp)
)


def mudnn_version() -> int | None:
    """``torch.backends.mudnn.version()`` (set up by torch_musa/core/mudnn.py), or None."""
    try:
        return int(torch.backends.mudnn.version())
    except Exception:
        return None


def musa_kernels(device: TorchModuleDevice) -> list[KernelImpl]:
    """The implementations to register, chosen by probing what torch_musa provides."""

    def on_musa(dtypes: tuple[torch.dtype, ...], arch: bool = False, least=MUDNN_MIN_CAPABILITY):
        def predicate(query: KernelQuery) -> bool:
            if query.device_type != device.type or query.dtype not in dtypes:
                return False
            return not arch or bool(device.capability_at_least(least))

        return predicate

    impls = [
        KernelImpl(
            "attention",
            musa_sdpa_attention,
            "sdpa",
            priority=50,
            predicate=on_musa(_HALF, arch=True),
            fallback_ok=attention_ok(lambda: sdpa_honours_scale(device), flash_head_dims_ok),
        ),
    ]
    if has_musa_kernel(FLASH_MUSA_OP):
        impls.append(
            KernelImpl(
                "attention_lse",
                musa_flash_attention_lse,
                "mudnn-flash",
                priority=50,
                predicate=on_musa(_HALF, arch=True),
                fallback_ok=flash_lse_ok,
            )
        )
    if mudnn_rms_norm_registered():
        # torch.rms_norm on musa tensors calls aten::_fused_rmsnorm_forward (muDNN), which
        # keeps its inverse RMS in float32 for half inputs (RMSNorm.cpp, InferInvvarDType).
        impls.append(
            KernelImpl(
                "rms_norm",
                torch_native.fused_rms_norm,
                "F.rms_norm",
                priority=50,
                predicate=on_musa(_FLOATS),
                fallback_ok=rms_norm_weight_ok,
            )
        )
    if has_musa_kernel(NATIVE_LAYER_NORM_OP):
        impls.append(
            KernelImpl(
                "layer_norm",
                torch_native.fused_layer_norm,
                "F.layer_norm",
                priority=50,
                predicate=on_musa(_FLOATS),
                fallback_ok=layer_norm_affine_ok,
            )
        )
    if has_musa_kernel(FUSED_CROSS_ENTROPY_OP):  # muDNN's fused loss (mtcore_musa.loss)
        impls.append(
            KernelImpl(
                "cross_entropy",
                torch_native.fused_cross_entropy,
                "F.cross_entropy",
                priority=50,
                predicate=on_musa(_FLOATS, arch=True, least=FUSED_CROSS_ENTROPY_MIN_CAPABILITY),
            )
        )
    # Only torch_musa's own op: torch's aten::_fused_adamw_ is a stub on musa that raises
    # "torch.optim.AdamW(fused=True) is not supported, try torch_musa.optim.FusedAdamW"
    # (csrc/aten/ops/FusedAdam.cpp), so torch_native.fused_adamw_step is no fallback here.
    if musa_fused_adamw_available():
        impls.append(
            KernelImpl(
                "adamw_step",
                musa_fused_adamw_step,
                "musa-fused",
                priority=50,
                predicate=on_musa((torch.float32,)),
                fallback_ok=adamw_fast_path_ok,
            )
        )
    fused_mudnn = (mudnn_version() or 0) >= MUDNN_FUSED_MIN_VERSION
    if fused_mudnn and hasattr(F, "rope"):
        impls.append(
            KernelImpl(
                "rope",
                musa_rope,
                "F.rope",
                priority=50,
                predicate=on_musa(_FLOATS, arch=True),
                fallback_ok=rope_inputs_ok,
            )
        )
    if fused_mudnn and hasattr(F, "swish_glu"):
        impls.append(
            KernelImpl(
                "swiglu",
                musa_swiglu,
                "F.swish_glu",
                priority=50,
                predicate=on_musa(_FLOATS, arch=True),
                fallback_ok=swiglu_input_ok,
            )
        )
    return impls
