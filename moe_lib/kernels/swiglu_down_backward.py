"""Triton backward of one SwiGLU expert with down projection (P1): two launches, or one for few tokens.

Dataflow (T tokens, H hidden, I intermediate; s = the saved gate_sigmoid):

    launch 1, tiles of two kinds side by side:
        dA    = dy · Wd                                  [T, I]   (reduce over H)
                epilogue: dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)),  dUp = dA ⊙ gate_silu
                -> stored in the input dtype; dA itself never leaves the chip
        dWd   = dyᵀ · intermediate                       [H, I]   (reduce over T)
    launch 2, tiles of three kinds side by side:
        dWg   = dGateᵀ · x ;  dWu = dUpᵀ · x             [I, H]   (reduce over T)
        dx    = dGate · Wg + dUp · Wu                    [T, H]   (reduce over 2I)

All products accumulate in fp32 on the tensor cores (bf16 operands for bf16 inputs; exact fp32
for fp32 inputs). Tiles of different kinds share a launch, so that the weight-gradient GEMMs (few
output tiles, long reductions over T) run beside the token-parallel ones; they are scheduled first.

Split-K: a tile kind can split its reduction over SPLIT programs (powers of two). Each parks its
fp32 partial in a workspace and counts itself in on a per-tile counter; the program that arrives
last adds the SPLIT partials in split order and runs the epilogue. The sum's order never depends
on arrival order, so results are deterministic. Few tokens need this: the reduction over H of dA
(and over I of dx) is then long while there are few output tiles, and without a split a handful of
programs would stream all the weights alone. The counters only ever grow (by SPLIT per tile per
call), so they need no reset; they live in a zeroed buffer kept per device and stream.

One launch for few tokens (:class:`OneLaunchConfig`): the same tiles in one persistent launch of at
most one program per SM, in two phases around a grid barrier:

    phase 1: programs [0, I/BI) own an I-slice: dA = dy · Wd[:, slice] → dGate, dUp (one token
             block after another); programs [I/BI, +H/BHD) own H-rows of dWd = dyᵀ · intermediate
    grid barrier (every program counts itself in on a counter, then waits for all)
    phase 2: program r owns H-columns [r·BH, (r+1)·BH): dx[:, cols], dWg[:, cols], dWu[:, cols]

so each weight is read once and each gradient written once, with no second launch and no split
partials. The barrier needs every program resident at once, hence at most one program per SM; the
interpreter runs programs one after another, so there the phases run as two launches instead. On
the H200 it measured no faster than the two launches at 1–512 tokens (the time there is the chain of
dependent loads in each program, not the launch count), so it is chosen only explicitly.

No host synchronisation anywhere: the call captures in a CUDA graph.
Workspace: dGate and dUp, 2·T·I elements in the input dtype (T = 8192: 25 MB in bf16), plus the
fp32 partials of split tiles (at most a few MB; none when nothing is split).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TileConfig:
    """Tile shapes of both launches: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT) per tile kind."""

    d_intermediate: tuple  # dA -> dGate, dUp tiles: [tokens, I] reducing over H
    grad_down: tuple  # dWd tiles: [H, I] reducing over T
    grad_x: tuple  # dx tiles: [tokens, H] reducing over 2I
    grad_gate_up: tuple  # dWg, dWu tiles: [I, H] reducing over T
    warps: tuple = (4, 4)  # num_warps of launch 1, launch 2
    stages: tuple = (3, 3)  # num_stages of launch 1, launch 2
    group_m: int = 8  # row tiles grouped for L2 reuse of the column operand


@dataclass(frozen=True)
class OneLaunchConfig:
    """Block sizes of the one-launch path (phase 1: dA by I-slices, dWd by H-rows; phase 2: H-columns)."""

    block_t: int = 16  # tokens per step: the M side of dA and dx, the reduction step of dWd, dWg, dWu
    block_i: int = 16  # I-columns of one dA program
    block_h_down: int = 32  # H-rows of one dWd program
    block_h: int = 16  # H-columns of one phase-2 program (dx, dWg, dWu)
    block_k: int = 128  # reduction step over H (dA) and over I (dx)
    block_n: int = 128  # I-columns per step of dWd, I-rows per step of dWg and dWu
    warps: int = 4
    stages: int = 3

    def programs(self, hidden_size: int, intermediate_size: int) -> tuple[int, int, int]:
        """(dA programs, dWd programs, phase-2 programs); the grid is the larger of phase 1's sum and phase 2."""
        return (triton.cdiv(intermediate_size, self.block_i), triton.cdiv(hidden_size, self.block_h_down),
                triton.cdiv(hidden_size, self.block_h))  # fmt: skip

    def grid_size(self, hidden_size: int, intermediate_size: int) -> int:
        num_da, num_dwd, num_phase2 = self.programs(hidden_size, intermediate_size)
        return max(num_da + num_dwd, num_phase2)


