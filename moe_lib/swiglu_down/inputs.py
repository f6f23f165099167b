"""P1's inputs drawn with the benchmark's distributions.

Two distributions (``distribution=``), weights ``randn/√fan_in`` in both:
- "forward" (the default): x and grad_output ``randn/√H`` (the scale of a real layer's activations);
  the saved tensors (gate, gate_sigmoid, gate_silu, up, intermediate) from the forward, each rounded
  to the dtype, so that they are consistent with x and the weights.
- "harness": what SOL-ExecBench's harness draws for ``random`` inputs: every activation and saved
  tensor an independent ``randn`` (std 1, 45× our activations; gate_sigmoid not even in (0, 1)). Its
  outputs are larger and have many elements near zero, which is where rounding dGate and dUp to bf16
  fails the element rule |out − ref| ≤ 0.01 + 0.01·|ref|.
"""

from __future__ import annotations

import math

import torch

from .reference import swiglu_expert_forward_reference


def normal(shape, std, dtype, device, generator) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)


DISTRIBUTIONS = ("forward", "harness")
SAVED = ("gate", "gate_sigmoid", "gate_silu", "up", "intermediate")


def make_inputs(
    sizes: dict, dtype: torch.dtype, device, generator: torch.Generator, *, distribution: str = "forward"
) -> dict:
    """The ten inputs of ``swiglu_down_backward`` for the axis values ``sizes``, in the definition's order."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution: expected one of {DISTRIBUTIONS}, got {distribution!r}")
    T, H, I = sizes["num_tokens"], sizes["hidden_size"], sizes["intermediate_size"]
    gate_weight = normal((I, H), 1 / math.sqrt(H), dtype, device, generator)
    up_weight = normal((I, H), 1 / math.sqrt(H), dtype, device, generator)
    down_weight = normal((H, I), 1 / math.sqrt(I), dtype, device, generator)
    activation_std = 1.0 if distribution == "harness" else 1 / math.sqrt(H)
    x = normal((T, H), activation_std, dtype, device, generator)
    grad_output = normal((T, H), activation_std, dtype, device, generator)
    if distribution == "harness":
        saved = {name: normal((T, I), 1.0, dtype, device, generator) for name in SAVED}
    else:
        _, saved = swiglu_expert_forward_reference(x, gate_weight, up_weight, down_weight)
    return dict(
        grad_output=grad_output, x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight, **saved
    )
