"""Checks of P1's inputs (one SwiGLU expert's backward and its layer), run before any work."""

from __future__ import annotations

from ..validation import ANY_LEADING, Argument, check_arguments

# precision= of the P1 functions: "faithful" carries dGate and dUp as 16-bit hi/lo pairs (about 16
# significant bits, close to the reference's fp32) into the dx, dWg and dWu products, at twice their
# tensor work, so that the outputs pass the benchmark's element rule on inputs of any scale; "fast"
# rounds them to the input's 16-bit dtype first, as torch.compile and training frameworks do. With
# fp32 inputs both are exact fp32.
PRECISIONS = ("faithful", "fast")


def check_precision(precision) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")


# The backward's tensor arguments, in the definition's order and with its shapes (data/problems/
# swiglu_down_backward/definition.json; tests/test_validation.py keeps them equal): one float dtype for all.
BACKWARD_ARGUMENTS = (
    Argument("grad_output", ("num_tokens", "hidden_size")),
    Argument("x", ("num_tokens", "hidden_size")),
    Argument("gate_weight", ("intermediate_size", "hidden_size")),
    Argument("up_weight", ("intermediate_size", "hidden_size")),
    Argument("down_weight", ("hidden_size", "intermediate_size")),
    Argument("gate", ("num_tokens", "intermediate_size")),
    Argument("gate_sigmoid", ("num_tokens", "intermediate_size")),
    Argument("gate_silu", ("num_tokens", "intermediate_size")),
    Argument("up", ("num_tokens", "intermediate_size")),
    Argument("intermediate", ("num_tokens", "intermediate_size")),
)
INPUT_NAMES = tuple(argument.name for argument in BACKWARD_ARGUMENTS)
# the layer's: x [..., H] and the three weights
LAYER_ARGUMENTS = (Argument("x", (ANY_LEADING, "hidden_size")), *BACKWARD_ARGUMENTS[2:5])
SIZES_FROM = ("x", "gate_weight")  # the arguments whose dimensions give the sizes the others are checked against


def check_swiglu_down_backward(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate
) -> dict:
    """Checks P1's inputs (:data:`BACKWARD_ARGUMENTS`); returns the sizes dict(num_tokens, hidden_size,
    intermediate_size)."""
    values = dict(
        zip(
            INPUT_NAMES,
            (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate),
            strict=True,
        )
    )
    sizes = check_arguments(BACKWARD_ARGUMENTS, values, SIZES_FROM)
    return dict(
        num_tokens=sizes["num_tokens"], hidden_size=sizes["hidden_size"], intermediate_size=sizes["intermediate_size"]
    )


def check_swiglu_expert(x, gate_weight, up_weight, down_weight) -> dict:
    """Checks the P1 layer's inputs (:data:`LAYER_ARGUMENTS`: x [..., H] and the three weights)."""
    values = dict(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
    return check_arguments(LAYER_ARGUMENTS, values, SIZES_FROM)
