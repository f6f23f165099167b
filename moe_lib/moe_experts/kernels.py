"""P2's Triton kernels (``@triton.jit`` only; the host side is :mod:`.launch` and :mod:`.designs`), the forward
recomputed inside.

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
       dg, du, aw to [T·K, I] workspaces (rows in sorted order; with kernel W's bf16×3 products also
       their lo halves) and ⟨dAp, a⟩ restricted to the I-tile to a [n_I_tiles, T·K] workspace.
    2. kernel W, programs (expert e, I-tile, H-tile): dWg_e, dWu_e and dWd_e on that tile, each
       reduced over all the expert's rows, written once (exact zeros for an expert with no rows).
    3. kernel D, programs (expert e, H-tile, row split r): dX_slotᵀ = Wg_e[:, H-tile]ᵀ·dgᵀ +
       Wu_e[:, H-tile]ᵀ·duᵀ over I for the row blocks r, r + R, …, to a [T·K, H] fp32 workspace
       indexed by slot.
    4. kernel C, programs (token t, H-tile): grad_hidden_states[t] = Σ_k dX_slot[t·K + k] and
       grad_topk_weights[t, k] = Σ_tiles partial[tile, t·K + k], both summed in a fixed order.

Grids depend on E, T·K, H, I and the tile sizes only. Programs that share an expert's weight tile
(the R row splits) or its gathered rows (its tiles) are adjacent in launch order, so they find them
in L2: each expert's weights are read from DRAM about once per kernel. Wg and Wu are read twice in
all (kernel A, then kernel D): dg needs the whole reduction over H before dX can use Wg again, and
the slice of Wg a program sweeps meanwhile does not fit on chip. That second read is this design's
known cost above the floor (fp32: 17.2 GB on top of 51.5 GB at the benchmark's shape).

Precision. fp32 interface: g, u and dAp as bf16×3 products (v = hi + lo with hi = bf16(v),
lo = bf16(v − hi); a·b ≈ hi·hi + hi·lo + lo·hi, fp32 accumulators), which grad_topk_weights needs
to pass the benchmark's element rule; dX uses plain bf16 products (dg, du and the weights rounded to
bf16) with fp32 accumulation. The weight gradients take plain bf16 products (x, dy, dg, du, aw
rounded) where the chooser predicts them within the element rule with a margin, and bf16×3 products
where it does not (many rows per expert: :mod:`.precision_rule`): kernel A then stores the lo halves
of dg, du and aw too (``STORE_LO``) and kernel W multiplies hi and lo halves (``SPLIT``). 16-bit
interfaces (bf16, fp16): plain products in the input dtype with fp32 accumulation everywhere.
``SPLIT_PRECISION`` selects kernel A's split. Under ``TRITON_INTERPRET=1`` (CPU) the interpreter's bf16
dot is wrong and its fp32→bf16 cast truncates, so ``INTERPRETER`` makes the kernels round to bf16
by hand and multiply the (already rounded) operands in fp32: the same numbers the GPU multiplies.
"""

import triton
import triton.language as tl

from ..rounding import round_to

# --------------------------------------------------------------------------------------------------
# helpers


@triton.jit
def dot16(a, b, acc, INTERPRETER: tl.constexpr):
    """acc + a·b for 16-bit operands on the tensor cores (in the interpreter: upcast, exact fp32)."""
    if INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def operand(v, OPERAND_DTYPE: tl.constexpr, INTERPRETER: tl.constexpr):
    """v as a tensor-core operand: 16-bit inputs as they are, fp32 rounded to OPERAND_DTYPE."""
    if v.dtype == OPERAND_DTYPE:
        return v
    return round_to(v.to(tl.float32), OPERAND_DTYPE, INTERPRETER)


@triton.jit
def split_operand(v, OPERAND_DTYPE: tl.constexpr, SPLIT_PRECISION: tl.constexpr, INTERPRETER: tl.constexpr):
    """(hi, lo) with v ≈ hi + lo, both in OPERAND_DTYPE; lo = hi (unused) without SPLIT_PRECISION."""
    hi = operand(v, OPERAND_DTYPE, INTERPRETER)
    if SPLIT_PRECISION:
        lo = round_to(v.to(tl.float32) - hi.to(tl.float32), OPERAND_DTYPE, INTERPRETER)
    else:
        lo = hi
    return hi, lo


