"""The musa probe's attention and hybrid-FP8 checks (run by musa_probe.py, in its process)."""

from __future__ import annotations

import math

import torch


def _served(chain, *args, **kwargs) -> str:
    return next(i.name for i in chain if i.fallback_ok is None or i.fallback_ok(*args, **kwargs))


def probe_attention(out: dict, standin) -> None:
    """SDPA's scale guard; attention_lse through the stand-in's flash ops, against the
    reference forward and backward (through the LSE too)."""
    import musa_standin_flash

    from mtcore.backend import KernelQuery, plugin_registry, select_backend
    from mtcore.ops import attention_lse
    from mtcore_musa import kernels

    backend = select_backend("musa")
    chain = backend.kernels["attention"].select(KernelQuery("musa", torch.bfloat16))
    q = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16)
    out["attention_by_scale"] = {
        label: _served(chain, q, q, q, True, None, scale)
        for label, scale in (("none", None), ("default", 1 / math.sqrt(64)), ("one", 1.0))
    }
    out["lse_before_op"] = [i.name for i in backend.kernels["attention_lse"].select(
        KernelQuery("musa", torch.bfloat16))]  # fmt: skip

    musa_standin_flash.register_flash(standin)
    plugin_registry(reload=True)
    backend = select_backend("musa")
    chain = backend.kernels["attention_lse"].select(KernelQuery("musa", torch.bfloat16))
    out["lse_table"] = [i.name for i in chain]
    out["lse_fp32_table"] = [i.name for i in backend.kernels["attention_lse"].select(
        KernelQuery("musa", torch.float32))]  # fmt: skip
    out["lse_served"] = {
        f"d{d}-{label}": _served(chain, *(torch.randn(1, 2, 4, d),) * 3, True, None, scale)
        for d in (32, 56, 64, 120, 128)
        for label, scale in (("default", None), ("one", 1.0))
    }

    gen = torch.Generator().manual_seed(7)
    diffs = {}
    for name, (sq, sk, causal, masked) in {
        "causal-square": (6, 6, True, False),
        "causal-block-below": (4, 9, True, False),
        "full-padded": (5, 7, False, True),
        "causal-documents": (8, 8, True, False),
    }.items():
        q = torch.randn(2, 4, sq, 16, generator=gen)
        k, v = torch.randn(2, 2, sk, 16, generator=gen), torch.randn(2, 2, sk, 16, generator=gen)
        mask = None
        if masked:
            mask = torch.ones(2, sk, dtype=torch.bool)
            mask[0, :3] = False
            mask[1] = False  # a batch row with no key at all
        d_out, d_lse = torch.randn(2, 4, sq, 16, generator=gen), torch.randn(2, 4, sq, generator=gen)
        results = []
        documents = {}
        if name.endswith("documents"):  # packed samples: two rows, other boundaries
            ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
            documents = dict(query_documents=ids, key_documents=ids)
        for fn in (kernels.musa_flash_attention_lse, attention_lse):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            o, lse = fn(*leaves, causal=causal, key_padding_mask=mask, **documents)
            finite = torch.isfinite(lse)
            grads = torch.autograd.grad((o, lse), leaves, (d_out, d_lse.masked_fill(~finite, 0)))
            results.append((o, torch.where(finite, lse, torch.zeros_like(lse)), *grads))
        diffs[name] = max((a - b).abs().max().item() for a, b in zip(*results, strict=True))
    out["lse_max_diff"] = diffs
    qb = torch.randn(1, 2, 4, 16).bfloat16()
    o, lse = kernels.musa_flash_attention_lse(qb, qb, qb)
    out["lse_bf16_dtypes"] = [str(o.dtype), str(lse.dtype)]


def probe_hybrid(out: dict, standin) -> None:
    """e5m2 x e4m3 native only where the stand-in's scaled matmul gets it right."""
    from mtcore.backend import plugin_registry, select_backend
    from mtcore.precision.fp8.recipes import FP8Recipe

    standin.capability, standin.musa_version = (3, 1), 4030
    facts = {}
    for mode in ("right", "wrong", "raise"):
        standin.mixed_fp8 = mode
        plugin_registry(reload=True)
        fp8 = select_backend("musa").fp8
        facts[mode] = {
            "same_format_native": fp8.is_native("tensor", "tensor"),
            "mixed_native": fp8.mixed_formats_native,
            "hybrid_paths": FP8Recipe(format="hybrid", scaling="current").paths(fp8),
        }
    out["hybrid"] = facts
    standin.capability, standin.mixed_fp8 = (2, 2), "right"
