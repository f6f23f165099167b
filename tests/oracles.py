"""Independent float64 autograd oracles: the forward written densely, gradients by autograd.

They share no formula with moe_lib.reference (which writes the backward by hand), so agreement
checks the hand-derived backward.
"""

import torch
import torch.nn.functional as F


def swiglu_expert_grads(grad_output, x, gate_weight, up_weight, down_weight):
    """(grad_x, grad_gate_weight, grad_up_weight, grad_down_weight) of y = (silu(xWgᵀ)⊙xWuᵀ)Wdᵀ."""
    leaves = [t.detach().double().requires_grad_() for t in (x, gate_weight, up_weight, down_weight)]
    x, w_gate, w_up, w_down = leaves
    y = (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T
    return torch.autograd.grad(y, leaves, grad_output.double(), allow_unused=True)


def moe_experts_forward_dense(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights):
    """y_t = Σ_k w_tk Wd_e(silu(Wg_e x_t) ⊙ Wu_e x_t) via per-slot gathered weights (no expert loop)."""
    w_gate = gate_weights[topk_indices]  # [T, K, I, H]
    w_up = up_weights[topk_indices]
    w_down = down_weights[topk_indices]  # [T, K, H, I]
    g = torch.einsum("tkih,th->tki", w_gate, hidden_states)
    u = torch.einsum("tkih,th->tki", w_up, hidden_states)
    o = torch.einsum("tkhi,tki->tkh", w_down, F.silu(g) * u)
    return torch.einsum("tk,tkh->th", topk_weights, o)


def moe_experts_grads(grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights):
    """(grad_hidden_states, grad_topk_weights, grad_gate, grad_up, grad_down) in float64."""
    leaves = [t.detach().double().requires_grad_()
              for t in (hidden_states, topk_weights, gate_weights, up_weights, down_weights)]
    x, w, wg, wu, wd = leaves
    y = moe_experts_forward_dense(x, topk_indices, w, wg, wu, wd)
    grads = torch.autograd.grad(y, leaves, grad_output.double(), allow_unused=True)
    return tuple(torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True))
