"""Stores that round float32 to the output dtype to nearest even on every target.

``x.to(tl.bfloat16)`` rounds to nearest even on GPUs but truncates in Triton's
CPU interpreter (3.x), where the tests run. Rounding the float32 bits first makes
the final cast exact, so the interpreter checks the rounding the GPU performs.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_rounded(ptr, value, mask):
    """``tl.store(ptr, value.to(element type), mask)`` with round-to-nearest-even."""
    if ptr.dtype.element_ty == tl.bfloat16:
        bits = value.to(tl.float32).to(tl.int32, bitcast=True)
        # Add half an ulp of bf16 (less one, plus the kept lsb: ties go to even), clear the rest.
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        value = bits.to(tl.float32, bitcast=True)
    tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)
