"""The weight-gradient kernel of :mod:`.grouped_wgrad` in plain Triton: the same tiles and schedule, pointer loads.

    A_p [M_total, M_p], B_p [M_total, N_p]   rows sorted by expert: expert e owns rows offsets[e] ≤ r < offsets[e+1]
                                             (a Gathered operand's row r is its source's row index[r])
    C_p [E, M_p, N_p]                        C_p[e] = Σ_{r of e} A_p[r]ᵀ B_p[r], fp32 accumulation, bf16 or fp32

Program p of P takes tiles p, p + P, ... of the tiles numbered expert by expert, problem by problem inside an
expert, in the grouped order inside one problem (:func:`.grouped_wgrad.tile_place` on the host). A tile reduces
its expert's rows BLOCK_K at a time; masked loads read nothing past the expert's last row (the Gluon kernel's
descriptors over the expert's rows, which TMA zero-fills past them), so no other expert's row enters, and an
expert without rows takes no step: its tiles are stored as zeros. For reading and for the CPU
(``TRITON_INTERPRET=1``, where the bf16 dot is wrong: UPCAST multiplies the bf16 operands in fp32, and a bf16
store rounds by hand, as the GPU rounds); it runs on any GPU Triton supports too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..rounding import round_to
from .gathered import Gathered
from .gluon_gemm import GemmConfig
from .grouped_wgrad import MAX_PROBLEMS, check_arguments, column_parts, grid, output_tensors

# the smallest tiles GemmConfig takes (ping-pong's 64 rows); the tl kernel uses only its tiles and group_m
SMALL_TILES = GemmConfig(64, 64, 32, 2, "pingpong")


@triton.jit
def pick(problem, x0, x1, x2):
    """x0, x1 or x2 by the problem's index (a run-time value)."""
    x = x0
    if problem == 1:
        x = x1
    if problem == 2:
        x = x2
    return x


