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


def swiglu_down_term_bounds(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate
):
    """(grad_x, grad_gate_weight, grad_up_weight, grad_down_weight) of P1 with every product term taken by its
    absolute value, in float64, through dA: an implementation whose every product term, and every rounding of dA,
    dGate and dUp, is off by a relative ε is within about ε times these. Where a sum's terms cancel (a weight
    gradient summed over few tokens), that is far more than ε times the sum itself.

    dA = dy·Wd is off by at most ε·|dy|·|Wd|; dGate = dA ⊙ up ⊙ s(1 + gate(1 − s)) and dUp = dA ⊙ gate_silu by as
    much times their other factors, from the saved tensors as given."""
    dy, x = grad_output.double(), x.double()
    w_gate, w_up, w_down = gate_weight.double(), up_weight.double(), down_weight.double()
    s = gate_sigmoid.double()
    d_a_terms = dy.abs() @ w_down.abs()
    d_gate_terms = d_a_terms * (up.double() * s * (1 + gate.double() * (1 - s))).abs()
    d_up_terms = d_a_terms * gate_silu.double().abs()
    grad_x = d_gate_terms @ w_gate.abs() + d_up_terms @ w_up.abs()
    return grad_x, d_gate_terms.T @ x.abs(), d_up_terms.T @ x.abs(), dy.abs().T @ intermediate.double().abs()


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
    leaves = [
        t.detach().double().requires_grad_()
        for t in (hidden_states, topk_weights, gate_weights, up_weights, down_weights)
    ]
    x, w, wg, wu, wd = leaves
    y = moe_experts_forward_dense(x, topk_indices, w, wg, wu, wd)
    grads = torch.autograd.grad(y, leaves, grad_output.double(), allow_unused=True)
    return tuple(torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves, strict=True))


def moe_experts_term_bounds(
    grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights
):
    """(grad_hidden_states, grad_gate, grad_up, grad_down) of P2 with every product term taken by its absolute
    value, in float64, through the intermediates too: an implementation whose every product term is off by a
    relative ε, the products that make g = Wg_e x, u = Wu_e x and dA = w Wd_eᵀ dy included, is within ε times
    these (to first order in ε).

    Each intermediate v enters as |v| plus what its own terms' errors move it by: g, u and dA are off by at most
    ε·G, ε·U, ε·DA with G = |Wg_e| |x|, U = |Wu_e| |x|, DA = |w| |Wd_e|ᵀ |dy| (where they cancel, that is far more
    than ε·|v|), and they reach dGate = dA u silu'(g), dUp = dA silu(g) and the scaled activation w silu(g) u
    through first derivatives bounded by |silu'| ≤ 1.1 and |silu''| ≤ 0.5."""
    x, dy, w = hidden_states.double(), grad_output.double(), topk_weights.double()
    wg, wu, wd = (
        gate_weights.double()[topk_indices],
        up_weights.double()[topk_indices],
        down_weights.double()[topk_indices],
    )
    g = torch.einsum("tkih,th->tki", wg, x)
    u = torch.einsum("tkih,th->tki", wu, x)
    s = torch.sigmoid(g)
    silu, d_silu = g * s, s * (1 + g * (1 - s))
    d_a = w[..., None] * torch.einsum("tkhi,th->tki", wd, dy)
    g_terms = torch.einsum("tkih,th->tki", wg.abs(), x.abs())
    u_terms = torch.einsum("tkih,th->tki", wu.abs(), x.abs())
    d_a_terms = w.abs()[..., None] * torch.einsum("tkhi,th->tki", wd.abs(), dy.abs())
    d_gate = (
        (d_a * u * d_silu).abs()
        + (u * d_silu).abs() * d_a_terms
        + (d_a * d_silu).abs() * u_terms
        + 0.5 * (d_a * u).abs() * g_terms
    )
    d_up = (d_a * silu).abs() + silu.abs() * d_a_terms + 1.1 * d_a.abs() * g_terms
    scaled_act = w.abs()[..., None] * ((silu * u).abs() + silu.abs() * u_terms + 1.1 * u.abs() * g_terms)
    experts = F.one_hot(topk_indices.long(), gate_weights.shape[0]).double()  # [T, K, E]
    grad_x = torch.einsum("tkih,tki->th", wg.abs(), d_gate) + torch.einsum("tkih,tki->th", wu.abs(), d_up)
    grad_gate = torch.einsum("tke,tki,th->eih", experts, d_gate, x.abs())
    grad_up = torch.einsum("tke,tki,th->eih", experts, d_up, x.abs())
    grad_down = torch.einsum("tke,th,tki->ehi", experts, dy.abs(), scaled_act)
    return grad_x, grad_gate, grad_up, grad_down
