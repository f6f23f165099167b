"""P1's public function and its differentiable layer.

- :func:`swiglu_down_backward`: the backward of one SwiGLU expert with down projection from its saved
  forward tensors (the benchmark's function): checks, then the reference or the Triton kernels.
- :func:`swiglu_expert`: y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ whose backward runs that function. It saves x,
  gate and up ([T, H] + 2·[T, I]) and recomputes σ(gate), silu(gate) and the intermediate in the
  backward: elementwise work that costs far less than storing and re-reading three more [T, I] tensors.
"""

from __future__ import annotations

import torch

from ..dispatch import check_impl, resolve_impl
from ..precision import compute_dtype
from ..validation import check_contiguous
from .checks import INPUT_NAMES, check_precision, check_swiglu_down_backward, check_swiglu_expert
from .reference import swiglu_down_backward_reference


def swiglu_down_backward(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
    *, impl: str = "auto", validate: bool = True, precision: str = "faithful",
):  # fmt: skip
    """Backward of one SwiGLU expert with down projection (P1) from its saved forward tensors.

    Shapes: grad_output, x [T, H]; gate_weight, up_weight [I, H]; down_weight [H, I];
    gate, gate_sigmoid, gate_silu, up, intermediate [T, I]; all one float dtype and device.
    Returns freshly allocated (grad_x [T, H], grad_gate_weight [I, H], grad_up_weight [I, H],
    grad_down_weight [H, I]) in the input dtype. ``validate`` is accepted for symmetry with P2:
    P1 has no index values to check, so every check here reads metadata only.
    ``precision`` (Triton path, 16-bit inputs): "faithful" (default) keeps dGate and dUp to about 16
    significant bits, as the benchmark's fp32 reference does, so the outputs pass its element rule on
    inputs of any scale; "fast" rounds them to the input dtype first (as torch.compile does), at about
    half the tensor work of the dx, dWg and dWu products.
    """
    check_impl(impl)
    check_precision(precision)
    args = (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate)
    check_swiglu_down_backward(*args)
    if resolve_impl(impl, x.device, x.dtype) == "reference":
        return swiglu_down_backward_reference(*args)
    check_contiguous(dict(zip(INPUT_NAMES, args, strict=True)))
    from .launch import swiglu_down_backward_triton  # imports triton: only on this path

    return swiglu_down_backward_triton(*args, precision=precision)


class _SwiGLUExpert(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, impl, precision):
        gate = x @ gate_weight.T
        up = x @ up_weight.T
        intermediate = _swiglu_saved(gate, up)[2]
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight, gate, up)
        ctx.impl, ctx.precision = impl, precision
        return intermediate @ down_weight.T

    @staticmethod
    def backward(ctx, grad_output):
        x, gate_weight, up_weight, down_weight, gate, up = ctx.saved_tensors
        gate_sigmoid, gate_silu, intermediate = _swiglu_saved(gate, up)
        grads = swiglu_down_backward(
            grad_output.contiguous(), x, gate_weight, up_weight, down_weight,
            gate, gate_sigmoid, gate_silu, up, intermediate, impl=ctx.impl, precision=ctx.precision,
        )  # fmt: skip
        return (*grads, None, None)


def _swiglu_saved(gate, up):
    """σ(gate), silu(gate) and the intermediate as the benchmark's forward rounds them."""
    f = compute_dtype(gate.dtype)
    gate_sigmoid = torch.sigmoid(gate.to(f)).to(gate.dtype)
    gate_silu = gate * gate_sigmoid
    return gate_sigmoid, gate_silu, gate_silu * up


def swiglu_expert(x, gate_weight, up_weight, down_weight, *, impl: str = "auto", precision: str = "fast"):
    """y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ for x [..., H], gate/up weights [I, H], down weight [H, I].

    Differentiable in all four arguments; the backward runs ``swiglu_down_backward(impl=impl,
    precision=precision)``: "fast" by default, as training frameworks round the intermediate gradients.
    """
    check_impl(impl)
    check_precision(precision)
    check_swiglu_expert(x, gate_weight, up_weight, down_weight)
    lead, H = x.shape[:-1], x.shape[-1]
    y = _SwiGLUExpert.apply(x.reshape(-1, H).contiguous(), gate_weight, up_weight, down_weight, impl, precision)
    return y.reshape(*lead, H)
