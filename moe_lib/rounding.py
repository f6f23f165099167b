"""Rounding inside Triton kernels, shared by both problems' kernels (``@triton.jit`` only).

Triton's fp32 → bf16 cast rounds to nearest-even on the GPU; its CPU interpreter's truncates. Kernels
whose stored values must round as PyTorch rounds, on both, cast through :func:`round_to`.
"""

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """x (fp32) rounded to nearest-even in DTYPE (the interpreter's own fp32→bf16 cast truncates)."""
    if INTERPRETER and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)
