"""P1's readable PyTorch: the backward with the benchmark's semantics, and the forward that saves its tensors.

Every fast path is checked against these. Inputs are upcast to float32 (float64 stays float64),
every product is computed there with TF32 off, and the results are rounded back to the input dtype.

    dWd   = dyᵀ · intermediate                        [H, I]
    dA    = dy · Wd                                   [T, I]
    dUp   = dA ⊙ gate_silu
    dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s))        s = gate_sigmoid (the saved one)
    dWg   = dGateᵀ · x ;  dWu = dUpᵀ · x              [I, H]
    dx    = dGate · Wg + dUp · Wu                     [T, H]
"""

from __future__ import annotations

import torch

from ..precision import compute_dtype, tf32_disabled


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
