"""Triton backward of all routed SwiGLU experts of one MoE layer (P2), the forward recomputed inside.

Notation: T tokens, K experts per token, E experts, H hidden, I intermediate; slot s = t·K + k is
token t's k-th choice, e = topk_indices[t, k], w = topk_weights[t, k], x = hidden_states[t],
dy = grad_output[t]. Per slot (rows of the expert's GEMMs):

    g = Wg_e x ;  u = Wu_e x ;  a = silu(g) ⊙ u ;  dAp = Wd_eᵀ dy                      [I] each
    grad_topk_weights[t, k] = ⟨dAp, a⟩                       (= ⟨dy, Wd_e a⟩, o is never formed)
    dA = w·dAp ;  dg = dA ⊙ u ⊙ silu'(g) ;  du = dA ⊙ silu(g) ;  aw = w·a
    dWg_e = Σ_slots dg xᵀ ;  dWu_e = Σ_slots du xᵀ ;  dWd_e = Σ_slots dy awᵀ
    grad_hidden_states[t] = Σ_k (Wg_eᵀ dg + Wu_eᵀ du)

Dataflow, five steps, no host synchronisation (CUDA-graph capturable), no float atomics
(deterministic: two calls give bitwise-equal results):

    0. routing (:mod:`.routing`, torch ops on the device): sorted_slot [T·K] = slots in expert
       order, expert_offsets [E + 1] = where each expert's rows start in that order. For fp32
       inputs x and dy are also split once into bf16 hi + lo halves [T, H] (see Precision).
    1. kernel A, programs (expert e, I-tile, row split r): the transposed products
       gᵀ = Wg_e[I-tile, :]·xᵀ, uᵀ, dApᵀ = Wd_e[:, I-tile]ᵀ·dyᵀ over H for the expert's row blocks
       r, r + R, … (rows gathered through sorted_slot inside the loads). The weight tile is the
       large M side of the product and the expert's rows the small N side, so a row block can be
       as narrow as the expert is busy. Epilogue: dSwiGLU and the routing-weight gradient. Writes
       dg, du, aw to [T·K, I] workspaces (rows in sorted order) and ⟨dAp, a⟩ restricted to the
       I-tile to a [n_I_tiles, T·K] workspace.
    2. kernel W, programs (expert e, I-tile, H-tile): dWg_e, dWu_e and dWd_e on that tile, each
       reduced over all the expert's rows, written once (exact zeros for an expert with no rows).
    3. kernel D, programs (expert e, H-tile, row split r): dX_slotᵀ = Wg_e[:, H-tile]ᵀ·dgᵀ +
       Wu_e[:, H-tile]ᵀ·duᵀ over I for the row blocks r, r + R, …, to a [T·K, H] fp32 workspace
       indexed by slot.
    4. kernel C, programs (token t, H-tile): grad_hidden_states[t] = Σ_k dX_slot[t·K + k] and
       grad_topk_weights[t, k] = Σ_tiles partial[tile, t·K + k], both summed in a fixed order.

An alternative for the experts with at most one row block (``fuse_dx=1``, measured no faster on
the H200, so off by default): kernel G, programs (expert e, H-tile), writes their dWg_e, dWu_e and
their dX on that H-tile in the same walk over I (dg, du read once for both); kernels W (its dWg·dWu
launch) and D skip them and do the busier experts.

Grids depend on E, T·K, H, I and the tile sizes only. Programs that share an expert's weight tile
(the R row splits) or its gathered rows (its tiles) are adjacent in launch order, so they find them
in L2: each expert's weights are read from DRAM about once per kernel. Wg and Wu are read twice in
all (kernel A, then kernel D): dg needs the whole reduction over H before dX can use Wg again, and
the slice of Wg a program sweeps meanwhile does not fit on chip. That second read is this design's
known cost above the floor (fp32: 17.2 GB on top of 51.5 GB at the benchmark's shape).

Precision. fp32 interface: g, u and dAp as bf16×3 products (v = hi + lo with hi = bf16(v),
lo = bf16(v − hi); a·b ≈ hi·hi + hi·lo + lo·hi, fp32 accumulators), which grad_topk_weights needs
to pass the benchmark's element rule; the weight gradients and dX use plain bf16 products (x, dy and
the weights rounded to bf16) with fp32 accumulation (dg, du and aw are stored in bf16). 16-bit
interfaces (bf16, fp16): plain products in the input dtype with fp32 accumulation everywhere.
``SPLIT_PRECISION`` selects the split. Under ``TRITON_INTERPRET=1`` (CPU) the interpreter's bf16
dot is wrong and its fp32→bf16 cast truncates, so ``INTERPRETER`` makes the kernels round to bf16
by hand and multiply the (already rounded) operands in fp32: the same numbers the GPU multiplies.

Workspace (freed when the call returns; outputs are freshly allocated and fully written):
    dg, du, aw        3 · T·K · I   in bf16 (the input dtype for 16-bit inputs)
    dX_slot           T·K · H       fp32
    x, dy halves      4 · T · H     bf16, fp32 inputs only
    topk partials     cdiv(I, BLOCK_I) · T·K   fp32
    routing           T·K int32 + E + 1 int32, and torch.sort's int64 outputs (2 · T·K)
At the benchmark's shape (H = 4096, I = 2048, E = 256, K = 8) and T = 8192 (T·K = 65536):
768 MiB + 1 GiB + 256 MiB + 8 MiB + 1.3 MiB ≈ 2.0 GiB; at T = 2048, ≈ 0.5 GiB.

Predicted DRAM traffic at the benchmark's shape, T = 2048, with the weights read once per kernel:
fp32: A reads Wg, Wu, Wd (25.8 GB), W writes dWg, dWu, dWd (25.8 GB), D reads Wg, Wu (17.2 GB);
the workspaces and activations add ≈ 1 GB: ≈ 70 GB, 1.35× the floor (≈ 16.5 ms at 4.2 TB/s).
bf16: 12.9 + 12.9 + 8.6 + ≈ 0.6 GB ≈ 35 GB (≈ 8.3 ms). At T = 8192 in fp32 the 18·T·K·H·I FLOPs of
kernel A's split products plus 10·T·K·H·I in W and D (15.4 TFLOP) bound the time instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..api import triton_interpreter_enabled
from .routing import route_by_expert

# Every output and workspace is allocated through this function (tests replace it with one that
# fills the memory with NaN, to prove that every element the kernels read or return was written).
allocate = torch.empty


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of kernels A, W, D and C."""

    block_m: int  # rows (slots of one expert) per row block: the N side of kernels A and D
    block_i: int  # A: intermediate columns per program (the M side)
    block_h: int  # A: hidden columns per reduction step
    grad_gate_up_tile: tuple[int, int, int]  # W: (I, H, rows per step) of the dWg and dWu tiles
    grad_down_tile: tuple[int, int, int]  # W: (H, I, rows per step) of the dWd tiles
    n_tiles_per_program: int  # W: tiles along the second dimension one program writes in turn
    block_h_dx: int  # D: hidden columns per program (the M side)
    block_i_dx: int  # D: intermediate columns per reduction step
    block_h_sum: int  # C: hidden columns per program
    row_split: int  # R: programs per (expert, tile) in A and D that share its row blocks (and weights via L2)
    warps_a: int = 8  # num_warps of kernel A
    stages_a: int = 3  # num_stages (software pipelining depth) of kernel A
    warps_gu: int = 8  # kernel W's dWg, dWu launch
    stages_gu: int = 3
    warps_dn: int = 8  # kernel W's dWd launch
    stages_dn: int = 3
    warps_d: int = 8  # kernel D
    stages_d: int = 3
    # kernel G (fuse_dx): for experts with at most `rows` rows, dWg, dWu and dX in one pass (W and D
    # skip them); 0: W for every dWg·dWu, D for every dX. Measured on the H200 no faster at 2048 tokens
    # (NOTES.md), so off by default.
    fuse_dx: int = 0
    gate_up_dx_tile: tuple[int, int, int] = (32, 128, 128)  # G: (I-columns per step, H-columns, rows)
    warps_g: int = 8
    stages_g: int = 3


