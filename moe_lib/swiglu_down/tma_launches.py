"""P1's two launches, each as one persistent kernel whose operands arrive by TMA (a design for many tokens).

    launch 1:  dWd = dyᵀ · intermediate                       [H, I]   (reduce over T)
               dA  = dy · Wd, epilogue dGate, dUp (hi/lo with WITH_LO)   [T, I]   (reduce over H)
    launch 2:  dWg = dGateᵀ · x ;  dWu = dUpᵀ · x             [I, H]   (reduce over T)
               dx  = dGate · Wg + dUp · Wu                    [T, H]   (reduce over 2I)

The same products and epilogue as :mod:`.kernels`' two launches (with ``WITH_LO``, the faithful path, dGate
and dUp stored and multiplied as hi + lo halves, the lo half ``lo_offset`` elements after the hi half); what
differs is how the operands get to the tensor cores: every operand block comes by a TMA copy through a tensor
descriptor (``tl.make_tensor_descriptor``, made once per program on the device) instead of pointer loads, and
each grid is persistent — one program per SM walking its launch's tiles, the reductions over T first,
NUM_PROGRAMS apart — so the pipeline's loads of a tile's next blocks run behind the current block's products;
or, with ``persistent=False`` (NUM_PROGRAMS = 0), one program per tile as the pointer-based launches have it.
Aᵀ operands (dyᵀ, dGateᵀ, dUpᵀ) are read as [K, M] blocks of the row-major [T, ·] tensors and transposed on the
way to the tensor cores. TMA zero-fills what lies past a tensor's edge, so no operand block needs a mask; the
saved tensors of the dSwiGLU epilogue and every output tile go through masked pointer loads and stores. No
split of the reductions (at the token counts this design is for, T ≥ 1024, there are enough tiles) and no
atomics: deterministic. Rows must be 16-byte multiples (:func:`fits`).

Why: on the H200 the pointer-based launches ran their GEMMs at about 0.65–0.7 of cuBLAS at 8192 tokens, and
TMA-fed persistent launches made P2's weight-gradient kernel 1.16–1.37× faster in bf16 (both in
data/results/NOTES.md). Not yet measured here: ``TileConfig.tma_first_launch`` and ``tma_second_launch`` are
off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..tiling import cdiv
from ..tma import install_tma_allocator
from .kernels import grouped_tile, mma, store_swiglu_grads, store_tile


@triton.jit
def tile_range(num_tiles, NUM_PROGRAMS: tl.constexpr):
    """(first, end, step) of this program's tiles: every NUM_PROGRAMS-th from its id (a persistent grid), or its
    id alone with NUM_PROGRAMS = 0 (a grid of one program per tile)."""
    if NUM_PROGRAMS == 0:
        return tl.program_id(0), tl.program_id(0) + 1, 1
    return tl.program_id(0), num_tiles, NUM_PROGRAMS


@triton.jit
def weight_grad_tile(tile, a_desc, a_lo_desc, b_desc, out_ptr, T, M, N,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr, WITH_LO: tl.constexpr):  # fmt: skip
    """out[tile] = Aᵀ · B over the T rows of A [T, M] (and of its lo half) and B [T, N]: one tile of a weight
    gradient (dWd, dWg or dWu)."""
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
def d_intermediate_tile(tile, dy_desc, wd_desc, gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_ptr,
                        d_up_ptr, lo_offset, T, H, I,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr, WITH_LO: tl.constexpr):  # fmt: skip
    """dA = dy · Wd for one [tokens, I] tile, then dUp = dA ⊙ gate_silu and dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s))
    stored (with WITH_LO as hi/lo pairs); dA itself never leaves the chip."""
    tile_m, tile_n = grouped_tile(tile, tl.cdiv(T, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    off_t, off_i = tile_m * BLOCK_M, tile_n * BLOCK_N
    d_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, H, BLOCK_K):
        d_a = mma(dy_desc.load([off_t, k]), wd_desc.load([k, off_i]), d_a, UPCAST, PRECISION)
    store_swiglu_grads(d_a, gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_ptr, d_up_ptr, lo_offset,
                       off_t, off_i, T, I, BLOCK_M, BLOCK_N, WITH_LO)  # fmt: skip


@triton.jit
def tma_d_intermediate_and_grad_down_kernel(
    grad_output_ptr,  # dy [T, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, intermediate_ptr,  # saved forward, each [T, I]
    d_gate_ptr, d_up_ptr,  # out (workspace): dGate, dUp [T, I], each followed by its lo half with WITH_LO
    lo_offset,  # T·I: where the lo halves start, in elements after dGate, dUp
    grad_down_weight_ptr,  # out: dWd [H, I]
    T, H, I,
    DA_M: tl.constexpr, DA_N: tl.constexpr, DA_K: tl.constexpr,  # a dA tile [tokens, I] and its step over H
    DWD_M: tl.constexpr, DWD_N: tl.constexpr, DWD_K: tl.constexpr,  # a dWd tile [H, I] and its step over T
    GROUP_M: tl.constexpr,  # row tiles grouped for L2 reuse of the column operand
    NUM_PROGRAMS: tl.constexpr,  # the persistent grid; 0: one tile per program (the grid covers every tile)
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    WITH_LO: tl.constexpr,  # store dGate, dUp as hi/lo pairs (the faithful path); else hi alone
):  # fmt: skip
    # descriptors over whole tensors, made once: [K, M] blocks of dy for dWd, [M, K] blocks for dA
    dwd_dy = tl.make_tensor_descriptor(grad_output_ptr, shape=[T, H], strides=[H, 1], block_shape=[DWD_K, DWD_M])
    dwd_inter = tl.make_tensor_descriptor(intermediate_ptr, shape=[T, I], strides=[I, 1],
                                          block_shape=[DWD_K, DWD_N])  # fmt: skip
    da_dy = tl.make_tensor_descriptor(grad_output_ptr, shape=[T, H], strides=[H, 1], block_shape=[DA_M, DA_K])
    da_wd = tl.make_tensor_descriptor(down_weight_ptr, shape=[H, I], strides=[I, 1], block_shape=[DA_K, DA_N])
    num_dwd_tiles = tl.cdiv(H, DWD_M) * tl.cdiv(I, DWD_N)
    num_tiles = num_dwd_tiles + tl.cdiv(T, DA_M) * tl.cdiv(I, DA_N)
    # dWd's long reductions over T first; one tile per program, or NUM_PROGRAMS apart
    first_tile, end, step = tile_range(num_tiles, NUM_PROGRAMS)
    for tile in range(first_tile, end, step):
        if tile < num_dwd_tiles:
            weight_grad_tile(tile, dwd_dy, dwd_dy, dwd_inter, grad_down_weight_ptr, T, H, I,
                             DWD_M, DWD_N, DWD_K, GROUP_M, UPCAST, PRECISION, False)  # fmt: skip
        else:
            d_intermediate_tile(tile - num_dwd_tiles, da_dy, da_wd, gate_ptr, gate_sigmoid_ptr, gate_silu_ptr,
                                up_ptr, d_gate_ptr, d_up_ptr, lo_offset, T, H, I, DA_M, DA_N, DA_K, GROUP_M,
                                UPCAST, PRECISION, WITH_LO)  # fmt: skip


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
    NUM_PROGRAMS: tl.constexpr,  # the persistent grid; 0: one tile per program (the grid covers every tile)
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
    # the long reductions over T first, so that the dx tiles fill in behind them; one tile per program, or
    # NUM_PROGRAMS apart
    first_tile, end, step = tile_range(num_tiles, NUM_PROGRAMS)
    for tile in range(first_tile, end, step):
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
class TmaFirstLaunchConfig:
    """Tiles and launch parameters of :func:`tma_d_intermediate_and_grad_down_kernel`."""

    da_tile: tuple[int, int, int] = (128, 128, 64)  # (tokens, I, step over H)
    dwd_tile: tuple[int, int, int] = (128, 128, 64)  # (H, I, step over T)
    warps: int = 8  # 128×128 dA tiles spill on 4 (their epilogue's saved tiles)
    stages: int = 3  # TMA blocks in flight per operand
    group_m: int = 8
    # one program per SM walking the tiles; else one program per tile, as the pointer-based launch (each program's
    # pipeline fills once, and the next program's loads start while this one's epilogue runs on the same SM)
    persistent: bool = True

    @classmethod
    def for_interpreter(cls) -> TmaFirstLaunchConfig:
        """16-wide tiles (the smallest ``tl.dot`` takes): several tiles and steps on tiny shapes."""
        return cls((16, 16, 16), (16, 16, 16), warps=1, stages=1, group_m=2)

    def tiles(self, num_tokens: int, hidden_size: int, intermediate_size: int) -> int:
        """Tiles of the launch: dWd's, then dA's."""
        T, H, I = num_tokens, hidden_size, intermediate_size
        weight_tiles = cdiv(H, self.dwd_tile[0]) * cdiv(I, self.dwd_tile[1])
        return weight_tiles + cdiv(T, self.da_tile[0]) * cdiv(I, self.da_tile[1])


@dataclass(frozen=True)
class TmaSecondLaunchConfig:
    """Tiles and launch parameters of :func:`tma_grad_x_and_grad_gate_up_kernel`."""

    dx_tile: tuple[int, int, int] = (128, 128, 64)  # (tokens, H, step over 2I)
    dw_tile: tuple[int, int, int] = (128, 128, 64)  # (I, H, step over T)
    warps: int = 8
    stages: int = 3  # TMA blocks in flight per operand
    group_m: int = 8
    # one program per SM walking the tiles; else one program per tile (see TmaFirstLaunchConfig.persistent)
    persistent: bool = True

    @classmethod
    def for_interpreter(cls) -> TmaSecondLaunchConfig:
        """16-wide tiles (the smallest ``tl.dot`` takes): several tiles and steps on tiny shapes."""
        return cls((16, 16, 16), (16, 16, 16), warps=1, stages=1, group_m=2)

    def tiles(self, num_tokens: int, hidden_size: int, intermediate_size: int) -> int:
        """Tiles of the launch: dWg's and dWu's, then dx's."""
        T, H, I = num_tokens, hidden_size, intermediate_size
        weight_tiles = cdiv(I, self.dw_tile[0]) * cdiv(H, self.dw_tile[1])
        return 2 * weight_tiles + cdiv(T, self.dx_tile[0]) * cdiv(H, self.dx_tile[1])


