"""The public backward functions: validate, pick an implementation, run it.

``impl="reference"`` is the readable PyTorch of :mod:`moe_lib.reference` (any device, any float
dtype); ``impl="triton"`` is ours (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``);
``impl="auto"`` is triton on CUDA where its kernel is available, the reference otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from . import reference, validation

# problem name -> module holding its Triton path (a function named like the problem + "_triton")
TRITON_MODULES = {
    "swiglu_down_backward": "moe_lib.kernels.swiglu_down_backward",
    "moe_experts_backward": "moe_lib.kernels.moe_experts_backward",
}


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(problem: str) -> bool:
    """Whether a Triton path exists for ``problem`` and triton can be imported."""
    if importlib.util.find_spec("triton") is None:
        return False
    return importlib.util.find_spec(TRITON_MODULES[problem]) is not None


# float dtypes the Triton paths compute in; "auto" falls back to the reference for others (float64)
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def resolve_impl(problem: str, impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """Turn ``impl`` (already checked) into "reference" or "triton" for tensors on ``device``."""
    if impl == "auto":
        use_triton = device.type == "cuda" and dtype in TRITON_DTYPES and triton_available(problem)
        return "triton" if use_triton else "reference"
    if impl == "triton":
        if dtype not in TRITON_DTYPES:
            raise TypeError(f"impl: 'triton' supports dtypes {TRITON_DTYPES}, got {dtype}; use impl='reference'")
        if not triton_available(problem):
            raise ValueError(f"impl: 'triton' is not available for {problem} (triton missing or no kernel)")
        if device.type != "cuda" and not triton_interpreter_enabled():
            raise ValueError(
                f"impl: 'triton' needs CUDA tensors (got {device}); on CPU set TRITON_INTERPRET=1 "
                "before importing triton, or use impl='reference'"
            )
    return impl


def _triton_function(problem: str):
    return getattr(importlib.import_module(TRITON_MODULES[problem]), f"{problem}_triton")


def swiglu_down_backward(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
    *, impl: str = "auto", validate: bool = True,
):  # fmt: skip
    """Backward of one SwiGLU expert with down projection (P1) from its saved forward tensors.

    Shapes: grad_output, x [T, H]; gate_weight, up_weight [I, H]; down_weight [H, I];
    gate, gate_sigmoid, gate_silu, up, intermediate [T, I]; all one float dtype and device.
    Returns freshly allocated (grad_x [T, H], grad_gate_weight [I, H], grad_up_weight [I, H],
    grad_down_weight [H, I]) in the input dtype. ``validate`` is accepted for symmetry with P2:
    P1 has no index values to check, so every check here reads metadata only.
    """
    validation.check_impl(impl)
    args = (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate)
    validation.check_swiglu_down_backward(*args)
    chosen = resolve_impl("swiglu_down_backward", impl, x.device, x.dtype)
    if chosen == "reference":
        return reference.swiglu_down_backward_reference(*args)
    validation.check_contiguous(dict(zip(_P1_NAMES, args, strict=True)))
    return _triton_function("swiglu_down_backward")(*args)


def moe_experts_backward(
    grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
    *, impl: str = "auto", validate: bool = True,
):  # fmt: skip
    """Backward of all routed SwiGLU experts of one MoE layer (P2), the forward recomputed inside.

    Shapes: grad_output, hidden_states [T, H]; topk_indices [T, K] int64/int32 (K distinct experts
    per token); topk_weights [T, K]; gate_weights, up_weights [E, I, H]; down_weights [E, H, I].
    Returns freshly allocated (grad_hidden_states [T, H], grad_topk_weights [T, K],
    grad_gate_weights [E, I, H], grad_up_weights [E, I, H], grad_down_weights [E, H, I]);
    experts no token chose get exact zeros. ``validate=False`` skips the index-value checks
    (range, duplicates), which need a host sync.
    """
    validation.check_impl(impl)
    args = (grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    validation.check_moe_experts_backward(*args, validate=validate)
    chosen = resolve_impl("moe_experts_backward", impl, hidden_states.device, hidden_states.dtype)
    if chosen == "reference":
        return reference.moe_experts_backward_reference(*args)
    validation.check_contiguous(dict(zip(_P2_NAMES, args, strict=True)))
    return _triton_function("moe_experts_backward")(*args)


_P1_NAMES = (
    "grad_output", "x", "gate_weight", "up_weight", "down_weight",
    "gate", "gate_sigmoid", "gate_silu", "up", "intermediate",
)  # fmt: skip
_P2_NAMES = (
    "grad_output", "hidden_states", "topk_indices", "topk_weights", "gate_weights", "up_weights", "down_weights",
)  # fmt: skip


def moe_experts_forward(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
                        *, impl: str = "auto"):  # fmt: skip
    """P2's forward y [T, H] (no validation: for the layers): the Triton kernels where ``impl``
    resolves to the Triton backward (bf16×3 for g and u with fp32 inputs, bf16 products for Wd·a),
    the reference loop over experts otherwise."""
    inputs = (hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    if resolve_impl("moe_experts_backward", impl, hidden_states.device, hidden_states.dtype) == "triton":
        return importlib.import_module(TRITON_MODULES["moe_experts_backward"]).moe_experts_forward_triton(*inputs)
    return reference.moe_experts_forward_reference(*inputs)
