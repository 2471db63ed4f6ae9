"""Triton kernel pack: fused implementations of mtcore's kernel ops.

Each module imports triton; :mod:`mtcore_cuda.triton_kernels.registration` does
not, so offering the pack to a backend costs nothing until a kernel first runs.
Every kernel matches the reference op in ``mtcore.ops`` (its spec) within the
conformance kit's tolerances; the tests run them on CPU under ``TRITON_INTERPRET=1``.
"""
