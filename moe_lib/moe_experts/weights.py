"""The experts' gate and up weights as models hold them: fused in one ``gate_up`` [E, 2I, H], gate rows first.

Hugging Face's expert modules and :class:`moe_lib.nn.MoEExperts` keep ``gate_up_proj`` in that layout and hand the
layers its two row halves as views (:func:`split_gate_up`). Those views are not contiguous (an expert's gate rows
are 2·I·H elements after the previous expert's), but the grouped engine's products take the fused block as it lies
(the swiglu epilogue's B stacked [E, 2I, H]; dX's B [E, K = 2I, N = H]), so :func:`stacked_gate_up` finds the block
back instead of copying the halves on every call.
"""

from __future__ import annotations

import torch


def split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up): the two row halves of a fused [..., 2I, H] weight, as views. Taken by unbind, whose backward
    stacks the two gradients into one [..., 2I, H] tensor (slices would each fill a zero tensor of that size)."""
    return gate_up.unflatten(-2, (2, gate_up.shape[-2] // 2)).unbind(-3)


def stacked_gate_up(gate_weights: torch.Tensor, up_weights: torch.Tensor) -> torch.Tensor | None:
    """The fused [E, 2I, H] block whose row halves ``gate_weights`` and ``up_weights`` [E, I, H] are (each expert's
    I gate rows, then its I up rows, rows of H adjacent elements), as one contiguous view; None where they are
    not (then they are two weights of their own)."""
    if gate_weights.dim() != 3 or up_weights.shape != gate_weights.shape or up_weights.dtype != gate_weights.dtype:
        return None
    E, I, H = gate_weights.shape
    if E == 0 or I == 0 or H == 0 or gate_weights.device != up_weights.device:
        return None
    fused_strides = (2 * I * H, H, 1)
    if any(gate_weights.stride(d) != s or up_weights.stride(d) != s for d, s in enumerate(fused_strides) if E > 1 or d):
        return None
    if gate_weights.device.type == "meta":
        return None  # meta tensors have no storage to compare
    if up_weights.untyped_storage().data_ptr() != gate_weights.untyped_storage().data_ptr():
        return None
    if up_weights.storage_offset() != gate_weights.storage_offset() + I * H:
        return None
    return gate_weights.as_strided((E, 2 * I, H), fused_strides)