@triton.jit
def store_halves(hi_ptr, lo_ptr, offsets, v, mask, OPERAND_DTYPE: tl.constexpr, STORE_LO: tl.constexpr,
                 INTERPRETER: tl.constexpr):
    """Stores hi = v rounded to OPERAND_DTYPE at hi_ptr and, with STORE_LO, lo = the rounded rest v − hi at lo_ptr."""
    hi = round_to(v, OPERAND_DTYPE, INTERPRETER)
    tl.store(hi_ptr + offsets, hi, mask=mask)
    if STORE_LO:
        tl.store(lo_ptr + offsets, round_to(v - hi.to(tl.float32), OPERAND_DTYPE, INTERPRETER), mask=mask)


@triton.jit
def expert_tile(pid, num_tiles, ROW_SPLIT):
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
def swiglu_grad_kernel(
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
    dgate_lo_ptr,  # out [T·K, I] dg − dg's hi, rounded, like dgate (STORE_LO), else unused
    dup_lo_ptr,  # out [T·K, I] du's lo half (STORE_LO), else unused
    scaled_act_lo_ptr,  # out [T·K, I] aw's lo half (STORE_LO), else unused
    topk_partial_ptr,  # out [n_I_tiles, T·K] fp32: ⟨dAp, a⟩ over one I-tile, column = slot
    gate_pre_ptr,  # [T·K, I] g = Wg_e x, row = sorted position, input dtype: written (PREACT 1) or read (2)
    up_pre_ptr,  # [T·K, I] u = Wu_e x, likewise
    preact_row_stride,  # elements between g's (and u's) rows: I, or 2I where g and u are the halves of one buffer
    num_slots,  # T·K
    top_k,  # K
    hidden_size,  # H
    inter_size,  # I
    num_i_tiles,  # cdiv(I, BLOCK_I)
    ROW_SPLIT,  # R
    OPERAND_DTYPE: tl.constexpr,  # dtype of the tensor-core operands (bf16 or fp16)
    SPLIT_PRECISION: tl.constexpr,  # bf16×3 products for g, u and dAp (fp32 interface)
    FORWARD_ONLY: tl.constexpr,  # the layer's forward: only aw = w·a is computed and stored (dy unused)
    PREACT: tl.constexpr,  # g and u: 0 computed; 1 computed and stored (a forward that saves them); 2 read back
    STORE_LO: tl.constexpr,  # also the lo halves of dg, du and aw (kernel W's bf16×3 products)
    INTERPRETER: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
):
    expert, i_tile, r = expert_tile(tl.program_id(0), num_i_tiles, ROW_SPLIT)
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
            # [BLOCK_I, BLOCK_H] tiles of Wg, Wu (Wg[e][i, h] at i·H + h) and of Wdᵀ (Wd[e][h, i] at h·I + i);
            # g and u only where they are not read back (PREACT 2), dAp only in the backward
            if PREACT != 2:
                wg = tl.load(gate_w + cols[:, None] * hidden_size + hs[None, :], mask=weight_mask, other=0.0)
                wu = tl.load(up_w + cols[:, None] * hidden_size + hs[None, :], mask=weight_mask, other=0.0)
            if not FORWARD_ONLY:
                wd_t = tl.load(down_w + hs[None, :] * inter_size + cols[:, None], mask=weight_mask, other=0.0)
            # [BLOCK_H, BLOCK_M] tiles of xᵀ and dyᵀ, gathered by token
            token_offsets = tokens[None, :] * hidden_size + hs[:, None]
            token_mask = h_ok[:, None] & row_ok[None, :]
            if PREACT != 2:
                x_hi = tl.load(x_hi_ptr + token_offsets, mask=token_mask, other=0.0)
            if not FORWARD_ONLY:
                dy_hi = tl.load(dy_hi_ptr + token_offsets, mask=token_mask, other=0.0)

            if PREACT != 2:
                wg_hi, wg_lo = split_operand(wg, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
                wu_hi, wu_lo = split_operand(wu, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            if not FORWARD_ONLY:
                wd_hi, wd_lo = split_operand(wd_t, OPERAND_DTYPE, SPLIT_PRECISION, INTERPRETER)
            if SPLIT_PRECISION:  # the two small cross terms first
                if PREACT != 2:
                    x_lo = tl.load(x_lo_ptr + token_offsets, mask=token_mask, other=0.0)
                if not FORWARD_ONLY:
                    dy_lo = tl.load(dy_lo_ptr + token_offsets, mask=token_mask, other=0.0)
                if PREACT != 2:
                    g = dot16(wg_lo, x_hi, g, INTERPRETER)
                    g = dot16(wg_hi, x_lo, g, INTERPRETER)
                    u = dot16(wu_lo, x_hi, u, INTERPRETER)
                    u = dot16(wu_hi, x_lo, u, INTERPRETER)
                if not FORWARD_ONLY:
                    dap = dot16(wd_lo, dy_hi, dap, INTERPRETER)
                    dap = dot16(wd_hi, dy_lo, dap, INTERPRETER)
            if PREACT != 2:
                g = dot16(wg_hi, x_hi, g, INTERPRETER)
                u = dot16(wu_hi, x_hi, u, INTERPRETER)
            if not FORWARD_ONLY:
                dap = dot16(wd_hi, dy_hi, dap, INTERPRETER)

        out_offsets = rows[None, :].to(tl.int64) * inter_size + cols[:, None]
        out_mask = col_ok[:, None] & row_ok[None, :]
        pre_offsets = rows[None, :].to(tl.int64) * preact_row_stride + cols[:, None]
        if PREACT == 1:  # a forward that saves g and u for its backward
            tl.store(gate_pre_ptr + pre_offsets, round_to(g, gate_pre_ptr.dtype.element_ty, INTERPRETER), mask=out_mask)
            tl.store(up_pre_ptr + pre_offsets, round_to(u, up_pre_ptr.dtype.element_ty, INTERPRETER), mask=out_mask)
        if PREACT == 2:  # the backward of such a forward: g and u read back instead of recomputed
            g = tl.load(gate_pre_ptr + pre_offsets, mask=out_mask, other=0.0).to(tl.float32)
            u = tl.load(up_pre_ptr + pre_offsets, mask=out_mask, other=0.0).to(tl.float32)
        # epilogue: padded rows and columns hold g = u = dAp = 0, so they add nothing to the sums over I
        w = tl.load(topk_weights_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        act = silu * u
        if not FORWARD_ONLY:
            tl.store(topk_partial_ptr + i_tile * num_slots + slots, tl.sum(dap * act, axis=0), mask=row_ok)
            da = w[None, :] * dap
            dg = da * u * sig * (1.0 + g * (1.0 - sig))
            store_halves(dgate_ptr, dgate_lo_ptr, out_offsets, dg, out_mask, OPERAND_DTYPE, STORE_LO, INTERPRETER)
            du = da * silu
            store_halves(dup_ptr, dup_lo_ptr, out_offsets, du, out_mask, OPERAND_DTYPE, STORE_LO, INTERPRETER)
        store_halves(scaled_act_ptr, scaled_act_lo_ptr, out_offsets, w[None, :] * act, out_mask, OPERAND_DTYPE,
                     STORE_LO, INTERPRETER)


# --------------------------------------------------------------------------------------------------
# kernel W: a weight gradient per expert, each tile reduced over all of the expert's rows


@triton.jit
def split_product(a_ptr, a_lo_ptr, a_t_offsets, a_t_mask, b, b_lo, acc, SPLIT: tl.constexpr,
                  INTERPRETER: tl.constexpr):
    """acc + aᵀ·b for the [BLOCK_M, BLOCK_ROWS] tile aᵀ at a_t_offsets; with SPLIT as bf16×3, the two small cross
    terms a_loᵀ·b_hi and a_hiᵀ·b_lo first."""
    a = tl.load(a_ptr + a_t_offsets, mask=a_t_mask, other=0.0)
    if SPLIT:
        acc = dot16(tl.load(a_lo_ptr + a_t_offsets, mask=a_t_mask, other=0.0), b, acc, INTERPRETER)
        acc = dot16(a, b_lo, acc, INTERPRETER)
    return dot16(a, b, acc, INTERPRETER)


@triton.jit
def expert_weight_grad_kernel(
    a_ptr,  # rows of A, [*, size_m]: row = token (A_BY_TOKEN) or sorted position
    a2_ptr,  # rows of a second A of the same shape (TWO_OUTPUTS), else unused
    b_ptr,  # rows of B, [*, size_n]: row = token (B_BY_TOKEN) or sorted position
    a_lo_ptr,  # A's lo half, laid out like A (SPLIT), else unused
    a2_lo_ptr,  # A2's lo half (SPLIT and TWO_OUTPUTS), else unused
    b_lo_ptr,  # B's lo half, laid out like B (SPLIT), else unused
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
    A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr, TWO_OUTPUTS: tl.constexpr,
    SPLIT: tl.constexpr,  # bf16×3 products: a_loᵀ b_hi + a_hiᵀ b_lo + a_hiᵀ b_hi
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
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
        b_offsets = b_rows[:, None] * size_n + ns[None, :]
        b_mask = row_ok[:, None] & n_ok[None, :]
        b = tl.load(b_ptr + b_offsets, mask=b_mask, other=0.0)
        if SPLIT:
            b_lo = tl.load(b_lo_ptr + b_offsets, mask=b_mask, other=0.0)
        else:
            b_lo = b  # unused
        acc = split_product(a_ptr, a_lo_ptr, a_t_offsets, a_t_mask, b, b_lo, acc, SPLIT, INTERPRETER)
        if TWO_OUTPUTS:
            acc2 = split_product(a2_ptr, a2_lo_ptr, a_t_offsets, a_t_mask, b, b_lo, acc2, SPLIT, INTERPRETER)
        if block == num_row_blocks - 1:  # the tile is complete: write it once
            out_offsets = out_offset + ms[:, None] * size_n + ns[None, :]
            out_mask = m_ok[:, None] & n_ok[None, :]
            tl.store(out_ptr + out_offsets, round_to(acc, out_dtype, INTERPRETER), mask=out_mask)
            if TWO_OUTPUTS:
                tl.store(out2_ptr + out_offsets, round_to(acc2, out_dtype, INTERPRETER), mask=out_mask)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)


# --------------------------------------------------------------------------------------------------
# kernel D: per-slot projections back to H (transposed tiles): dX contributions, and the forward's y


@triton.jit
def slot_projection_kernel(
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
    TWO_TERMS: tl.constexpr,
    OPERAND_DTYPE: tl.constexpr,  # dtype of the tensor-core operands (bf16 or fp16)
    INTERPRETER: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
):
    # Backward: W1 = Wgᵀ (Wg[e][i, h] at i·H + h), v1 = dg, W2 = Wuᵀ, v2 = du: dX_slot.
    # Forward: W1 = Wd (Wd[e][h, i] at h·I + i), v1 = aw: y_slot.
    expert, h_tile, r = expert_tile(tl.program_id(0), num_h_tiles, ROW_SPLIT)
    row_begin = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
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
            acc = dot16(operand(w1_tile, OPERAND_DTYPE, INTERPRETER), v1_t, acc, INTERPRETER)
            if TWO_TERMS:
                acc = dot16(operand(w2_tile, OPERAND_DTYPE, INTERPRETER), v2_t, acc, INTERPRETER)
        tl.store(out_slot_ptr + slots[None, :].to(tl.int64) * hidden_size + hs[:, None], acc,
                 mask=h_ok[:, None] & row_ok[None, :])


# --------------------------------------------------------------------------------------------------
# kernel C: per-token sums in a fixed order


@triton.jit
def token_sum_kernel(
    dx_slot_ptr,  # [T·K, H] fp32 per-slot dX contributions, row = slot id
    topk_partial_ptr,  # [n_I_tiles, T·K] fp32 per-I-tile parts of grad_topk_weights
    topk_indices_ptr,  # [T·K] int32/int64 expert of each slot: slots outside [0, E) were never routed
    grad_hidden_ptr,  # out [T, H] grad_hidden_states, output dtype
    grad_topk_ptr,  # out [T·K] grad_topk_weights, topk_weights' dtype
    num_slots,  # T·K
    top_k,  # K
    num_experts,  # E
    hidden_size,  # H
    num_i_tiles,  # cdiv(I, BLOCK_I) of kernel A
    WITH_TOPK: tl.constexpr,  # also sum grad_topk_weights (the backward; not the forward)
    INTERPRETER: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h_tile = tl.program_id(1)
    hs = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < hidden_size
    # a slot whose expert index lies outside [0, E) (possible with validate=False) belongs to no expert:
    # kernels A and D never wrote its rows, and it contributes nothing, as in the reference
    total = tl.zeros((BLOCK_H,), tl.float32)
    for k in range(0, top_k):
        expert = tl.load(topk_indices_ptr + token * top_k + k)
        routed = (expert >= 0) & (expert < num_experts)
        total += tl.load(dx_slot_ptr + (token * top_k + k) * hidden_size + hs, mask=h_ok & routed, other=0.0)
    tl.store(grad_hidden_ptr + token * hidden_size + hs, round_to(total, grad_hidden_ptr.dtype.element_ty, INTERPRETER),
             mask=h_ok)

    if WITH_TOPK and h_tile == 0:
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < top_k
        experts = tl.load(topk_indices_ptr + token * top_k + ks, mask=k_ok, other=-1)
        routed = k_ok & (experts >= 0) & (experts < num_experts)
        grad_w = tl.zeros((BLOCK_K,), tl.float32)
        for tile in range(0, num_i_tiles):
            grad_w += tl.load(topk_partial_ptr + tile * num_slots + token * top_k + ks, mask=routed, other=0.0)
        tl.store(grad_topk_ptr + token * top_k + ks, round_to(grad_w, grad_topk_ptr.dtype.element_ty, INTERPRETER),
                 mask=k_ok)
