"""One training step of an op's differentiable layer: its forward, and in ``forward_backward`` the
gradients of its leaves (:func:`step`).

Each op has one :class:`Layer` in :data:`LAYERS`: the inputs it differentiates. The training-step modes
(:mod:`.modes`) time these steps, and a peer that runs a whole layer to answer the op (SonicMoE's, in
:mod:`.peers.moe_experts`) builds its callable here too; this module imports neither, so that both can
import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Layer:
    """The differentiable layer of one op (its reference is the layer peer labelled ``reference``)."""

    leaves: tuple  # the inputs it differentiates, in the order of their gradients


LAYERS = {
    "swiglu_down_backward": Layer(("x", "gate_weight", "up_weight", "down_weight")),
    "moe_experts_backward": Layer(("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")),
}


def step(forward: Callable, layer: Layer, mode: str, inputs: dict, parameters=None, gradients=None) -> Callable:
    """The timed callable of one step on ``inputs``: ``forward(inputs, leaves)``'s output, and in
    ``forward_backward`` the gradients for ``inputs["grad_output"]`` of the layer's leaves. The leaves are
    built once, untimed: the layer's own (fresh tensors requiring grad), or ``parameters(inputs)`` for a
    layout of the implementation's own, whose gradients ``gradients(grads, inputs)`` maps back."""
    if parameters is None:
        leaves = {name: inputs[name].detach().requires_grad_() for name in layer.leaves}
    else:
        leaves = parameters(inputs)
    grad_output = inputs["grad_output"]

    def run():
        with torch.enable_grad():
            y = forward(inputs, leaves)
            if mode == "forward":
                return (y,)
            values = torch.autograd.grad(y, list(leaves.values()), grad_outputs=grad_output.to(y.dtype))
            grads = dict(zip(leaves, values, strict=True))
        mapped = tuple(grads[name] for name in layer.leaves) if gradients is None else gradients(grads, inputs)
        return (y.detach(), *mapped)

    return run
