"""Readable PyTorch references with the benchmark's semantics.

These favour clarity over speed: they are what every fast path is checked against.
Inputs are upcast to float32 (float64 stays float64), every product is computed there with
TF32 off, and the results are rounded back to the input dtype at the end.

P1 · swiglu_down_backward (one expert, saved forward tensors):
    dWd   = dyᵀ · intermediate                        [H, I]
    dA    = dy · Wd                                   [T, I]
    dUp   = dA ⊙ gate_silu
    dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s))        s = gate_sigmoid (the saved one)
    dWg   = dGateᵀ · x ;  dWu = dUpᵀ · x              [I, H]
    dx    = dGate · Wg + dUp · Wu                     [T, H]

P2 · moe_experts_backward (all routed experts, forward recomputed), per (token t, slot k, e):
    g = Wg_e x_t ;  u = Wu_e x_t ;  a = silu(g) ⊙ u
    grad_topk_weights[t, k] = ⟨Wd_eᵀ dy_t, a⟩
    dA = w_tk · Wd_eᵀ dy_t
    dg = dA ⊙ u ⊙ silu'(g) ;  du = dA ⊙ silu(g)
    dWd_e += w_tk · dy_t aᵀ ;  dWg_e += dg x_tᵀ ;  dWu_e += du x_tᵀ
    grad_hidden_states[t] += Wg_eᵀ dg + Wu_eᵀ du
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def tf32_disabled():
    """Plain fp32 products on CUDA for the duration (restores the previous setting)."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the references compute in: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def silu_grad(z: torch.Tensor) -> torch.Tensor:
    """d/dz silu(z) = σ(z)·(1 + z·(1 − σ(z)))."""
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


def swiglu_down_backward_reference(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate
):
    """P1: gradients of one SwiGLU expert from its saved forward tensors.

    Returns (grad_x, grad_gate_weight, grad_up_weight, grad_down_weight) in the input dtype.
    """
    out_dtype = x.dtype
    f = compute_dtype(out_dtype)
    dy, x, w_gate, w_up, w_down = (t.to(f) for t in (grad_output, x, gate_weight, up_weight, down_weight))
    gate, s, gate_silu, up, intermediate = (t.to(f) for t in (gate, gate_sigmoid, gate_silu, up, intermediate))

    with tf32_disabled():
        grad_down_weight = dy.T @ intermediate  # [H, I]
        d_intermediate = dy @ w_down  # dA, [T, I]
        d_up = d_intermediate * gate_silu
        d_gate = d_intermediate * up * s * (1 + gate * (1 - s))
        grad_gate_weight = d_gate.T @ x  # [I, H]
        grad_up_weight = d_up.T @ x  # [I, H]
        grad_x = d_gate @ w_gate + d_up @ w_up  # [T, H]

    return tuple(t.to(out_dtype) for t in (grad_x, grad_gate_weight, grad_up_weight, grad_down_weight))


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
            a = torch.nn.functional.silu(g) * u
            dy_down = dy_e @ w_down  # rows are Wd_eᵀ dy_t

            grad_routing[token_ids, slot_ids] = (dy_down * a).sum(dim=1)
            grad_down[e] = (w_e * dy_e).T @ a
            d_a = w_e * dy_down
            d_g = d_a * u * silu_grad(g)
            d_u = d_a * torch.nn.functional.silu(g)
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


def swiglu_expert_forward_reference(x, gate_weight, up_weight, down_weight):
    """The P1 forward with the benchmark's saved tensors, each rounded to x's dtype.

    Returns (y, saved) where saved = dict(gate, gate_sigmoid, gate_silu, up, intermediate).
    """
    dtype = x.dtype
    f = compute_dtype(dtype)
    with tf32_disabled():
        gate = (x.to(f) @ gate_weight.to(f).T).to(dtype)
        gate_sigmoid = torch.sigmoid(gate.to(f)).to(dtype)
        gate_silu = (gate.to(f) * gate_sigmoid.to(f)).to(dtype)
        up = (x.to(f) @ up_weight.to(f).T).to(dtype)
        intermediate = (gate_silu.to(f) * up.to(f)).to(dtype)
        y = (intermediate.to(f) @ down_weight.to(f).T).to(dtype)
    saved = dict(gate=gate, gate_sigmoid=gate_sigmoid, gate_silu=gate_silu, up=up, intermediate=intermediate)
    return y, saved


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
            a = torch.nn.functional.silu(x_e @ gate_weights[e].to(f).T) * (x_e @ up_weights[e].to(f).T)
            o = a @ down_weights[e].to(f).T
            y.index_add_(0, token_ids, topk_weights[token_ids, slot_ids].to(f)[:, None] * o)
    return y.to(out_dtype)
