"""P1's Triton kernels shared by its designs (``@triton.jit`` only; the hosts are in :mod:`.designs`): two launches.

Dataflow (T tokens, H hidden, I intermediate; s = the saved gate_sigmoid):

    launch 1, tiles of two kinds side by side  (d_intermediate_and_grad_down_kernel):
        dA    = dy · Wd                                  [T, I]   (reduce over H)
                epilogue: dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)),  dUp = dA ⊙ gate_silu
                -> stored in the input dtype; dA itself never leaves the chip
        dWd   = dyᵀ · intermediate                       [H, I]   (reduce over T)
    launch 2, tiles of three kinds side by side  (grad_x_and_grad_gate_up_kernel):
        dWg   = dGateᵀ · x ;  dWu = dUpᵀ · x             [I, H]   (reduce over T)
        dx    = dGate · Wg + dUp · Wu                    [T, H]   (reduce over 2I)

All products accumulate in fp32 on the tensor cores (bf16 operands for bf16 inputs; exact fp32
for fp32 inputs). Tiles of different kinds share a launch, so that the weight-gradient GEMMs (few
output tiles, long reductions over T) run beside the token-parallel ones; they are scheduled first, or
after the dx tiles (``GRAD_X_FIRST``: where launch 2 is a few waves of tiles, the longer dx tiles first).

Split-K: a tile kind can split its reduction over SPLIT programs (powers of two). Each parks its
fp32 partial in a workspace and counts itself in on a per-tile counter; the program that arrives
last adds the SPLIT partials in split order and runs the epilogue. The sum's order never depends
on arrival order, so results are deterministic. The counters only ever grow (by SPLIT per tile per
call), so they need no reset.

The same epilogue as a pass of its own (swiglu_grads_kernel, by [tokens, I] blocks) for the design on cuBLAS GEMMs
(designs/library_gemms.py): dA read from memory, [dGate | dUp] written side by side in each row.

The ``swiglu_expert`` layer's elementwise step (swiglu_activation_kernel), one pass over gate and up:

    σ = round(sigmoid(gate)),  silu = round(gate ⊙ σ),  intermediate = round(silu ⊙ up)

each computed in fp32 and rounded to the input dtype as the benchmark's forward rounds it (its forward
writes the intermediate; its backward also σ and silu, the saved tensors the two launches read).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from ..rounding import round_to


@triton.jit
def accumulate_product(
    acc,  # [BLOCK_M, BLOCK_N] fp32 accumulator, returned updated
    a_ptr, stride_am, stride_ak,  # A[m, k] = a_ptr[m * stride_am + k * stride_ak]
    a_lo_offset,  # with A_HAS_LO: A's low half A_lo[m, k] lies a_lo_offset elements after A[m, k]
    b_ptr, stride_bk, stride_bn,  # B[k, n] = b_ptr[k * stride_bk + n * stride_bn]
    M, N,  # rows of A, columns of B
    k_start, k_end,  # the slice of the reduction this call covers
    off_m, off_n,  # first row / column of this tile
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dot in fp32 (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot input_precision for fp32 operands
    A_HAS_LO: tl.constexpr,  # A is a 16-bit hi/lo pair, A ≈ A_hi + A_lo: both halves multiply each B tile
):
    """acc += A[off_m : off_m+BM, k_start:k_end] · B[k_start:k_end, off_n : off_n+BN], zero-padded at edges
    (with A_HAS_LO: acc += A_hi·B + A_lo·B, one B tile per step for both products)."""
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
        if A_HAS_LO:
            a_lo = tl.load(a_ptrs + a_lo_offset, mask=row_ok & k_ok[None, :], other=0.0)
            if UPCAST:
                a_lo = a_lo.to(tl.float32)
            acc = tl.dot(a_lo, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a · b on the tensor cores (fp32 operands under the interpreter, whose bf16 dot is wrong)."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def split_range(split, K, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """[k_start, k_end) of split number `split` of a reduction of length K (BLOCK_K-aligned pieces)."""
    per_split = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_start = split * per_split
    return k_start, tl.minimum(k_start + per_split, K)


@triton.jit
def combine_splits(
    acc,  # this program's fp32 partial [BLOCK_M, BLOCK_N]
    partials_ptr,  # fp32 workspace: [num_tiles, SPLIT, BLOCK_M, BLOCK_N] for this tile kind
    counters_ptr,  # int32 arrival counters, one per tile of this kind
    tile, split,  # which tile, which split of its reduction
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
):
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
def grouped_tile(tile, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """(tile_m, tile_n) of a linear tile index, GROUP_M row tiles at a time (L2 reuse of columns)."""
    tiles_per_group = GROUP_M * num_tiles_n
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % tiles_per_group) % group_rows
    tile_n = (tile % tiles_per_group) // group_rows
    return tile_m, tile_n


@triton.jit
def store_tile(ptr, values, off_m, off_n, M, N, stride_m,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """ptr[m, n] = values for the in-bounds part of the [BLOCK_M, BLOCK_N] tile (row-major, stride_m)."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ptrs = ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :]
    tl.store(ptrs, values.to(ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def store_halves(ptrs, lo_offset, values, mask, WITH_LO: tl.constexpr):
    """:func:`store_tile_halves` at pointers of any shape: fp32 ``values`` in the pointers' dtype, and with WITH_LO
    what that rounding lost ``lo_offset`` elements further on."""
    hi = values.to(ptrs.dtype.element_ty)
    tl.store(ptrs, hi, mask=mask)
    if WITH_LO:
        tl.store(ptrs + lo_offset, (values - hi.to(tl.float32)).to(hi.dtype), mask=mask)


@triton.jit
def store_tile_halves(ptr, lo_offset, values, off_m, off_n, M, N, stride_m,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WITH_LO: tl.constexpr):
    """Stores fp32 ``values`` in ptr's dtype; WITH_LO also stores what that rounding lost, lo = values − hi,
    ``lo_offset`` elements further on (hi + lo carries about twice the 16-bit dtype's precision)."""
    hi = values.to(ptr.dtype.element_ty)
    store_tile(ptr, hi, off_m, off_n, M, N, stride_m, BLOCK_M, BLOCK_N)
    if WITH_LO:
        store_tile(ptr + lo_offset, values - hi.to(tl.float32), off_m, off_n, M, N, stride_m, BLOCK_M, BLOCK_N)


@triton.jit
def load_block(ptr, off_m, off_n, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """ptr[m, n] in ptr's dtype for the [BLOCK_M, BLOCK_N] block at (off_m, off_n); 0 outside [M, N]."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ptrs = ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :]
    return tl.load(ptrs, mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)


@triton.jit
def load_tile(ptr, off_m, off_n, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """ptr[m, n] as fp32 for the [BLOCK_M, BLOCK_N] tile at (off_m, off_n); 0 outside [M, N]."""
    return load_block(ptr, off_m, off_n, M, N, stride_m, BLOCK_M, BLOCK_N).to(tl.float32)


@triton.jit
def token_reduction_program(
    program,  # index of this program among this kind's (tile, split) programs
    a_ptr,  # A [T, M], row-major
    a_lo_offset,  # with A_HAS_LO: where A's low half starts, in elements after A
    b_ptr,  # B [T, N], row-major
    out_ptr,  # out: Aᵀ · B [M, N]
    partials_ptr, counters_ptr,  # split-K workspace of this kind
    T, M, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, A_HAS_LO: tl.constexpr,
):
    """out[m, n] = Σ_t A[t, m] · B[t, n] for one tile (or one split of it): the weight gradients
    dWd = dyᵀ · intermediate, dWg = dGateᵀ · x and dWu = dUpᵀ · x."""
    tile, split = program // SPLIT, program % SPLIT
    tile_m, tile_n = grouped_tile(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    off_m, off_n = tile_m * BLOCK_M, tile_n * BLOCK_N
    k_start, k_end = split_range(split, T, SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = accumulate_product(acc, a_ptr, 1, M, a_lo_offset, b_ptr, N, 1, M, N, k_start, k_end, off_m, off_n,
                             BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION, A_HAS_LO)
    total, is_last = combine_splits(acc, partials_ptr, counters_ptr, tile, split, BLOCK_M, BLOCK_N, SPLIT)
    if is_last:
        store_tile(out_ptr, total, off_m, off_n, M, N, N, BLOCK_M, BLOCK_N)


@triton.jit
def swiglu_grads(d_a, gate, s, gate_silu, up):
    """(dGate, dUp) in fp32 from dA and the saved tiles: dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)), dA ⊙ gate_silu."""
    gate, s, gate_silu, up = gate.to(tl.float32), s.to(tl.float32), gate_silu.to(tl.float32), up.to(tl.float32)
    d_gate = d_a * s * (1.0 + gate * (1.0 - s)) * up
    return d_gate, d_a * gate_silu


@triton.jit
def store_swiglu_grads(d_a, gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_ptr, d_up_ptr, lo_offset,
                       off_t, off_i, T, I, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       WITH_LO: tl.constexpr):
    """The dA tile's epilogue: dUp = dA ⊙ gate_silu and dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)) from the saved
    tiles at (off_t, off_i), stored as [T, I] rows (with WITH_LO as hi/lo pairs, ``lo_offset`` elements apart)."""
    # one saved tensor at a time, so that few [BLOCK_M, BLOCK_N] tiles are live at once
    d_up = d_a * load_tile(gate_silu_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)
    store_tile_halves(d_up_ptr, lo_offset, d_up, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N, WITH_LO)
    s = load_tile(gate_sigmoid_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)
    d_gate = d_a * s * (1.0 + load_tile(gate_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N) * (1.0 - s))
    d_gate = d_gate * load_tile(up_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N)
    store_tile_halves(d_gate_ptr, lo_offset, d_gate, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N, WITH_LO)


@triton.jit
def d_a_tile(
    program,  # index of this program among the dA (tile, split) programs
    grad_output_ptr,  # dy [T, H]
    down_weight_ptr,  # Wd [H, I]
    partials_ptr, counters_ptr,  # split-K workspace of the dA tiles
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """(dA, is_last, off_t, off_i): the fp32 tile of dA = dy · Wd at (off_t, off_i) [BLOCK_M, BLOCK_N], complete in the
    program that gets is_last (with SPLIT > 1 the last of its splits to arrive, :func:`combine_splits`)."""
    tile, split = program // SPLIT, program % SPLIT
    tile_m, tile_n = grouped_tile(tile, tl.cdiv(T, BLOCK_M), tl.cdiv(I, BLOCK_N), GROUP_M)
    off_t, off_i = tile_m * BLOCK_M, tile_n * BLOCK_N
    k_start, k_end = split_range(split, H, SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = accumulate_product(acc, grad_output_ptr, H, 1, 0, down_weight_ptr, I, 1, T, I, k_start, k_end,
                             off_t, off_i, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION, False)
    d_a, is_last = combine_splits(acc, partials_ptr, counters_ptr, tile, split, BLOCK_M, BLOCK_N, SPLIT)
    return d_a, is_last, off_t, off_i


@triton.jit
def d_intermediate_program(
    program,  # index of this program among this kind's (tile, split) programs
    grad_output_ptr,  # dy [T, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr,  # saved forward, each [T, I]
    d_gate_ptr, d_up_ptr,  # out: dGate, dUp [T, I] (with WITH_LO: their hi halves; the lo halves follow)
    lo_offset,  # with WITH_LO: where the lo halves start, in elements after dGate, dUp (T·I)
    partials_ptr, counters_ptr,  # split-K workspace of this kind
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, WITH_LO: tl.constexpr,
):
    """dA = dy · Wd for one tile, then dUp = dA ⊙ gate_silu and dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s))."""
    d_a, is_last, off_t, off_i = d_a_tile(program, grad_output_ptr, down_weight_ptr, partials_ptr, counters_ptr,
                                          T, H, I, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, GROUP_M, UPCAST,
                                          PRECISION)
    if is_last:
        store_swiglu_grads(d_a, gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_ptr, d_up_ptr, lo_offset,
                           off_t, off_i, T, I, BLOCK_M, BLOCK_N, WITH_LO)


@triton.jit
def d_intermediate_and_grad_down_kernel(
    grad_output_ptr,  # dy [T, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, intermediate_ptr,  # saved forward, each [T, I]
    d_gate_ptr, d_up_ptr,  # out (workspace): dGate, dUp [T, I], each followed by its lo half with WITH_LO
    lo_offset,  # T·I: where the lo halves start, in elements after dGate, dUp
    grad_down_weight_ptr,  # out: dWd [H, I]
    da_partials_ptr, da_counters_ptr,  # split-K workspace of the dA tiles
    dwd_partials_ptr, dwd_counters_ptr,  # split-K workspace of the dWd tiles
    T, H, I,
    DA_M: tl.constexpr, DA_N: tl.constexpr, DA_K: tl.constexpr, DA_SPLIT: tl.constexpr,
    DWD_M: tl.constexpr, DWD_N: tl.constexpr, DWD_K: tl.constexpr, DWD_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    WITH_LO: tl.constexpr,  # store dGate, dUp as hi/lo pairs (the faithful path); else hi alone
):
    pid = tl.program_id(0)
    num_dwd_programs = tl.cdiv(H, DWD_M) * tl.cdiv(I, DWD_N) * DWD_SPLIT
    if pid < num_dwd_programs:  # the long reductions over T first
        token_reduction_program(pid, grad_output_ptr, 0, intermediate_ptr, grad_down_weight_ptr,
                                dwd_partials_ptr, dwd_counters_ptr, T, H, I,
                                DWD_M, DWD_N, DWD_K, DWD_SPLIT, GROUP_M, UPCAST, PRECISION, False)
    else:
        d_intermediate_program(pid - num_dwd_programs, grad_output_ptr, down_weight_ptr,
                               gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_ptr, d_up_ptr,
                               lo_offset, da_partials_ptr, da_counters_ptr, T, H, I,
                               DA_M, DA_N, DA_K, DA_SPLIT, GROUP_M, UPCAST, PRECISION, WITH_LO)


@triton.jit
def grad_x_program(
    program,  # index of this program among this kind's (tile, split) programs
    d_gate_ptr, d_up_ptr,  # dGate, dUp [T, I], rows stride_d elements apart
    stride_d,  # I where dGate, dUp are arrays of their own; 2I (4I with lo halves) in [dG | dU] rows
    lo_offset,  # with A_HAS_LO: where their lo halves start, in elements after dGate, dUp
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    grad_x_ptr,  # out: dx [T, H]
    partials_ptr, counters_ptr,  # split-K workspace of this kind
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, A_HAS_LO: tl.constexpr,
):
    """dx = dGate · Wg + dUp · Wu for one tile: a reduction over the 2I rows of [Wg; Wu] (or a split of it)."""
    tile, split = program // SPLIT, program % SPLIT
    tile_m, tile_n = grouped_tile(tile, tl.cdiv(T, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    off_t, off_h = tile_m * BLOCK_M, tile_n * BLOCK_N
    k_start, k_end = split_range(split, 2 * I, SPLIT, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the part of [k_start, k_end) below I runs over Wg, the part above over Wu
    acc = accumulate_product(acc, d_gate_ptr, stride_d, 1, lo_offset, gate_weight_ptr, H, 1, T, H,
                             k_start, tl.minimum(k_end, I), off_t, off_h,
                             BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION, A_HAS_LO)
    acc = accumulate_product(acc, d_up_ptr, stride_d, 1, lo_offset, up_weight_ptr, H, 1, T, H,
                             tl.maximum(k_start, I) - I, k_end - I, off_t, off_h,
                             BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, PRECISION, A_HAS_LO)
    total, is_last = combine_splits(acc, partials_ptr, counters_ptr, tile, split, BLOCK_M, BLOCK_N, SPLIT)
    if is_last:
        store_tile(grad_x_ptr, total, off_t, off_h, T, H, H, BLOCK_M, BLOCK_N)


@triton.jit
def grad_x_and_grad_gate_up_kernel(
    x_ptr,  # x [T, H]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    d_gate_ptr, d_up_ptr,  # dGate, dUp [T, I] from launch 1, each followed by its lo half with WITH_LO
    lo_offset,  # T·I: where the lo halves start, in elements after dGate, dUp
    grad_x_ptr,  # out: dx [T, H]
    grad_gate_weight_ptr, grad_up_weight_ptr,  # out: dWg, dWu [I, H]
    dx_partials_ptr, dx_counters_ptr,  # split-K workspace of the dx tiles
    dw_partials_ptr, dw_counters_ptr,  # split-K workspace of the dWg tiles, then the dWu tiles
    T, H, I,
    DX_M: tl.constexpr, DX_N: tl.constexpr, DX_K: tl.constexpr, DX_SPLIT: tl.constexpr,
    DW_M: tl.constexpr, DW_N: tl.constexpr, DW_K: tl.constexpr, DW_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    WITH_LO: tl.constexpr,  # dGate, dUp are hi/lo pairs (the faithful path): every product takes both halves
    GRAD_X_FIRST: tl.constexpr,  # the dx tiles take the first program ids (else the dWg, dWu tiles do)
):
    grad_x_and_grad_gate_up_program(tl.program_id(0), x_ptr, gate_weight_ptr, up_weight_ptr, d_gate_ptr, d_up_ptr,
                                    lo_offset, grad_x_ptr, grad_gate_weight_ptr, grad_up_weight_ptr, dx_partials_ptr,
                                    dx_counters_ptr, dw_partials_ptr, dw_counters_ptr, T, H, I,
                                    DX_M, DX_N, DX_K, DX_SPLIT, DW_M, DW_N, DW_K, DW_SPLIT, GROUP_M, UPCAST,
                                    PRECISION, WITH_LO, GRAD_X_FIRST)


@triton.jit
def grad_x_and_grad_gate_up_program(
    program,  # index of this program among launch 2's: the dWg tiles', the dWu tiles', the dx tiles' (or dx first)
    x_ptr, gate_weight_ptr, up_weight_ptr, d_gate_ptr, d_up_ptr, lo_offset, grad_x_ptr, grad_gate_weight_ptr,
    grad_up_weight_ptr, dx_partials_ptr, dx_counters_ptr, dw_partials_ptr, dw_counters_ptr,  # as the kernel's
    T, H, I,
    DX_M: tl.constexpr, DX_N: tl.constexpr, DX_K: tl.constexpr, DX_SPLIT: tl.constexpr,
    DW_M: tl.constexpr, DW_N: tl.constexpr, DW_K: tl.constexpr, DW_SPLIT: tl.constexpr,
    GROUP_M: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, WITH_LO: tl.constexpr,
    GRAD_X_FIRST: tl.constexpr,  # program ids [dx | dWg | dWu] instead of [dWg | dWu | dx]
):
    """One program of launch 2 (grad_x_and_grad_gate_up_kernel; the chained launch runs them too)."""
    num_dw_tiles = tl.cdiv(I, DW_M) * tl.cdiv(H, DW_N)  # per weight
    num_dw_programs = num_dw_tiles * DW_SPLIT
    up_partials_ptr = dw_partials_ptr + num_dw_tiles.to(tl.int64) * (DW_SPLIT * DW_M * DW_N)
    if GRAD_X_FIRST:  # ids [dx | dWg | dWu] -> [dWg | dWu | dx] (the branches below in this order keep the launch's
        # shared memory at its largest branch's; taken the other way round, the compiler gave each its own)
        num_dx_programs = tl.cdiv(T, DX_M) * tl.cdiv(H, DX_N) * DX_SPLIT
        program = program - num_dx_programs if program >= num_dx_programs else program + 2 * num_dw_programs
    if program < num_dw_programs:  # dWg = dGateᵀ · x (the long reductions over T first)
        token_reduction_program(program, d_gate_ptr, lo_offset, x_ptr, grad_gate_weight_ptr, dw_partials_ptr,
                                dw_counters_ptr, T, I, H, DW_M, DW_N, DW_K, DW_SPLIT, GROUP_M, UPCAST, PRECISION,
                                WITH_LO)
    elif program < 2 * num_dw_programs:  # dWu = dUpᵀ · x
        token_reduction_program(program - num_dw_programs, d_up_ptr, lo_offset, x_ptr, grad_up_weight_ptr,
                                up_partials_ptr, dw_counters_ptr + num_dw_tiles,
                                T, I, H, DW_M, DW_N, DW_K, DW_SPLIT, GROUP_M, UPCAST, PRECISION, WITH_LO)
    else:
        grad_x_program(program - 2 * num_dw_programs, d_gate_ptr, d_up_ptr, I, lo_offset, gate_weight_ptr,
                       up_weight_ptr, grad_x_ptr, dx_partials_ptr, dx_counters_ptr,
                       T, H, I, DX_M, DX_N, DX_K, DX_SPLIT, GROUP_M, UPCAST, PRECISION, WITH_LO)


@triton.jit
def swiglu_activation_kernel(
    gate_ptr,  # [N] gate = x·Wgᵀ, contiguous, input dtype
    up_ptr,  # [N] up = x·Wuᵀ, like gate
    gate_sigmoid_ptr,  # out [N] σ(gate), input dtype (written with WITH_SAVED)
    gate_silu_ptr,  # out [N] silu(gate) = gate ⊙ σ(gate), input dtype (written with WITH_SAVED)
    intermediate_ptr,  # out [N] silu(gate) ⊙ up, input dtype
    num_elements,  # N
    WITH_SAVED: tl.constexpr,  # also write σ and silu (the backward's saved tensors)
    INTERPRETER: tl.constexpr,  # CPU interpreter: numpy's exp, and bf16 rounded by hand (its cast truncates)
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    DTYPE: tl.constexpr = intermediate_ptr.dtype.element_ty
    if INTERPRETER:
        e = tl.exp(-gate)
    else:  # CUDA's expf and an IEEE division, as PyTorch's sigmoid (exp(−gate) = inf gives σ = 0)
        e = libdevice.exp(-gate)
    sigmoid = round_to(tl.math.div_rn(tl.zeros_like(gate) + 1.0, 1.0 + e), DTYPE, INTERPRETER)
    silu = round_to(gate * sigmoid.to(tl.float32), DTYPE, INTERPRETER)
    intermediate = round_to(silu.to(tl.float32) * up, DTYPE, INTERPRETER)
    if WITH_SAVED:
        tl.store(gate_sigmoid_ptr + offsets, sigmoid, mask=mask)
        tl.store(gate_silu_ptr + offsets, silu, mask=mask)
    tl.store(intermediate_ptr + offsets, intermediate, mask=mask)


@triton.jit
def store_swiglu_grads_rows(d_a, gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, d_gate_up_ptr, off_t, off_i, T, I,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WITH_LO: tl.constexpr):
    """dGate and dUp of the fp32 dA tile at (off_t, off_i) from the saved tiles, stored side by side in each row of
    ``d_gate_up_ptr``: [T, 2I] rows dGate | dUp; with WITH_LO [T, 4I] rows dGate_hi | dUp_hi | dGate_lo | dUp_lo.
    Every saved tile is loaded before anything is stored, so a program makes one round trip to memory (the
    compiler may not move a load above a store it cannot prove apart)."""
    d_gate, d_up = swiglu_grads(d_a, load_block(gate_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N),
                                load_block(gate_sigmoid_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N),
                                load_block(gate_silu_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N),
                                load_block(up_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N))
    row = 4 * I if WITH_LO else 2 * I
    store_tile_halves(d_gate_up_ptr, 2 * I, d_gate, off_t, off_i, T, I, row, BLOCK_M, BLOCK_N, WITH_LO)
    store_tile_halves(d_gate_up_ptr + I, 2 * I, d_up, off_t, off_i, T, I, row, BLOCK_M, BLOCK_N, WITH_LO)


@triton.jit
def swiglu_grads_kernel(
    d_a_ptr,  # dA = dy · Wd [T, I], fp32 or the input dtype
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr,  # saved forward, each [T, I]
    d_gate_up_ptr,  # out: [T, 2I] rows dGate | dUp; with WITH_LO [T, 4I] rows dGate_hi | dUp_hi | dGate_lo | dUp_lo
    T, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WITH_LO: tl.constexpr,  # store hi/lo pairs (the faithful path); else hi alone
):
    """The dA tile's epilogue as a pass of its own (library_gemms.py: dA comes from cuBLAS): dGate and dUp
    side by side in each row, the layout that lets dx and [dWg; dWu] each be one GEMM."""
    off_t = tl.program_id(0) * BLOCK_M
    off_i = tl.program_id(1) * BLOCK_N
    store_swiglu_grads_rows(load_tile(d_a_ptr, off_t, off_i, T, I, I, BLOCK_M, BLOCK_N), gate_ptr, gate_sigmoid_ptr,
                            gate_silu_ptr, up_ptr, d_gate_up_ptr, off_t, off_i, T, I, BLOCK_M, BLOCK_N,
                            WITH_LO)


@triton.jit
def wait_for(counter_ptr, target):
    """Returns once the int64 counter has reached ``target`` (acquire: what was stored before the
    arrivals it counts is visible to every thread of this program afterwards)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
