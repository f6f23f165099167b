"""P1 on the Triton path: choose a design, allocate the outputs, run it.

The call holds no decision of its own: :func:`.choose.choose_design` picks the design from the shape, the dtype and
the device, each design (:mod:`.designs`) says what it supports and runs. No host synchronisation anywhere: a call
captures in a CUDA graph.
"""

from __future__ import annotations

import torch

from ..tma import aligned
from . import runtime
from .choose import choose_design
from .designs import Inputs, Outputs
from .runtime import carries_low_halves, device_of


def swiglu_down_backward_triton(
    grad_output,
    x,
    gate_weight,
    up_weight,
    down_weight,
    gate,
    gate_sigmoid,
    gate_silu,
    up,
    intermediate,
    *,
    config=None,
    precision: str = "faithful",
):
    """P1 backward on Triton; inputs already validated (same float dtype and device, contiguous).

    Returns freshly allocated (grad_x, grad_gate_weight, grad_up_weight, grad_down_weight), the two weight gradients
    the row halves of one [2I, H] buffer. ``config`` (a configured design of :data:`.designs.DESIGNS`) overrides the
    chooser's; one that cannot run the call raises a ``ValueError`` with its reason before any work.
    ``precision`` is one of :data:`~.checks.PRECISIONS`.
    """
    inputs = Inputs(
        grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate
    )
    T, H = x.shape
    I = gate_weight.shape[0]
    with_lo = carries_low_halves(x.dtype, precision)
    device = device_of(x)
    tma_aligned = aligned(*inputs)
    design = config or choose_design(T, H, I, dtype=x.dtype, precision=precision, device=device, aligned=tma_aligned)
    reason = design.supports(T, H, I, x.dtype, device, aligned=tma_aligned)
    if reason is not None:
        raise ValueError(f"config: the {design.name} design cannot run T = {T}, H = {H}, I = {I}, {x.dtype}: {reason}")
    out = allocate_outputs(x, I)
    design.run(inputs, with_lo=with_lo, out=out)
    return tuple(out)


def allocate_outputs(x: torch.Tensor, intermediate_size: int) -> Outputs:
    """P1's outputs in x's dtype: dx [T, H], dWg and dWu as the row halves of one [2I, H] buffer, dWd [H, I]."""
    T, H = x.shape
    I = intermediate_size
    grad_gate_up = runtime.allocate((2 * I, H), dtype=x.dtype, device=x.device)
    return Outputs(
        runtime.allocate((T, H), dtype=x.dtype, device=x.device),
        grad_gate_up[:I],
        grad_gate_up[I:],
        runtime.allocate((H, I), dtype=x.dtype, device=x.device),
    )