def fits(hidden_size: int, intermediate_size: int, element_bytes: int) -> bool:
    """Whether TMA can address P1's operands: rows of H and of I elements are 16-byte multiples."""
    return (hidden_size * element_bytes) % 16 == 0 and (intermediate_size * element_bytes) % 16 == 0


def aligned(*tensors) -> bool:
    """Whether each tensor starts on a 16-byte boundary, as a TMA copy's global address must (a view into a larger
    tensor need not)."""
    return all(tensor.data_ptr() % 16 == 0 for tensor in tensors)


def launch_first_launch_tma(config: TmaFirstLaunchConfig, grad_output, down_weight, gate, gate_sigmoid, gate_silu,
                            up, intermediate, d_gate, d_up, grad_down_weight, *, with_lo: bool, num_programs: int,
                            dot_flags: tuple[bool, str]) -> None:  # fmt: skip
    """dGate, dUp ([1 or 2, T, I]: hi, and with ``with_lo`` lo) and dWd in one launch, persistent (at most
    ``num_programs`` programs) or of one program per tile (``config.persistent``), the products under
    ``dot_flags`` (UPCAST, PRECISION: :func:`.launch.dot_flags`). Contiguous operands whose rows :func:`fits`; no
    host synchronisation."""
    T, H = grad_output.shape
    I = down_weight.shape[1]
    if not fits(H, I, grad_output.element_size()):
        raise ValueError(f"grad_output, down_weight: rows of H = {H} and I = {I} elements of "
                         f"{grad_output.element_size()} B must be 16-byte multiples for TMA")  # fmt: skip
    if grad_output.is_cuda and not interpreter_enabled():
        install_tma_allocator(grad_output.device)
    tiles = config.tiles(T, H, I)
    grid = max(1, min(num_programs, tiles) if config.persistent else tiles)
    tma_d_intermediate_and_grad_down_kernel[(grid,)](
        grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate, d_gate, d_up, T * I,
        grad_down_weight, T, H, I, *config.da_tile, *config.dwd_tile, config.group_m,
        grid if config.persistent else 0, *dot_flags,
        with_lo, num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip


def launch_second_launch_tma(config: TmaSecondLaunchConfig, x, gate_weight, up_weight, d_gate, d_up, grad_x,
                             grad_gate_weight, grad_up_weight, *, with_lo: bool, num_programs: int,
                             dot_flags: tuple[bool, str]) -> None:  # fmt: skip
    """dx, dWg and dWu from dGate, dUp ([1 or 2, T, I]: hi, and with ``with_lo`` lo) in one launch, persistent (at
    most ``num_programs`` programs) or of one program per tile (``config.persistent``), the products under
    ``dot_flags`` (UPCAST, PRECISION: :func:`.launch.dot_flags`). Contiguous operands whose rows :func:`fits`; no
    host synchronisation."""
    T, H = x.shape
    I = gate_weight.shape[0]
    if not fits(H, I, x.element_size()):
        raise ValueError(f"x, gate_weight: rows of H = {H} and I = {I} elements of {x.element_size()} B must be "
                         "16-byte multiples for TMA")  # fmt: skip
    if x.is_cuda and not interpreter_enabled():
        install_tma_allocator(x.device)
    tiles = config.tiles(T, H, I)
    grid = max(1, min(num_programs, tiles) if config.persistent else tiles)
    tma_grad_x_and_grad_gate_up_kernel[(grid,)](
        x, gate_weight, up_weight, d_gate, d_up, T * I, grad_x, grad_gate_weight, grad_up_weight, T, H, I,
        *config.dx_tile, *config.dw_tile, config.group_m, grid if config.persistent else 0, *dot_flags, with_lo,
        num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
