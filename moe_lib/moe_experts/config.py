"""P2's launch configuration and launch plan entries, as plain frozen dataclasses.

:class:`LaunchConfig` holds the tiles of kernels A, W, D and C (:mod:`.choose` fills it from the shape);
:class:`KernelLaunch` describes one launch of a plan (:func:`.launch.launch_plan`). A leaf: it imports no
kernel and no design.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the TMA-fed forms' configs live beside their kernels
    from .tma_slot_projection import TmaSlotProjectionConfig
    from .tma_weight_grad import TmaWeightGradConfig


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of kernels A, W, D and C."""

    block_m: int  # rows (slots of one expert) per row block: the N side of kernels A and D
    block_i: int  # A: intermediate columns per program (the M side)
    block_h: int  # A: hidden columns per reduction step
    grad_gate_up_tile: tuple[int, int, int]  # W: (I, H, rows per step) of the dWg and dWu tiles
    grad_down_tile: tuple[int, int, int]  # W: (H, I, rows per step) of the dWd tiles
    n_tiles_per_program: int  # W: tiles along the second dimension one program writes in turn
    block_h_dx: int  # D: hidden columns per program (the M side)
    block_i_dx: int  # D: intermediate columns per reduction step
    block_h_sum: int  # C: hidden columns per program
    row_split: int  # R: programs per (expert, tile) in A and D that share its row blocks (and weights via L2)
    warps_a: int = 8  # num_warps of kernel A
    stages_a: int = 3  # num_stages (software pipelining depth) of kernel A
    warps_gu: int = 8  # kernel W's dWg, dWu launch
    stages_gu: int = 3
    warps_dn: int = 8  # kernel W's dWd launch
    stages_dn: int = 3
    warps_d: int = 8  # kernel D
    stages_d: int = 3
    # kernel W as a persistent TMA-fed grouped GEMM (:mod:`.tma_weight_grad`); None: the pointer-based kernel W
    tma_weight_grad: TmaWeightGradConfig | None = None
    # kernel D likewise (:mod:`.tma_slot_projection`); None: the pointer-based kernel D
    tma_slot_projection: TmaSlotProjectionConfig | None = None


@dataclass(frozen=True)
class KernelLaunch:
    """One launch of the backward: its grid as named factors and what one program does."""

    step: str  # "A", "W_gate_up", "W_down", "D", "C"
    grid: dict = field(default_factory=dict)  # factor name -> size; the programs are their product
    one_program: str = ""
    launched: bool = True  # False where the launch is skipped (A, D and C need T·K > 0)
    # a persistent launch's work items as named factors (its programs loop over them); empty: one tile per program
    tiles: dict = field(default_factory=dict)

    @property
    def programs(self) -> int:
        return math.prod(self.grid.values()) if self.launched else 0