def launch_config(num_slots: int, num_experts: int, *, input_bytes: int = 4, interpreter: bool = False) -> LaunchConfig:
    """Tile sizes for T·K = ``num_slots`` slots over ``num_experts`` experts (the one place they are set).

    GPU (measured on the H200, data/results/NOTES.md): kernel A and D tiles are 128 weight rows ×
    64 expert rows (fp32 accumulators, 8 warps); kernel A reduces over 32 hidden columns per step in
    fp32 (its three weight tiles are split to hi/lo in registers) and 64 in 16-bit; kernel W writes
    128 × 128 tiles of dWg and dWu (one launch, x shared) and 128 × 256 tiles of dWd, 64 rows per
    step, each program a whole row of tiles in turn, 2 pipeline stages. 16-bit inputs with 512 or
    more rows per expert on average get 128-row blocks everywhere (A then takes 64 weight rows per
    program, so its accumulators still fit); with fp32 inputs those W tiles would need more shared
    memory than an SM has (fp32 output tiles), and A and D spill.
    Interpreter: small tiles (16 is the smallest ``tl.dot`` takes), so that tiny test shapes still
    have several row blocks, several tiles and masked edges.
    R, the row split, covers an expert with a few standard deviations more rows than the mean
    (uniform routing gives binomial counts): the rows of almost every expert are then worked on by
    R programs side by side, which read its weights from DRAM once; busier experts loop.
    """
    mean_rows = num_slots / max(num_experts, 1)
    likely_max_rows = mean_rows + 4.0 * math.sqrt(mean_rows) + 1.0
    if interpreter:
        row_split = min(max(1, math.ceil(likely_max_rows / 16)), 3)
        tiny = (16, 16, 16)
        return LaunchConfig(16, 16, 32, tiny, tiny, 2, 32, 16, 32, row_split, 1, 1, 1, 1, 1, 1, 1, 1,
                            gate_up_dx_tile=(16, 16, 32), warps_g=1, stages_g=1)  # fmt: skip
    block_h = 32 if input_bytes == 4 else 64
    if mean_rows >= 512 and input_bytes == 2:  # busy experts: 128-row blocks (measured at 1024 rows: −11%)
        row_split = min(max(1, math.ceil(likely_max_rows / 128)), 8)
        return LaunchConfig(128, 64, block_h, (128, 128, 128), (128, 256, 128), 32, 128, 64, 1024, row_split,
                            stages_gu=2, stages_dn=2)  # fmt: skip
    block_m = 64
    row_split = min(max(1, math.ceil(likely_max_rows / block_m)), 8)
    return LaunchConfig(
        block_m, 128, block_h, (128, 128, 64), (128, 256, 64), 32, 128, 64, 1024, row_split, stages_gu=2, stages_dn=2
    )


# --------------------------------------------------------------------------------------------------
# helpers


