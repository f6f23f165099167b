"""A set-aside P1 design: both phases in one persistent launch around a grid barrier.

    phase 1: programs [0, I/BI) own an I-slice: dA = dy · Wd[:, slice] → dGate, dUp (one token
             block after another); programs [I/BI, +H/BHD) own H-rows of dWd = dyᵀ · intermediate
    grid barrier (every program counts itself in on a counter, then waits for all)
    phase 2: program r owns H-columns [r·BH, (r+1)·BH): dx[:, cols], dWg[:, cols], dWu[:, cols]

Each weight is read once and each gradient written once, with no second launch and no split partials.
The barrier needs every program resident at once, hence at most one program per SM; the interpreter
runs programs one after another, so there the phases run as two launches instead. Measured on the
H200 no faster than the two launches at 1–512 tokens in GPU time (``data/results/NOTES.md``: the time
there is the chain of dependent loads in each program, not the launch count); but where a call is timed
from its first kernel's start to its last kernel's end, as NVIDIA's harness does, the host gap between
two launches counts, so the faithful path runs this design for few tokens (``launch.choose_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..tiling import cdiv
from . import launch
from .kernels import d_intermediate_program, grad_x_program, token_reduction_program
from .launch import SplitWorkspace, dot_flags, resident_programs


@triton.jit
def grid_barrier(counter_ptr, num_programs):
    """Return once all ``num_programs`` programs of this launch have called it (all must be resident).

    The int64 counter only grows, by num_programs per launch, so it never needs a reset: a program
    waits for the next multiple of num_programs above its own arrival. Stores before the barrier
    are visible to every program after it (release on arrival, acquire while waiting)."""
    tl.debug_barrier()  # every thread of this program has stored its phase-1 results
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    target = (arrived // num_programs + 1) * num_programs
    seen = arrived + 1
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def one_launch_kernel(
    grad_output_ptr,  # dy [T, H]
    x_ptr,  # x [T, H]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, intermediate_ptr,  # saved forward, each [T, I]
    d_gate_ptr, d_up_ptr,  # workspace: dGate, dUp [T, I], written in phase 1, read in phase 2
    lo_offset,  # T·I: where their lo halves start (WITH_LO), in elements after dGate, dUp
    grad_x_ptr,  # out: dx [T, H]
    grad_gate_weight_ptr, grad_up_weight_ptr,  # out: dWg, dWu [I, H]
    grad_down_weight_ptr,  # out: dWd [H, I]
    barrier_ptr,  # int64 grid-barrier counter (only grows)
    T, H, I,
    PHASE: tl.constexpr,  # 0: both phases around the grid barrier; 1 or 2: that phase alone (interpreter)
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H_DOWN: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    WITH_LO: tl.constexpr,  # dGate, dUp as hi/lo pairs (the faithful path), the lo halves T·I elements on
):  # fmt: skip
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(T, BLOCK_T)
    num_da = tl.cdiv(I, BLOCK_I)
    num_dwd = tl.cdiv(H, BLOCK_H_DOWN)
    if PHASE != 2:
        if pid < num_da:  # dA → dGate, dUp for I-columns [pid·BI, +BI), every token block
            for t in range(token_blocks):
                d_intermediate_program(t * num_da + pid, grad_output_ptr, down_weight_ptr, gate_ptr,
                                       gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_ptr, d_up_ptr, lo_offset,
                                       barrier_ptr, barrier_ptr, T, H, I,
                                       BLOCK_T, BLOCK_I, BLOCK_K, 1, 1, UPCAST, PRECISION, WITH_LO)  # fmt: skip
        elif pid < num_da + num_dwd:  # dWd for H-rows [(pid − num_da)·BHD, +BHD), every I-block
            n_blocks = tl.cdiv(I, BLOCK_N)
            for n in range(n_blocks):
                token_reduction_program((pid - num_da) * n_blocks + n, grad_output_ptr, 0, intermediate_ptr,
                                        grad_down_weight_ptr, barrier_ptr, barrier_ptr, T, H, I,
                                        BLOCK_H_DOWN, BLOCK_N, BLOCK_T, 1, 1, UPCAST, PRECISION, False)  # fmt: skip
    if PHASE == 0:
        grid_barrier(barrier_ptr, tl.num_programs(0))
    if PHASE != 1:
        if pid < tl.cdiv(H, BLOCK_H):  # H-columns [pid·BH, +BH) of dx, dWg and dWu
            num_h = tl.cdiv(H, BLOCK_H)
            for t in range(token_blocks):
                grad_x_program(t * num_h + pid, d_gate_ptr, d_up_ptr, I, lo_offset, gate_weight_ptr, up_weight_ptr,
                               grad_x_ptr, barrier_ptr, barrier_ptr, T, H, I, BLOCK_T, BLOCK_H, BLOCK_K, 1, 1,
                               UPCAST, PRECISION, WITH_LO)  # fmt: skip
            for m in range(tl.cdiv(I, BLOCK_N)):
                token_reduction_program(m * num_h + pid, d_gate_ptr, lo_offset, x_ptr, grad_gate_weight_ptr,
                                        barrier_ptr, barrier_ptr, T, I, H, BLOCK_N, BLOCK_H, BLOCK_T, 1, 1,
                                        UPCAST, PRECISION, WITH_LO)  # fmt: skip
                token_reduction_program(m * num_h + pid, d_up_ptr, lo_offset, x_ptr, grad_up_weight_ptr,
                                        barrier_ptr, barrier_ptr, T, I, H, BLOCK_N, BLOCK_H, BLOCK_T, 1, 1,
                                        UPCAST, PRECISION, WITH_LO)  # fmt: skip



@dataclass(frozen=True)
class OneLaunchConfig:
    """Block sizes of the one-launch design (phase 1: dA by I-slices, dWd by H-rows; phase 2: H-columns)."""

    block_t: int = 16  # tokens per step: the M side of dA and dx, the reduction step of dWd, dWg, dWu
    block_i: int = 16  # I-columns of one dA program
    block_h_down: int = 32  # H-rows of one dWd program
    block_h: int = 16  # H-columns of one phase-2 program (dx, dWg, dWu)
    block_k: int = 128  # reduction step over H (dA) and over I (dx)
    block_n: int = 128  # I-columns per step of dWd, I-rows per step of dWg and dWu
    warps: int = 4
    stages: int = 3
    # a cooperative launch: CUDA guarantees every program resident (or refuses the launch), so the grid
    # barrier cannot hang beside another stream's kernel (as :class:`~.few_tokens.FewTokensConfig`'s)
    cooperative: bool = False

    def programs(self, hidden_size: int, intermediate_size: int) -> tuple[int, int, int]:
        """(dA programs, dWd programs, phase-2 programs); the grid is the larger of phase 1's sum and phase 2."""
        return (cdiv(intermediate_size, self.block_i), cdiv(hidden_size, self.block_h_down),
                cdiv(hidden_size, self.block_h))  # fmt: skip

    def grid_size(self, hidden_size: int, intermediate_size: int) -> int:
        num_da, num_dwd, num_phase2 = self.programs(hidden_size, intermediate_size)
        return max(num_da + num_dwd, num_phase2)

    def run(self, grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up,
            intermediate, grad_x, grad_gate_weight, grad_up_weight, grad_down_weight, *, with_lo: bool):  # fmt: skip
        """Both phases in one persistent launch (two launches under the interpreter); returns the outputs.
        ``with_lo``: dGate and dUp carried as hi/lo pairs (the faithful path)."""
        T, H = x.shape
        I = gate_weight.shape[0]
        grid = self.grid_size(H, I)
        if grid > resident_programs(x.device):
            raise ValueError(f"config: the one-launch grid ({grid} programs for H={H}, I={I}) exceeds one "
                             f"program per SM ({resident_programs(x.device)}); use larger blocks or a TileConfig")
        d_gate = launch.allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
        d_up = launch.allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
        # one counter per grid size: the barrier needs the counter at a multiple of the grid when a launch starts
        barrier = SplitWorkspace.counters(f"one-launch barrier, grid {grid}", 1, 1, x.device).view(torch.int64)
        interpreter = interpreter_enabled()
        for phase in (1, 2) if interpreter else (0,):
            one_launch_kernel[(grid,)](
                grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up,
                intermediate, d_gate, d_up, T * I, grad_x, grad_gate_weight, grad_up_weight, grad_down_weight, barrier,
                T, H, I, phase, self.block_t, self.block_i, self.block_h_down, self.block_h, self.block_k,
                self.block_n, *dot_flags(x), with_lo, num_warps=self.warps, num_stages=self.stages,
                **({"launch_cooperative_grid": True} if self.cooperative and not interpreter else {}),
            )  # fmt: skip
        return grad_x, grad_gate_weight, grad_up_weight, grad_down_weight
