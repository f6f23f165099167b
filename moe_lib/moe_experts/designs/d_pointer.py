"""Kernel D, pointer-based (:func:`~..kernels.slot_projection_kernel`): the readable form, and the fallback.

One program per (expert, H-tile, row split r), over the expert's row blocks r, r + R, …, each reduced over I.
Runs on any H and I, with weights at any address, on any GPU and under the interpreter.
"""

from __future__ import annotations

import torch

from ...dispatch import interpreter_enabled
from ...tiling import cdiv
from .. import kernels
from ..config import KernelLaunch, LaunchConfig
from ..runtime import OPERAND_DTYPES, Target, dtype_reason


def launch_slot_projection(
    config: LaunchConfig, routing, weights1, weights2, rows1, rows2, out_slot, stride_h, stride_i
) -> None:
    """Kernel D over every (expert, H-tile, row split): out_slot = W1_e v1 (+ W2_e v2 when given twice)."""
    H, I = out_slot.shape[1], rows1.shape[1]
    E, h_tiles = weights1.shape[0], cdiv(H, config.block_h_dx)
    kernels.slot_projection_kernel[(E * h_tiles * config.row_split,)](
        weights1,
        weights2,
        routing.sorted_slot,
        routing.expert_offsets,
        rows1,
        rows2,
        out_slot,
        H,
        I,
        stride_h,
        stride_i,
        h_tiles,
        config.row_split,
        TWO_TERMS=weights2 is not weights1,
        OPERAND_DTYPE=OPERAND_DTYPES[rows1.dtype],
        INTERPRETER=interpreter_enabled(),
        BLOCK_H=config.block_h_dx,
        BLOCK_M=config.block_m,
        BLOCK_I=config.block_i_dx,
        num_warps=config.warps_d,
        num_stages=config.stages_d,
    )


class PointerSlotProjection:
    """Kernel D by pointer loads: weight tiles where they lie, the expert's rows by sorted position."""

    name = "pointer"
    needs = "inputs in float32, bfloat16 or float16; any H and I, any CUDA GPU or the interpreter"

    def supports(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        target: Target,
        *,
        transposed_weights: bool = True,
        weights_aligned: bool = True,
    ) -> str | None:
        return dtype_reason(dtype)

    def plan(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        config: LaunchConfig,
        num_programs: int,
        launched: bool,
    ) -> KernelLaunch:
        grid = {"experts": num_experts, "H-tiles": cdiv(hidden_size, config.block_h_dx), "row split": config.row_split}
        return KernelLaunch(
            "D",
            grid,
            f"dX_slotᵀ = Wgᵀdgᵀ + Wuᵀduᵀ on an H-tile of {config.block_h_dx} (M side) for row blocks r, r+R, … of "
            f"{config.block_m} rows (N side), over I in steps of {config.block_i_dx}",
            launched,
        )

    def run(
        self,
        config: LaunchConfig,
        routing,
        weights1,
        weights2,
        rows1,
        rows2,
        out_slot,
        *,
        transposed_weights: bool,
        num_programs: int,
    ) -> None:
        H, I = out_slot.shape[1], rows1.shape[1]
        strides = (1, H) if transposed_weights else (I, 1)  # (stride over H, stride over I) of one expert's weights
        two = weights2 if weights2 is not None else weights1
        launch_slot_projection(
            config, routing, weights1, two, rows1, rows2 if rows2 is not None else rows1, out_slot, *strides
        )


DESIGN = PointerSlotProjection()
