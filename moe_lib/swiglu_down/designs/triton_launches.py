"""P1's portable design: two Triton launches of tiles of several kinds (the kernels of :mod:`..kernels`).

    launch 1   dWd = dyᵀ · intermediate  [H, I] (reduce over T)   beside
               dA  = dy · Wd             [T, I] (reduce over H), epilogue dGate, dUp (hi/lo with WITH_LO)
    launch 2   dWg = dGateᵀ · x, dWu = dUpᵀ · x  [I, H] (reduce over T)   beside
               dx  = dGate · Wg + dUp · Wu       [T, H] (reduce over 2I)

Each tile kind has its (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT); a split reduction parks fp32 partials and the last
program of a tile to arrive sums them in split order (deterministic). Pointer-based loads: it runs on any CUDA GPU,
any float dtype, any row length, and under the interpreter, where every CPU test runs it. :func:`launch_plan`
describes both launches (the launcher takes its grids from it, notebook 04 draws it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ...dispatch import TRITON_DTYPES
from ...tiling import cdiv
from .. import kernels, runtime
from ..runtime import Device, SplitWorkspace, dot_flags
from .base import Inputs, Outputs, on_triton


@dataclass(frozen=True)
class TileConfig:
    """Tile shapes of both launches: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT) per tile kind."""

    name: ClassVar[str] = "triton_launches"

    d_intermediate: tuple  # dA -> dGate, dUp tiles: [tokens, I] reducing over H
    grad_down: tuple  # dWd tiles: [H, I] reducing over T
    grad_x: tuple  # dx tiles: [tokens, H] reducing over 2I
    grad_gate_up: tuple  # dWg, dWu tiles: [I, H] reducing over T
    warps: tuple = (4, 4)  # num_warps of launch 1, launch 2
    stages: tuple = (3, 3)  # num_stages of launch 1, launch 2
    group_m: int = 8  # row tiles grouped for L2 reuse of the column operand
    # launch 2's dx tiles take its first program ids (else the dWg, dWu tiles do): where launch 2 is a few waves of
    # tiles of unequal length, the longest first leaves a shorter tail
    grad_x_first: bool = False

    def supports(self, num_tokens, hidden_size, intermediate_size, dtype, device: Device, *, aligned=True):
        if dtype not in TRITON_DTYPES:
            return f"dtype {dtype} is not one of {TRITON_DTYPES}"
        for field in ("d_intermediate", "grad_down", "grad_x", "grad_gate_up"):
            split = getattr(self, field)[3]
            if split < 1 or split & (split - 1):
                return f"{field}: SPLIT must be a power of two, got {split}"
        return on_triton(device)

    def run(self, inputs: Inputs, *, with_lo: bool, out: Outputs) -> None:
        x, I = inputs.x, inputs.gate_weight.shape[0]
        T = x.shape[0]
        # dGate, dUp: [hi] or [hi, lo] halves of [T, I] each, in the input dtype
        d_gate = runtime.allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
        d_up = runtime.allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
        plan = launch_plan(T, x.shape[1], I, self)
        workspaces = split_workspaces(plan, x.device)
        launch_d_intermediate_and_grad_down(inputs, d_gate, d_up, out.grad_down_weight, self, plan, with_lo, workspaces)
        launch_grad_x_and_grad_gate_up(inputs, d_gate, d_up, out, self, plan, with_lo, workspaces)


# Under the interpreter: 16-wide tiles split in two, so that tiny test shapes still have several tiles, splits and
# edges
INTERPRETER_TILES = TileConfig((16, 16, 16, 2), (16, 16, 16, 2), (16, 16, 16, 2), (16, 16, 16, 1), (1, 1), (1, 1), 2)
# the faithful path's tiles (a second A tile per step in launch 2, two halves stored in launch 1's epilogue: 8 warps
# in launch 1, dx on 128 × 128 tiles, 3 stages keep both within the registers and shared memory)
FAITHFUL_TILES = TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3))


# fp32 operands (exact fp32 products, on the CUDA cores): 64 × 64 tiles, K steps of 16, on 4 warps. The 16-bit tiles
# hold twice the bytes in fp32: from 257 tokens launch 2's 128 × 256 ones need 288 KB of shared memory, more than an
# SM has (the launch fails), and below they spill up to 2 KB a thread (compiled for sm_90:
# tests/swiglu_down/test_compile_sm90.py)
FP32_TILES = TileConfig((64, 64, 16, 1), (64, 64, 16, 1), (64, 64, 16, 1), (64, 64, 16, 1), (4, 4), (3, 3))


def tiles_for(num_tokens: int, *, with_lo: bool) -> TileConfig:
    """Tiles by token count: split reductions over H and 2I where few token rows leave few tiles
    (notes/p1/design-01.md, design-02.md)."""
    if num_tokens <= 16:
        return TileConfig((16, 64, 128, 8), (64, 128, 16, 1), (16, 64, 128, 8), (64, 128, 16, 1), (4, 4), (3, 3))
    if num_tokens <= 256:
        return TileConfig((64, 64, 64, 4), (64, 128, 64, 1), (64, 128, 64, 4), (64, 128, 64, 1), (4, 4), (3, 3))
    if with_lo:
        return FAITHFUL_TILES
    return TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (4, 8), (4, 4))


@dataclass(frozen=True)
class TileKind:
    """One kind of tile in one launch: what it computes and how the launch covers it."""

    launch: int  # 1 or 2
    kind: str  # "dWd", "dA", "dWg", "dWu", "dx"
    computes: str
    M: int  # output rows
    N: int  # output columns
    reduce_name: str  # what the reduction runs over ("T", "H", "2I")
    reduce_length: int
    block_m: int
    block_n: int
    block_k: int
    split: int  # programs per tile, each one piece of the reduction
    first_program: int  # program id of this kind's first program in its launch

    @property
    def tiles(self) -> int:
        return cdiv(self.M, self.block_m) * cdiv(self.N, self.block_n)

    @property
    def programs(self) -> int:
        return self.tiles * self.split


def launch_plan(num_tokens: int, hidden_size: int, intermediate_size: int, config: TileConfig) -> list[TileKind]:
    """Every tile kind of both launches under ``config``, in program order (the kernels put the
    weight-gradient kinds, long reductions over T, first; launch 2's dx tiles first with ``grad_x_first``)."""
    T, H, I = num_tokens, hidden_size, intermediate_size
    grad_x = (2, "dx", "dx = dGate · Wg + dUp · Wu", T, H, "2I", 2 * I, config.grad_x)
    kinds = [  # (launch, kind, computes, M, N, reduction name, reduction length, config field)
        (1, "dWd", "dWd = dyᵀ · intermediate", H, I, "T", T, config.grad_down),
        (1, "dA", "dA = dy · Wd, epilogue dGate, dUp", T, I, "H", H, config.d_intermediate),
        *([grad_x] if config.grad_x_first else []),
        (2, "dWg", "dWg = dGateᵀ · x", I, H, "T", T, config.grad_gate_up),
        (2, "dWu", "dWu = dUpᵀ · x", I, H, "T", T, config.grad_gate_up),
        *([] if config.grad_x_first else [grad_x]),
    ]
    plan, first = [], {1: 0, 2: 0}
    for launch, kind, computes, m, n, reduce_name, reduce_length, (bm, bn, bk, split) in kinds:
        tile_kind = TileKind(launch, kind, computes, m, n, reduce_name, reduce_length, bm, bn, bk, split, first[launch])
        plan.append(tile_kind)
        first[launch] += tile_kind.programs
    return plan


def grid_sizes(plan: list[TileKind]) -> dict[int, int]:
    """Programs of each launch: {1: ..., 2: ...}."""
    return {launch: sum(k.programs for k in plan if k.launch == launch) for launch in (1, 2)}


def split_workspaces(plan: list[TileKind], device: torch.device) -> dict:
    """The fp32 partials and arrival counters of every tile kind of both launches, by slot name."""
    kinds = {k.kind: k for k in plan}
    return {
        slot: SplitWorkspace.for_tiles(
            slot, tiles * kinds[kind].tiles, kinds[kind].split, kinds[kind].block_m, kinds[kind].block_n, device
        )
        for slot, kind, tiles in (("dA", "dA", 1), ("dWd", "dWd", 1), ("dx", "dx", 1), ("dWgu", "dWg", 2))
    }


def launch_d_intermediate_and_grad_down(
    inputs: Inputs, d_gate, d_up, grad_down_weight, config: TileConfig, plan, with_lo: bool, workspaces: dict
) -> None:
    """Launch 1: dGate, dUp (through dA = dy · Wd; with ``with_lo`` as hi/lo pairs) and dWd."""
    grad_output, down_weight = inputs.grad_output, inputs.down_weight
    T, H = grad_output.shape
    I = down_weight.shape[1]
    kernels.d_intermediate_and_grad_down_kernel[(grid_sizes(plan)[1],)](
        grad_output,
        down_weight,
        inputs.gate,
        inputs.gate_sigmoid,
        inputs.gate_silu,
        inputs.up,
        inputs.intermediate,
        d_gate,
        d_up,
        T * I,
        grad_down_weight,
        *workspaces["dA"],
        *workspaces["dWd"],
        T,
        H,
        I,
        *config.d_intermediate,
        *config.grad_down,
        config.group_m,
        *dot_flags(grad_output),
        with_lo,
        num_warps=config.warps[0],
        num_stages=config.stages[0],
    )


def launch_grad_x_and_grad_gate_up(
    inputs: Inputs, d_gate, d_up, out: Outputs, config: TileConfig, plan, with_lo: bool, workspaces: dict
) -> None:
    """Launch 2: dx, dWg and dWu from dGate and dUp (with ``with_lo``, both halves of each)."""
    x = inputs.x
    T, H = x.shape
    I = inputs.gate_weight.shape[0]
    kernels.grad_x_and_grad_gate_up_kernel[(grid_sizes(plan)[2],)](
        x,
        inputs.gate_weight,
        inputs.up_weight,
        d_gate,
        d_up,
        T * I,
        out.grad_x,
        out.grad_gate_weight,
        out.grad_up_weight,
        *workspaces["dx"],
        *workspaces["dWgu"],
        T,
        H,
        I,
        *config.grad_x,
        *config.grad_gate_up,
        config.group_m,
        *dot_flags(x),
        with_lo,
        config.grad_x_first,
        num_warps=config.warps[1],
        num_stages=config.stages[1],
    )
