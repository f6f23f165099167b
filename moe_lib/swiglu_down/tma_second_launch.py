"""P1's second launch as one persistent kernel whose operands arrive by TMA (a design for many tokens).

    dWg[m, n] = Σ_t dGate[t, m] · x[t, n]        [I, H]   (reduce over T)
    dWu[m, n] = Σ_t dUp[t, m] · x[t, n]          [I, H]
    dx[t, n]  = Σ_i dGate[t, i] · Wg[i, n] + Σ_i dUp[t, i] · Wu[i, n]      [T, H]   (reduce over 2I)

with dGate, dUp taken as they arrive from launch 1 (with ``WITH_LO``, the faithful path: hi + lo halves, both
multiplied, the lo half ``lo_offset`` elements after the hi half). The same products as
:func:`.kernels.grad_x_and_grad_gate_up_kernel`; what differs is how the operands get to the tensor cores:
every operand block comes by a TMA copy through a tensor descriptor (``tl.make_tensor_descriptor``, made once
per program on the device) instead of pointer loads, and the grid is persistent — one program per SM, each
walking tiles dWg, dWu, then dx, NUM_PROGRAMS apart — so the pipeline's loads of a tile's next blocks run
behind the current block's products. dGateᵀ is read as [K, M] blocks of dGate (row-major [T, I]) and
transposed on the way to the tensor cores. TMA zero-fills what lies past a tensor's edge, so no block needs a
mask; the output tiles are stored with masks. No split of the reductions (at the token counts this design is
for, T ≥ 1024, there are enough tiles) and no atomics: deterministic. Rows must be 16-byte multiples
(:func:`fits`).

Why: on the H200 the pointer-based second launch ran its GEMMs at about 0.65–0.7 of cuBLAS at 8192 tokens,
and TMA-fed persistent launches made P2's weight-gradient kernel 1.16–1.37× faster in bf16 (both in
data/results/NOTES.md). Not yet measured here: ``TileConfig.tma_second_launch`` is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..tiling import cdiv
from ..tma import install_tma_allocator
from .kernels import grouped_tile, store_tile


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a · b on the tensor cores (fp32 operands under the interpreter, whose bf16 dot is wrong)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def weight_grad_tile(tile, a_desc, a_lo_desc, b_desc, out_ptr, T, M, N,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr, WITH_LO: tl.constexpr):  # fmt: skip
    """out[tile] = Aᵀ · B over the T rows of A [T, M] (and of its lo half) and B [T, N]: one tile of dWg or dWu."""
    tile_m, tile_n = grouped_tile(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m, off_n = tile_m * BLOCK_M, tile_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, T, BLOCK_K):
        b = b_desc.load([k, off_n])
        acc = mma(a_desc.load([k, off_m]).T, b, acc, UPCAST, PRECISION)
        if WITH_LO:
            acc = mma(a_lo_desc.load([k, off_m]).T, b, acc, UPCAST, PRECISION)
    store_tile(out_ptr, acc, off_m, off_n, M, N, N, BLOCK_M, BLOCK_N)


@triton.jit
def grad_x_tile(tile, gate_desc, gate_lo_desc, up_desc, up_lo_desc, wg_desc, wu_desc, grad_x_ptr, T, H, I,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, WITH_LO: tl.constexpr):  # fmt: skip
    """dx[tile] = dGate · Wg + dUp · Wu (each with its lo half too): the reduction over Wg's rows, then Wu's."""
    tile_m, tile_n = grouped_tile(tile, tl.cdiv(T, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    off_t, off_h = tile_m * BLOCK_M, tile_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, I, BLOCK_K):
        w = wg_desc.load([k, off_h])
        acc = mma(gate_desc.load([off_t, k]), w, acc, UPCAST, PRECISION)
        if WITH_LO:
            acc = mma(gate_lo_desc.load([off_t, k]), w, acc, UPCAST, PRECISION)
    for k in range(0, I, BLOCK_K):
        w = wu_desc.load([k, off_h])
        acc = mma(up_desc.load([off_t, k]), w, acc, UPCAST, PRECISION)
        if WITH_LO:
            acc = mma(up_lo_desc.load([off_t, k]), w, acc, UPCAST, PRECISION)
    store_tile(grad_x_ptr, acc, off_t, off_h, T, H, H, BLOCK_M, BLOCK_N)


@triton.jit
def tma_grad_x_and_grad_gate_up_kernel(
    x_ptr,  # x [T, H]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    d_gate_ptr, d_up_ptr,  # dGate, dUp [T, I] from launch 1, each followed by its lo half with WITH_LO
    lo_offset,  # T·I: where the lo halves start, in elements after dGate, dUp
    grad_x_ptr,  # out: dx [T, H]
    grad_gate_weight_ptr, grad_up_weight_ptr,  # out: dWg, dWu [I, H]
    T, H, I,
    DX_M: tl.constexpr, DX_N: tl.constexpr, DX_K: tl.constexpr,  # a dx tile [tokens, H] and its step over 2I
    DW_M: tl.constexpr, DW_N: tl.constexpr, DW_K: tl.constexpr,  # a dWg or dWu tile [I, H] and its step over T
    GROUP_M: tl.constexpr,  # row tiles grouped for L2 reuse of the column operand
    NUM_PROGRAMS: tl.constexpr,  # the persistent grid
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    WITH_LO: tl.constexpr,  # dGate, dUp are hi/lo pairs (the faithful path): every product takes both halves
):  # fmt: skip
    # descriptors over whole tensors, made once: [K, M] blocks of dGate, dUp for dWg, dWu; [M, K] blocks for dx
    dw_gate = tl.make_tensor_descriptor(d_gate_ptr, shape=[T, I], strides=[I, 1], block_shape=[DW_K, DW_M])
    dw_up = tl.make_tensor_descriptor(d_up_ptr, shape=[T, I], strides=[I, 1], block_shape=[DW_K, DW_M])
    dw_x = tl.make_tensor_descriptor(x_ptr, shape=[T, H], strides=[H, 1], block_shape=[DW_K, DW_N])
    dx_gate = tl.make_tensor_descriptor(d_gate_ptr, shape=[T, I], strides=[I, 1], block_shape=[DX_M, DX_K])
    dx_up = tl.make_tensor_descriptor(d_up_ptr, shape=[T, I], strides=[I, 1], block_shape=[DX_M, DX_K])
    dx_wg = tl.make_tensor_descriptor(gate_weight_ptr, shape=[I, H], strides=[H, 1], block_shape=[DX_K, DX_N])
    dx_wu = tl.make_tensor_descriptor(up_weight_ptr, shape=[I, H], strides=[H, 1], block_shape=[DX_K, DX_N])
    if WITH_LO:
        lo_gate_ptr = d_gate_ptr + lo_offset
        lo_up_ptr = d_up_ptr + lo_offset
        dw_gate_lo = tl.make_tensor_descriptor(lo_gate_ptr, shape=[T, I], strides=[I, 1], block_shape=[DW_K, DW_M])
        dw_up_lo = tl.make_tensor_descriptor(lo_up_ptr, shape=[T, I], strides=[I, 1], block_shape=[DW_K, DW_M])
        dx_gate_lo = tl.make_tensor_descriptor(lo_gate_ptr, shape=[T, I], strides=[I, 1], block_shape=[DX_M, DX_K])
        dx_up_lo = tl.make_tensor_descriptor(lo_up_ptr, shape=[T, I], strides=[I, 1], block_shape=[DX_M, DX_K])
    else:  # never read
        dw_gate_lo, dw_up_lo, dx_gate_lo, dx_up_lo = dw_gate, dw_up, dx_gate, dx_up

    num_dw_tiles = tl.cdiv(I, DW_M) * tl.cdiv(H, DW_N)  # per weight
    num_tiles = 2 * num_dw_tiles + tl.cdiv(T, DX_M) * tl.cdiv(H, DX_N)
    # the long reductions over T first, so that the dx tiles fill in behind them
    for tile in range(tl.program_id(0), num_tiles, NUM_PROGRAMS):
        if tile < num_dw_tiles:
            weight_grad_tile(tile, dw_gate, dw_gate_lo, dw_x, grad_gate_weight_ptr, T, I, H,
                             DW_M, DW_N, DW_K, GROUP_M, UPCAST, PRECISION, WITH_LO)  # fmt: skip
        elif tile < 2 * num_dw_tiles:
            weight_grad_tile(tile - num_dw_tiles, dw_up, dw_up_lo, dw_x, grad_up_weight_ptr, T, I, H,
                             DW_M, DW_N, DW_K, GROUP_M, UPCAST, PRECISION, WITH_LO)  # fmt: skip
        else:
            grad_x_tile(tile - 2 * num_dw_tiles, dx_gate, dx_gate_lo, dx_up, dx_up_lo, dx_wg, dx_wu, grad_x_ptr,
                        T, H, I, DX_M, DX_N, DX_K, GROUP_M, UPCAST, PRECISION, WITH_LO)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# host side


@dataclass(frozen=True)
class TmaSecondLaunchConfig:
    """Tiles and launch parameters of :func:`tma_grad_x_and_grad_gate_up_kernel`."""

    dx_tile: tuple[int, int, int] = (128, 128, 64)  # (tokens, H, step over 2I)
    dw_tile: tuple[int, int, int] = (128, 128, 64)  # (I, H, step over T)
    warps: int = 8
    stages: int = 3  # TMA blocks in flight per operand
    group_m: int = 8

    @classmethod
    def for_interpreter(cls) -> TmaSecondLaunchConfig:
        """16-wide tiles (the smallest ``tl.dot`` takes): several tiles and steps on tiny shapes."""
        return cls((16, 16, 16), (16, 16, 16), warps=1, stages=1, group_m=2)

    def tiles(self, num_tokens: int, hidden_size: int, intermediate_size: int) -> int:
        """Tiles of the launch: dWg's and dWu's, then dx's."""
        T, H, I = num_tokens, hidden_size, intermediate_size
        weight_tiles = cdiv(I, self.dw_tile[0]) * cdiv(H, self.dw_tile[1])
        return 2 * weight_tiles + cdiv(T, self.dx_tile[0]) * cdiv(H, self.dx_tile[1])


