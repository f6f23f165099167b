"""Triton backward of one SwiGLU expert with down projection (P1), in two launches.

Dataflow (T tokens, H hidden, I intermediate; s = the saved gate_sigmoid):

    launch 1, tiles of two kinds side by side:
        dA    = dy · Wd                                  [T, I]   (reduce over H)
                epilogue: dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)),  dUp = dA ⊙ gate_silu
                -> stored in the input dtype; dA itself never leaves the chip
        dWd   = dyᵀ · intermediate                       [H, I]   (reduce over T)
    launch 2, tiles of three kinds side by side:
        dx    = dGate · Wg + dUp · Wu                    [T, H]   (reduce over 2I)
        dWg   = dGateᵀ · x ;  dWu = dUpᵀ · x             [I, H]   (reduce over T)

All products accumulate in fp32 on the tensor cores (bf16 operands for bf16 inputs; exact fp32
for fp32 inputs). Tiles of different kinds share one launch so that the small weight-gradient
GEMMs (few output tiles, long reductions over T) run beside the token-parallel ones instead of
leaving most of the GPU idle; the long-reduction tiles are scheduled first. Every output element
is written by exactly one program, in a fixed order: the result is deterministic, and the call
needs no host synchronisation (CUDA-graph capturable).

Workspace: dGate and dUp, 2·T·I elements in the input dtype (T = 8192: 25 MB in bf16).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TileConfig:
    """Tile shapes of both launches; (BLOCK_M, BLOCK_N, BLOCK_K) per tile kind."""

    d_intermediate: tuple  # dA / dGate / dUp tiles: [tokens, I] reducing over H
    grad_down: tuple  # dWd tiles: [H, I] reducing over T
    grad_x: tuple  # dx tiles: [tokens, H] reducing over I (twice)
    grad_gate_up: tuple  # dWg / dWu tiles: [I, H] reducing over T
    warps: tuple = (4, 4)  # num_warps of launch 1, launch 2
    stages: tuple = (3, 3)  # num_stages of launch 1, launch 2
    group_m: int = 8  # token tiles grouped for L2 reuse of the weight tiles


def choose_config(num_tokens: int, hidden_size: int, intermediate_size: int) -> TileConfig:
    """Tile shapes by token count (tuned on the H200 for H = 2048, I = 768)."""
    if _interpreting():
        return TileConfig((16, 16, 16), (16, 16, 16), (16, 16, 16), (16, 16, 16), (1, 1), (1, 1), 2)
    if num_tokens <= 16:
        return TileConfig((16, 32, 128), (64, 64, 16), (16, 32, 128), (64, 64, 16), (4, 4), (3, 3))
    if num_tokens <= 256:
        return TileConfig((64, 64, 64), (64, 64, 64), (64, 64, 64), (64, 128, 64), (4, 4), (3, 3))
    return TileConfig((128, 128, 64), (128, 128, 64), (128, 128, 64), (128, 128, 64), (8, 8), (3, 3))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _accumulate_product(
    acc,  # [BLOCK_M, BLOCK_N] fp32 accumulator, returned updated
    a_ptr, stride_am, stride_ak,  # A[m, k] = a_ptr[m * stride_am + k * stride_ak]
    b_ptr, stride_bk, stride_bn,  # B[k, n] = b_ptr[k * stride_bk + n * stride_bn]
    M, N, K,  # problem extents: rows of A, columns of B, reduction length
    off_m, off_n,  # first row / column of this tile
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dot in fp32 (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot input_precision for fp32 operands
):  # fmt: skip
    """acc += A[off_m : off_m+BM, :K] · B[:K, off_n : off_n+BN], zero-padded at the edges."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :].to(tl.int64) * stride_bn
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=row_ok & (ks[None, :] + k < K), other=0.0)
        b = tl.load(b_ptrs, mask=(ks[:, None] + k < K) & col_ok, other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _grouped_tile(tile, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """(tile_m, tile_n) of a linear tile index, GROUP_M row tiles at a time (L2 reuse of columns)."""
    tiles_per_group = GROUP_M * num_tiles_n
    group = tile // tiles_per_group
    first_m = group * GROUP_M
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
def _grad_down_tile(
    tile,  # index of this tile among dWd's [H, I] tiles
    grad_output_ptr,  # dy [T, H]
    intermediate_ptr,  # intermediate [T, I]
    grad_down_weight_ptr,  # out: dWd [H, I]
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dWd[h, i] = Σ_t dy[t, h] · intermediate[t, i] for one tile."""
    tile_m, tile_n = _grouped_tile(tile, tl.cdiv(H, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    off_h, off_i = tile_m * BLOCK_M, tile_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate_product(acc, grad_output_ptr, 1, H, intermediate_ptr, I, 1, H, I, T, off_h, off_i,
                              BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)  # fmt: skip
    _store_tile(grad_down_weight_ptr, acc, off_h, off_i, H, I, I, BLOCK_M, BLOCK_N)


@triton.jit
def _d_intermediate_tile(
    tile,  # index of this tile among the [T, I] tiles
    grad_output_ptr,  # dy [T, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr,  # saved forward, each [T, I]
    d_gate_ptr, d_up_ptr,  # out: dGate, dUp [T, I]
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dA = dy · Wd for one tile, then dUp = dA ⊙ gate_silu and dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s))."""
    tile_m, tile_n = _grouped_tile(tile, tl.cdiv(T, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    off_t, off_i = tile_m * BLOCK_M, tile_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    d_a = _accumulate_product(acc, grad_output_ptr, H, 1, down_weight_ptr, I, 1, T, I, H, off_t, off_i,
                              BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)  # fmt: skip
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
    T, H, I,
    DA_M: tl.constexpr, DA_N: tl.constexpr, DA_K: tl.constexpr,  # dA tiles [tokens, I], reduce over H
    DWD_M: tl.constexpr, DWD_N: tl.constexpr, DWD_K: tl.constexpr,  # dWd tiles [H, I], reduce over T
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_dwd_tiles = tl.cdiv(H, DWD_M) * tl.cdiv(I, DWD_N)
    if pid < num_dwd_tiles:  # the long reductions over T first
        _grad_down_tile(pid, grad_output_ptr, intermediate_ptr, grad_down_weight_ptr, T, H, I,
                        DWD_M, DWD_N, DWD_K, GROUP_M, UPCAST, PRECISION)  # fmt: skip
    else:
        _d_intermediate_tile(pid - num_dwd_tiles, grad_output_ptr, down_weight_ptr,
                             gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_ptr, d_up_ptr, T, H, I,
                             DA_M, DA_N, DA_K, GROUP_M, UPCAST, PRECISION)  # fmt: skip


@triton.jit
def _weight_grad_tile(
    tile,  # index of this tile among the [I, H] output's tiles
    d_ptr,  # dGate or dUp [T, I]
    x_ptr,  # x [T, H]
    out_ptr,  # out: dWg or dWu [I, H]
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out[i, h] = Σ_t d[t, i] · x[t, h] for one tile."""
    tile_m, tile_n = _grouped_tile(tile, tl.cdiv(I, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    off_i, off_h = tile_m * BLOCK_M, tile_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate_product(acc, d_ptr, 1, I, x_ptr, H, 1, I, H, T, off_i, off_h,
                              BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)  # fmt: skip
    _store_tile(out_ptr, acc, off_i, off_h, I, H, H, BLOCK_M, BLOCK_N)


@triton.jit
def _grad_x_tile(
    tile,  # index of this tile among dx's [T, H] tiles
    d_gate_ptr, d_up_ptr,  # dGate, dUp [T, I]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    grad_x_ptr,  # out: dx [T, H]
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """dx = dGate · Wg + dUp · Wu for one tile."""
    tile_m, tile_n = _grouped_tile(tile, tl.cdiv(T, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    off_t, off_h = tile_m * BLOCK_M, tile_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _accumulate_product(acc, d_gate_ptr, I, 1, gate_weight_ptr, H, 1, T, H, I, off_t, off_h,
                              BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)  # fmt: skip
    acc = _accumulate_product(acc, d_up_ptr, I, 1, up_weight_ptr, H, 1, T, H, I, off_t, off_h,
                              BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION)  # fmt: skip
    _store_tile(grad_x_ptr, acc, off_t, off_h, T, H, H, BLOCK_M, BLOCK_N)


@triton.jit
def _launch2_kernel(
    x_ptr,  # x [T, H]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    d_gate_ptr, d_up_ptr,  # dGate, dUp [T, I] from launch 1
    grad_x_ptr,  # out: dx [T, H]
    grad_gate_weight_ptr, grad_up_weight_ptr,  # out: dWg, dWu [I, H]
    T, H, I,
    DX_M: tl.constexpr, DX_N: tl.constexpr, DX_K: tl.constexpr,  # dx tiles [tokens, H], reduce over I
    DW_M: tl.constexpr, DW_N: tl.constexpr, DW_K: tl.constexpr,  # dWg / dWu tiles [I, H], reduce over T
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    num_dw_tiles = tl.cdiv(I, DW_M) * tl.cdiv(H, DW_N)  # per weight
    if pid < num_dw_tiles:  # dWg = dGateᵀ · x (the long reductions over T first)
        _weight_grad_tile(pid, d_gate_ptr, x_ptr, grad_gate_weight_ptr, T, H, I,
                          DW_M, DW_N, DW_K, GROUP_M, UPCAST, PRECISION)  # fmt: skip
    elif pid < 2 * num_dw_tiles:  # dWu = dUpᵀ · x
        _weight_grad_tile(pid - num_dw_tiles, d_up_ptr, x_ptr, grad_up_weight_ptr, T, H, I,
                          DW_M, DW_N, DW_K, GROUP_M, UPCAST, PRECISION)  # fmt: skip
    else:
        _grad_x_tile(pid - 2 * num_dw_tiles, d_gate_ptr, d_up_ptr, gate_weight_ptr, up_weight_ptr, grad_x_ptr,
                     T, H, I, DX_M, DX_N, DX_K, GROUP_M, UPCAST, PRECISION)  # fmt: skip


def _num_tiles(m: int, n: int, block: tuple) -> int:
    return triton.cdiv(m, block[0]) * triton.cdiv(n, block[1])


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

    grad_x = torch.empty_like(x)
    grad_gate_weight = torch.empty_like(gate_weight)
    grad_up_weight = torch.empty_like(up_weight)
    grad_down_weight = torch.empty_like(down_weight)
    d_gate = torch.empty((T, I), dtype=x.dtype, device=x.device)
    d_up = torch.empty((T, I), dtype=x.dtype, device=x.device)
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
    grid = (_num_tiles(H, I, config.grad_down) + _num_tiles(T, I, config.d_intermediate),)
    _launch1_kernel[grid](
        grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
        d_gate, d_up, grad_down_weight, T, H, I,
        *config.d_intermediate, *config.grad_down, config.group_m, *_flags(grad_output),
        num_warps=config.warps[0], num_stages=config.stages[0],
    )  # fmt: skip


def launch_grad_x_and_grad_gate_up(x, gate_weight, up_weight, d_gate, d_up, grad_x, grad_gate_weight,
                                   grad_up_weight, config):  # fmt: skip
    """Launch 2: dx, dWg and dWu from dGate and dUp."""
    T, H = x.shape
    I = gate_weight.shape[0]
    grid = (2 * _num_tiles(I, H, config.grad_gate_up) + _num_tiles(T, H, config.grad_x),)
    _launch2_kernel[grid](
        x, gate_weight, up_weight, d_gate, d_up, grad_x, grad_gate_weight, grad_up_weight, T, H, I,
        *config.grad_x, *config.grad_gate_up, config.group_m, *_flags(x),
        num_warps=config.warps[1], num_stages=config.stages[1],
    )  # fmt: skip