@triton.jit
def dot16(a, b, acc, UPCAST: tl.constexpr):
    """acc + a·b for bf16 operands (with UPCAST in exact fp32: the interpreter's bf16 dot is wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def grouped_wgrad_tl_kernel(
    a0_ptr, b0_ptr, c0_ptr,  # problem 0: A_0 [M_total, M_0], B_0 [M_total, N_0] bf16; out: C_0 [E, M_0, N_0]
    a1_ptr, b1_ptr, c1_ptr,  # problem 1 likewise (PROBLEMS > 1), else never touched
    a2_ptr, b2_ptr, c2_ptr,  # problem 2 likewise (PROBLEMS > 2), else never touched
    a0_stride, b0_stride, a1_stride, b1_stride, a2_stride, b2_stride,  # A's and B's row strides (elements)
    c0_expert_stride, c0_row_stride, c0_col_stride,  # C_0's strides (elements): a column slice, a transposed view
    c1_expert_stride, c1_row_stride, c1_col_stride,  # C_1's likewise
    c2_expert_stride, c2_row_stride, c2_col_stride,  # C_2's likewise
    m0, n0, m1, n1, m2, n2,  # each problem's M_p, N_p
    split_cols,  # with SPLIT: C_0's columns below this are c0's, the rest c1's (from its column 0)
    offsets_ptr,  # [E + 1] int32: expert e's rows are offsets[e] ≤ r < offsets[e + 1]
    index_ptr,  # [M_total] int32: a gathered operand's row r is its source's row index[r]; else offsets_ptr, unread
    num_experts,  # E
    PROBLEMS: tl.constexpr,  # products in the launch: 1, 2 or 3
    GATHER_A: tl.constexpr,  # bit p set: A_p is gathered (a_p_ptr, a_p_stride: its source [T, M_p])
    GATHER_B: tl.constexpr,  # bit p set: B_p is gathered (b_p_ptr, b_p_stride: its source [T, N_p])
    GROUP_M: tl.constexpr,  # row tiles taken together in a problem's tile order
    UPCAST: tl.constexpr,  # multiply in fp32 and round a bf16 store by hand (the interpreter's bf16 is wrong)
    SPLIT: tl.constexpr,  # PROBLEMS 1, C_0 in two column parts: c0 (split_cols columns) then c1 (the rest)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tiles0 = tl.cdiv(m0, BLOCK_M) * tl.cdiv(n0, BLOCK_N)
    tiles1 = tiles0 * 0  # no tiles past the given problems
    tiles2 = tiles0 * 0
    if PROBLEMS > 1:
        tiles1 = tl.cdiv(m1, BLOCK_M) * tl.cdiv(n1, BLOCK_N)
    if PROBLEMS > 2:
        tiles2 = tl.cdiv(m2, BLOCK_M) * tl.cdiv(n2, BLOCK_N)
    per_expert = tiles0 + tiles1 + tiles2
    tile = tl.program_id(0)
    while tile < num_experts * per_expert:
        # (expert, problem, the tile among the problem's tiles of the expert): grouped_wgrad.tile_place
        expert = tile // per_expert
        local = tile % per_expert
        problem = (local >= tiles0).to(tl.int32) + (local >= tiles0 + tiles1).to(tl.int32)
        local -= (problem >= 1).to(tl.int32) * tiles0 + (problem >= 2).to(tl.int32) * tiles1
        m = pick(problem, m0, m1, m2)
        n = pick(problem, n0, n1, n2)
        a_ptr = pick(problem, a0_ptr, a1_ptr, a2_ptr)
        b_ptr = pick(problem, b0_ptr, b1_ptr, b2_ptr)
        c_ptr = pick(problem, c0_ptr, c1_ptr, c2_ptr)
        a_stride = pick(problem, a0_stride, a1_stride, a2_stride).to(tl.int64)
        b_stride = pick(problem, b0_stride, b1_stride, b2_stride).to(tl.int64)
        c_expert_stride = pick(problem, c0_expert_stride, c1_expert_stride, c2_expert_stride).to(tl.int64)
        c_row_stride = pick(problem, c0_row_stride, c1_row_stride, c2_row_stride).to(tl.int64)
        c_col_stride = pick(problem, c0_col_stride, c1_col_stride, c2_col_stride).to(tl.int64)
        # the grouped order inside the problem (gluon_gemm.tile_origin, moe_lib.tiling.grouped_tile)
        tiles_m = tl.cdiv(m, BLOCK_M)
        tiles_n = tl.cdiv(n, BLOCK_N)
        group_tiles = GROUP_M * tiles_n
        first_m = (local // group_tiles) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        cols_m = (first_m + (local % group_tiles) % group_rows) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_n = ((local % group_tiles) // group_rows) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = cols_m < m
        n_ok = cols_n < n
        row_begin = tl.load(offsets_ptr + expert)
        row_end = tl.load(offsets_ptr + expert + 1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(row_begin, row_end, BLOCK_K):  # no step for an expert without rows: zeros
            rows = k0 + tl.arange(0, BLOCK_K)
            row_ok = rows < row_end  # the expert's rows only: the next expert's are never read
            source_rows = tl.load(index_ptr + rows, mask=row_ok & (GATHER_A | GATHER_B != 0), other=0)
            a_rows = tl.where(((GATHER_A >> problem) & 1) != 0, source_rows, rows).to(tl.int64)
            b_rows = tl.where(((GATHER_B >> problem) & 1) != 0, source_rows, rows).to(tl.int64)
            a = tl.load(a_ptr + a_rows[:, None] * a_stride + cols_m[None, :],
                        mask=row_ok[:, None] & m_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_M]
            b = tl.load(b_ptr + b_rows[:, None] * b_stride + cols_n[None, :],
                        mask=row_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = dot16(tl.trans(a), b, acc, UPCAST)
        out = c_ptr + expert.to(tl.int64) * c_expert_stride + cols_m[:, None] * c_row_stride
        out += cols_n[None, :] * c_col_stride
        in_c = m_ok[:, None] & n_ok[None, :]
        if SPLIT:  # the columns past split_cols go to c1, from its column 0
            right = c1_ptr + expert.to(tl.int64) * c1_expert_stride + cols_m[:, None] * c1_row_stride
            right += (cols_n[None, :] - split_cols) * c1_col_stride
            tl.store(right, round_to(acc, c_ptr.dtype.element_ty, UPCAST), mask=in_c & (cols_n[None, :] >= split_cols))
            in_c = in_c & (cols_n[None, :] < split_cols)
        tl.store(out, round_to(acc, c_ptr.dtype.element_ty, UPCAST), mask=in_c)
        tile += tl.num_programs(0)


def grouped_weight_grad_tl(problems, offsets: torch.Tensor, *, outs=None, out_dtype: torch.dtype = torch.bfloat16,
                           config: GemmConfig = SMALL_TILES, programs: int = 4) -> list[torch.Tensor]:
    """:func:`.grouped_wgrad.grouped_weight_grad`'s result by the plain Triton kernel, ``programs`` persistent
    programs (the tiles and the order of ``config``; its ring and consumers play no part here)."""
    num_experts, shapes, out_dtype = check_arguments(problems, offsets, outs=outs, out_dtype=out_dtype, config=config)
    if outs is None:
        outs = [torch.empty((num_experts, m, n), dtype=out_dtype, device=offsets.device) for m, n in shapes]
    outs = list(outs)
    live = [p for p, (m, n) in enumerate(shapes) if m and n]  # a product with no output elements takes no tiles
    if num_experts == 0 or not live:
        return outs
    split = column_parts(outs[0])
    parts = output_tensors(outs)  # C_0's column parts take c0 and c1 (SPLIT)
    padded = [p for p in live] + [live[0]] * (MAX_PROBLEMS - len(live))  # repeats: never touched
    tensors, strides, out_strides, sizes, index, gather_a, gather_b = [], [], [], [], offsets, 0, 0
    for slot, p in enumerate(padded):
        a, b = problems[p]
        if slot < len(live):
            gather_a |= isinstance(a, Gathered) << slot
            gather_b |= isinstance(b, Gathered) << slot
        index = next((x.index for x in (a, b) if isinstance(x, Gathered)), index)
        a, b = (x.source if isinstance(x, Gathered) else x for x in (a, b))
        out = parts[slot] if split and slot < 2 else parts[0] if split else outs[p]
        tensors += [a, b, out]
        strides += [a.stride(0), b.stride(0)]
        out_strides += list(out.stride())
        sizes += list(shapes[p])
    grouped_wgrad_tl_kernel[(grid(num_experts, [shapes[p] for p in live], config, programs),)](
        *tensors, *strides, *out_strides, *sizes, parts[0].shape[2] if split else 0, offsets, index, num_experts,
        PROBLEMS=len(live), GATHER_A=gather_a, GATHER_B=gather_b, GROUP_M=config.group_m, UPCAST=interpreter_enabled(),
        SPLIT=split,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
    )
    return outs