def fits(x: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    """Whether TMA can address P1's operands: rows of H and of I elements are 16-byte multiples."""
    return (x.shape[1] * x.element_size()) % 16 == 0 and (gate_weight.shape[0] * x.element_size()) % 16 == 0


def launch_second_launch_tma(config: TmaSecondLaunchConfig, x, gate_weight, up_weight, d_gate, d_up, grad_x,
                             grad_gate_weight, grad_up_weight, *, with_lo: bool,
                             num_programs: int) -> None:  # fmt: skip
    """dx, dWg and dWu from dGate, dUp ([1 or 2, T, I]: hi, and with ``with_lo`` lo) in one persistent launch of
    at most ``num_programs`` programs. Contiguous operands whose rows :func:`fits`; no host synchronisation."""
    T, H = x.shape
    I = gate_weight.shape[0]
    if not fits(x, gate_weight):
        raise ValueError(f"x, gate_weight: rows of H = {H} and I = {I} elements of {x.element_size()} B must be "
                         "16-byte multiples for TMA")  # fmt: skip
    interpreter = interpreter_enabled()
    if x.is_cuda and not interpreter:
        install_tma_allocator(x.device)
    grid = max(1, min(num_programs, config.tiles(T, H, I)))
    upcast = interpreter
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    tma_grad_x_and_grad_gate_up_kernel[(grid,)](
        x, gate_weight, up_weight, d_gate, d_up, T * I, grad_x, grad_gate_weight, grad_up_weight, T, H, I,
        *config.dx_tile, *config.dw_tile, config.group_m, grid, upcast, precision, with_lo,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
