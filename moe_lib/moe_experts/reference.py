"""P2's readable PyTorch: all routed experts' backward (forward recomputed) and the forward, one expert at a time.

Every fast path is checked against these. Inputs are upcast to float32 (float64 stays float64),
every product is computed there with TF32 off, and the results are rounded back to the input dtype.
Per (token t, slot k, expert e = topk_indices[t, k]):

    g = Wg_e x_t ;  u = Wu_e x_t ;  a = silu(g) ⊙ u
    grad_topk_weights[t, k] = ⟨Wd_eᵀ dy_t, a⟩
    dA = w_tk · Wd_eᵀ dy_t
    dg = dA ⊙ u ⊙ silu'(g) ;  du = dA ⊙ silu(g)
    dWd_e += w_tk · dy_t aᵀ ;  dWg_e += dg x_tᵀ ;  dWu_e += du x_tᵀ
    grad_hidden_states[t] += Wg_eᵀ dg + Wu_eᵀ du
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..precision import compute_dtype, silu_grad, tf32_disabled


def moe_experts_backward_reference(
    grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights
):
    """P2: gradients of all routed SwiGLU experts, the forward recomputed, one expert at a time.

    Returns (grad_hidden_states, grad_topk_weights, grad_gate_weights, grad_up_weights,
    grad_down_weights); grad_topk_weights in topk_weights' dtype, the rest in the hidden dtype.
    Experts that no token chose get exact zeros.
    """
    out_dtype = hidden_states.dtype
    f = compute_dtype(out_dtype)
    num_experts = gate_weights.shape[0]
    dy = grad_output.to(f)
    x = hidden_states.to(f)
    routing_weights = topk_weights.to(f)

    grad_x = torch.zeros_like(x)
    grad_routing = torch.zeros_like(routing_weights)
    grad_gate = torch.zeros(gate_weights.shape, dtype=f, device=x.device)
    grad_up = torch.zeros(up_weights.shape, dtype=f, device=x.device)
    grad_down = torch.zeros(down_weights.shape, dtype=f, device=x.device)

    with tf32_disabled():
        for e in range(num_experts):
            token_ids, slot_ids = (topk_indices == e).nonzero(as_tuple=True)
            if token_ids.numel() == 0:
                continue  # nobody chose this expert: its gradients stay exactly zero
            w_gate, w_up, w_down = (w[e].to(f) for w in (gate_weights, up_weights, down_weights))
            x_e, dy_e = x[token_ids], dy[token_ids]
            w_e = routing_weights[token_ids, slot_ids][:, None]

            g = x_e @ w_gate.T  # recomputed forward
            u = x_e @ w_up.T
            a = F.silu(g) * u
            dy_down = dy_e @ w_down  # rows are Wd_eᵀ dy_t

            grad_routing[token_ids, slot_ids] = (dy_down * a).sum(dim=1)
            grad_down[e] = (w_e * dy_e).T @ a
            d_a = w_e * dy_down
            d_g = d_a * u * silu_grad(g)
            d_u = d_a * F.silu(g)
            grad_gate[e] = d_g.T @ x_e
            grad_up[e] = d_u.T @ x_e
            grad_x.index_add_(0, token_ids, d_g @ w_gate + d_u @ w_up)

    return (
        grad_x.to(out_dtype),
        grad_routing.to(topk_weights.dtype),
        grad_gate.to(out_dtype),
        grad_up.to(out_dtype),
        grad_down.to(out_dtype),
    )


def moe_experts_forward_reference(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights):
    """The P2 forward: y_t = Σ_k w_tk · Wd_e (silu(Wg_e x_t) ⊙ (Wu_e x_t)), e = topk_indices[t, k]."""
    out_dtype = hidden_states.dtype
    f = compute_dtype(out_dtype)
    x = hidden_states.to(f)
    y = torch.zeros_like(x)
    with tf32_disabled():
        for e in range(gate_weights.shape[0]):
            token_ids, slot_ids = (topk_indices == e).nonzero(as_tuple=True)
            if token_ids.numel() == 0:
                continue
            x_e = x[token_ids]
            a = F.silu(x_e @ gate_weights[e].to(f).T) * (x_e @ up_weights[e].to(f).T)
            o = a @ down_weights[e].to(f).T
            y.index_add_(0, token_ids, topk_weights[token_ids, slot_ids].to(f)[:, None] * o)
    return y.to(out_dtype)
