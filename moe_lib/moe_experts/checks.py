"""Checks of P2's inputs (all routed experts' backward, its layer and the expert-parallel layer).

Shape, dtype and device checks read metadata only and always run; the checks of index values (range,
a token listing one expert twice) read the indices back to the host and run only with ``validate=True``.
Meta tensors are refused for topk_indices: the routing reads its values on every path.
"""

from __future__ import annotations

import torch

from ..validation import float_tensor, ndim, same_device, same_dtype, shape, tensor

# the backward's arguments, in the definition's order
INPUT_NAMES = (
    "grad_output", "hidden_states", "topk_indices", "topk_weights", "gate_weights", "up_weights", "down_weights",
)  # fmt: skip


def check_routing(topk_indices, topk_weights, hidden_states) -> int:
    """Checks the routing tensors against hidden_states [T, H] (already checked); returns top_k."""
    float_tensor("topk_weights", topk_weights)
    tensor("topk_indices", topk_indices)
    if topk_indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_indices: expected dtype torch.int64 or torch.int32, got {topk_indices.dtype}")
    ndim("topk_indices", topk_indices, 2, "num_tokens, top_k")
    if topk_indices.device.type == "meta":
        raise ValueError("topk_indices: expected a tensor with values (tokens are routed by them), got a meta tensor")
    T, K = hidden_states.shape[0], topk_indices.shape[1]
    shape("topk_indices", topk_indices, (T, K), ("num_tokens", "top_k"))
    shape("topk_weights", topk_weights, (T, K), ("num_tokens", "top_k"))
    if topk_weights.dtype not in (hidden_states.dtype, torch.float32):
        raise TypeError(
            f"topk_weights: expected dtype {hidden_states.dtype} (that of hidden_states) or torch.float32, "
            f"got {topk_weights.dtype}"
        )
    return K


def check_moe_experts_backward(
    grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
    *, validate: bool = True,
) -> dict:  # fmt: skip
    """Checks P2's inputs; returns the sizes dict(num_tokens, hidden_size, intermediate_size,
    num_experts, top_k)."""
    floats = dict(
        grad_output=grad_output, hidden_states=hidden_states, gate_weights=gate_weights,
        up_weights=up_weights, down_weights=down_weights,
    )  # fmt: skip
    for name, value in floats.items():
        float_tensor(name, value)
    ndim("hidden_states", hidden_states, 2, "num_tokens, hidden_size")
    ndim("gate_weights", gate_weights, 3, "num_experts, intermediate_size, hidden_size")
    K = check_routing(topk_indices, topk_weights, hidden_states)
    T, H = hidden_states.shape
    E, I = gate_weights.shape[:2]
    shape("grad_output", grad_output, (T, H), ("num_tokens", "hidden_size"))
    shape("gate_weights", gate_weights, (E, I, H), ("num_experts", "intermediate_size", "hidden_size"))
    shape("up_weights", up_weights, (E, I, H), ("num_experts", "intermediate_size", "hidden_size"))
    shape("down_weights", down_weights, (E, H, I), ("num_experts", "hidden_size", "intermediate_size"))
    if K > E:
        raise ValueError(f"topk_indices: top_k={K} exceeds num_experts={E}: a token cannot pick an expert twice")

    same_dtype(floats)
    same_device(dict(floats, topk_indices=topk_indices, topk_weights=topk_weights))

    if validate:
        check_index_values(topk_indices, E)
    return dict(num_tokens=T, hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)


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
