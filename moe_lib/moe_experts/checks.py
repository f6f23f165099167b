"""Checks of P2's inputs (all routed experts' backward, its layer and the expert-parallel layer).

Shape, dtype and device checks read metadata only and always run; the checks of index values (range,
a token listing one expert twice) read the indices back to the host and run only with ``validate=True``.
Meta tensors are refused for topk_indices: the routing reads its values on every path.
"""

from __future__ import annotations

import torch

from ..validation import FLOAT_OR_FP32, INDEX, Argument, check_arguments

# The backward's tensor arguments, in the definition's order and with its shapes (data/problems/
# moe_experts_backward/definition.json; tests/test_validation.py keeps them equal)
BACKWARD_ARGUMENTS = (
    Argument("grad_output", ("num_tokens", "hidden_size")),
    Argument("hidden_states", ("num_tokens", "hidden_size")),
    Argument("topk_indices", ("num_tokens", "top_k"), INDEX),
    Argument("topk_weights", ("num_tokens", "top_k"), FLOAT_OR_FP32),
    Argument("gate_weights", ("num_experts", "intermediate_size", "hidden_size")),
    Argument("up_weights", ("num_experts", "intermediate_size", "hidden_size")),
    Argument("down_weights", ("num_experts", "hidden_size", "intermediate_size")),
)
INPUT_NAMES = tuple(argument.name for argument in BACKWARD_ARGUMENTS)
SIZES_FROM = ("hidden_states", "topk_indices", "gate_weights")  # the arguments whose dimensions give the sizes
# the expert-parallel layer's: the routing of this rank's tokens and the weights of this rank's experts
PARALLEL_ARGUMENTS = (
    *BACKWARD_ARGUMENTS[1:4],
    Argument("local_gate_weights", ("local_experts", "intermediate_size", "hidden_size")),
    Argument("local_up_weights", ("local_experts", "intermediate_size", "hidden_size")),
    Argument("local_down_weights", ("local_experts", "hidden_size", "intermediate_size")),
)
PARALLEL_SIZES_FROM = ("hidden_states", "topk_indices", "local_gate_weights")
# the layer with the gate and up weights fused in one block (moe_experts_gate_up): gate_up_rows = 2·intermediate_size
GATE_UP_ARGUMENTS = (
    *BACKWARD_ARGUMENTS[1:4],
    Argument("gate_up_weights", ("num_experts", "gate_up_rows", "hidden_size")),
    BACKWARD_ARGUMENTS[6],
)
GATE_UP_SIZES_FROM = ("hidden_states", "topk_indices", "down_weights", "gate_up_weights")


def check_routing_has_values(topk_indices) -> None:
    """The routing reads the indices' values on every path: a meta tensor has none."""
    if topk_indices.device.type == "meta":
        raise ValueError("topk_indices: expected a tensor with values (tokens are routed by them), got a meta tensor")


def check_moe_experts_backward(
    grad_output,
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    up_weights,
    down_weights,
    *,
    validate: bool = True,
) -> dict:
    """Checks P2's inputs (:data:`BACKWARD_ARGUMENTS`); returns the sizes dict(num_tokens, hidden_size,
    intermediate_size, num_experts, top_k)."""
    values = dict(
        zip(
            INPUT_NAMES,
            (grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights),
            strict=True,
        )
    )
    sizes = check_arguments(BACKWARD_ARGUMENTS, values, SIZES_FROM)
    check_routing_has_values(topk_indices)
    T, H, I, E, K = (sizes[axis] for axis in ("num_tokens", "hidden_size", "intermediate_size", "num_experts", "top_k"))
    if K > E:
        raise ValueError(f"topk_indices: top_k={K} exceeds num_experts={E}: a token cannot pick an expert twice")

    if validate:
        check_index_values(topk_indices, E)
    return dict(num_tokens=T, hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)


def check_moe_experts_gate_up(hidden_states, topk_indices, topk_weights, gate_up_weights, down_weights) -> None:
    """Checks the inputs of the fused-block layer (:data:`GATE_UP_ARGUMENTS`): as P2's, with gate_up_weights
    [E, 2I, H] (each expert's I gate rows, then its I up rows)."""
    names = [argument.name for argument in GATE_UP_ARGUMENTS]
    values = (hidden_states, topk_indices, topk_weights, gate_up_weights, down_weights)
    sizes = check_arguments(GATE_UP_ARGUMENTS, dict(zip(names, values, strict=True)), GATE_UP_SIZES_FROM)
    E, I, H, K = (sizes[axis] for axis in ("num_experts", "intermediate_size", "hidden_size", "top_k"))
    if sizes["gate_up_rows"] != 2 * I:
        raise ValueError(
            f"gate_up_weights: expected shape [num_experts={E}, 2·intermediate_size={2 * I}, hidden_size={H}] (each "
            f"expert's gate rows, then its up rows), got {list(gate_up_weights.shape)} (intermediate_size from "
            "down_weights)"
        )
    check_routing_has_values(topk_indices)
    if K > E:
        raise ValueError(f"topk_indices: top_k={K} exceeds num_experts={E}: a token cannot pick an expert twice")


def check_index_values(topk_indices, num_experts: int) -> None:
    """Every expert id in [0, num_experts), none twice in one token's row: reads the ids back to the host (one
    sync). Skipped while ``torch.compile`` traces, where there are no values to read: the layers' ops run it on
    their real inputs instead, with the same messages."""
    T, K = topk_indices.shape
    if T * K == 0 or torch.compiler.is_compiling():
        return
    E = num_experts
    low, high = int(topk_indices.min()), int(topk_indices.max())
    if low < 0 or high >= E:
        bad = low if low < 0 else high
        raise ValueError(f"topk_indices: expert index {bad} out of range [0, {E})")
    if K > 1:
        ordered = topk_indices.sort(dim=1).values
        repeats = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
        if bool(repeats.any()):
            t = int(repeats.nonzero()[0, 0])
            raise ValueError(
                f"topk_indices: token {t} lists the same expert twice ({topk_indices[t].tolist()}); "
                "each token's top_k experts must be distinct"
            )
