"""The musa probe's cross-entropy checks (run by musa_probe.py, in its process): which
implementation serves ``cross_entropy`` by arch and by the presence of torch_musa's fused
op, what the adapter hands to ``F.cross_entropy``, and that its losses and gradients
equal the reference's (the stand-in's F.cross_entropy is torch's CPU one: this checks
the call, not muDNN). The vocab-parallel loss at tp 1 is the backend's ``cross_entropy``
(tests/unit/parallel checks that routing on the host)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _table(backend, dtype) -> list[str]:
    from mtcore.backend import KernelQuery

    return [i.name for i in backend.kernels["cross_entropy"].select(KernelQuery("musa", dtype))]


def probe_cross_entropy(out: dict, standin) -> None:
    import musa_standin as st

    from mtcore.backend import KernelQuery, plugin_registry, select_backend
    from mtcore.ops import cross_entropy

    facts: dict = {}
    saved = tuple(standin.capability)
    standin.capability = (3, 1)
    plugin_registry(reload=True)
    facts["without_op_31"] = _table(select_backend("musa"), torch.float32)
    st.register_fused_cross_entropy(standin)
    plugin_registry(reload=True)
    backend = select_backend("musa")
    facts["with_op_31"] = {str(d): _table(backend, d) for d in (torch.float32, torch.bfloat16)}
    standin.capability = (3, 0)
    facts["with_op_30"] = _table(backend, torch.float32)
    standin.capability = (2, 2)
    facts["with_op_22"] = _table(backend, torch.float32)
    standin.capability = (3, 1)

    calls = []
    original = F.cross_entropy

    def recording(input, target, *args, **kwargs):
        calls.append({"dtype": str(input.dtype), "dim": input.dim(), **{
            k: kwargs.get(k) for k in ("ignore_index", "reduction")}})  # fmt: skip
        return original(input, target, *args, **kwargs)

    gen = torch.Generator().manual_seed(3)
    diffs = {}
    F.cross_entropy = recording
    try:
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(9, 50, generator=gen).to(dtype)
            target = torch.randint(0, 50, (9,), generator=gen)
            target[[1, 6]] = -100
            grad = torch.rand(9, generator=gen)
            got_x = logits.clone().requires_grad_()
            ref_x = logits.clone().requires_grad_()
            # The stand-in's "musa" tensors are CPU tensors, which the table serves with
            # the host's kernels: the implementation musa resolves is called directly.
            (impl,) = backend.kernels["cross_entropy"].select(KernelQuery("musa", dtype))
            got = impl.fn(got_x, target, -100)
            ref = cross_entropy(ref_x, target, -100)
            (got * grad).sum().backward()
            (ref * grad).sum().backward()
            diffs[str(dtype)] = {
                "loss": (got - ref).abs().max().item(),
                "grad": (got_x.grad.float() - ref_x.grad.float()).abs().max().item(),
                "loss_dtype": str(got.dtype),
                "ignored": [got[1].item(), got[6].item()],
                "ignored_grad_zero": bool((got_x.grad[[1, 6]] == 0).all()),
            }
    finally:
        F.cross_entropy = original
    facts["calls"] = calls
    facts["vs_reference"] = diffs
    standin.capability = saved
    out["cross_entropy"] = facts