def _resident_programs(device: torch.device) -> int:
    """Programs that are surely resident at once for a grid barrier: one per SM (any count under the interpreter)."""
    if device.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_config(num_tokens: int, hidden_size: int, intermediate_size: int) -> TileConfig:
    """Tile shapes by token count (tuned on the H200 for H = 2048, I = 768). The one-launch path is
    chosen only explicitly: on the H200 it measured no faster than the two launches (NOTES.md)."""
    if _interpreting():
        return TileConfig((16, 16, 16, 2), (16, 16, 16, 2), (16, 16, 16, 2), (16, 16, 16, 1), (1, 1), (1, 1), 2)
    if num_tokens <= 16:
        return TileConfig((16, 64, 128, 8), (64, 128, 16, 1), (16, 64, 128, 8), (64, 128, 16, 1), (4, 4), (3, 3))
    if num_tokens <= 256:
        return TileConfig((64, 64, 64, 4), (64, 128, 64, 1), (64, 128, 64, 4), (64, 128, 64, 1), (4, 4), (3, 3))
    return TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (4, 8), (4, 4))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _accumulate_product(
    acc,  # [BLOCK_M, BLOCK_N] fp32 accumulator, returned updated
    a_ptr, stride_am, stride_ak,  # A[m, k] = a_ptr[m * stride_am + k * stride_ak]
    b_ptr, stride_bk, stride_bn,  # B[k, n] = b_ptr[k * stride_bk + n * stride_bn]
    M, N,  # rows of A, columns of B
    k_start, k_end,  # the slice of the reduction this call covers
    off_m, off_n,  # first row / column of this tile
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dot in fp32 (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot input_precision for fp32 operands
):  # fmt: skip
    """acc += A[off_m : off_m+BM, k_start:k_end] · B[k_start:k_end, off_n : off_n+BN], zero-padded at edges."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ks = k_start + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :].to(tl.int64) * stride_ak
    b_ptrs = b_ptr + ks[:, None].to(tl.int64) * stride_bk + cols[None, :].to(tl.int64) * stride_bn
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    for k in range(k_start, k_end, BLOCK_K):
        k_ok = ks + (k - k_start) < k_end
        a = tl.load(a_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _split_range(split, K, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_start, k_end) of split number `split` of a reduction of length K (BLOCK_K-aligned pieces)."""
    per_split = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_start = split * per_split
    return k_start, tl.minimum(k_start + per_split, K)


@triton.jit
def _combine_splits(
    acc,  # this program's fp32 partial [BLOCK_M, BLOCK_N]
    partials_ptr,  # fp32 workspace: [num_tiles, SPLIT, BLOCK_M, BLOCK_N] for this tile kind
    counters_ptr,  # int32 arrival counters, one per tile of this kind
    tile, split,  # which tile, which split of its reduction
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """(total, is_last): with SPLIT > 1 only the last program of a tile to arrive gets is_last, and
    total = Σ_s partial_s in split order; with SPLIT == 1 every program is last and total = acc."""
    if SPLIT == 1:
        return acc, True
    offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_partials = partials_ptr + tile.to(tl.int64) * (SPLIT * BLOCK_M * BLOCK_N)
    tl.store(tile_partials + split * (BLOCK_M * BLOCK_N) + offsets, acc)
    tl.debug_barrier()  # every thread's partial is stored before the arrival is counted
    arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
    is_last = (arrived & (SPLIT - 1)) == SPLIT - 1  # counters wrap around safely: SPLIT is a power of two
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if is_last:
        for s in tl.static_range(SPLIT):
            total += tl.load(tile_partials + s * (BLOCK_M * BLOCK_N) + offsets, cache_modifier=".cg")
    return total, is_last


@triton.jit
def _tile_coordinates(tile, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """(tile_m, tile_n) of a linear tile index, GROUP_M row tiles at a time (L2 reuse of columns)."""
    tiles_per_group = GROUP_M * num_tiles_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % tiles_per_group) % group_rows
    tile_n = (tile % tiles_per_group) // group_rows
    return tile_m, tile_n


@triton.jit
def _store_tile(ptr, values, off_m, off_n, M, N, stride_m,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """ptr[m, n] = values for the in-bounds part of the [BLOCK_M, BLOCK_N] tile (row-major, stride_m)."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ptrs = ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :]
    tl.store(ptrs, values.to(ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _load_tile(ptr, off_m, off_n, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """ptr[m, n] as fp32 for the [BLOCK_M, BLOCK_N] tile at (off_m, off_n); 0 outside [M, N]."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ptrs = ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :]
    return tl.load(ptrs, mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0).to(tl.float32)


@triton.jit
def _token_reduction_program(
    program,  # index of this program among this kind's (tile, split) programs
    a_ptr,  # A [T, M], row-major
    b_ptr,  # B [T, N], row-major
    out_ptr,  # out: Aᵀ · B [M, N]
    partials_ptr, counters_ptr,  # split-K workspace of this kind
    T, M, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out[m, n] = Σ_t A[t, m] · B[t, n] for one tile (or one split of it): the weight gradients
    dWd = dyᵀ · intermediate, dWg = dGateᵀ · x and dWu = dUpᵀ · x."""
    tile, split = program // SPLIT, program % SPLIT
    tile_m, tile_n = _tile_coordinates(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m, off_n = tile_m * BLOCK_M, tile_n * BLOCK_N
    k_start, k_end = _split_range(split, T, SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate_product(acc, a_ptr, 1, M, b_ptr, N, 1, M, N, k_start, k_end, off_m, off_n,
                              BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)  # fmt: skip
    total, is_last = _combine_splits(acc, partials_ptr, counters_ptr, tile, split, BLOCK_M, BLOCK_N, SPLIT)
    if is_last:
        _store_tile(out_ptr, total, off_m, off_n, M, N, N, BLOCK_M, BLOCK_N)


@triton.jit
def _d_intermediate_program(
    program,  # index of this program among this kind's (tile, split) programs
    grad_output_ptr,  # dy [T, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr,  # saved forward, each [T, I]
    d_gate_ptr, d_up_ptr,  # out: dGate, dUp [T, I]
    partials_ptr, counters_ptr,  # split-K workspace of this kind
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dA = dy · Wd for one tile, then dUp = dA ⊙ gate_silu and dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s))."""
    tile, split = program // SPLIT, program % SPLIT
    tile_m, tile_n = _tile_coordinates(tile, tl.cdiv(T, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    off_t, off_i = tile_m * BLOCK_M, tile_n * BLOCK_N
    k_start, k_end = _split_range(split, H, SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate_product(acc, grad_output_ptr, H, 1, down_weight_ptr, I, 1, T, I, k_start, k_end,
                              off_t, off_i, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)  # fmt: skip
    d_a, is_last = _combine_splits(acc, partials_ptr, counters_ptr, tile, split, BLOCK_M, BLOCK_N, SPLIT)
    if is_last:
        # one saved tensor at a time, so that few [BLOCK_M, BLOCK_N] tiles are live at once
        d_up = d_a * _load_tile(gate_silu_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)
        _store_tile(d_up_ptr, d_up, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)
        s = _load_tile(gate_sigmoid_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)
        d_gate = d_a * s * (1.0 + _load_tile(gate_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N) * (1.0 - s))
        d_gate = d_gate * _load_tile(up_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)
        _store_tile(d_gate_ptr, d_gate, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)


@triton.jit
def _launch1_kernel(
    grad_output_ptr,  # dy [T, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, intermediate_ptr,  # saved forward, each [T, I]
    d_gate_ptr, d_up_ptr,  # out (workspace): dGate, dUp [T, I]
    grad_down_weight_ptr,  # out: dWd [H, I]
    da_partials_ptr, da_counters_ptr,  # split-K workspace of the dA tiles
    dwd_partials_ptr, dwd_counters_ptr,  # split-K workspace of the dWd tiles
    T, H, I,
    DA_M: tl.constexpr, DA_N: tl.constexpr, DA_K: tl.constexpr, DA_SPLIT: tl.constexpr,
    DWD_M: tl.constexpr, DWD_N: tl.constexpr, DWD_K: tl.constexpr, DWD_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_dwd_programs = tl.cdiv(H, DWD_M) * tl.cdiv(I, DWD_N) * DWD_SPLIT
    if pid < num_dwd_programs:  # the long reductions over T first
        _token_reduction_program(pid, grad_output_ptr, intermediate_ptr, grad_down_weight_ptr,
                                 dwd_partials_ptr, dwd_counters_ptr, T, H, I,
                                 DWD_M, DWD_N, DWD_K, DWD_SPLIT, GROUP_M, UPCAST, PRECISION)  # fmt: skip
    else:
        _d_intermediate_program(pid - num_dwd_programs, grad_output_ptr, down_weight_ptr,
                                gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_ptr, d_up_ptr,
                                da_partials_ptr, da_counters_ptr, T, H, I,
                                DA_M, DA_N, DA_K, DA_SPLIT, GROUP_M, UPCAST, PRECISION)  # fmt: skip


@triton.jit
def _grad_x_program(
    program,  # index of this program among this kind's (tile, split) programs
    d_gate_ptr, d_up_ptr,  # dGate, dUp [T, I]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    grad_x_ptr,  # out: dx [T, H]
    partials_ptr, counters_ptr,  # split-K workspace of this kind
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dx = dGate · Wg + dUp · Wu for one tile: a reduction over the 2I rows of [Wg; Wu] (or a split of it)."""
    tile, split = program // SPLIT, program % SPLIT
    tile_m, tile_n = _tile_coordinates(tile, tl.cdiv(T, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    off_t, off_h = tile_m * BLOCK_M, tile_n * BLOCK_N
    k_start, k_end = _split_range(split, 2 * I, SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the part of [k_start, k_end) below I runs over Wg, the part above over Wu
    acc = _accumulate_product(acc, d_gate_ptr, I, 1, gate_weight_ptr, H, 1, T, H,
                              k_start, tl.minimum(k_end, I), off_t, off_h,
                              BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)  # fmt: skip
    acc = _accumulate_product(acc, d_up_ptr, I, 1, up_weight_ptr, H, 1, T, H,
                              tl.maximum(k_start, I) - I, k_end - I, off_t, off_h,
                              BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)  # fmt: skip
    total, is_last = _combine_splits(acc, partials_ptr, counters_ptr, tile, split, BLOCK_M, BLOCK_N, SPLIT)
    if is_last:
        _store_tile(grad_x_ptr, total, off_t, off_h, T, H, H, BLOCK_M, BLOCK_N)


@triton.jit
def _launch2_kernel(
    x_ptr,  # x [T, H]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    d_gate_ptr, d_up_ptr,  # dGate, dUp [T, I] from launch 1
    grad_x_ptr,  # out: dx [T, H]
    grad_gate_weight_ptr, grad_up_weight_ptr,  # out: dWg, dWu [I, H]
    dx_partials_ptr, dx_counters_ptr,  # split-K workspace of the dx tiles
    dw_partials_ptr, dw_counters_ptr,  # split-K workspace of the dWg tiles, then the dWu tiles
    T, H, I,
    DX_M: tl.constexpr, DX_N: tl.constexpr, DX_K: tl.constexpr, DX_SPLIT: tl.constexpr,
    DW_M: tl.constexpr, DW_N: tl.constexpr, DW_K: tl.constexpr, DW_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_dw_tiles = tl.cdiv(I, DW_M) * tl.cdiv(H, DW_N)  # per weight
    num_dw_programs = num_dw_tiles * DW_SPLIT
    up_partials_ptr = dw_partials_ptr + num_dw_tiles.to(tl.int64) * (DW_SPLIT * DW_M * DW_N)
    if pid < num_dw_programs:  # dWg = dGateᵀ · x (the long reductions over T first)
        _token_reduction_program(pid, d_gate_ptr, x_ptr, grad_gate_weight_ptr, dw_partials_ptr, dw_counters_ptr,
                                 T, I, H, DW_M, DW_N, DW_K, DW_SPLIT, GROUP_M, UPCAST, PRECISION)  # fmt: skip
    elif pid < 2 * num_dw_programs:  # dWu = dUpᵀ · x
        _token_reduction_program(pid - num_dw_programs, d_up_ptr, x_ptr, grad_up_weight_ptr,
                                 up_partials_ptr, dw_counters_ptr + num_dw_tiles,
                                 T, I, H, DW_M, DW_N, DW_K, DW_SPLIT, GROUP_M, UPCAST, PRECISION)  # fmt: skip
    else:
        _grad_x_program(pid - 2 * num_dw_programs, d_gate_ptr, d_up_ptr, gate_weight_ptr, up_weight_ptr,
                        grad_x_ptr, dx_partials_ptr, dx_counters_ptr,
                        T, H, I, DX_M, DX_N, DX_K, DX_SPLIT, GROUP_M, UPCAST, PRECISION)  # fmt: skip


@triton.jit
def _grid_barrier(counter_ptr, num_programs):
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
def _one_launch_kernel(
    grad_output_ptr,  # dy [T, H]
    x_ptr,  # x [T, H]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, intermediate_ptr,  # saved forward, each [T, I]
    d_gate_ptr, d_up_ptr,  # workspace: dGate, dUp [T, I], written in phase 1, read in phase 2
    grad_x_ptr,  # out: dx [T, H]
    grad_gate_weight_ptr, grad_up_weight_ptr,  # out: dWg, dWu [I, H]
    grad_down_weight_ptr,  # out: dWd [H, I]
    barrier_ptr,  # int64 grid-barrier counter (only grows)
    T, H, I,
    PHASE: tl.constexpr,  # 0: both phases around the grid barrier; 1 or 2: that phase alone (interpreter)
    BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H_DOWN: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    token_blocks = tl.cdiv(T, BLOCK_T)
    num_da = tl.cdiv(I, BLOCK_I)
    num_dwd = tl.cdiv(H, BLOCK_H_DOWN)
    if PHASE != 2:
        if pid < num_da:  # dA → dGate, dUp for I-columns [pid·BI, +BI), every token block
            for t in range(token_blocks):
                _d_intermediate_program(t * num_da + pid, grad_output_ptr, down_weight_ptr, gate_ptr,
                                        gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_ptr, d_up_ptr,
                                        barrier_ptr, barrier_ptr, T, H, I,
                                        BLOCK_T, BLOCK_I, BLOCK_K, 1, 1, UPCAST, PRECISION)  # fmt: skip
        elif pid < num_da + num_dwd:  # dWd for H-rows [(pid − num_da)·BHD, +BHD), every I-block
            n_blocks = tl.cdiv(I, BLOCK_N)
            for n in range(n_blocks):
                _token_reduction_program((pid - num_da) * n_blocks + n, grad_output_ptr, intermediate_ptr,
                                         grad_down_weight_ptr, barrier_ptr, barrier_ptr, T, H, I,
                                         BLOCK_H_DOWN, BLOCK_N, BLOCK_T, 1, 1, UPCAST, PRECISION)  # fmt: skip
    if PHASE == 0:
        _grid_barrier(barrier_ptr, tl.num_programs(0))
    if PHASE != 1:
        if pid < tl.cdiv(H, BLOCK_H):  # H-columns [pid·BH, +BH) of dx, dWg and dWu
            num_h = tl.cdiv(H, BLOCK_H)
            for t in range(token_blocks):
                _grad_x_program(t * num_h + pid, d_gate_ptr, d_up_ptr, gate_weight_ptr, up_weight_ptr, grad_x_ptr,
                                barrier_ptr, barrier_ptr, T, H, I, BLOCK_T, BLOCK_H, BLOCK_K, 1, 1,
                                UPCAST, PRECISION)  # fmt: skip
            for m in range(tl.cdiv(I, BLOCK_N)):
                _token_reduction_program(m * num_h + pid, d_gate_ptr, x_ptr, grad_gate_weight_ptr,
                                         barrier_ptr, barrier_ptr, T, I, H, BLOCK_N, BLOCK_H, BLOCK_T, 1, 1,
                                         UPCAST, PRECISION)  # fmt: skip
                _token_reduction_program(m * num_h + pid, d_up_ptr, x_ptr, grad_up_weight_ptr,
                                         barrier_ptr, barrier_ptr, T, I, H, BLOCK_N, BLOCK_H, BLOCK_T, 1, 1,
                                         UPCAST, PRECISION)  # fmt: skip


def _num_tiles(m: int, n: int, kind: tuple) -> int:
    return triton.cdiv(m, kind[0]) * triton.cdiv(n, kind[1])


class _SplitWorkspace:
    """fp32 partials (uninitialised, per call) and int32 arrival counters (zeroed once, kept) of one tile kind."""

    # (device, stream, tile kind, SPLIT) -> int32 counters; each call adds SPLIT to every counter of the
    # tiles it splits, so a counter is a multiple of its SPLIT whenever no call is running
    _counters: dict = {}

    @classmethod
    def make(cls, slot: str, num_tiles: int, kind: tuple, device: torch.device):
        block_m, block_n, _, split = kind
        if split == 1 or num_tiles == 0:
            empty = torch.empty(1, dtype=torch.float32, device=device)
            return empty, empty.view(torch.int32)
        if split & (split - 1):
            raise ValueError(f"config: SPLIT must be a power of two, got {split}")
        partials = torch.empty(num_tiles * split * block_m * block_n, dtype=torch.float32, device=device)
        return partials, cls.counters(slot, split, num_tiles, device)

    @classmethod
    def counters(cls, slot: str, split: int, size: int, device: torch.device) -> torch.Tensor:
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (str(device), stream, slot, split)
        buffer = cls._counters.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
            capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if not capturing:  # memory of a graph's private pool must not outlive the graph
                cls._counters[key] = buffer
        return buffer


def swiglu_down_backward_triton(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
    *, config: TileConfig | None = None,
):  # fmt: skip
    """P1 backward on Triton; inputs already validated (same float dtype and device, contiguous).

    Returns freshly allocated (grad_x, grad_gate_weight, grad_up_weight, grad_down_weight).
    ``config`` overrides the tile shapes chosen by :func:`choose_config`.
    """
    T, H = x.shape
    I = gate_weight.shape[0]
    config = config or choose_config(T, H, I)
    if isinstance(config, OneLaunchConfig):
        grid = config.grid_size(H, I)
        if grid > _resident_programs(x.device):
            raise ValueError(f"config: the one-launch grid ({grid} programs for H={H}, I={I}) exceeds one "
                             f"program per SM ({_resident_programs(x.device)}); use larger blocks or a TileConfig")
    grad_x = torch.empty_like(x)
    grad_gate_weight = torch.empty_like(gate_weight)
    grad_up_weight = torch.empty_like(up_weight)
    grad_down_weight = torch.empty_like(down_weight)
    d_gate = torch.empty((T, I), dtype=x.dtype, device=x.device)
    d_up = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if isinstance(config, OneLaunchConfig):
        launch_one(grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up,
                   intermediate, d_gate, d_up, grad_x, grad_gate_weight, grad_up_weight, grad_down_weight, config)
        return grad_x, grad_gate_weight, grad_up_weight, grad_down_weight
    launch_d_intermediate_and_grad_down(grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
                                        d_gate, d_up, grad_down_weight, config)  # fmt: skip
    launch_grad_x_and_grad_gate_up(x, gate_weight, up_weight, d_gate, d_up, grad_x, grad_gate_weight,
                                   grad_up_weight, config)  # fmt: skip
    return grad_x, grad_gate_weight, grad_up_weight, grad_down_weight


def _flags(x):
    """(UPCAST, PRECISION): fp32 dots under the interpreter; exact fp32 products for fp32 inputs."""
    return _interpreting(), ("ieee" if x.dtype == torch.float32 else "tf32")


def launch_d_intermediate_and_grad_down(grad_output, down_weight, gate, gate_sigmoid, gate_silu, up,
                                        intermediate, d_gate, d_up, grad_down_weight, config):  # fmt: skip
    """Launch 1: dGate, dUp (through dA = dy · Wd) and dWd."""
    T, H = grad_output.shape
    I = down_weight.shape[1]
    da_tiles, dwd_tiles = _num_tiles(T, I, config.d_intermediate), _num_tiles(H, I, config.grad_down)
    da_workspace = _SplitWorkspace.make("dA", da_tiles, config.d_intermediate, grad_output.device)
    dwd_workspace = _SplitWorkspace.make("dWd", dwd_tiles, config.grad_down, grad_output.device)
    grid = (dwd_tiles * config.grad_down[3] + da_tiles * config.d_intermediate[3],)
    _launch1_kernel[grid](
        grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
        d_gate, d_up, grad_down_weight, *da_workspace, *dwd_workspace, T, H, I,
        *config.d_intermediate, *config.grad_down, config.group_m, *_flags(grad_output),
        num_warps=config.warps[0], num_stages=config.stages[0],
    )  # fmt: skip


def launch_grad_x_and_grad_gate_up(x, gate_weight, up_weight, d_gate, d_up, grad_x, grad_gate_weight,
                                   grad_up_weight, config):  # fmt: skip
    """Launch 2: dx, dWg and dWu from dGate and dUp."""
    T, H = x.shape
    I = gate_weight.shape[0]
    dx_tiles, dw_tiles = _num_tiles(T, H, config.grad_x), _num_tiles(I, H, config.grad_gate_up)
    dx_workspace = _SplitWorkspace.make("dx", dx_tiles, config.grad_x, x.device)
    dw_workspace = _SplitWorkspace.make("dWgu", 2 * dw_tiles, config.grad_gate_up, x.device)
    grid = (2 * dw_tiles * config.grad_gate_up[3] + dx_tiles * config.grad_x[3],)
    _launch2_kernel[grid](
        x, gate_weight, up_weight, d_gate, d_up, grad_x, grad_gate_weight, grad_up_weight,
        *dx_workspace, *dw_workspace, T, H, I,
        *config.grad_x, *config.grad_gate_up, config.group_m, *_flags(x),
        num_warps=config.warps[1], num_stages=config.stages[1],
    )  # fmt: skip


def launch_one(grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up,
               intermediate, d_gate, d_up, grad_x, grad_gate_weight, grad_up_weight, grad_down_weight,
               config: OneLaunchConfig):  # fmt: skip
    """The one-launch path: both phases in one persistent launch (two launches under the interpreter)."""
    T, H = x.shape
    I = gate_weight.shape[0]
    grid = config.grid_size(H, I)
    # one counter per grid size: the barrier needs the counter at a multiple of the grid when a launch starts
    barrier = _SplitWorkspace.counters(f"one-launch barrier, grid {grid}", 1, 1, x.device).view(torch.int64)
    phases = (1, 2) if _interpreting() else (0,)
    for phase in phases:
        _one_launch_kernel[(grid,)](
            grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
            d_gate, d_up, grad_x, grad_gate_weight, grad_up_weight, grad_down_weight, barrier, T, H, I, phase,
            config.block_t, config.block_i, config.block_h_down, config.block_h, config.block_k, config.block_n,
            *_flags(x), num_warps=config.warps, num_stages=config.stages,
        )  # fmt: skip
