"""Kernel D, TMA-fed and persistent (:mod:`..tma_slot_projection`): the default of the backward and the forward.

One program per SM loops over (expert, H-tile, row block) tiles; weights and the expert's rows arrive by TMA
through descriptors made once per program. Needs Hopper (or the interpreter), rows of I 16-bit elements and
weight rows (H in the backward, I in the forward) in whole multiples of 16 bytes, and weights whose base
address is 16-byte aligned.
"""

from __future__ import annotations

import torch

from ...tiling import cdiv
from ..config import KernelLaunch, LaunchConfig
from ..runtime import WORKSPACE_DTYPES, Target, dtype_reason, tma_reason
from ..tma_slot_projection import launch_slot_projection_tma


class TmaSlotProjection:
    """Kernel D as a persistent grouped GEMM over the expert's rows, fed by TMA."""

    name = "tma"
    needs = (
        "inputs in float32, bfloat16 or float16; rows of I 16-bit elements and weight rows (H backward, I "
        "forward) in whole multiples of 16 bytes; 16-byte aligned weights; a GPU of compute capability 9.0 "
        "or later, or the interpreter"
    )

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
        if reason := dtype_reason(dtype):
            return reason
        # the rows are kernel A's 16-bit workspaces; the weights come in the interface dtype (fp32 too)
        name, width = ("H", hidden_size) if transposed_weights else ("I", intermediate_size)
        rows = {"rows of I": (intermediate_size, WORKSPACE_DTYPES[dtype]), f"weight rows of {name}": (width, dtype)}
        if reason := tma_reason(target, rows):
            return reason
        return None if weights_aligned else "the weights' base address is not 16-byte aligned, as TMA needs"

    def plan(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        config: LaunchConfig,
        num_programs: int,
        launched: bool,
    ) -> KernelLaunch:
        block_h, block_rows, block_i = config.tma_slot_projection.backward_tile
        return KernelLaunch(
            "D",
            {"programs (one per SM)": num_programs},
            f"dX_slotᵀ = Wgᵀdgᵀ + Wuᵀduᵀ on tiles of {block_h} weight rows (an H-tile, M side) × {block_rows} of "
            f"the expert's rows (N side), expert by expert, over I in steps of {block_i} that arrive by TMA",
            launched,
            tiles={"experts": num_experts, "H-tiles": cdiv(hidden_size, block_h)},
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
        launch_slot_projection_tma(
            config.tma_slot_projection,
            routing,
            weights1,
            weights2,
            rows1,
            rows2,
            out_slot,
            transposed_weights=transposed_weights,
            num_programs=num_programs,
        )


DESIGN = TmaSlotProjection()
