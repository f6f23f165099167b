"""Differentiable layers whose backward runs :func:`moe_lib.swiglu_down_backward` and
:func:`moe_lib.moe_experts_backward` (Triton on CUDA, the reference elsewhere).

``swiglu_expert`` saves x, gate and up ([T, H] + 2·[T, I]) and recomputes σ(gate), silu(gate) and
the intermediate in the backward: elementwise work that costs far less than storing and re-reading
three more [T, I] tensors. ``moe_experts`` saves nothing but its inputs: its backward recomputes
the forward, as the benchmark's P2 does. Its forward runs the Triton kernels too where the backward
does (a grouped GEMM per expert over the routed rows, no host synchronisation), the reference loop
over experts elsewhere.
"""

from __future__ import annotations

import torch

from . import api, reference, validation


class _SwiGLUExpert(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight, down_weight, impl):
        gate = x @ gate_weight.T
        up = x @ up_weight.T
        intermediate = _swiglu_saved(gate, up)[2]
        ctx.save_for_backward(x, gate_weight, up_weight, down_weight, gate, up)
        ctx.impl = impl
        return intermediate @ down_weight.T

    @staticmethod
    def backward(ctx, grad_output):
        x, gate_weight, up_weight, down_weight, gate, up = ctx.saved_tensors
        gate_sigmoid, gate_silu, intermediate = _swiglu_saved(gate, up)
        grads = api.swiglu_down_backward(
            grad_output.contiguous(), x, gate_weight, up_weight, down_weight,
            gate, gate_sigmoid, gate_silu, up, intermediate, impl=ctx.impl,
        )  # fmt: skip
        return (*grads, None)


def _swiglu_saved(gate, up):
    """σ(gate), silu(gate) and the intermediate as the benchmark's forward rounds them."""
    f = reference.compute_dtype(gate.dtype)
    gate_sigmoid = torch.sigmoid(gate.to(f)).to(gate.dtype)
    gate_silu = gate * gate_sigmoid
    return gate_sigmoid, gate_silu, gate_silu * up


def swiglu_expert(x, gate_weight, up_weight, down_weight, *, impl: str = "auto"):
    """y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ for x [..., H], gate/up weights [I, H], down weight [H, I].

    Differentiable in all four arguments; the backward runs ``swiglu_down_backward(impl=impl)``.
    """
    validation.check_impl(impl)
    validation.check_swiglu_expert(x, gate_weight, up_weight, down_weight)
    lead, H = x.shape[:-1], x.shape[-1]
    y = _SwiGLUExpert.apply(x.reshape(-1, H).contiguous(), gate_weight, up_weight, down_weight, impl)
    return y.reshape(*lead, H)


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, impl):
        ctx.save_for_backward(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
        ctx.impl = impl
        return api.moe_experts_forward(
            hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, impl=impl
        )

    @staticmethod
    def backward(ctx, grad_output):
        hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights = ctx.saved_tensors
        (grad_x, grad_w, grad_gate, grad_up, grad_down) = api.moe_experts_backward(
            grad_output.contiguous(), hidden_states, topk_indices, topk_weights,
            gate_weights, up_weights, down_weights, impl=ctx.impl, validate=False,
        )  # fmt: skip
        return grad_x, None, grad_w, grad_gate, grad_up, grad_down, None


def moe_experts(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
                *, impl: str = "auto", validate: bool = True):  # fmt: skip
    """y_t = Σ_k w_tk · Wd_e (silu(Wg_e x_t) ⊙ Wu_e x_t), e = topk_indices[t, k].

    Differentiable in hidden_states, topk_weights and the three expert weight tensors; the backward
    recomputes the forward and runs ``moe_experts_backward(impl=impl)``. With the Triton path the
    forward is :func:`moe_lib.kernels.moe_experts_backward.moe_experts_forward_triton` (fp32 inputs:
    g and u from bf16×3 products, Wd·a from bf16 products: relative error ≈ 2e-3).
    """
    validation.check_impl(impl)
    validation.check_moe_experts_backward(
        hidden_states, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
        validate=validate,
    )  # fmt: skip
    return _MoEExperts.apply(
        hidden_states.contiguous(), topk_indices.contiguous(), topk_weights.contiguous(),
        gate_weights, up_weights, down_weights, impl,
    )  # fmt: skip
