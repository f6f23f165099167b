"""Which implementation runs a call: ``impl`` resolved against the device, the dtype and what is installed.

``impl="reference"`` is readable PyTorch (any device, any float dtype); ``impl="triton"`` our kernels
(CUDA, or CPU tensors under ``TRITON_INTERPRET=1``); ``impl="auto"`` Triton on CUDA where triton is
importable and the dtype is one the kernels compute in, the reference otherwise. The kernel modules
import this module (for :func:`interpreter_enabled`), never the public API.
"""

from __future__ import annotations

import importlib.util
import os

import torch

IMPLS = ("auto", "reference", "triton")
# float dtypes the Triton paths compute in; "auto" falls back to the reference for others (float64)
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET`` set and not 0)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# looked up once: torch.compile does not trace importlib (a graph break in every layer on CUDA)
TRITON_IMPORTABLE = importlib.util.find_spec("triton") is not None


def triton_importable() -> bool:
    return TRITON_IMPORTABLE


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton path cannot run on ``device`` (None when it can)."""
    if not triton_importable():
        return "triton is not installed"
    if device.type != "cuda" and not interpreter_enabled():
        return (
            f"needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 before importing triton, "
            "or use impl='reference'"
        )
    return None


def resolve_impl(impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """Turn ``impl`` (already checked) into "reference" or "triton" for tensors on ``device``."""
    if impl == "auto":
        use_triton = device.type == "cuda" and dtype in TRITON_DTYPES and triton_importable()
        return "triton" if use_triton else "reference"
    if impl == "triton":
        if dtype not in TRITON_DTYPES:
            raise TypeError(f"impl: 'triton' supports dtypes {TRITON_DTYPES}, got {dtype}; use impl='reference'")
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise ValueError(f"impl: 'triton' {reason}")
    return impl
