"""P1's public function and its differentiable layer.

- :func:`swiglu_down_backward`: the backward of one SwiGLU expert with down projection from its saved
  forward tensors (the benchmark's function): checks, then the reference or the Triton kernels.
- :func:`swiglu_expert`: y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ whose backward runs that function. It saves x,
  gate and up ([T, H] + 2·[T, I]) and recomputes σ(gate), silu(gate) and the intermediate in the
  backward: elementwise work that costs far less than storing and re-reading three more [T, I] tensors.
  On the Triton path that elementwise step is one launch in the forward and one in the backward
  (:func:`.activation.swiglu_activation`), where PyTorch's eager ops take several.

NaN and Inf in the inputs are not looked for (that would cost a pass over every input and a host sync):
they flow into the outputs as the arithmetic carries them. ``check_finite=True`` opts into that check.
"""

from __future__ import annotations

import torch

from ..dispatch import check_impl, resolve_impl
from ..precision import compute_dtype
from ..validation import check_contiguous, finite, flag, not_differentiable_again
from .checks import INPUT_NAMES, check_precision, check_swiglu_down_backward, check_swiglu_expert
from .reference import swiglu_down_backward_reference


def swiglu_down_backward(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
    *, impl: str = "auto", validate: bool = True, precision: str = "faithful", check_finite: bool = False,
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
    half the tensor work of the dx, dWg and dWu products. The design follows the shape, the dtype and the
    device (:func:`.choose.choose_design`, whose docstring lists the rules): one launch for few tokens, then on a
    Hopper GPU two TMA-fed Gluon launches, cuBLAS's GEMMs around one Triton pass for the fast path, and portable
    Triton launches where neither runs.
    NaN/Inf in the inputs pass through unchecked; ``check_finite=True`` raises a ``ValueError`` naming the
    first input that holds one (a pass over every input and one host sync).
    """
    check_impl(impl)
    check_precision(precision)
    flag("check_finite", check_finite)
    args = (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate)
    check_swiglu_down_backward(*args)
    if check_finite:
        finite(dict(zip(INPUT_NAMES, args, strict=True)))
    if resolve_impl(impl, x.device, x.dtype) == "reference":
        return swiglu_down_backward_reference(*args)
    check_contiguous(dict(zip(INPUT_NAMES, args, strict=True)))
    from .backward import swiglu_down_backward_triton  # imports triton: only on this path

    return swiglu_down_backward_triton(*args, precision=precision)


class _SwiGLUExpert(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, impl, precision, check_finite):
        on_triton = resolve_impl(impl, x.device, x.dtype) == "triton"
        gate = x @ gate_weight.T
        up = x @ up_weight.T
        if on_triton:  # one launch for the elementwise step
            from .activation import swiglu_activation  # imports triton: only on this path

            intermediate = swiglu_activation(gate, up, with_saved=False)
        else:
            intermediate = _swiglu_saved(gate, up)[2]
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight, gate, up)
        ctx.impl, ctx.precision, ctx.check_finite = impl, precision, check_finite
        return intermediate @ down_weight.T

    @staticmethod
    def backward(ctx, grad_output):
        x, gate_weight, up_weight, down_weight, gate, up = ctx.saved_tensors
        on_triton = resolve_impl(ctx.impl, x.device, x.dtype) == "triton"
        if torch.is_grad_enabled() and not on_triton:
            # create_graph=True on the reference path: gate and up recomputed where autograd sees them, so
            # that the gradients are differentiable again (exactly, through the reference's PyTorch ops)
            gate, up = x @ gate_weight.T, x @ up_weight.T
        if on_triton:  # the saved tensors in one launch
            from .activation import swiglu_activation

            gate_sigmoid, gate_silu, intermediate = swiglu_activation(gate, up, with_saved=True)
        else:
            gate_sigmoid, gate_silu, intermediate = _swiglu_saved(gate, up)
        grads = swiglu_down_backward(
            grad_output.contiguous(), x, gate_weight, up_weight, down_weight,
            gate, gate_sigmoid, gate_silu, up, intermediate, impl=ctx.impl, precision=ctx.precision,
            check_finite=ctx.check_finite,
        )  # fmt: skip
        if on_triton:
            grads = not_differentiable_again(grads, (grad_output, x, gate_weight, up_weight, down_weight),
                                             DOUBLE_BACKWARD_REFUSED)  # fmt: skip
        return (*grads, None, None, None)


DOUBLE_BACKWARD_REFUSED = (
    "impl: swiglu_expert's Triton backward cannot be differentiated again (double backward); "
    "use impl='reference' for higher-order gradients"
)


def _swiglu_saved(gate, up):
    """σ(gate), silu(gate) and the intermediate as the benchmark's forward rounds them."""
    f = compute_dtype(gate.dtype)
    gate_sigmoid = torch.sigmoid(gate.to(f)).to(gate.dtype)
    gate_silu = gate * gate_sigmoid
    return gate_sigmoid, gate_silu, gate_silu * up


def swiglu_expert(x, gate_weight, up_weight, down_weight, *, impl: str = "auto", precision: str = "fast",
                  check_finite: bool = False):  # fmt: skip
    """y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ for x [..., H], gate/up weights [I, H], down weight [H, I].

    Differentiable in all four arguments; the backward runs ``swiglu_down_backward(impl=impl,
    precision=precision)``: "fast" by default, as training frameworks round the intermediate gradients.
    Twice differentiable (``create_graph=True``) on the reference path; differentiating the Triton
    path's gradients again raises a ``RuntimeError``. NaN/Inf pass through unchecked;
    ``check_finite=True`` raises a ``ValueError`` naming the first non-finite input (in the backward:
    grad_output and the saved tensors). Passing ``gate_weight`` and ``up_weight`` as the two row halves of one
    [2I, H] tensor (``w[:I]``, ``w[I:]``) spares the fast backward a copy of both per call.
    """
    check_impl(impl)
    check_precision(precision)
    flag("check_finite", check_finite)
    check_swiglu_expert(x, gate_weight, up_weight, down_weight)
    if check_finite:
        finite(dict(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight))
    lead, H = x.shape[:-1], x.shape[-1]
    y = _SwiGLUExpert.apply(x.reshape(-1, H).contiguous(), gate_weight, up_weight, down_weight, impl, precision,
                            check_finite)  # fmt: skip
    return y.reshape(*lead, H)
