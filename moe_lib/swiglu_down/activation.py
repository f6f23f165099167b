"""The ``swiglu_expert`` layer's elementwise step in one Triton launch (:func:`.kernels.swiglu_activation_kernel`)."""

from __future__ import annotations

import torch

from ..dispatch import interpreter_enabled
from ..tiling import cdiv
from . import kernels, runtime

ACTIVATION_BLOCK = 1024  # elements per program of the layer's elementwise step


def swiglu_activation(gate: torch.Tensor, up: torch.Tensor, *, with_saved: bool):
    """The layer's elementwise step in one launch (:func:`.kernels.swiglu_activation_kernel`): the
    intermediate silu(gate) ⊙ up, and with ``with_saved`` (σ(gate), silu(gate), intermediate), each
    rounded to the input dtype as the benchmark's forward rounds it. ``gate`` and ``up`` contiguous, of
    one shape, float dtype and device."""
    intermediate = runtime.allocate(gate.shape, dtype=gate.dtype, device=gate.device)
    if with_saved:
        saved = (
            runtime.allocate(gate.shape, dtype=gate.dtype, device=gate.device),
            runtime.allocate(gate.shape, dtype=gate.dtype, device=gate.device),
        )
    else:
        saved = (intermediate, intermediate)  # not written
    n = gate.numel()
    if n:
        kernels.swiglu_activation_kernel[(cdiv(n, ACTIVATION_BLOCK),)](
            gate,
            up,
            *saved,
            intermediate,
            n,
            with_saved,
            interpreter_enabled(),
            BLOCK=ACTIVATION_BLOCK,
            num_warps=4,
        )
    return (*saved, intermediate) if with_saved else intermediate
