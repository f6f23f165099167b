"""P2's public function, its forward and its differentiable layer.

- :func:`moe_experts_backward`: all routed experts' backward with the forward recomputed inside (the
  benchmark's function): checks, then the reference or the Triton kernels.
- :func:`moe_experts_forward`: y [T, H] for the layers (no checks).
- :func:`moe_experts`: the layer; it saves nothing but its inputs, and its backward recomputes the
  forward, as the benchmark's P2 does. Its forward runs the Triton kernels too where the backward
  does (a grouped GEMM per expert over the routed rows, no host synchronisation).
"""

from __future__ import annotations

import torch

from ..dispatch import check_impl, resolve_impl
from ..validation import check_contiguous
from .checks import INPUT_NAMES, check_moe_experts_backward
from .reference import moe_experts_backward_reference, moe_experts_forward_reference


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
    check_impl(impl)
    args = (grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    check_moe_experts_backward(*args, validate=validate)
    if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "reference":
        return moe_experts_backward_reference(*args)
    check_contiguous(dict(zip(INPUT_NAMES, args, strict=True)))
    from .launch import moe_experts_backward_triton  # imports triton: only on this path

    return moe_experts_backward_triton(*args)


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
    def forward(ctx, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, impl):
        ctx.save_for_backward(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
        ctx.impl = impl
        return moe_experts_forward(
            hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, impl=impl
        )

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights = ctx.saved_tensors
        (grad_x, grad_w, grad_gate, grad_up, grad_down) = moe_experts_backward(
            grad_output.contiguous(), hidden_states, topk_indices, topk_weights,
            gate_weights, up_weights, down_weights, impl=ctx.impl, validate=False,
        )  # fmt: skip
        return grad_x, None, grad_w, grad_gate, grad_up, grad_down, None


def moe_experts(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
                *, impl: str = "auto", validate: bool = True):  # fmt: skip
    """y_t = Σ_k w_tk · Wd_e (silu(Wg_e x_t) ⊙ Wu_e x_t), e = topk_indices[t, k].

    Differentiable in hidden_states, topk_weights and the three expert weight tensors; the backward
    recomputes the forward and runs ``moe_experts_backward(impl=impl)``. With the Triton path the
    forward is :func:`moe_lib.moe_experts.launch.moe_experts_forward_triton` (fp32 inputs: g and u
    from bf16×3 products, Wd·a from bf16 products: relative error ≈ 2e-3).
    """
    check_impl(impl)
    check_moe_experts_backward(
        hidden_states, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
        validate=validate,
    )  # fmt: skip
    return _MoEExperts.apply(
        hidden_states.contiguous(), topk_indices.contiguous(), topk_weights.contiguous(),
        gate_weights, up_weights, down_weights, impl,
    )  # fmt: skip
