"""mtcore-triton: a kernel pack of fused Triton implementations of mtcore's kernel ops.

The pack is a plugin of its own (entry point ``mtcore_triton`` in ``mtcore.plugins``)
that implements only ``mtcore_kernels``: it offers its kernels to whichever backend's
torch device type an active Triton driver targets (:mod:`mtcore_triton.targets`).
The kernel modules (norms, pointwise, cross_entropy, adamw, fp8, rounding) import
triton; :mod:`mtcore_triton.plugin`, :mod:`mtcore_triton.registration`,
:mod:`mtcore_triton.targets` and :mod:`mtcore_triton.launch` do not at import, so
discovering the plugin costs nothing. Every kernel matches the reference op in
``mtcore.ops`` (its spec) within the conformance kit's tolerances; the tests run
them on CPU under ``TRITON_INTERPRET=1``.
"""

__version__ = "0.1.0"
