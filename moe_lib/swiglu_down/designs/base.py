"""The interface every P1 design implements, and the tensors it reads and writes.

A design is a frozen dataclass of its configuration (tiles, warps, forms) with

    name                                   its label in results and notes (a class attribute)
    supports(T, H, I, dtype, device, *, aligned) -> str | None
                                           why it cannot run such a call (None: it can), from the shape, the
                                           dtype, the device's limits (:class:`~..runtime.Device`) and whether
                                           every operand starts on a 16-byte boundary (``aligned``)
    run(inputs, *, with_lo, out) -> None   the four gradients into ``out``; ``with_lo``: dGate and dUp carried
                                           as 16-bit hi/lo pairs (the faithful path)

and nothing else is asked of it. The outputs are allocated by the call (:mod:`..backward`), every element
written by the design; grad_gate_weight and grad_up_weight are always the two row halves of one [2I, H] buffer,
so that a design may write both with one product.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Protocol

import torch

from ..runtime import Device


class Inputs(NamedTuple):
    """P1's inputs, in the definition's order: dy, x [T, H]; Wg, Wu [I, H]; Wd [H, I]; the saved tensors [T, I]."""

    grad_output: torch.Tensor
    x: torch.Tensor
    gate_weight: torch.Tensor
    up_weight: torch.Tensor
    down_weight: torch.Tensor
    gate: torch.Tensor
    gate_sigmoid: torch.Tensor
    gate_silu: torch.Tensor
    up: torch.Tensor
    intermediate: torch.Tensor


class Outputs(NamedTuple):
    """P1's outputs: dx [T, H]; dWg, dWu [I, H] (the row halves of one [2I, H] buffer); dWd [H, I]."""

    grad_x: torch.Tensor
    grad_gate_weight: torch.Tensor
    grad_up_weight: torch.Tensor
    grad_down_weight: torch.Tensor


class Design(Protocol):
    name: ClassVar[str]

    def supports(
        self,
        num_tokens: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        device: Device,
        *,
        aligned: bool = True,
    ) -> str | None: ...

    def run(self, inputs: Inputs, *, with_lo: bool, out: Outputs) -> None: ...


SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def on_triton(device: Device) -> str | None:
    """Why Triton kernels cannot run on ``device`` (a CUDA GPU, or the interpreter), or None."""
    return None if device.kind in ("cuda", "interpreter") else "Triton kernels need a CUDA GPU or the interpreter"
