"""The grouped GEMM of :mod:`.grouped_gemm` in plain Triton: the same tiles, schedule and epilogues, pointer loads.

    A [M_total, K]            rows sorted by expert: expert e owns rows offsets[e] ≤ r < offsets[e + 1] (or
                              Gathered: row r is source[index[r]])
    B [E, N, K] or [E, K, N]  one matrix per expert, read through its strides
    P = A[r] · B_e            fp32; then per epilogue (outputs [M_total, N], rows through their strides):

    none        out = P (bf16, or fp32)
    row_scale   out = P · w[r]
    swiglu      g = A·gate_eᵀ, u = A·up_eᵀ (B stacked [E, 2N, K] or the pair (gate, up)): out = silu(g)·u,
                gate_out = g, up_out = u (each optional)
    dswiglu     dAp = P, with the saved g, u and w: dgate_out = w·dAp·u·silu'(g), dup_out = w·dAp·silu(g),
                scaled_act_out = w·silu(g)·u, topk_partial[j, r] = Σ_{n in column tile j} dAp·silu(g)·u; with the
                saved s, silu (``gate_sigmoid``, ``gate_silu``) in place of σ(g), silu(g): dgate_out = w·dAp·u·s(1 +
                g(1 − s)), dup_out = w·dAp·silu, a = silu·u
    B as a pair along K: P = A[:, :K_h]·B₀_e + A[:, K_h:]·B₁_e (B₀, B₁ [E, K_h, N] each)

Program p of G takes tiles p, p + G, ... of the experts' tiles numbered expert by expert (:func:`expert_of` walks
the offsets forward as the Gluon kernel's partitions do; :func:`.grouped_gemm.schedule` lists them on the host),
each BLOCK_M rows from the expert's first row, in the grouped order inside the expert. Masked loads and stores stop
at the expert's end row, at N and at K, so no tile touches another expert's rows. swiglu multiplies each K step
twice, by the gate's and by the up's columns (its second pointer: the stacked weights' rows N on, or the pair's
up); a pair along K takes each K step's B from B₀ below K_h and from B₁ past it. For reading and for the CPU
(``TRITON_INTERPRET=1``, where the bf16 dot is wrong: UPCAST multiplies the bf16 operands in fp32, and the stores
round to bf16 by hand, as the GPU rounds); it runs on any GPU Triton supports too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..rounding import round_to
from .gathered import Gathered
from .gluon_gemm import GemmConfig
from .grouped_gemm import (
    EPILOGUES,
    check_arguments,
    grid,
    output_columns,
    output_width,
    pair_kind,
    roles,
    weights_of,
    with_defaults,
)

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
def store_tile(ptr, row_stride, rows, cols, value, mask, UPCAST: tl.constexpr):
    """``value`` (fp32) into the output at ``ptr`` (bf16, rounded as the GPU rounds, or fp32) where ``mask``."""
    if ptr.dtype.element_ty == tl.bfloat16:
        value = round_to(value, tl.bfloat16, UPCAST)
    tl.store(ptr + rows.to(tl.int64)[:, None] * row_stride + cols[None, :], value, mask=mask)


@triton.jit
def grouped_gemm_tl_kernel(
    a_ptr,  # A [M_total, K] bf16, rows sorted by expert (GATHER_A: its source [T, K], A's row r its row index[r])
    index_ptr,  # GATHER_A: [M_total] int32, the source row of each of A's rows; else never read
    b_ptr,  # B: expert e's [N, K] or [K, N] bf16 matrix at b_ptr + e·stride_be (swiglu: gate; a K pair: B₀ [K_h, N])
    b2_ptr,  # swiglu: the up matrices (the stacked weights' rows N on, or the pair's up); a K pair: B₁; else b_ptr
    c_ptr,  # out: C [M_total, N] bf16 or fp32 (swiglu: silu(g)·u; dswiglu: scaled_act_out); where not written, any
    g_ptr,  # swiglu: gate_out g; dswiglu: dgate_out dg; [M_total, N] bf16; where not written, any pointer
    u_ptr,  # swiglu: up_out u; dswiglu: dup_out du; [M_total, N] bf16; where not written, any pointer
    gin_ptr,  # dswiglu: the saved g [M_total, N] bf16; else never read
    uin_ptr,  # dswiglu: the saved u [M_total, N] bf16; else never read
    sigmoid_ptr,  # dswiglu with SAVED: the saved σ(g) [M_total, N] bf16; else never read
    silu_ptr,  # dswiglu with SAVED: the saved silu(g) [M_total, N] bf16; else never read
    scale_ptr,  # row_scale, dswiglu: [M_total] fp32 or bf16, each row's routing weight; else never read
    partial_ptr,  # dswiglu: topk_partial [⌈N / BLOCK_N⌉, M_total] fp32; else never written
    offsets_ptr,  # [E + 1] int32: expert e's rows are offsets[e] ≤ r < offsets[e + 1]
    num_experts,  # E
    M_total, N, K,
    K_half,  # a pair along K: B₀'s rows K_h (A's columns from K_h on meet B₁); else unused
    stride_a,  # the rows' stride of a_ptr's tensor (elements)
    stride_be, stride_bk, stride_bn,  # B's strides (elements) along E, K and N (a pair's two alike)
    stride_c, stride_g, stride_u, stride_gin, stride_uin,  # the rows' strides of c, g, u and the saved g, u
    stride_sigmoid, stride_silu,  # the rows' strides of the saved σ and silu
    EPILOGUE: tl.constexpr,  # 0 none, 1 row_scale, 2 swiglu, 3 dswiglu (grouped_gemm.EPILOGUES)
    K_PAIR: tl.constexpr,  # whether B is a pair along K (B₀, B₁)
    WRITE_OUT: tl.constexpr, WRITE_GATE: tl.constexpr, WRITE_UP: tl.constexpr,  # which of c, g, u are written
    WRITE_PARTIAL: tl.constexpr,  # whether dswiglu's topk_partial is written
    SAVED: tl.constexpr,  # dswiglu: σ and silu read from sigmoid_ptr and silu_ptr, not computed from g
    GATHER_A: tl.constexpr,  # whether A's rows are read through index_ptr
    GROUP_M: tl.constexpr,  # row tiles taken together in an expert's tile order
    UPCAST: tl.constexpr,  # multiply in fp32 and round the stores by hand (the interpreter's bf16 is wrong)
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
        col_tile = (local % group_tiles) // group_rows
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < row_end  # the expert's rows only
        a_rows = tl.load(index_ptr + rows, mask=row_ok, other=0) if GATHER_A else rows  # A's rows in a_ptr's tensor
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        b_tile = b_ptr + expert.to(tl.int64) * stride_be
        b2_tile = b2_ptr + expert.to(tl.int64) * stride_be
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # swiglu's second product (the up columns)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b_mask = k_ok[:, None] & col_ok[None, :]
            if K_PAIR:  # along K: B₀'s rows below K_h, B₁'s past it (K_h a multiple of BLOCK_K)
                if k0 < K_half:
                    b = tl.load(b_tile + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=b_mask, other=0.0)
                else:
                    b = tl.load(b2_tile + (ks - K_half)[:, None] * stride_bk + cols[None, :] * stride_bn, mask=b_mask,
                                other=0.0)
            else:
                b = tl.load(b_tile + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=b_mask, other=0.0)
            acc = dot16(a, b, acc, UPCAST)
            if EPILOGUE == 2:
                b_up = tl.load(b2_tile + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=b_mask, other=0.0)
                up = dot16(a, b_up, up, UPCAST)
        if EPILOGUE <= 1:  # none, row_scale: the routing weight of each row, before the rounding
            if EPILOGUE == 1:
                acc = acc * tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            store_tile(c_ptr, stride_c, rows, cols, acc, mask, UPCAST)
        if EPILOGUE == 2:  # swiglu: silu(g) · u in fp32, then the rounding
            if WRITE_OUT:
                store_tile(c_ptr, stride_c, rows, cols, acc / (1.0 + tl.exp(-acc)) * up, mask, UPCAST)
            if WRITE_GATE:
                store_tile(g_ptr, stride_g, rows, cols, acc, mask, UPCAST)
            if WRITE_UP:
                store_tile(u_ptr, stride_u, rows, cols, up, mask, UPCAST)
        if EPILOGUE == 3:  # dswiglu in fp32 from dAp (acc) and the saved bf16 g, u
            g = tl.load(gin_ptr + rows.to(tl.int64)[:, None] * stride_gin + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            u = tl.load(uin_ptr + rows.to(tl.int64)[:, None] * stride_uin + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            w = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            if SAVED:  # P1's definition: the saved values, whatever g is
                sigmoid = tl.load(sigmoid_ptr + rows.to(tl.int64)[:, None] * stride_sigmoid + cols[None, :], mask=mask,
                                  other=0.0).to(tl.float32)
                silu = tl.load(silu_ptr + rows.to(tl.int64)[:, None] * stride_silu + cols[None, :], mask=mask,
                               other=0.0).to(tl.float32)
            else:
                sigmoid = 1.0 / (1.0 + tl.exp(-g))
                silu = g * sigmoid
            a = silu * u
            dA = acc * w
            store_tile(g_ptr, stride_g, rows, cols, dA * u * sigmoid * (1.0 + g * (1.0 - sigmoid)), mask, UPCAST)
            store_tile(u_ptr, stride_u, rows, cols, dA * silu, mask, UPCAST)
            if WRITE_OUT:
                store_tile(c_ptr, stride_c, rows, cols, a * w, mask, UPCAST)
            if WRITE_PARTIAL:  # a row's share of its routing weight's gradient, one row of topk_partial a tile
                tl.store(partial_ptr + col_tile.to(tl.int64) * M_total + rows, tl.sum(acc * a, axis=1), mask=row_ok)
        tile += tl.num_programs(0)
        expert, first, last = expert_of(offsets_ptr, num_experts, tile, expert, first, last, tiles_n, BLOCK_M)


def grouped_gemm_tl(a: torch.Tensor | Gathered, b, offsets: torch.Tensor, *, out: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None, epilogue: str = "none", b_transposed: bool | None = None,
                    config: GemmConfig = SMALL_TILES, programs: int = 4, gate: torch.Tensor | None = None,
                    up: torch.Tensor | None = None, gate_out: torch.Tensor | None = None,
                    up_out: torch.Tensor | None = None, dgate_out: torch.Tensor | None = None,
                    dup_out: torch.Tensor | None = None, scaled_act_out: torch.Tensor | None = None,
                    topk_partial: torch.Tensor | None = None, gate_sigmoid: torch.Tensor | None = None,
                    gate_silu: torch.Tensor | None = None):
    """:func:`.grouped_gemm.grouped_gemm`'s result (the same arguments, outputs and return value) by the plain
    Triton kernel, ``programs`` persistent programs (the tiles, the order and the epilogue of ``config``; its ring and
    consumers play no part here)."""
    tensors = dict(out=out, scale=scale, gate=gate, up=up, gate_out=gate_out, up_out=up_out, dgate_out=dgate_out,
                   dup_out=dup_out, scaled_act_out=scaled_act_out, topk_partial=topk_partial, gate_sigmoid=gate_sigmoid,
                   gate_silu=gate_silu)
    b_transposed = check_arguments(a, b, offsets, epilogue=epilogue, b_transposed=b_transposed, config=config,
                                   **tensors)
    M, K = a.shape
    weights = weights_of(b)
    E = weights[0].shape[0]
    N = output_width(b, b_transposed, epilogue)
    tensors = with_defaults(epilogue, tensors, M, N, a)
    result = (tuple(tensors[name] for name in ("dgate_out", "dup_out", "scaled_act_out", "topk_partial"))
              if epilogue == "dswiglu" else tensors["out"])
    if M == 0 or N == 0 or E == 0:
        return result
    first = weights[0]
    second = weights[-1] if len(weights) == 2 else first[:, N:] if epilogue == "swiglu" else first  # up: rows N on
    # B's strides along (E, K, N): [E, N, K] held transposed or [E, K, N] as it lies
    stride_be, stride_bk, stride_bn = (first.stride(0), first.stride(2), first.stride(1)) if b_transposed \
        else first.stride()
    c, g, u = roles(epilogue, tensors)
    unused = offsets  # for an output not written: a pointer never used

    def pointer(tensor):
        return tensor if tensor is not None else unused

    def row_stride(tensor):
        return tensor.stride(0) if tensor is not None else 0

    interpret = interpreter_enabled()
    gathered = isinstance(a, Gathered)
    a_tensor = a.source if gathered else a
    grouped_gemm_tl_kernel[(grid(M, E, N, config, programs, epilogue),)](
        a_tensor, a.index if gathered else offsets, first, second, pointer(c), pointer(g), pointer(u),
        pointer(tensors["gate"]), pointer(tensors["up"]), pointer(gate_sigmoid), pointer(gate_silu),
        pointer(tensors["scale"]), pointer(tensors["topk_partial"]), offsets, E, M, N, K, first.shape[1],
        a_tensor.stride(0), stride_be, stride_bk, stride_bn, row_stride(c), row_stride(g), row_stride(u),
        row_stride(tensors["gate"]), row_stride(tensors["up"]), row_stride(gate_sigmoid), row_stride(gate_silu),
        EPILOGUE=EPILOGUES.index(epilogue), K_PAIR=pair_kind(b, epilogue) == 2, WRITE_OUT=c is not None,
        WRITE_GATE=g is not None, WRITE_UP=u is not None, WRITE_PARTIAL=tensors["topk_partial"] is not None,
        SAVED=gate_sigmoid is not None, GATHER_A=gathered,
        GROUP_M=config.group_m, UPCAST=interpret, BLOCK_M=config.block_m, BLOCK_N=output_columns(config, epilogue),
        BLOCK_K=config.block_k,
    )
    return result
