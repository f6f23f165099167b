"""The grouped GEMM of :mod:`.grouped_gemm` in plain Triton: the same tiles, schedule and epilogues, pointer loads.

    A [M_total, K]            rows sorted by expert: expert e owns rows offsets[e] ≤ r < offsets[e + 1]
    B [E, N, K] or [E, K, N]  one matrix per expert, read through its strides
    C [M_total, N]            C[r] = (A[r] · B_e) · scale[r] (the scale with the ``row_scale`` epilogue), bf16;
                              with ``swiglu``, B_e = [gate; up] ([2N, K]) and C[r] = silu(A[r]·gateᵀ) · (A[r]·upᵀ)

Program p of P takes tiles p, p + P, ... of the experts' tiles numbered expert by expert (:func:`expert_of` walks
the offsets forward as the Gluon kernel's partitions do; :func:`.grouped_gemm.schedule` lists them on the host),
each BLOCK_M rows from the expert's first row, in the grouped order inside the expert. Masked loads and stores stop
at the expert's end row, at N and at K, so no tile touches another expert's rows. For reading and for the CPU
(``TRITON_INTERPRET=1``, where the bf16 dot is wrong: UPCAST multiplies the bf16 operands in fp32, and the store
rounds to bf16 by hand, as the GPU rounds); it runs on any GPU Triton supports too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..rounding import round_to
from .gluon_gemm import GemmConfig
from .grouped_gemm import EPILOGUES, check_arguments, grid, output_columns, output_width

# the smallest tiles GemmConfig takes (ping-pong's 64 rows); the tl kernel uses only its tiles and group_m
SMALL_TILES = GemmConfig(64, 64, 32, 2, "pingpong")


@triton.jit
def expert_of(offsets_ptr, num_experts, tile, expert, first, last, tiles_n, BLOCK_M: tl.constexpr):
    """(expert, first, last) walked forward to the expert whose tiles first ≤ t < last hold ``tile``; expert is
    num_experts once ``tile`` is past the last expert's tiles. Start from (-1, 0, 0)."""
    while (tile >= last) & (expert < num_experts):
        expert += 1
        begin = tl.load(offsets_ptr + tl.minimum(expert, num_experts))
        end = tl.load(offsets_ptr + tl.minimum(expert + 1, num_experts))  # past the last expert: no rows
        first = last
        last = first + tl.cdiv(end - begin, BLOCK_M) * tiles_n
    return expert, first, last


@triton.jit
def dot16(a, b, acc, UPCAST: tl.constexpr):
    """acc + a·b for bf16 operands (with UPCAST in exact fp32: the interpreter's bf16 dot is wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def grouped_gemm_tl_kernel(
    a_ptr,  # A [M_total, K] bf16, rows sorted by expert
    b_ptr,  # B: expert e's [N, K] or [K, N] bf16 matrix at b_ptr + e·stride_be (swiglu: [2N, K], gate rows first)
    c_ptr,  # out: C [M_total, N] bf16
    scale_ptr,  # EPILOGUE 1 (row_scale): [M_total] fp32 or bf16 row scales; else never read
    offsets_ptr,  # [E + 1] int32: expert e's rows are offsets[e] ≤ r < offsets[e + 1]
    num_experts,  # E
    M_total, N, K,
    stride_be, stride_bk, stride_bn,  # B's strides (elements) along E, K and N
    EPILOGUE: tl.constexpr,  # 0 none, 1 row_scale, 2 swiglu (grouped_gemm.EPILOGUES)
    GROUP_M: tl.constexpr,  # row tiles taken together in an expert's tile order
    UPCAST: tl.constexpr,  # multiply in fp32 and round the store by hand (the interpreter's bf16 is wrong)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tiles_n = tl.cdiv(N, BLOCK_N)
    tile = tl.program_id(0)
    none = tl.full((), 0, tl.int32)  # the walk's start as tensors: its loop carries them
    expert, first, last = expert_of(offsets_ptr, num_experts, tile, none - 1, none, none, tiles_n, BLOCK_M)
    while expert < num_experts:
        row_begin = tl.load(offsets_ptr + expert)
        row_end = tl.load(offsets_ptr + expert + 1)
        # the grouped order inside the expert (gluon_gemm.tile_origin, moe_lib.tiling.grouped_tile)
        local = tile - first
        tiles_m = (last - first) // tiles_n
        group_tiles = GROUP_M * tiles_n
        first_m = (local // group_tiles) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        rows = row_begin + (first_m + (local % group_tiles) % group_rows) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = ((local % group_tiles) // group_rows) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < row_end  # the expert's rows only
        col_ok = cols < N
        b_tile = b_ptr + expert.to(tl.int64) * stride_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # swiglu's second product (B's rows N + j)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            b = tl.load(b_tile + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = dot16(a, b, acc, UPCAST)
            if EPILOGUE == 2:
                b_up = tl.load(b_tile + ks[:, None] * stride_bk + (N + cols)[None, :] * stride_bn,
                               mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                up = dot16(a, b_up, up, UPCAST)
        if EPILOGUE == 1:  # row_scale: the routing weight of each row, before the rounding to bf16
            scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * scale[:, None]
        if EPILOGUE == 2:  # swiglu: silu(gate) · up in fp32, then the rounding
            acc = acc / (1.0 + tl.exp(-acc)) * up
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], round_to(acc, tl.bfloat16, UPCAST),
                 mask=row_ok[:, None] & col_ok[None, :])
        tile += tl.num_programs(0)
        expert, first, last = expert_of(offsets_ptr, num_experts, tile, expert, first, last, tiles_n, BLOCK_M)


def grouped_gemm_tl(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, out: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None, epilogue: str = "none", b_transposed: bool | None = None,
                    config: GemmConfig = SMALL_TILES, programs: int = 4) -> torch.Tensor:
    """:func:`.grouped_gemm.grouped_gemm`'s result by the plain Triton kernel, ``programs`` persistent programs
    (the tiles, the order and the epilogue of ``config``; its ring and consumers play no part here)."""
    b_transposed = check_arguments(a, b, offsets, out=out, scale=scale, epilogue=epilogue, b_transposed=b_transposed,
                                   config=config)
    M, K = a.shape
    E = b.shape[0]
    N = output_width(b, b_transposed, epilogue)
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0 or E == 0:
        return out
    # B's strides along (E, K, N): [E, N, K] held transposed or [E, K, N] as it lies
    stride_be, stride_bk, stride_bn = (b.stride(0), b.stride(2), b.stride(1)) if b_transposed else b.stride()
    interpret = interpreter_enabled()
    grouped_gemm_tl_kernel[(grid(M, E, N, config, programs, epilogue),)](
        a, b, out, scale if scale is not None else offsets, offsets, E, M, N, K, stride_be, stride_bk, stride_bn,
        EPILOGUE=EPILOGUES.index(epilogue), GROUP_M=config.group_m, UPCAST=interpret,
        BLOCK_M=config.block_m, BLOCK_N=output_columns(config, epilogue), BLOCK_K=config.block_k,
    )
    return out