@triton.jit
def _round(x, DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """x (fp32) rounded to nearest-even in DTYPE (the interpreter's own fp32→bf16 cast truncates)."""
    if INTERPRETER and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _dot(a, b, acc, INTERPRETER: tl.constexpr):
    """acc + a·b for 16-bit operands on the tensor cores (in the interpreter: upcast, exact fp32)."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _operand(v, OPERAND_DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """v as a tensor-core operand: 16-bit inputs as they are, fp32 rounded to OPERAND_DTYPE."""
    if v.dtype == OPERAND_DTYPE:
        return v
    return _round(v.to(tl.float32), OPERAND_DTYPE, INTERPRETER)


@triton.jit
def _split(v, OPERAND_DTYPE: tl.constexpr, SPLIT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr):
    """(hi, lo) with v ≈ hi + lo, both in OPERAND_DTYPE; lo = hi (unused) without SPLIT_PRECISION."""
    hi = _operand(v, OPERAND_DTYPE, INTERPRETER)
    if SPLIT_PRECISION:
        lo = _round(v.to(tl.float32) - hi.to(tl.float32), OPERAND_DTYPE, INTERPRETER)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _expert_tile(pid, num_tiles, ROW_SPLIT):
    """Program id -> (expert, tile, r). The R programs of one (expert, tile) are adjacent (they
    stream the same weight tiles), and the tiles of one expert follow each other (they read the
    same rows of x and dy, or of the workspaces): launched together, they share them through L2."""
    r = pid % ROW_SPLIT
    tile = (pid // ROW_SPLIT) % num_tiles
    expert = pid // (ROW_SPLIT * num_tiles)
    return expert, tile, r


# --------------------------------------------------------------------------------------------------
# kernel A: recomputed forward, dA' = Wdᵀ·dy, dSwiGLU and the routing-weight gradient (transposed tiles)


@triton.jit
def _swiglu_grad_kernel(
    x_hi_ptr,  # [T, H] x, OPERAND_DTYPE (fp32 inputs: bf16(x); 16-bit inputs: x itself)
    x_lo_ptr,  # [T, H] bf16(x − x_hi), read only with SPLIT_PRECISION
    dy_hi_ptr,  # [T, H] dy, like x_hi
    dy_lo_ptr,  # [T, H] like x_lo
    topk_weights_ptr,  # [T·K] w per slot, fp32 / input dtype
    gate_weights_ptr,  # [E, I, H] Wg
    up_weights_ptr,  # [E, I, H] Wu
    down_weights_ptr,  # [E, H, I] Wd
    sorted_slot_ptr,  # [T·K] int32: slot ids in expert order
    expert_offsets_ptr,  # [E + 1] int32: first sorted position of each expert
    dgate_ptr,  # out [T·K, I] dg, row = sorted position, OPERAND_DTYPE
    dup_ptr,  # out [T·K, I] du, row = sorted position, OPERAND_DTYPE
    scaled_act_ptr,  # out [T·K, I] aw = w·a, row = sorted position, OPERAND_DTYPE
    topk_partial_ptr,  # out [n_I_tiles, T·K] fp32: ⟨dAp, a⟩ over one I-tile, column = slot
    num_slots,  # T·K
    top_k,  # K
    hidden_size,  # H
    inter_size,  # I
    num_i_tiles,  # cdiv(I, BLOCK_I)
    ROW_SPLIT,  # R
    OPERAND_DTYPE: tl.constexpr,  # dtype of the tensor-core operands (bf16 or fp16)
    SPLIT_PRECISION: tl.constexpr,  # bf16×3 products for g, u and dAp (fp32 interface)
    FORWARD_ONLY: tl.constexpr,  # the layer's forward: only aw = w·a is computed and stored (dy unused)
    INTERPRETER: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    expert, i_tile, r = _expert_tile(tl.program_id(0), num_i_tiles, ROW_SPLIT)
    row_begin = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    e64 = expert.to(tl.int64)
    gate_w = gate_weights_ptr + e64 * inter_size * hidden_size
    up_w = up_weights_ptr + e64 * inter_size * hidden_size
    down_w = down_weights_ptr + e64 * hidden_size * inter_size

    cols = i_tile * BLOCK_I + tl.arange(0, BLOCK_I)  # this program's I-tile: the M side
    col_ok = cols < inter_size
    for m0 in range(row_begin + r * BLOCK_M, row_end, ROW_SPLIT * BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)  # sorted positions: the N side
        row_ok = rows < row_end
        slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
        tokens = (slots // top_k).to(tl.int64)

        g = tl.zeros((BLOCK_I, BLOCK_M), tl.float32)  # gᵀ: [I-tile, rows]
        u = tl.zeros((BLOCK_I, BLOCK_M), tl.float32)
        dap = tl.zeros((BLOCK_I, BLOCK_M), tl.float32)
        for h0 in range(0, hidden_size, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < hidden_size
            weight_mask = col_ok[:, None] & h_ok[None, :]
            # [BLOCK_I, BLOCK_H] tiles of Wg, Wu (Wg[e][i, h] at i·H + h) and of Wdᵀ (Wd[e][h, i] at h·I + i)
            wg = tl.load(gate_w + cols[:, None] * hidden_size + hs[None, :], mask=weight_mask, other=0.0)
            wu = tl.load(up_w + cols[:, None] * hidden_size + hs[None, :], mask=weight_mask, other=0.0)
            if not FORWARD_ONLY:
                wd_t = tl.load(down_w + hs[None, :] * inter_size + cols[:, None], mask=weight_mask, other=0.0)
            # [BLOCK_H, BLOCK_M] tiles of xᵀ and dyᵀ, gathered by token
            token_offsets = tokens[None, :] * hidden_size + hs[:, None]
            token_mask = h_ok[:, None] & row_ok[None, :]
            x_hi = tl.load(x_hi_ptr + token_offsets, mask=token_mask, other=0.0)
            if not FORWARD_ONLY:
                dy_hi = tl.load(dy_hi_ptr + token_offsets, mask=token_mask, other=0.0)

            wg_hi, wg_lo = _split(wg, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            wu_hi, wu_lo = _split(wu, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            if not FORWARD_ONLY:
                wd_hi, wd_lo = _split(wd_t, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            if SPLIT_PRECISION:  # the two small cross terms first
                x_lo = tl.load(x_lo_ptr + token_offsets, mask=token_mask, other=0.0)
                if not FORWARD_ONLY:
                    dy_lo = tl.load(dy_lo_ptr + token_offsets, mask=token_mask, other=0.0)
                g = _dot(wg_lo, x_hi, g, INTERPRETER)
                g = _dot(wg_hi, x_lo, g, INTERPRETER)
                u = _dot(wu_lo, x_hi, u, INTERPRETER)
                u = _dot(wu_hi, x_lo, u, INTERPRETER)
                if not FORWARD_ONLY:
                    dap = _dot(wd_lo, dy_hi, dap, INTERPRETER)
                    dap = _dot(wd_hi, dy_lo, dap, INTERPRETER)
            g = _dot(wg_hi, x_hi, g, INTERPRETER)
            u = _dot(wu_hi, x_hi, u, INTERPRETER)
            if not FORWARD_ONLY:
                dap = _dot(wd_hi, dy_hi, dap, INTERPRETER)

        # epilogue: padded rows and columns hold g = u = dAp = 0, so they add nothing to the sums over I
        w = tl.load(topk_weights_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        act = silu * u
        if not FORWARD_ONLY:
            tl.store(topk_partial_ptr + i_tile * num_slots + slots, tl.sum(dap * act, axis=0), mask=row_ok)
            da = w[None, :] * dap
            dg = da * u * sig * (1.0 + g * (1.0 - sig))
            du = da * silu
        out_offsets = rows[None, :].to(tl.int64) * inter_size + cols[:, None]
        out_mask = col_ok[:, None] & row_ok[None, :]
        if not FORWARD_ONLY:
            tl.store(dgate_ptr + out_offsets, _round(dg, OPERAND_DTYPE, INTERPRETER), mask=out_mask)
            tl.store(dup_ptr + out_offsets, _round(du, OPERAND_DTYPE, INTERPRETER), mask=out_mask)
        tl.store(scaled_act_ptr + out_offsets, _round(w[None, :] * act, OPERAND_DTYPE, INTERPRETER), mask=out_mask)


# --------------------------------------------------------------------------------------------------
# kernel W: a weight gradient per expert, each tile reduced over all of the expert's rows


@triton.jit
def _expert_weight_grad_kernel(
    a_ptr,  # rows of A, [*, size_m]: row = token (A_BY_TOKEN) or sorted position
    a2_ptr,  # rows of a second A of the same shape (TWO_OUTPUTS), else unused
    b_ptr,  # rows of B, [*, size_n]: row = token (B_BY_TOKEN) or sorted position
    out_ptr,  # out [E, size_m, size_n]: out_e = Σ over the expert's rows of aᵀ b, output dtype
    out2_ptr,  # out [E, size_m, size_n]: Σ a2ᵀ b (TWO_OUTPUTS), else unused
    sorted_slot_ptr,  # [T·K] int32: slot ids in expert order
    expert_offsets_ptr,  # [E + 1] int32: first sorted position of each expert
    top_k,  # K
    size_m,  # rows of each expert's output
    size_n,  # columns of each expert's output
    num_m_tiles,  # cdiv(size_m, BLOCK_M)
    num_n_tiles,  # cdiv(size_n, BLOCK_N)
    N_TILES_PER_PROGRAM,  # output tiles along N one program writes, one after the other
    done_rows,  # experts with at most this many rows are skipped (kernel G wrote their tiles); −1: none
    A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr, TWO_OUTPUTS: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    # Launched twice: dWg_e = Σ dgᵀ x and dWu_e = Σ duᵀ x (A = dg, A2 = du, B = x, [I, H]), then
    # dWd_e = Σ dyᵀ aw (A = dy, B = aw, [H, I]). Program (expert, M-tile, N-group): the tiles of
    # N_TILES_PER_PROGRAM N-tiles, each reduced over the expert's row blocks. One flat loop over
    # (N-tile, row block) pairs lets the compiler fetch the next pair's operands while the current
    # one multiplies; a tile is stored (and its accumulators cleared) after its last row block. An
    # expert with no rows still takes one pass per tile (all loads masked): exact zeros are written.
    pid = tl.program_id(0)
    num_n_groups = tl.cdiv(num_n_tiles, N_TILES_PER_PROGRAM)
    n_group = pid % num_n_groups
    m_tile = (pid // num_n_groups) % num_m_tiles
    expert = pid // (num_n_groups * num_m_tiles)  # an expert's programs are adjacent: its rows stay in L2
    row_begin = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    num_row_blocks = tl.maximum(tl.cdiv(row_end - row_begin, BLOCK_ROWS), 1)
    first_n_tile = n_group * N_TILES_PER_PROGRAM
    num_tiles = tl.minimum(N_TILES_PER_PROGRAM, num_n_tiles - first_n_tile)
    num_tiles = tl.where(row_end - row_begin <= done_rows, 0, num_tiles)
    out_offset = expert.to(tl.int64) * size_m * size_n
    out_dtype = out_ptr.dtype.element_ty

    ms = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < size_m
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for step in range(0, num_tiles * num_row_blocks):
        block = step % num_row_blocks
        ns = (first_n_tile + step // num_row_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = ns < size_n
        rows = row_begin + block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < row_end
        slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
        tokens = (slots // top_k).to(tl.int64)
        a_rows = tokens if A_BY_TOKEN else rows.to(tl.int64)
        b_rows = tokens if B_BY_TOKEN else rows.to(tl.int64)
        # [BLOCK_M, BLOCK_ROWS] transposed tile of A, [BLOCK_ROWS, BLOCK_N] tile of B
        a_t_offsets = a_rows[None, :] * size_m + ms[:, None]
        a_t_mask = m_ok[:, None] & row_ok[None, :]
        b = tl.load(b_ptr + b_rows[:, None] * size_n + ns[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(tl.load(a_ptr + a_t_offsets, mask=a_t_mask, other=0.0), b, acc, INTERPRETER)
        if TWO_OUTPUTS:
            acc2 = _dot(tl.load(a2_ptr + a_t_offsets, mask=a_t_mask, other=0.0), b, acc2, INTERPRETER)
        if block == num_row_blocks - 1:  # the tile is complete: write it once
            out_offsets = out_offset + ms[:, None] * size_n + ns[None, :]
            out_mask = m_ok[:, None] & n_ok[None, :]
            tl.store(out_ptr + out_offsets, _round(acc, out_dtype, INTERPRETER), mask=out_mask)
            if TWO_OUTPUTS:
                tl.store(out2_ptr + out_offsets, _round(acc2, out_dtype, INTERPRETER), mask=out_mask)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)


# --------------------------------------------------------------------------------------------------
# kernel G: dWg and dWu per (expert, H-tile), with the expert's dX on that H-tile in the same pass


@triton.jit
def _gate_up_grad_kernel(
    dgate_ptr,  # [T·K, I] dg from kernel A, row = sorted position, OPERAND_DTYPE
    dup_ptr,  # [T·K, I] du, likewise
    x_ptr,  # [T, H] x as an operand (fp32 inputs: bf16(x); 16-bit inputs: x itself)
    gate_weights_ptr,  # [E, I, H] Wg
    up_weights_ptr,  # [E, I, H] Wu
    sorted_slot_ptr,  # [T·K] int32: slot ids in expert order
    expert_offsets_ptr,  # [E + 1] int32: first sorted position of each expert
    grad_gate_ptr,  # out [E, I, H] dWg, output dtype
    grad_up_ptr,  # out [E, I, H] dWu
    dx_slot_ptr,  # out [T·K, H] fp32: Wgᵀ dg + Wuᵀ du per slot, row = slot id
    top_k,  # K
    hidden_size,  # H
    inter_size,  # I
    num_h_tiles,  # cdiv(H, BLOCK_H)
    OPERAND_DTYPE: tl.constexpr,  # dtype of the tensor-core operands (bf16 or fp16)
    INTERPRETER: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    # Program (expert, H-tile), for the experts with at most BLOCK_ROWS rows (most of them while
    # T·K/E is small; kernels W and D skip them): the expert's x rows [rows, H-tile] stay on chip while
    # the program walks I once: per I-step it loads dg, du [rows, I-step] and the weight tiles Wg, Wu
    # [I-step, H-tile], writes the finished dWg, dWu tiles (dgᵀ x, duᵀ x: the whole reduction over the
    # rows at once) and adds dg·Wg + du·Wu to the expert's dX rows, stored at the end. dg and du are
    # read once for both. Programs of busier experts do nothing: kernel W writes their dWg, dWu and
    # kernel D their dX.
    pid = tl.program_id(0)
    h_tile = pid % num_h_tiles
    expert = pid // num_h_tiles  # an expert's programs are adjacent: its rows of dg, du, x stay in L2
    row_begin = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    expert_offset = expert.to(tl.int64) * inter_size * hidden_size
    gate_w = gate_weights_ptr + expert_offset
    up_w = up_weights_ptr + expert_offset
    out_dtype = grad_gate_ptr.dtype.element_ty
    hs = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < hidden_size
    if row_end - row_begin <= BLOCK_ROWS:  # one row block (also an expert with no rows: zeros written)
        rows = row_begin + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < row_end
        slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
        tokens = (slots // top_k).to(tl.int64)
        x_rows = tl.load(x_ptr + tokens[:, None] * hidden_size + hs[None, :], mask=row_ok[:, None] & h_ok[None, :],
                         other=0.0)  # fmt: skip
        dx = tl.zeros((BLOCK_ROWS, BLOCK_H), tl.float32)
        for i0 in range(0, inter_size, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            col_ok = cols < inter_size
            ws_offsets = rows[:, None].to(tl.int64) * inter_size + cols[None, :]
            ws_mask = row_ok[:, None] & col_ok[None, :]
            dg = tl.load(dgate_ptr + ws_offsets, mask=ws_mask, other=0.0)  # [rows, I-step]
            du = tl.load(dup_ptr + ws_offsets, mask=ws_mask, other=0.0)
            w_offsets = cols[:, None] * hidden_size + hs[None, :]  # [I-step, H-tile] of Wg[e], Wu[e], dWg[e], dWu[e]
            w_mask = col_ok[:, None] & h_ok[None, :]
            wg = tl.load(gate_w + w_offsets, mask=w_mask, other=0.0)
            wu = tl.load(up_w + w_offsets, mask=w_mask, other=0.0)
            grad_g = _dot(tl.trans(dg), x_rows, tl.zeros((BLOCK_I, BLOCK_H), tl.float32), INTERPRETER)
            grad_u = _dot(tl.trans(du), x_rows, tl.zeros((BLOCK_I, BLOCK_H), tl.float32), INTERPRETER)
            tl.store(grad_gate_ptr + expert_offset + w_offsets, _round(grad_g, out_dtype, INTERPRETER), mask=w_mask)
            tl.store(grad_up_ptr + expert_offset + w_offsets, _round(grad_u, out_dtype, INTERPRETER), mask=w_mask)
            dx = _dot(dg, _operand(wg, OPERAND_DTYPE, INTERPRETER), dx, INTERPRETER)
            dx = _dot(du, _operand(wu, OPERAND_DTYPE, INTERPRETER), dx, INTERPRETER)
        tl.store(dx_slot_ptr + slots[:, None].to(tl.int64) * hidden_size + hs[None, :], dx,
                 mask=row_ok[:, None] & h_ok[None, :])  # fmt: skip


# --------------------------------------------------------------------------------------------------
# kernel D: per-slot projections back to H (transposed tiles): dX contributions, and the forward's y


@triton.jit
def _slot_projection_kernel(
    weights1_ptr,  # [E, …] W1: element (h, i) of expert e at e·H·I + h·stride_h + i·stride_i
    weights2_ptr,  # W2, laid out like W1 (TWO_TERMS), else unused
    sorted_slot_ptr,  # [T·K] int32: slot ids in expert order
    expert_offsets_ptr,  # [E + 1] int32: first sorted position of each expert
    rows1_ptr,  # [T·K, I] v1 from kernel A, row = sorted position
    rows2_ptr,  # [T·K, I] v2 (TWO_TERMS), else unused
    out_slot_ptr,  # out [T·K, H] fp32: W1_e v1 (+ W2_e v2) per slot, row = slot id
    hidden_size,  # H
    inter_size,  # I
    stride_h,  # distance between (h, i) and (h + 1, i) in one expert's weights
    stride_i,  # distance between (h, i) and (h, i + 1)
    num_h_tiles,  # cdiv(H, BLOCK_H)
    ROW_SPLIT,  # R
    done_rows,  # experts with at most this many rows are skipped (kernel G did their dX); −1: none
    TWO_TERMS: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr,  # dtype of the tensor-core operands (bf16 or fp16)
    INTERPRETER: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    # Backward: W1 = Wgᵀ (Wg[e][i, h] at i·H + h), v1 = dg, W2 = Wuᵀ, v2 = du: dX_slot.
    # Forward: W1 = Wd (Wd[e][h, i] at h·I + i), v1 = aw: y_slot.
    expert, h_tile, r = _expert_tile(tl.program_id(0), num_h_tiles, ROW_SPLIT)
    row_begin = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    if row_end - row_begin <= done_rows:
        row_end = row_begin  # nothing to do
    expert_offset = expert.to(tl.int64) * inter_size * hidden_size
    w1 = weights1_ptr + expert_offset
    w2 = weights2_ptr + expert_offset

    hs = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # this program's H-tile: the M side
    h_ok = hs < hidden_size
    # out_slotᵀ[h, row] = Σ_i W1_e[h, i] v1[row, i] (+ W2_e[h, i] v2[row, i])
    for m0 in range(row_begin + r * BLOCK_M, row_end, ROW_SPLIT * BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
        acc = tl.zeros((BLOCK_H, BLOCK_M), tl.float32)
        for i0 in range(0, inter_size, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            col_ok = cols < inter_size
            # [BLOCK_H, BLOCK_I] tiles of the weights; [BLOCK_I, BLOCK_M] tiles of v1ᵀ, v2ᵀ
            w_offsets = hs[:, None] * stride_h + cols[None, :] * stride_i
            w_mask = h_ok[:, None] & col_ok[None, :]
            ws_offsets = rows[None, :].to(tl.int64) * inter_size + cols[:, None]
            ws_mask = col_ok[:, None] & row_ok[None, :]
            w1_tile = tl.load(w1 + w_offsets, mask=w_mask, other=0.0)
            if TWO_TERMS:
                w2_tile = tl.load(w2 + w_offsets, mask=w_mask, other=0.0)
            v1_t = tl.load(rows1_ptr + ws_offsets, mask=ws_mask, other=0.0)
            if TWO_TERMS:
                v2_t = tl.load(rows2_ptr + ws_offsets, mask=ws_mask, other=0.0)
            acc = _dot(_operand(w1_tile, OPERAND_DTYPE, INTERPRETER), v1_t, acc, INTERPRETER)
            if TWO_TERMS:
                acc = _dot(_operand(w2_tile, OPERAND_DTYPE, INTERPRETER), v2_t, acc, INTERPRETER)
        tl.store(out_slot_ptr + slots[None, :].to(tl.int64) * hidden_size + hs[:, None], acc,
                 mask=h_ok[:, None] & row_ok[None, :])  # fmt: skip


# --------------------------------------------------------------------------------------------------
# kernel C: per-token sums in a fixed order


@triton.jit
def _token_sum_kernel(
    dx_slot_ptr,  # [T·K, H] fp32 per-slot dX contributions, row = slot id
    topk_partial_ptr,  # [n_I_tiles, T·K] fp32 per-I-tile parts of grad_topk_weights
    grad_hidden_ptr,  # out [T, H] grad_hidden_states, output dtype
    grad_topk_ptr,  # out [T·K] grad_topk_weights, topk_weights' dtype
    num_slots,  # T·K
    top_k,  # K
    hidden_size,  # H
    num_i_tiles,  # cdiv(I, BLOCK_I) of kernel A
    WITH_TOPK: tl.constexpr,  # also sum grad_topk_weights (the backward; not the forward)
    INTERPRETER: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    h_tile = tl.program_id(1)
    hs = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < hidden_size
    total = tl.zeros((BLOCK_H,), tl.float32)
    for k in range(0, top_k):
        total += tl.load(dx_slot_ptr + (token * top_k + k) * hidden_size + hs, mask=h_ok, other=0.0)
    tl.store(grad_hidden_ptr + token * hidden_size + hs, _round(total, grad_hidden_ptr.dtype.element_ty, INTERPRETER),
             mask=h_ok)  # fmt: skip

    if WITH_TOPK and h_tile == 0:
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < top_k
        grad_w = tl.zeros((BLOCK_K,), tl.float32)
        for tile in range(0, num_i_tiles):
            grad_w += tl.load(topk_partial_ptr + tile * num_slots + token * top_k + ks, mask=k_ok, other=0.0)
        tl.store(grad_topk_ptr + token * top_k + ks, _round(grad_w, grad_topk_ptr.dtype.element_ty, INTERPRETER),
                 mask=k_ok)  # fmt: skip


# --------------------------------------------------------------------------------------------------
# host side

_OPERAND_DTYPES = {torch.float32: tl.bfloat16, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_TORCH_DTYPES = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}


def split_halves(v: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) in ``dtype`` with v ≈ hi + lo: hi = round(v), lo = round(v − hi) (both nearest-even)."""
    hi = v.to(dtype)
    return hi, (v - hi.to(v.dtype)).to(dtype)


def _operand_halves(v: torch.Tensor, split_precision: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel A's (hi, lo) view of x or dy: bf16 halves for fp32 inputs, the 16-bit tensor itself twice otherwise."""
    return split_halves(v, dtype) if split_precision else (v, v)


def _launch_swiglu_grad(config, routing, x_halves, dy_halves, topk_weights, gate_weights, up_weights, down_weights,
                        dgate, dup, scaled_act, topk_partial, *, forward_only: bool):  # fmt: skip
    """Kernel A over every (expert, I-tile, row split); ``forward_only`` stores aw alone (dy unused)."""
    H = x_halves[0].shape[1]
    E, I, _ = gate_weights.shape
    num_slots, top_k = topk_weights.numel(), topk_weights.shape[1]
    num_i_tiles = triton.cdiv(I, config.block_i)
    _swiglu_grad_kernel[(E * num_i_tiles * config.row_split,)](
        *x_halves, *dy_halves, topk_weights, gate_weights, up_weights, down_weights,
        routing.sorted_slot, routing.expert_offsets, dgate, dup, scaled_act, topk_partial,
        num_slots, top_k, H, I, num_i_tiles, config.row_split,
        OPERAND_DTYPE=_OPERAND_DTYPES[x_halves[0].dtype], SPLIT_PRECISION=gate_weights.dtype == torch.float32,
        FORWARD_ONLY=forward_only, INTERPRETER=triton_interpreter_enabled(),
        BLOCK_I=config.block_i, BLOCK_M=config.block_m, BLOCK_H=config.block_h,
        num_warps=config.warps_a, num_stages=config.stages_a,
    )  # fmt: skip


def _launch_slot_projection(config, routing, weights1, weights2, rows1, rows2, out_slot, stride_h, stride_i,
                            done_rows=-1):  # fmt: skip
    """Kernel D over every (expert, H-tile, row split): out_slot = W1_e v1 (+ W2_e v2 when given twice),
    except for experts with at most ``done_rows`` rows."""
    H, E, I = out_slot.shape[1], weights1.shape[0], rows1.shape[1]
    num_h_tiles = triton.cdiv(H, config.block_h_dx)
    _slot_projection_kernel[(E * num_h_tiles * config.row_split,)](
        weights1, weights2, routing.sorted_slot, routing.expert_offsets, rows1, rows2, out_slot,
        H, I, stride_h, stride_i, num_h_tiles, config.row_split, done_rows,
        TWO_TERMS=weights2 is not weights1, OPERAND_DTYPE=_OPERAND_DTYPES[rows1.dtype],
        INTERPRETER=triton_interpreter_enabled(),
        BLOCK_H=config.block_h_dx, BLOCK_M=config.block_m, BLOCK_I=config.block_i_dx,
        num_warps=config.warps_d, num_stages=config.stages_d,
    )  # fmt: skip


def _launch_token_sum(config, out_slot, out, top_k, topk_partial=None, grad_topk=None):
    """Kernel C: out[t] = Σ_k out_slot[t·K + k]; with ``grad_topk``, also the routing-weight sums."""
    T, H = out.shape
    with_topk = grad_topk is not None
    _token_sum_kernel[(T, triton.cdiv(H, config.block_h_sum))](
        out_slot, topk_partial if with_topk else out_slot, out, grad_topk if with_topk else out,
        T * top_k, top_k, H, topk_partial.shape[0] if with_topk else 1,
        WITH_TOPK=with_topk, INTERPRETER=triton_interpreter_enabled(), BLOCK_H=config.block_h_sum,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
    )  # fmt: skip


def moe_experts_backward_triton(
    grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
    *, config: LaunchConfig | None = None,
):  # fmt: skip
    """P2 with the Triton kernels; inputs already validated and contiguous (see :mod:`moe_lib.api`).

    Returns freshly allocated (grad_hidden_states [T, H], grad_topk_weights [T, K],
    grad_gate_weights [E, I, H], grad_up_weights [E, I, H], grad_down_weights [E, H, I]); the
    routing-weight gradient in topk_weights' dtype, the rest in the hidden dtype. ``config``
    overrides the tile sizes (default: :func:`launch_config`).
    """
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    dtype, device = hidden_states.dtype, hidden_states.device
    num_slots = T * K
    interpreter = triton_interpreter_enabled()
    if config is None:
        config = launch_config(num_slots, E, input_bytes=hidden_states.element_size(), interpreter=interpreter)
    split_precision = dtype == torch.float32
    num_i_tiles = triton.cdiv(I, config.block_i)

    grad_hidden = allocate((T, H), dtype=dtype, device=device)
    grad_topk = allocate((T, K), dtype=topk_weights.dtype, device=device)
    grad_gate = allocate((E, I, H), dtype=dtype, device=device)
    grad_up = allocate((E, I, H), dtype=dtype, device=device)
    grad_down = allocate((E, H, I), dtype=dtype, device=device)

    routing = route_by_expert(topk_indices, E)
    ws_rows = max(num_slots, 1)  # kernels take no zero-size buffers
    workspace_dtype = _TORCH_DTYPES[_OPERAND_DTYPES[dtype]]
    dgate = allocate((ws_rows, I), dtype=workspace_dtype, device=device)
    dup = allocate((ws_rows, I), dtype=workspace_dtype, device=device)
    scaled_act = allocate((ws_rows, I), dtype=workspace_dtype, device=device)
    topk_partial = allocate((num_i_tiles, ws_rows), dtype=torch.float32, device=device)
    dx_slot = allocate((ws_rows, H), dtype=torch.float32, device=device)
    sorted_slot = routing.sorted_slot if num_slots > 0 else torch.zeros(1, dtype=torch.int32, device=device)
    x_halves = _operand_halves(hidden_states, split_precision, workspace_dtype)
    dy_halves = _operand_halves(grad_output, split_precision, workspace_dtype)

    if num_slots > 0:
        _launch_swiglu_grad(config, routing, x_halves, dy_halves, topk_weights, gate_weights, up_weights,
                            down_weights, dgate, dup, scaled_act, topk_partial, forward_only=False)  # fmt: skip
    # kernel G (fuse_dx): dWg, dWu and dX of the experts with at most one row block; W and D skip those
    done_rows = config.gate_up_dx_tile[2] if config.fuse_dx else -1
    if config.fuse_dx:
        block_i, block_h, block_rows = config.gate_up_dx_tile
        num_h_tiles = triton.cdiv(H, block_h)
        _gate_up_grad_kernel[(E * num_h_tiles,)](
            dgate, dup, x_halves[0], gate_weights, up_weights, sorted_slot, routing.expert_offsets,
            grad_gate, grad_up, dx_slot, K, H, I, num_h_tiles,
            OPERAND_DTYPE=_OPERAND_DTYPES[dtype], INTERPRETER=interpreter,
            BLOCK_I=block_i, BLOCK_H=block_h, BLOCK_ROWS=block_rows,
            num_warps=config.warps_g, num_stages=config.stages_g,
        )  # fmt: skip
    # kernel W: dWg, dWu = Σ dgᵀ x, Σ duᵀ x (one launch, x shared); then dWd = Σ dyᵀ aw (every expert)
    for a, a2, b, out, out2, size_m, size_n, a_by_token, b_by_token, tile, warps, stages, skipped_rows in (
        (dgate, dup, x_halves[0], grad_gate, grad_up, I, H, False, True, config.grad_gate_up_tile,
         config.warps_gu, config.stages_gu, done_rows),
        (dy_halves[0], dy_halves[0], scaled_act, grad_down, grad_down, H, I, True, False, config.grad_down_tile,
         config.warps_dn, config.stages_dn, -1),
    ):  # fmt: skip
        block_m, block_n, block_rows = tile
        num_m_tiles, num_n_tiles = triton.cdiv(size_m, block_m), triton.cdiv(size_n, block_n)
        n_tiles_per_program = min(config.n_tiles_per_program, num_n_tiles)
        _expert_weight_grad_kernel[(E * num_m_tiles * triton.cdiv(num_n_tiles, n_tiles_per_program),)](
            a, a2, b, out, out2, sorted_slot, routing.expert_offsets,
            K, size_m, size_n, num_m_tiles, num_n_tiles, n_tiles_per_program, skipped_rows,
            A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, TWO_OUTPUTS=out2 is not out, INTERPRETER=interpreter,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_ROWS=block_rows, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    if num_slots > 0:
        # dX_slot = Wg_eᵀ dg + Wu_eᵀ du: Wg[e][i, h] at i·H + h (for the experts kernel G left)
        _launch_slot_projection(config, routing, gate_weights, up_weights, dgate, dup, dx_slot, 1, H, done_rows)
        _launch_token_sum(config, dx_slot, grad_hidden, K, topk_partial, grad_topk)
    return grad_hidden, grad_topk, grad_gate, grad_up, grad_down


def moe_experts_forward_triton(
    hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
    *, config: LaunchConfig | None = None,
):  # fmt: skip
    """The layer's forward y [T, H] (hidden dtype), y_t = Σ_k w_tk · Wd_e (silu(Wg_e x_t) ⊙ Wu_e x_t),
    with the backward's kernels: A without dy (aw = w·a only), D with Wd in place of Wgᵀ and Wuᵀ
    (y per slot), C without the routing-weight gradient. Same precision as the backward: fp32 inputs
    get bf16×3 products for g and u, and a plain bf16 product (aw and Wd rounded) for Wd·aw.
    """
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    dtype, device = hidden_states.dtype, hidden_states.device
    num_slots = T * K
    interpreter = triton_interpreter_enabled()
    if config is None:
        config = launch_config(num_slots, E, input_bytes=hidden_states.element_size(), interpreter=interpreter)
    y = allocate((T, H), dtype=dtype, device=device)
    if num_slots == 0:
        return y.zero_()
    routing = route_by_expert(topk_indices, E)
    workspace_dtype = _TORCH_DTYPES[_OPERAND_DTYPES[dtype]]
    scaled_act = allocate((num_slots, I), dtype=workspace_dtype, device=device)
    y_slot = allocate((num_slots, H), dtype=torch.float32, device=device)
    x_halves = _operand_halves(hidden_states, dtype == torch.float32, workspace_dtype)
    # kernel A without dy: the dy, dg, du and top-k partial arguments are never touched
    _launch_swiglu_grad(config, routing, x_halves, x_halves, topk_weights, gate_weights, up_weights, down_weights,
                        scaled_act, scaled_act, scaled_act, y_slot, forward_only=True)  # fmt: skip
    # y_slot = Wd_e · aw: Wd[e][h, i] at h·I + i
    _launch_slot_projection(config, routing, down_weights, down_weights, scaled_act, scaled_act, y_slot, I, 1)
    _launch_token_sum(config, y_slot, y, K)
    return y
