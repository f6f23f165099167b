"""Input checks shared by every implementation, run before any work.

Shape, dtype and device checks read only metadata and always run. Checks of index values
(range, a token listing one expert twice) read the indices back to the host, so they run only
with ``validate=True``; pass ``validate=False`` inside CUDA-graph capture or training hot loops.
"""

from __future__ import annotations

import torch

IMPLS = ("auto", "reference", "triton")


def check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")


def _tensor(name, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _float_tensor(name, value) -> torch.Tensor:
    t = _tensor(name, value)
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {t.dtype}")
    return t


def _shape(name, t: torch.Tensor, expected: tuple, labels: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        want = "[" + ", ".join(f"{lab}={n}" for lab, n in zip(labels, expected, strict=True)) + "]"
        raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")


def _ndim(name, t: torch.Tensor, ndim: int, labels: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-d tensor [{labels}], got shape {list(t.shape)}")


def _same_device(named: dict) -> None:
    devices = {name: t.device for name, t in named.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name}: expected device {first} (the device of {first_name}), got {device}")


def _same_dtype(named: dict) -> None:
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: expected dtype {first.dtype} (the dtype of {first_name}), got {t.dtype}")


def check_contiguous(named: dict) -> None:
    """Fast kernels address their operands by row-major strides."""
    for name, t in named.items():
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous() first)")


def check_swiglu_down_backward(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate
) -> dict:
    """Checks P1's inputs; returns the sizes dict(num_tokens, hidden_size, intermediate_size)."""
    named = dict(
        grad_output=grad_output, x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight,
        gate=gate, gate_sigmoid=gate_sigmoid, gate_silu=gate_silu, up=up, intermediate=intermediate,
    )  # fmt: skip
    for name, value in named.items():
        _float_tensor(name, value)
    _ndim("x", x, 2, "num_tokens, hidden_size")
    _ndim("gate_weight", gate_weight, 2, "intermediate_size, hidden_size")
    T, H = x.shape
    I = gate_weight.shape[0]
    _shape("gate_weight", gate_weight, (I, H), ("intermediate_size", "hidden_size"))
    _shape("grad_output", grad_output, (T, H), ("num_tokens", "hidden_size"))
    _shape("up_weight", up_weight, (I, H), ("intermediate_size", "hidden_size"))
    _shape("down_weight", down_weight, (H, I), ("hidden_size", "intermediate_size"))
    for name in ("gate", "gate_sigmoid", "gate_silu", "up", "intermediate"):
        _shape(name, named[name], (T, I), ("num_tokens", "intermediate_size"))
    _same_dtype(named)
    _same_device(named)
    return dict(num_tokens=T, hidden_size=H, intermediate_size=I)


def check_swiglu_expert(x, gate_weight, up_weight, down_weight) -> dict:
    """Checks the P1 layer's inputs (x [..., H] and the three weights)."""
    named = dict(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight)
    for name, value in named.items():
        _float_tensor(name, value)
    if x.dim() < 1:
        raise ValueError(f"x: expected a tensor [..., hidden_size], got shape {list(x.shape)}")
    _ndim("gate_weight", gate_weight, 2, "intermediate_size, hidden_size")
    H, I = x.shape[-1], gate_weight.shape[0]
    _shape("gate_weight", gate_weight, (I, H), ("intermediate_size", "hidden_size"))
    _shape("up_weight", up_weight, (I, H), ("intermediate_size", "hidden_size"))
    _shape("down_weight", down_weight, (H, I), ("hidden_size", "intermediate_size"))
    _same_dtype(named)
    _same_device(named)
    return dict(hidden_size=H, intermediate_size=I)


def check_routing(topk_indices, topk_weights, hidden_states) -> int:
    """Checks the routing tensors against hidden_states [T, H] (already checked); returns top_k."""
    _float_tensor("topk_weights", topk_weights)
    _tensor("topk_indices", topk_indices)
    if topk_indices.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"topk_indices: expected dtype torch.int64 or torch.int32, got {topk_indices.dtype}")
    _ndim("topk_indices", topk_indices, 2, "num_tokens, top_k")
    T, K = hidden_states.shape[0], topk_indices.shape[1]
    _shape("topk_indices", topk_indices, (T, K), ("num_tokens", "top_k"))
    _shape("topk_weights", topk_weights, (T, K), ("num_tokens", "top_k"))
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
        _float_tensor(name, value)
    _ndim("hidden_states", hidden_states, 2, "num_tokens, hidden_size")
    _ndim("gate_weights", gate_weights, 3, "num_experts, intermediate_size, hidden_size")
    K = check_routing(topk_indices, topk_weights, hidden_states)
    T, H = hidden_states.shape
    E, I = gate_weights.shape[:2]
    _shape("grad_output", grad_output, (T, H), ("num_tokens", "hidden_size"))
    _shape("gate_weights", gate_weights, (E, I, H), ("num_experts", "intermediate_size", "hidden_size"))
    _shape("up_weights", up_weights, (E, I, H), ("num_experts", "intermediate_size", "hidden_size"))
    _shape("down_weights", down_weights, (E, H, I), ("num_experts", "hidden_size", "intermediate_size"))
    if K > E:
        raise ValueError(f"topk_indices: top_k={K} exceeds num_experts={E}: a token cannot pick an expert twice")

    _same_dtype(floats)
    _same_device(dict(floats, topk_indices=topk_indices, topk_weights=topk_weights))

    if validate and T > 0:
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
    return dict(num_tokens=T, hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
