"""P2's public function, its forward and its differentiable layer.

- :func:`moe_experts_backward`: all routed experts' backward with the forward recomputed inside (the
  benchmark's function): checks, then the reference or the Triton kernels.
- :func:`moe_experts_forward`: y [T, H] for the layers (no checks).
- :func:`moe_experts`: the layer; it saves nothing but its inputs, and its backward recomputes the
  forward, as the benchmark's P2 does. Its forward runs the Triton kernels too where the backward
  does (a grouped GEMM per expert over the routed rows, no host synchronisation).

NaN and Inf in the inputs are not looked for (that would cost a pass over every input and a host sync):
they flow into the outputs as the arithmetic carries them. ``check_finite=True`` opts into that check.
"""

from __future__ import annotations

import torch

from ..dispatch import check_impl, resolve_impl
from ..validation import check_contiguous, finite, flag, not_differentiable_again
from .checks import INPUT_NAMES, check_moe_experts_backward
from .reference import moe_experts_backward_reference, moe_experts_forward_reference


def moe_experts_backward(
    grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
    *, impl: str = "auto", validate: bool = True, check_finite: bool = False,
):  # fmt: skip
    """Backward of all routed SwiGLU experts of one MoE layer (P2), the forward recomputed inside.

    Shapes: grad_output, hidden_states [T, H]; topk_indices [T, K] int64/int32 (K distinct experts
    per token); topk_weights [T, K]; gate_weights, up_weights [E, I, H]; down_weights [E, H, I].
    Returns freshly allocated (grad_hidden_states [T, H], grad_topk_weights [T, K],
    grad_gate_weights [E, I, H], grad_up_weights [E, I, H], grad_down_weights [E, H, I]);
    experts no token chose get exact zeros. ``validate=False`` skips the index-value checks
    (range, duplicates), which need a host sync. NaN/Inf in the inputs pass through unchecked;
    ``check_finite=True`` raises a ``ValueError`` naming the first float input that holds one (a pass over
    every input and one host sync).
    """
    check_impl(impl)
    args = (grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    return _backward(args, impl=impl, validate=validate, check_finite=check_finite)


def _backward(args: tuple, *, impl: str, validate: bool, check_finite: bool, preactivations=None):
    """The checks, then the reference or the Triton kernels; ``preactivations`` (g, u), saved by the
    layer's Triton forward, are read instead of recomputed (only the Triton path has them)."""
    flag("check_finite", check_finite)
    check_moe_experts_backward(*args, validate=validate)
    if check_finite:
        finite(dict(zip(INPUT_NAMES, args, strict=True)))
    hidden_states = args[1]
    if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "reference":
        return moe_experts_backward_reference(*args)
    check_contiguous(dict(zip(INPUT_NAMES, args, strict=True)))
    from .launch import moe_experts_backward_triton  # imports triton: only on this path

    return moe_experts_backward_triton(*args, preactivations=preactivations)


def moe_experts_forward(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
                        *, impl: str = "auto"):  # fmt: skip
    """P2's forward y [T, H] (no validation: for the layers): the Triton kernels where ``impl``
    resolves to Triton (bf16×3 for g and u with fp32 inputs, bf16 products for Wd·a), the reference
    loop over experts otherwise."""
    inputs = (hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "triton":
        from .launch import moe_experts_forward_triton

        return moe_experts_forward_triton(*inputs)
    return moe_experts_forward_reference(*inputs)


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, impl,
                check_finite, save_activations):  # fmt: skip
        inputs = (hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
        ctx.impl, ctx.check_finite = impl, check_finite
        on_triton = resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "triton"
        if not (save_activations and on_triton):  # the reference recomputes the forward in any case
            ctx.save_for_backward(*inputs)
            return moe_experts_forward(*inputs, impl=impl)
        from .launch import moe_experts_forward_triton

        y, (gate_pre, up_pre) = moe_experts_forward_triton(*inputs, save_preactivations=True)
        ctx.save_for_backward(*inputs, gate_pre, up_pre)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights = ctx.saved_tensors[:6]
        args = (grad_output.contiguous(), hidden_states, topk_indices, topk_weights, gate_weights, up_weights,
                down_weights)  # fmt: skip
        preactivations = tuple(ctx.saved_tensors[6:]) or None  # g and u, where the forward kept them
        (grad_x, grad_w, grad_gate, grad_up, grad_down) = _backward(
            args, impl=ctx.impl, validate=False, check_finite=ctx.check_finite, preactivations=preactivations)
        if resolve_impl(ctx.impl, hidden_states.device, hidden_states.dtype) == "triton":
            depends_on = (grad_output, hidden_states, topk_weights, gate_weights, up_weights, down_weights)
            grad_x, grad_w, grad_gate, grad_up, grad_down = not_differentiable_again(
                (grad_x, grad_w, grad_gate, grad_up, grad_down), depends_on, DOUBLE_BACKWARD_REFUSED)
        return grad_x, None, grad_w, grad_gate, grad_up, grad_down, None, None, None


DOUBLE_BACKWARD_REFUSED = (
    "impl: moe_experts' Triton backward cannot be differentiated again (double backward); "
    "use impl='reference' for higher-order gradients"
)


def moe_experts(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
                *, impl: str = "auto", validate: bool = True, check_finite: bool = False,
                save_activations: bool = False):  # fmt: skip
    """y_t = Σ_k w_tk · Wd_e (silu(Wg_e x_t) ⊙ Wu_e x_t), e = topk_indices[t, k].

    Differentiable in hidden_states, topk_weights and the three expert weight tensors; the backward
    recomputes the forward and runs ``moe_experts_backward(impl=impl)``. With the Triton path the
    forward is :func:`moe_lib.moe_experts.launch.moe_experts_forward_triton` (fp32 inputs: g and u
    from bf16×3 products, Wd·a from bf16 products: relative error ≈ 2e-3).
    Twice differentiable (``create_graph=True``) on the reference path; differentiating the Triton
    path's gradients again raises a ``RuntimeError``. NaN/Inf pass through unchecked;
    ``check_finite=True`` raises a ``ValueError`` naming the first non-finite input (in the backward:
    grad_output and the saved inputs).
    ``save_activations``: the memory/compute choice. False (default) saves nothing but the inputs and
    the backward recomputes g and u; True keeps the pre-activations g and u (2·T·K·I values in the input
    dtype) from the forward, and the backward reads them instead (on the Triton path; the reference
    recomputes either way).
    """
    check_impl(impl)
    flag("check_finite", check_finite)
    flag("save_activations", save_activations)
    check_moe_experts_backward(
        hidden_states, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
        validate=validate,
    )  # fmt: skip
    if check_finite:
        finite(dict(hidden_states=hidden_states, topk_weights=topk_weights, gate_weights=gate_weights,
                    up_weights=up_weights, down_weights=down_weights))  # fmt: skip
    return _MoEExperts.apply(
        hidden_states.contiguous(), topk_indices.contiguous(), topk_weights.contiguous(),
        gate_weights, up_weights, down_weights, impl, check_finite, save_activations,
    )  # fmt: skip
