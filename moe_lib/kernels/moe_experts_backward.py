"""Triton backward of all routed SwiGLU experts of one MoE layer (P2), the forward recomputed inside.

Notation: T tokens, K experts per token, E experts, H hidden, I intermediate; slot s = t·K + k is
token t's k-th choice, e = topk_indices[t, k], w = topk_weights[t, k], x = hidden_states[t],
dy = grad_output[t]. Per slot (rows of the expert's GEMMs):

    g = Wg_e x ;  u = Wu_e x ;  a = silu(g) ⊙ u ;  dAp = Wd_eᵀ dy                      [I] each
    grad_topk_weights[t, k] = ⟨dAp, a⟩                       (= ⟨dy, Wd_e a⟩, o is never formed)
    dA = w·dAp ;  dg = dA ⊙ u ⊙ silu'(g) ;  du = dA ⊙ silu(g) ;  aw = w·a
    dWg_e = Σ_slots dg xᵀ ;  dWu_e = Σ_slots du xᵀ ;  dWd_e = Σ_slots dy awᵀ
    grad_hidden_states[t] = Σ_k (Wg_eᵀ dg + Wu_eᵀ du)

Dataflow, four steps, no host synchronisation (CUDA-graph capturable), no float atomics
(deterministic: two calls give bitwise-equal results):

    0. routing (:mod:`.routing`, torch ops on the device): sorted_slot [T·K] = slots in expert
       order, expert_offsets [E + 1] = where each expert's rows start in that order.
    1. kernel A, programs (expert e, I-tile, row split r): for the expert's rows (sorted positions
       p, gathered through sorted_slot inside the loads) accumulate g, u, dAp over H; epilogue:
       dSwiGLU and the routing-weight gradient. Writes dg, du, aw to [T·K, I] workspaces (rows in
       sorted order) and ⟨dAp, a⟩ restricted to the I-tile to a [n_I_tiles, T·K] workspace.
    2. kernel B, programs (expert e, H-tile, row split r): the weight gradients dWg_e[:, H-tile],
       dWu_e[:, H-tile], dWd_e[H-tile, :] for the I-tiles r, r + R, … (each reduced over all the
       expert's rows; exact zeros for an expert with no rows, written here), and the per-slot
       contribution dX_slot[s, H-tile] = dg·Wg_e[:, H-tile] + du·Wu_e[:, H-tile] for the row blocks
       r, r + R, … (reduced over I), to a [T·K, H] fp32 workspace indexed by slot.
    3. kernel C, programs (token t, H-tile): grad_hidden_states[t] = Σ_k dX_slot[t·K + k] and
       grad_topk_weights[t, k] = Σ_tiles partial[tile, t·K + k], both summed in a fixed order.

Grids depend on E, T·K, H, I and the tile sizes only. The R programs that share one expert's
(tile of) weights are launched side by side, so while they stream the same weight tiles the
second read comes from L2: each expert's weights are read from DRAM about once per kernel. Wg and
Wu are read twice in all (kernel A for g and u, kernel B for dX): that second read is the known
cost of this design (fp32: 16 GiB more than the floor of weights read once + gradients written
once); a single-read design that also fuses dX into kernel A's programs is future work.

Precision. fp32 interface: g, u and dAp as bf16×3 products (v = hi + lo with hi = bf16(v),
lo = bf16(v − hi); a·b ≈ hi·hi + hi·lo + lo·hi, fp32 accumulators), which grad_topk_weights needs
to pass the benchmark's element rule; the weight gradients and dX use plain bf16 products with fp32
accumulation (dg, du and aw are stored in bf16). 16-bit interfaces (bf16, fp16): plain products
in the input dtype with fp32 accumulation everywhere. ``SPLIT_PRECISION`` selects the split.
Under ``TRITON_INTERPRET=1`` (CPU) the interpreter's bf16 dot is wrong and its fp32→bf16 cast
truncates, so ``INTERPRETER`` makes the kernels round to bf16 by hand and multiply the (already
rounded) operands in fp32: the same numbers the GPU multiplies.

Workspace (freed when the call returns; outputs are freshly allocated and fully written):
    dg, du, aw        3 · T·K · I   in bf16 (the input dtype for 16-bit inputs)
    dX_slot           T·K · H       fp32
    topk partials     cdiv(I, BLOCK_I) · T·K   fp32
    routing           T·K int32 + E + 1 int32, and torch.sort's int64 outputs (2 · T·K)
At the benchmark's shape (H = 4096, I = 2048, E = 256, K = 8) and T = 8192 (T·K = 65536):
768 MiB + 1 GiB + 8 MiB + 1.3 MiB ≈ 1.8 GiB; at T = 2048, ≈ 450 MiB.

Predicted DRAM traffic, fp32 at T = 2048 (floor: every input read once and every output written
once, 51.5 GB), assuming the R programs of one tile find each other's weight tiles in L2 and the
I-tiles of one expert find its rows of x and dy there: A reads Wg, Wu, Wd (25.8 GB) and gathers
x, dy (≤ 0.54 GB); B reads Wg, Wu (17.2 GB), writes dWg, dWu, dWd (25.8 GB), gathers x, dy
(≤ 0.54 GB) and writes dX_slot (0.27 GB); the workspaces otherwise move ≈ 0.7 GB: ≈ 71 GB in all,
1.37× the floor (16.8 ms at the H200's 4.21 TB/s copy rate). T = 8192: ≈ 77 GB, 1.5× the floor,
where the 28·T·K·H·I FLOPs of bf16 tensor work (19.5 ms at 791 TFLOP/s) bound the time instead.
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
    """Tile sizes and launch parameters of the three kernels."""

    block_m: int  # rows (slots of one expert) per tile, kernels A and B
    block_i: int  # intermediate columns per tile (A: the I-tile a program owns; B: the reduction step)
    block_h: int  # hidden columns per reduction step of kernel A
    block_h_out: int  # hidden columns of the dW / dX_slot tiles one program of kernel B writes
    block_h_sum: int  # hidden columns per program of kernel C
    row_split: int  # R: programs per (expert, tile) that share its row blocks (and its weights via L2)
    warps_a: int = 8  # num_warps of kernel A
    stages_a: int = 3  # num_stages (software pipelining depth) of kernel A
    warps_b: int = 8
    stages_b: int = 3


def launch_config(num_slots: int, num_experts: int, *, input_bytes: int = 4, interpreter: bool = False) -> LaunchConfig:
    """Tile sizes for T·K = ``num_slots`` slots over ``num_experts`` experts (the one place they are set).

    GPU: 64-row tiles (one wgmma M-block), 64-wide I tiles, fp32 accumulators, 8 warps, 3 pipeline
    stages. Kernel A keeps three [64, 64] accumulators (g, u, dAp) and per stage five operand tiles
    (x, dy, Wg, Wu, Wd) of 32 hidden columns in fp32 (40 KB; 64 columns spill registers next to the
    hi/lo splits) or 64 in 16-bit (40 KB). Kernel B writes [64, 64] gradient tiles. Compiled for
    sm_90 with Triton 3.6 these use no local memory and ≤ 124 KB of shared memory; not yet tuned by
    measurement.
    Interpreter: small tiles (16 is the smallest ``tl.dot`` takes), so that tiny test shapes still
    have several row blocks, several I-tiles and masked edges.
    R, the row split, covers an expert with a few standard deviations more rows than the mean
    (uniform routing gives binomial counts): the rows of almost every expert are then worked on by
    R programs side by side, which read its weights from DRAM once; busier experts loop.
    """
    mean_rows = num_slots / max(num_experts, 1)
    likely_max_rows = mean_rows + 4.0 * math.sqrt(mean_rows) + 1.0
    if interpreter:
        row_split = min(max(1, math.ceil(likely_max_rows / 16)), 3)
        return LaunchConfig(16, 16, 32, 32, 32, row_split, 1, 1, 1, 1)
    block_m = 64
    row_split = min(max(1, math.ceil(likely_max_rows / block_m)), 8)
    block_h = 32 if input_bytes == 4 else 64
    return LaunchConfig(block_m, 64, block_h, 64, 1024, row_split, 8, 3, 8, 3)


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
def _split(v, OPERAND_DTYPE: tl.constexpr, SPLIT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr):
    """(hi, lo) with v ≈ hi + lo, both in OPERAND_DTYPE; lo = hi (unused) without SPLIT_PRECISION."""
    v = v.to(tl.float32)
    hi = _round(v, OPERAND_DTYPE, INTERPRETER)
    if SPLIT_PRECISION:
        lo = _round(v - hi.to(tl.float32), OPERAND_DTYPE, INTERPRETER)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _split_dot(a_hi, a_lo, b_hi, b_lo, acc, SPLIT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr):
    """acc + a·b: hi·hi + hi·lo + lo·hi with SPLIT_PRECISION, else hi·hi."""
    if SPLIT_PRECISION:
        acc = _dot(a_lo, b_hi, acc, INTERPRETER)
        acc = _dot(a_hi, b_lo, acc, INTERPRETER)
    return _dot(a_hi, b_hi, acc, INTERPRETER)


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
# kernel A: recomputed forward, dA' = dy·Wd, dSwiGLU and the routing-weight gradient


@triton.jit
def _swiglu_grad_kernel(
    grad_output_ptr,  # [T, H] dy, input dtype
    hidden_ptr,  # [T, H] x, input dtype
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
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    expert, i_tile, r = _expert_tile(tl.program_id(0), num_i_tiles, ROW_SPLIT)
    row_begin = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    e64 = expert.to(tl.int64)
    gate_w = gate_weights_ptr + e64 * inter_size * hidden_size
    up_w = up_weights_ptr + e64 * inter_size * hidden_size
    down_w = down_weights_ptr + e64 * hidden_size * inter_size

    cols = i_tile * BLOCK_I + tl.arange(0, BLOCK_I)  # this program's I-tile
    col_ok = cols < inter_size
    for m0 in range(row_begin + r * BLOCK_M, row_end, ROW_SPLIT * BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)  # sorted positions
        row_ok = rows < row_end
        slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
        tokens = (slots // top_k).to(tl.int64)

        g = tl.zeros((BLOCK_M, BLOCK_I), tl.float32)
        u = tl.zeros((BLOCK_M, BLOCK_I), tl.float32)
        dap = tl.zeros((BLOCK_M, BLOCK_I), tl.float32)
        for h0 in range(0, hidden_size, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < hidden_size
            token_mask = row_ok[:, None] & h_ok[None, :]
            weight_mask = h_ok[:, None] & col_ok[None, :]
            x = tl.load(hidden_ptr + tokens[:, None] * hidden_size + hs[None, :], mask=token_mask, other=0.0)
            dy = tl.load(grad_output_ptr + tokens[:, None] * hidden_size + hs[None, :], mask=token_mask, other=0.0)
            # [BLOCK_H, BLOCK_I] tiles of Wgᵀ, Wuᵀ (Wg[e][i, h] at i·H + h) and of Wd (Wd[e][h, i] at h·I + i)
            wg_t = tl.load(gate_w + cols[None, :] * hidden_size + hs[:, None], mask=weight_mask, other=0.0)
            wu_t = tl.load(up_w + cols[None, :] * hidden_size + hs[:, None], mask=weight_mask, other=0.0)
            wd = tl.load(down_w + hs[:, None] * inter_size + cols[None, :], mask=weight_mask, other=0.0)

            x_hi, x_lo = _split(x, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            dy_hi, dy_lo = _split(dy, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            wg_hi, wg_lo = _split(wg_t, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            wu_hi, wu_lo = _split(wu_t, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            wd_hi, wd_lo = _split(wd, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            g = _split_dot(x_hi, x_lo, wg_hi, wg_lo, g, SPLIT_PRECISION, INTERPRETER)
            u = _split_dot(x_hi, x_lo, wu_hi, wu_lo, u, SPLIT_PRECISION, INTERPRETER)
            dap = _split_dot(dy_hi, dy_lo, wd_hi, wd_lo, dap, SPLIT_PRECISION, INTERPRETER)

        # epilogue: padded rows and columns hold g = u = dAp = 0, so they add nothing to the row sums
        w = tl.load(topk_weights_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        act = silu * u
        tl.store(topk_partial_ptr + i_tile * num_slots + slots, tl.sum(dap * act, axis=1), mask=row_ok)
        da = w[:, None] * dap
        dg = da * u * sig * (1.0 + g * (1.0 - sig))
        du = da * silu
        out_offsets = rows[:, None].to(tl.int64) * inter_size + cols[None, :]
        out_mask = row_ok[:, None] & col_ok[None, :]
        tl.store(dgate_ptr + out_offsets, _round(dg, OPERAND_DTYPE, INTERPRETER), mask=out_mask)
        tl.store(dup_ptr + out_offsets, _round(du, OPERAND_DTYPE, INTERPRETER), mask=out_mask)
        tl.store(scaled_act_ptr + out_offsets, _round(w[:, None] * act, OPERAND_DTYPE, INTERPRETER), mask=out_mask)


# --------------------------------------------------------------------------------------------------
# kernel B: weight gradients and per-slot dX contributions


@triton.jit
def _weight_grad_kernel(
    grad_output_ptr,  # [T, H] dy, input dtype
    hidden_ptr,  # [T, H] x, input dtype
    gate_weights_ptr,  # [E, I, H] Wg
    up_weights_ptr,  # [E, I, H] Wu
    sorted_slot_ptr,  # [T·K] int32: slot ids in expert order
    expert_offsets_ptr,  # [E + 1] int32: first sorted position of each expert
    dgate_ptr,  # [T·K, I] dg from kernel A, row = sorted position
    dup_ptr,  # [T·K, I] du from kernel A, row = sorted position
    scaled_act_ptr,  # [T·K, I] aw from kernel A, row = sorted position
    grad_gate_ptr,  # out [E, I, H] dWg, output dtype
    grad_up_ptr,  # out [E, I, H] dWu, output dtype
    grad_down_ptr,  # out [E, H, I] dWd, output dtype
    dx_slot_ptr,  # out [T·K, H] fp32: Wg_eᵀ dg + Wu_eᵀ du per slot, row = slot id
    top_k,  # K
    hidden_size,  # H
    inter_size,  # I
    num_h_tiles,  # cdiv(H, BLOCK_H_OUT)
    ROW_SPLIT,  # R
    OPERAND_DTYPE: tl.constexpr,  # dtype of the tensor-core operands (bf16 or fp16)
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H_OUT: tl.constexpr,
):  # fmt: skip
    expert, h_tile, r = _expert_tile(tl.program_id(0), num_h_tiles, ROW_SPLIT)
    row_begin = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    e64 = expert.to(tl.int64)
    gate_w = gate_weights_ptr + e64 * inter_size * hidden_size
    up_w = up_weights_ptr + e64 * inter_size * hidden_size
    out_dtype = grad_gate_ptr.dtype.element_ty

    hs = h_tile * BLOCK_H_OUT + tl.arange(0, BLOCK_H_OUT)  # this program's H-tile
    h_ok = hs < hidden_size
    ms = tl.arange(0, BLOCK_M)

    # dWg_e[i, h] = Σ_rows dg[row, i] x[row, h];  dWu_e likewise;  dWd_e[h, i] = Σ_rows dy[row, h] aw[row, i]
    for i0 in range(r * BLOCK_I, inter_size, ROW_SPLIT * BLOCK_I):
        cols = i0 + tl.arange(0, BLOCK_I)
        col_ok = cols < inter_size
        grad_gate = tl.zeros((BLOCK_I, BLOCK_H_OUT), tl.float32)
        grad_up = tl.zeros((BLOCK_I, BLOCK_H_OUT), tl.float32)
        grad_down = tl.zeros((BLOCK_H_OUT, BLOCK_I), tl.float32)
        for m0 in range(row_begin, row_end, BLOCK_M):
            rows = m0 + ms
            row_ok = rows < row_end
            slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
            tokens = (slots // top_k).to(tl.int64)
            token_mask = row_ok[:, None] & h_ok[None, :]
            x = tl.load(hidden_ptr + tokens[:, None] * hidden_size + hs[None, :], mask=token_mask, other=0.0)
            dy = tl.load(grad_output_ptr + tokens[:, None] * hidden_size + hs[None, :], mask=token_mask, other=0.0)
            # [BLOCK_I, BLOCK_M] transposed tiles of dg and du; [BLOCK_M, BLOCK_I] of aw; [BLOCK_H_OUT, BLOCK_M] of dyᵀ
            ws_t_offsets = rows[None, :].to(tl.int64) * inter_size + cols[:, None]
            ws_t_mask = col_ok[:, None] & row_ok[None, :]
            dg_t = tl.load(dgate_ptr + ws_t_offsets, mask=ws_t_mask, other=0.0)
            du_t = tl.load(dup_ptr + ws_t_offsets, mask=ws_t_mask, other=0.0)
            aw = tl.load(scaled_act_ptr + rows[:, None].to(tl.int64) * inter_size + cols[None, :],
                         mask=row_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            x16 = _round(x.to(tl.float32), OPERAND_DTYPE, INTERPRETER)
            dy16_t = tl.trans(_round(dy.to(tl.float32), OPERAND_DTYPE, INTERPRETER))
            grad_gate = _dot(dg_t, x16, grad_gate, INTERPRETER)
            grad_up = _dot(du_t, x16, grad_up, INTERPRETER)
            grad_down = _dot(dy16_t, aw, grad_down, INTERPRETER)
        # written for every expert, with or without rows: an expert no token chose gets exact zeros
        ih_offsets = e64 * inter_size * hidden_size + cols[:, None] * hidden_size + hs[None, :]
        ih_mask = col_ok[:, None] & h_ok[None, :]
        tl.store(grad_gate_ptr + ih_offsets, _round(grad_gate, out_dtype, INTERPRETER), mask=ih_mask)
        tl.store(grad_up_ptr + ih_offsets, _round(grad_up, out_dtype, INTERPRETER), mask=ih_mask)
        hi_offsets = e64 * hidden_size * inter_size + hs[:, None] * inter_size + cols[None, :]
        hi_mask = h_ok[:, None] & col_ok[None, :]
        tl.store(grad_down_ptr + hi_offsets, _round(grad_down, out_dtype, INTERPRETER), mask=hi_mask)

    # dX_slot[slot, h] = Σ_i dg[row, i] Wg_e[i, h] + du[row, i] Wu_e[i, h]
    for m0 in range(row_begin + r * BLOCK_M, row_end, ROW_SPLIT * BLOCK_M):
        rows = m0 + ms
        row_ok = rows < row_end
        slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
        grad_x = tl.zeros((BLOCK_M, BLOCK_H_OUT), tl.float32)
        for i0 in range(0, inter_size, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            col_ok = cols < inter_size
            ws_offsets = rows[:, None].to(tl.int64) * inter_size + cols[None, :]
            ws_mask = row_ok[:, None] & col_ok[None, :]
            dg = tl.load(dgate_ptr + ws_offsets, mask=ws_mask, other=0.0)
            du = tl.load(dup_ptr + ws_offsets, mask=ws_mask, other=0.0)
            w_offsets = cols[:, None] * hidden_size + hs[None, :]
            w_mask = col_ok[:, None] & h_ok[None, :]
            wg = tl.load(gate_w + w_offsets, mask=w_mask, other=0.0)
            wu = tl.load(up_w + w_offsets, mask=w_mask, other=0.0)
            grad_x = _dot(dg, _round(wg.to(tl.float32), OPERAND_DTYPE, INTERPRETER), grad_x, INTERPRETER)
            grad_x = _dot(du, _round(wu.to(tl.float32), OPERAND_DTYPE, INTERPRETER), grad_x, INTERPRETER)
        tl.store(dx_slot_ptr + slots[:, None].to(tl.int64) * hidden_size + hs[None, :], grad_x,
                 mask=row_ok[:, None] & h_ok[None, :])  # fmt: skip


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

    if h_tile == 0:
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
    operand_dtype = _OPERAND_DTYPES[dtype]
    split_precision = dtype == torch.float32
    num_i_tiles = triton.cdiv(I, config.block_i)
    num_h_tiles = triton.cdiv(H, config.block_h_out)
    R = config.row_split

    grad_hidden = allocate((T, H), dtype=dtype, device=device)
    grad_topk = allocate((T, K), dtype=topk_weights.dtype, device=device)
    grad_gate = allocate((E, I, H), dtype=dtype, device=device)
    grad_up = allocate((E, I, H), dtype=dtype, device=device)
    grad_down = allocate((E, H, I), dtype=dtype, device=device)

    routing = route_by_expert(topk_indices, E)
    ws_rows = max(num_slots, 1)  # kernels take no zero-size buffers
    dgate = allocate((ws_rows, I), dtype=_TORCH_DTYPES[operand_dtype], device=device)
    dup = allocate((ws_rows, I), dtype=_TORCH_DTYPES[operand_dtype], device=device)
    scaled_act = allocate((ws_rows, I), dtype=_TORCH_DTYPES[operand_dtype], device=device)
    topk_partial = allocate((num_i_tiles, ws_rows), dtype=torch.float32, device=device)
    dx_slot = allocate((ws_rows, H), dtype=torch.float32, device=device)
    sorted_slot = routing.sorted_slot if num_slots > 0 else torch.zeros(1, dtype=torch.int32, device=device)

    if num_slots > 0:
        _swiglu_grad_kernel[(E * num_i_tiles * R,)](
            grad_output, hidden_states, topk_weights, gate_weights, up_weights, down_weights,
            sorted_slot, routing.expert_offsets, dgate, dup, scaled_act, topk_partial,
            num_slots, K, H, I, num_i_tiles, R,
            OPERAND_DTYPE=operand_dtype, SPLIT_PRECISION=split_precision, INTERPRETER=interpreter,
            BLOCK_M=config.block_m, BLOCK_I=config.block_i, BLOCK_H=config.block_h,
            num_warps=config.warps_a, num_stages=config.stages_a,
        )  # fmt: skip
    _weight_grad_kernel[(E * num_h_tiles * R,)](
        grad_output, hidden_states, gate_weights, up_weights, sorted_slot, routing.expert_offsets,
        dgate, dup, scaled_act, grad_gate, grad_up, grad_down, dx_slot,
        K, H, I, num_h_tiles, R,
        OPERAND_DTYPE=operand_dtype, INTERPRETER=interpreter,
        BLOCK_M=config.block_m, BLOCK_I=config.block_i, BLOCK_H_OUT=config.block_h_out,
        num_warps=config.warps_b, num_stages=config.stages_b,
    )  # fmt: skip
    if num_slots > 0:
        _token_sum_kernel[(T, triton.cdiv(H, config.block_h_sum))](
            dx_slot, topk_partial, grad_hidden, grad_topk, num_slots, K, H, num_i_tiles,
            INTERPRETER=interpreter, BLOCK_H=config.block_h_sum, BLOCK_K=triton.next_power_of_2(K),
            num_warps=4,
        )  # fmt: skip
    return grad_hidden, grad_topk, grad_gate, grad_up, grad_down
