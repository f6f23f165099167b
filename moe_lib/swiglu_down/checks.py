"""Checks of P1's inputs (one SwiGLU expert's backward and its layer), run before any work."""

from __future__ import annotations

from ..validation import float_tensor, ndim, same_device, same_dtype, shape

# precision= of the P1 functions: "faithful" carries dGate and dUp as 16-bit hi/lo pairs (about 16
# significant bits, close to the reference's fp32) into the dx, dWg and dWu products, at twice their
# tensor work, so that the outputs pass the benchmark's element rule on inputs of any scale; "fast"
# rounds them to the input's 16-bit dtype first, as torch.compile and training frameworks do. With
# fp32 inputs both are exact fp32.
PRECISIONS = ("faithful", "fast")


def check_precision(precision) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")


# the backward's arguments, in the definition's order
INPUT_NAMES = (
    "grad_output", "x", "gate_weight", "up_weight", "down_weight",
    "gate", "gate_sigmoid", "gate_silu", "up", "intermediate",
)  # fmt: skip


def check_swiglu_down_backward(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate
) -> dict:
    """Checks P1's inputs; returns the sizes dict(num_tokens, hidden_size, intermediate_size)."""
    named = dict(
        grad_output=grad_output, x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight,
        gate=gate, gate_sigmoid=gate_sigmoid, gate_silu=gate_silu, up=up, intermediate=intermediate,
    )  # fmt: skip
    for name, value in named.items():
        float_tensor(name, value)
    ndim("x", x, 2, "num_tokens, hidden_size")
    ndim("gate_weight", gate_weight, 2, "intermediate_size, hidden_size")
    T, H = x.shape
    I = gate_weight.shape[0]
    shape("gate_weight", gate_weight, (I, H), ("intermediate_size", "hidden_size"))
    shape("grad_output", grad_output, (T, H), ("num_tokens", "hidden_size"))
    shape("up_weight", up_weight, (I, H), ("intermediate_size", "hidden_size"))
    shape("down_weight", down_weight, (H, I), ("hidden_size", "intermediate_size"))
    for name in ("gate", "gate_sigmoid", "gate_silu", "up", "intermediate"):
        shape(name, named[name], (T, I), ("num_tokens", "intermediate_size"))
    same_dtype(named)
    same_device(named)
    return dict(num_tokens=T, hidden_size=H, intermediate_size=I)


def check_swiglu_expert(x, gate_weight, up_weight, down_weight) -> dict:
    """Checks the P1 layer's inputs (x [..., H] and the three weights)."""
    named = dict(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
    for name, value in named.items():
        float_tensor(name, value)
    if x.dim() < 1:
        raise ValueError(f"x: expected a tensor [..., hidden_size], got shape {list(x.shape)}")
    ndim("gate_weight", gate_weight, 2, "intermediate_size, hidden_size")
    H, I = x.shape[-1], gate_weight.shape[0]
    shape("gate_weight", gate_weight, (I, H), ("intermediate_size", "hidden_size"))
    shape("up_weight", up_weight, (I, H), ("intermediate_size", "hidden_size"))
    shape("down_weight", down_weight, (H, I), ("hidden_size", "intermediate_size"))
    same_dtype(named)
    same_device(named)
    return dict(hidden_size=H, intermediate_size=I)


