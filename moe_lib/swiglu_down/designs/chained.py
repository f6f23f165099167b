"""A P1 design (design 8): the two launches of :mod:`.kernels` chained into one, programs ordered by tickets.

    every program first takes a ticket t (an atomic counter: tickets go out in the order programs start)
    t ∈ [0, nA)                 a dA tile:  dA = dy · Wd → dGate, dUp stored; then counts itself done
    t ∈ [nA, nA + nWd)          a dWd tile: dWd = dyᵀ · intermediate
    t ∈ [nA + nWd, grid)        waits until all nA dA programs of this launch are done, then launch 2's tile:
                                dWg = dGateᵀ · x,  dWu = dUpᵀ · x,  dx = dGate · Wg + dUp · Wu
                                (in the order of launch 2's program ids: dx first with ``grad_x_first``)
    (with ``grad_down_first`` the dWd tiles take the first nWd tickets and the dA tiles the next nA, as in launch 1;
    with ``grad_down_last`` the dWd tiles take the last nWd tickets, after launch 2's)

The tiles, split-K partials and epilogues are those of the two launches (:func:`.kernels.d_intermediate_program`,
:func:`.kernels.token_reduction_program`, :func:`.kernels.grad_x_and_grad_gate_up_program`); only the order and the
wait are new.

Why: where a call is timed from its first kernel's start to its last kernel's end with the host issuing each
launch as the call runs (NVIDIA's harness), the host work of the second launch shows as a gap whenever the first
launch is shorter than it (at 512 tokens the faithful path's two launches took 105 µs there against 62 µs by graph
replay, ``notes/p1/design-08.md``). One launch has no such gap. And launch 2's tiles start as soon as dA is done,
beside the tail of the dWd tiles, where the second launch waited for every tile of the first. The price: one
launch holds the registers and shared memory of its largest branch for every program (on the faithful path launch
2's, one program per SM), so launch 1's tiles should be as wide as that allows (:data:`CHAINED_TILES`).

Why tickets and not program ids: a program waits only for programs holding smaller tickets, which had started
before it took its own, and those never wait; so the wait cannot hang, whatever the grid size, however many
programs are resident at once, and whatever else runs beside the launch. No residency guarantee is needed (the
grid may be many waves). Counters (int64, zeroed once, never reset, one pair per grid size and dA program count):
    [0]   +1 per program: its ticket is (the count it found) mod grid, its launch number g = that count // grid
    [1]   +1 per dA program once its tile is stored: this launch's dA is complete once it reaches (g + 1) · nA
The interpreter runs programs one after another in program order, so tickets come out as program ids and every
wait is already satisfied when it is reached.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from .. import runtime
from ..kernels import (
    d_intermediate_program,
    grad_x_and_grad_gate_up_program,
    token_reduction_program,
    wait_for,
)
from ..runtime import Device, SplitWorkspace, dot_flags
from .base import Inputs, Outputs
from .triton_launches import TileConfig, grid_sizes, launch_plan, split_workspaces


@triton.jit
def chained_kernel(
    grad_output_ptr,  # dy [T, H]
    x_ptr,  # x [T, H]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, intermediate_ptr,  # saved forward, each [T, I]
    d_gate_ptr, d_up_ptr,  # workspace: dGate, dUp [T, I], each followed by its lo half with WITH_LO
    lo_offset,  # T·I: where the lo halves start, in elements after dGate, dUp
    grad_x_ptr,  # out: dx [T, H]
    grad_gate_weight_ptr, grad_up_weight_ptr,  # out: dWg, dWu [I, H]
    grad_down_weight_ptr,  # out: dWd [H, I]
    da_partials_ptr, da_counters_ptr,  # split-K workspace of the dA tiles
    dwd_partials_ptr, dwd_counters_ptr,  # split-K workspace of the dWd tiles
    dx_partials_ptr, dx_counters_ptr,  # split-K workspace of the dx tiles
    dw_partials_ptr, dw_counters_ptr,  # split-K workspace of the dWg tiles, then the dWu tiles
    tickets_ptr,  # int64 [2]: [0] tickets handed out, [1] dA programs done (both summed over launches)
    T, H, I,
    DA_M: tl.constexpr, DA_N: tl.constexpr, DA_K: tl.constexpr, DA_SPLIT: tl.constexpr,
    DWD_M: tl.constexpr, DWD_N: tl.constexpr, DWD_K: tl.constexpr, DWD_SPLIT: tl.constexpr,
    DX_M: tl.constexpr, DX_N: tl.constexpr, DX_K: tl.constexpr, DX_SPLIT: tl.constexpr,
    DW_M: tl.constexpr, DW_N: tl.constexpr, DW_K: tl.constexpr, DW_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    WITH_LO: tl.constexpr,  # dGate, dUp as hi/lo pairs (the faithful path); else hi alone
    GRAD_DOWN_FIRST: tl.constexpr,  # the dWd tiles' tickets before the dA tiles' (else after)
    GRAD_DOWN_LAST: tl.constexpr,  # the dWd tiles' tickets after launch 2's (else before)
    GRAD_X_FIRST: tl.constexpr,  # launch 2's dx tiles' tickets before its dWg, dWu tiles' (else after)
):
    grid = tl.num_programs(0)
    arrival = tl.atomic_add(tickets_ptr, 1, sem="relaxed", scope="gpu")
    ticket = (arrival % grid).to(tl.int32)
    num_da = tl.cdiv(T, DA_M) * tl.cdiv(I, DA_N) * DA_SPLIT
    num_dwd = tl.cdiv(H, DWD_M) * tl.cdiv(I, DWD_N) * DWD_SPLIT
    # the tiles in the order asked for: tickets [dA | dWd | launch 2], [dWd | dA | launch 2] or [dA | launch 2 | dWd]
    if GRAD_DOWN_FIRST:
        da_program, dwd_program, second_program = ticket - num_dwd, ticket, ticket - num_da - num_dwd
    elif GRAD_DOWN_LAST:
        da_program, dwd_program, second_program = ticket, ticket - (grid - num_dwd), ticket - num_da
    else:
        da_program, dwd_program, second_program = ticket, ticket - num_da, ticket - num_da - num_dwd
    if (da_program >= 0) & (da_program < num_da):  # launch 2's tiles wait for these alone
        d_intermediate_program(da_program, grad_output_ptr, down_weight_ptr, gate_ptr, gate_sigmoid_ptr, gate_silu_ptr,
                               up_ptr, d_gate_ptr, d_up_ptr, lo_offset, da_partials_ptr, da_counters_ptr, T, H, I,
                               DA_M, DA_N, DA_K, DA_SPLIT, GROUP_M, UPCAST, PRECISION, WITH_LO)
        tl.debug_barrier()  # every thread's dGate, dUp stores come before the count
        tl.atomic_add(tickets_ptr + 1, 1, sem="release", scope="gpu")
    elif (dwd_program >= 0) & (dwd_program < num_dwd):
        token_reduction_program(dwd_program, grad_output_ptr, 0, intermediate_ptr, grad_down_weight_ptr,
                                dwd_partials_ptr, dwd_counters_ptr, T, H, I,
                                DWD_M, DWD_N, DWD_K, DWD_SPLIT, GROUP_M, UPCAST, PRECISION, False)
    else:
        wait_for(tickets_ptr + 1, (arrival // grid + 1) * num_da)  # this launch's dA, stored and visible
        grad_x_and_grad_gate_up_program(second_program, x_ptr, gate_weight_ptr, up_weight_ptr, d_gate_ptr,
                                        d_up_ptr, lo_offset, grad_x_ptr, grad_gate_weight_ptr, grad_up_weight_ptr,
                                        dx_partials_ptr, dx_counters_ptr, dw_partials_ptr, dw_counters_ptr, T, H, I,
                                        DX_M, DX_N, DX_K, DX_SPLIT, DW_M, DW_N, DW_K, DW_SPLIT, GROUP_M, UPCAST,
                                        PRECISION, WITH_LO, GRAD_X_FIRST)

@dataclass(frozen=True)
class ChainedConfig:
    """The two launches' tiles (a :class:`~.triton_launches.TileConfig`) run as one launch."""

    name: ClassVar[str] = "chained"

    tiles: TileConfig
    warps: int = 8
    stages: int = 3
    # the dWd tiles (long reductions over T) take their tickets before the dA tiles, as they run first in launch 1;
    # else after them, so that launch 2's tiles, which wait for dA alone, can start sooner
    grad_down_first: bool = False
    # the dWd tiles take the last tickets, after launch 2's: they depend on nothing, so they fill the SMs that launch
    # 2's last wave leaves free (not with grad_down_first)
    grad_down_last: bool = False

    def __post_init__(self):
        if self.grad_down_first and self.grad_down_last:
            raise ValueError("config: grad_down_first and grad_down_last exclude each other")

    @classmethod
    def for_tokens(cls, num_tokens: int) -> ChainedConfig:
        """The tiles by token count: from :data:`GRAD_DOWN_LAST_MIN_TOKENS` the dWd tiles take the last tickets
        (notes/p1/design-08.md)."""
        tiles = CHAINED_TILES[max(first for first in CHAINED_TILES if first <= num_tokens)]
        return cls(tiles, warps=8, stages=3, grad_down_last=num_tokens >= GRAD_DOWN_LAST_MIN_TOKENS)

    def supports(self, num_tokens, hidden_size, intermediate_size, dtype, device: Device, *, aligned=True):
        return self.tiles.supports(num_tokens, hidden_size, intermediate_size, dtype, device, aligned=aligned)

    def programs(self, num_tokens: int, hidden_size: int, intermediate_size: int) -> dict[int, int]:
        """Programs of launch 1's tiles and of launch 2's: {1: ..., 2: ...}; the grid is their sum."""
        return grid_sizes(launch_plan(num_tokens, hidden_size, intermediate_size, self.tiles))

    def run(self, inputs: Inputs, *, with_lo: bool, out: Outputs) -> None:
        """One launch. ``with_lo``: dGate and dUp carried as hi/lo pairs (the faithful path)."""
        x = inputs.x
        T, H = x.shape
        I = inputs.gate_weight.shape[0]
        plan = launch_plan(T, H, I, self.tiles)
        grid = sum(grid_sizes(plan).values())
        d_gate = runtime.allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
        d_up = runtime.allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
        workspaces = split_workspaces(plan, x.device)
        # one pair per (grid, dA programs): a launch needs the ticket counter at a multiple of its grid and the dA
        # count at the same multiple of its dA programs when it starts (launches of other shapes may share a grid)
        num_da = next(kind.programs for kind in plan if kind.kind == "dA")
        slot = f"chained tickets, grid {grid}, dA programs {num_da}"
        tickets = SplitWorkspace.counters(slot, 1, 4, x.device).view(torch.int64)
        tiles = self.tiles
        chained_kernel[(grid,)](
            *inputs, d_gate, d_up, T * I, *out,
            *workspaces["dA"], *workspaces["dWd"], *workspaces["dx"], *workspaces["dWgu"], tickets, T, H, I,
            *tiles.d_intermediate, *tiles.grad_down, *tiles.grad_x, *tiles.grad_gate_up, tiles.group_m,
            *dot_flags(x), with_lo, self.grad_down_first, self.grad_down_last, tiles.grad_x_first, num_warps=self.warps,
            num_stages=self.stages,
        )


# From this many tokens the dWd tiles take the last tickets, after launch 2's tiles: they depend on nothing, so they
# fill the SMs that launch 2's last wave leaves free (notes/p1/design-08.md, third round)
GRAD_DOWN_LAST_MIN_TOKENS = 1153
_WIDE_TILES = TileConfig((64, 128, 64, 1), (128, 256, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1))
CHAINED_TILES = {  # from this many tokens: these tiles (from 512 128 × 256 dWd tiles, dx's tiles first: design 8)
    0: TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)),
    512: dataclasses.replace(_WIDE_TILES, grad_x_first=True),
    GRAD_DOWN_LAST_MIN_TOKENS: _WIDE_TILES,
}
