"""The number formats every path shares: what the references compute in, silu', and bf16 hi/lo splits.

- The references upcast to float32 (float64 stays float64), multiply there with TF32 off, and round
  back to the input dtype at the end: :func:`compute_dtype`, :func:`tf32_disabled`.
- silu'(z) = σ(z)·(1 + z·(1 − σ(z))): :func:`silu_grad`.
- A value split into two 16-bit halves, v ≈ hi + lo with hi = round(v), lo = round(v − hi): the
  fp32 interfaces multiply such halves on the tensor cores (bf16×3: hi·hi + hi·lo + lo·hi) where one
  bf16 product would be too coarse: :func:`split_halves`.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def tf32_disabled():
    """Plain fp32 products on CUDA for the duration (restores the previous setting)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the references compute in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def silu_grad(z: torch.Tensor) -> torch.Tensor:
    """d/dz silu(z) = σ(z)·(1 + z·(1 − σ(z)))."""
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def split_halves(v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) in ``dtype`` with v ≈ hi + lo: hi = round(v), lo = round(v − hi) (both nearest-even)."""
    hi = v.to(dtype)
    return hi, (v - hi.to(v.dtype)).to(dtype)
