"""Kernel D as a persistent grouped GEMM whose operands arrive by TMA: per-slot projections back to H.

Expert e owns the sorted positions o_e ≤ p < o_e + n_e (``expert_offsets``); slot(p) = sorted_slot[p].
Per position p, with [T·K, I] row workspaces of kernel A (row p = the p-th sorted slot):

    backward:  dX_slot[slot(p)] = Wg_eᵀ dg[p] + Wu_eᵀ du[p]      Wg, Wu [E, I, H]   (two terms)
    forward:   y_slot[slot(p)]  = Wd_e aw[p]                      Wd [E, H, I]       (one term)

both [H] per slot, written to a [T·K, H] fp32 workspace indexed by slot (kernel C sums a token's K
slots). For a row block B of expert e and an H-tile h (transposed tiles, as today's kernel D):

    outᵀ[h, B] = Σ_i W1_e[h, i] v1[B, i]ᵀ (+ W2_e[h, i] v2[B, i]ᵀ)

with W_e[h, i] = Wg_e[i, h] (backward: the weight tile read as [BLOCK_I, BLOCK_H] rows of H and used
transposed from shared memory) or Wd_e[h, i] (forward: a [BLOCK_H, BLOCK_I] tile as stored), and the
expert's rows v[B, i] (dg, du or aw) read as a [BLOCK_ROWS, BLOCK_I] block of contiguous rows and used
transposed. The weight tile is the M side (64 rows per warp group), the expert's rows the N side, so a
row block can be as narrow as the expert is busy (wgmma's N goes down to 8).

Tiles and order. A tile is (expert, H-tile, row block); expert e has n_H · ⌈n_e / BLOCK_ROWS⌉ of them
(none for an expert without rows). A tiny
prologue kernel (:func:`tile_offsets_kernel`, one program) writes the exclusive prefix of the tile
counts, ``tile_offsets`` [E + 1], on the device: the tiles are numbered expert-major (expert e's are
tile_offsets[e] ≤ t < tile_offsets[e + 1]; within an expert row blocks inner, so neighbouring tiles
share the weight slab W_e[:, H-tile], or H-tiles inner with ``row_blocks_inner=False``). The persistent
launch (``NUM_PROGRAMS`` programs, the number of SMs) deals them round-robin: program r takes tiles r,
r + P, r + 2P, … So at any moment the programs work on P consecutive tiles — a few experts at 64 rows per
expert, a part of one at 1024 — and share the experts' weight tiles and rows through L2: each expert's
weights are read from DRAM about once.

Loop. Per program, a loop over its tiles — the tile's expert found by a binary search over
``tile_offsets`` (⌈log₂ E⌉ scalar loads that hit L1), the accumulator zeroed, a loop over the reduction
steps, the store — whose two levels Triton fuses into one (``tl.range(flatten=True)``: the inner trip
count is the same for every tile). The software pipeline (``num_stages`` reduction steps of TMA blocks in
flight) then runs on from one tile to the next and from one expert to the next, and wgmma stays
asynchronous across steps (one group in flight); the store waits for the tile's last products only. No
descriptor is rebuilt and no pipeline restarts inside the loop (the costs of per-expert visits in
:mod:`.tma_weight_grad`). ``flatten=False`` keeps the two loops (the pipeline refills at each tile); the
fp32 weights take that form, since ptxas serialises the wgmma of the fused form when its A operand
comes from registers (``scripts/p2/p2_tma_d_compile_check.py`` reports it).

Descriptors are made once per program, on the device, over whole tensors: the weights as
[terms, E, I, H] (or [terms, E, H, I]) with a [1, 1, BLOCK_I, BLOCK_H] box, so TMA zero-fills past I and
H inside an expert; the rows as [terms, T·K, I]. A row block reaching past the expert's n_e rows reads the
next expert's rows (or zeros past T·K): those only feed output columns of the product that belong to
no row of the expert, and the store masks them out (a column of W·vᵀ depends on its own row of v only),
so nothing leaks, whatever those rows hold.

Two terms (the backward). Wg and Wu (and dg and du) are separate tensors of one shape and dtype, so the
second lies a fixed number of elements from the first: one descriptor with a leading term axis of
stride that distance (taken from the lower address up, as TMA strides are unsigned) covers both, and
the reduction becomes 2 · ⌈I / BLOCK_I⌉ steps of one product each, Wg·dg and Wu·du of an I-block in turn
(as today's kernel D sums them). One product per step is what keeps wgmma asynchronous: with two
products into one accumulator per step ptxas serialises every wgmma. Where the distance is no valid TMA
stride (not a multiple of 16 bytes, or 2⁴⁰ bytes or more), or with ``concat_terms=False``, the paired
form runs instead: a descriptor per term, both products in every step, half the stages, nested loops
(flattened, ptxas serialises its wgmma; nested, it does not).

Epilogue: a tile's [BLOCK_H, BLOCK_ROWS] result goes to rows slot(p) of the fp32 workspace by plain masked
stores (each slot row a contiguous run of BLOCK_H fp32: whole 32-byte sectors). Kept scattered on
purpose: writing in sorted order instead would need per-expert TMA-store descriptors (a block past n_e
would overwrite the next expert's rows) and kernel C would then gather the same rows through the inverse
permutation: the same scattered traffic moved, nothing saved. Kernel C is unchanged.

Precision: 16-bit interfaces multiply in their dtype (weights, rows and tensor-core operands all
bf16 or all fp16), fp32 interface: the rows are bf16 (kernel A's workspaces) and the fp32 weights are
rounded to bf16 in registers (:func:`~.kernels.operand`, as today's kernel D); fp32 accumulation
throughout. fp32 weights by TMA arrive as fp32 (TMA copies the stored dtype): twice the shared memory
per block, and the rounding happens after a shared → register load (wgmma then takes A from registers).
``weight_tma=False`` reads fp32 weights with pointer loads instead (as today, pipelined by cp.async);
the rows still come by TMA. 16-bit weights always come by TMA.

Deterministic (every output element is written by exactly one program, one fixed-order reduction),
no atomics, no host synchronisation (the launcher reads shapes and addresses; the tile count is read on
the device), so the launches can be captured in a CUDA graph. Under ``TRITON_INTERPRET=1`` the dots are upcast to
fp32 (:func:`~.kernels.dot16`) and the tiles are 16 wide.

TMA constraints: 16-byte aligned bases and row strides that are multiples of 16 bytes: I · 2 bytes for the
rows, the weights' inner width (H backward, I forward) times their element size
(:func:`tma_slot_projection_fits`); the design (:mod:`.designs.d_tma`) declares them, so that the chooser
(:mod:`.choose`, which also picks the tiles) falls back to the pointer-based kernel D elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..tma import install_tma_allocator
from .kernels import dot16, operand

# --------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def tile_offsets_kernel(
    expert_offsets_ptr,  # [E + 1] int32: first sorted position of each expert, then T·K
    tile_offsets_ptr,  # out [E + 1] int32: first tile number of each expert, then the number of tiles
    num_experts,  # E
    num_h_tiles,  # cdiv(H, BLOCK_H): tiles per row block
    BLOCK_ROWS: tl.constexpr,  # rows per row block of the main kernel
    BLOCK_E: tl.constexpr,  # experts per chunk of the prefix sum
):
    # One program: tile_offsets[e] = Σ_{e' < e} n_H · ⌈n_e' / BLOCK_ROWS⌉.
    tl.store(tile_offsets_ptr, 0)
    total = 0
    for e0 in range(0, num_experts, BLOCK_E):
        es = e0 + tl.arange(0, BLOCK_E)
        ok = es < num_experts
        begin = tl.load(expert_offsets_ptr + es, mask=ok, other=0)
        end = tl.load(expert_offsets_ptr + es + 1, mask=ok, other=0)
        rows = end - begin
        tiles = (rows + BLOCK_ROWS - 1) // BLOCK_ROWS * num_h_tiles
        tl.store(tile_offsets_ptr + es + 1, total + tl.cumsum(tiles, 0), mask=ok)
        total += tl.sum(tiles, 0)


@triton.jit
def slot_projection_tma_kernel(
    weights_ptr,  # [E, I, H] (TRANSPOSED_WEIGHTS: Wg, Wu) or [E, H, I] (Wd) weights, 16-bit or fp32 (fp32 interface):
    #   W1 (term 0) or, with weights_flip, W2 (term 1): the one at the lower address under CONCAT_TERMS
    weights_term_stride,  # elements from weights_ptr to the other term's weights (≥ 0 under CONCAT_TERMS); TWO_TERMS
    weights_flip,  # 1 where weights_ptr holds term 1's weights (CONCAT_TERMS), else 0
    rows_ptr,  # [num_rows, I] rows v1 (dg or aw; term 0) or, with rows_flip, v2 (du; term 1), OPERAND_DTYPE, row p =
    #   p-th sorted slot
    rows_term_stride,  # elements from rows_ptr to the other term's rows (≥ 0 under CONCAT_TERMS); TWO_TERMS only
    rows_flip,  # 1 where rows_ptr holds term 1's rows (CONCAT_TERMS), else 0
    out_slot_ptr,  # out [T·K, H] fp32: W1_e v1 (+ W2_e v2) per slot, row = slot id
    sorted_slot_ptr,  # [T·K] int32: slot ids in expert order
    expert_offsets_ptr,  # [E + 1] int32: first sorted position of each expert, then T·K
    tile_offsets_ptr,  # [E + 1] int32: first tile number of each expert, then the tile count (tile_offsets_kernel)
    num_experts,  # E
    num_rows,  # rows of the row workspaces (≥ T·K; TMA zero-fills past them)
    hidden_size,  # H
    inter_size,  # I
    TWO_TERMS: tl.constexpr,  # also W2_e v2 (the backward), into the same accumulator
    CONCAT_TERMS: tl.constexpr,  # TWO_TERMS through one descriptor with a leading term axis: one product per step
    TRANSPOSED_WEIGHTS: tl.constexpr,  # weights [E, I, H], used transposed (backward); else [E, H, I] (forward)
    WEIGHT_TMA: tl.constexpr,  # weights by TMA; else pointer loads (an option for fp32 weights)
    OPERAND_DTYPE: tl.constexpr,  # dtype of the tensor-core operands (bf16 or fp16): fp32 weights are rounded to it
    NUM_PROGRAMS: tl.constexpr,  # P, programs of the launch: program r takes tiles r, r + P, …
    SEARCH_STEPS: tl.constexpr,  # ⌈log₂ E⌉: halvings of the binary search for a tile's expert
    ROW_BLOCKS_INNER: tl.constexpr,  # within an expert, tile = H-tile · n_blocks + block (else block · n_H + H-tile)
    FLATTEN: tl.constexpr,  # fuse the tile and step loops into one software pipeline (tl.range(flatten=True))
    INTERPRETER: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_I: tl.constexpr,
):
    pid = tl.program_id(0)
    num_h_tiles = tl.cdiv(hidden_size, BLOCK_H)
    num_i_steps = tl.cdiv(inter_size, BLOCK_I)
    total_tiles = tl.load(tile_offsets_ptr + num_experts)
    my_tiles = tl.cdiv(tl.maximum(total_tiles - pid, 0), NUM_PROGRAMS)
    # Descriptors over whole tensors, made once, with a leading term axis: term t's tensor starts t · term_stride
    # elements after term 0's (with CONCAT_TERMS both terms are one reduction of 2 · n_I steps, term = step % 2;
    # otherwise the term axis has one entry and term 1, if any, gets its own descriptor at its own base)
    NUM_TERMS: tl.constexpr = 2 if CONCAT_TERMS else 1
    expert_stride = inter_size * hidden_size
    # the term axis's stride; with one entry it is never stepped over: any valid TMA stride (a multiple of 16 B)
    rows_axis_stride = rows_term_stride if CONCAT_TERMS else inter_size
    weights_axis_stride = weights_term_stride if CONCAT_TERMS else expert_stride
    rows_desc = tl.make_tensor_descriptor(rows_ptr, shape=[NUM_TERMS, num_rows, inter_size],
                                          strides=[rows_axis_stride, inter_size, 1],
                                          block_shape=[1, BLOCK_ROWS, BLOCK_I])
    rows2_desc = rows_desc  # term 1's when it is not on the term axis
    if TWO_TERMS and not CONCAT_TERMS:
        rows2_desc = tl.make_tensor_descriptor(rows_ptr + rows_term_stride, shape=[1, num_rows, inter_size],
                                               strides=[rows_axis_stride, inter_size, 1],
                                               block_shape=[1, BLOCK_ROWS, BLOCK_I])
    if WEIGHT_TMA:
        if TRANSPOSED_WEIGHTS:  # [E, I, H]: a [BLOCK_I, BLOCK_H] box per (term, expert), zero-filled past I and H
            w_desc = tl.make_tensor_descriptor(weights_ptr, shape=[NUM_TERMS, num_experts, inter_size, hidden_size],
                                               strides=[weights_axis_stride, expert_stride, hidden_size, 1],
                                               block_shape=[1, 1, BLOCK_I, BLOCK_H])
            w2_desc = w_desc  # term 1's when it is not on the term axis
            if TWO_TERMS and not CONCAT_TERMS:
                w2_desc = tl.make_tensor_descriptor(weights_ptr + weights_term_stride,
                                                    shape=[1, num_experts, inter_size, hidden_size],
                                                    strides=[weights_axis_stride, expert_stride, hidden_size, 1],
                                                    block_shape=[1, 1, BLOCK_I, BLOCK_H])
        else:  # [E, H, I]: a [BLOCK_H, BLOCK_I] box
            w_desc = tl.make_tensor_descriptor(weights_ptr, shape=[NUM_TERMS, num_experts, hidden_size, inter_size],
                                               strides=[weights_axis_stride, expert_stride, inter_size, 1],
                                               block_shape=[1, 1, BLOCK_H, BLOCK_I])
            w2_desc = w_desc
            if TWO_TERMS and not CONCAT_TERMS:
                w2_desc = tl.make_tensor_descriptor(weights_ptr + weights_term_stride,
                                                    shape=[1, num_experts, hidden_size, inter_size],
                                                    strides=[weights_axis_stride, expert_stride, inter_size, 1],
                                                    block_shape=[1, 1, BLOCK_H, BLOCK_I])
    # pointer loads: element (h, i) of expert e's W at e·I·H + h·stride_h + i·stride_i
    stride_h = 1 if TRANSPOSED_WEIGHTS else inter_size
    stride_i = hidden_size if TRANSPOSED_WEIGHTS else 1
    num_steps = num_i_steps * NUM_TERMS  # reduction steps per tile

    for k in tl.range(0, my_tiles, flatten=FLATTEN):
        tile = pid + k * NUM_PROGRAMS
        # the tile's expert: the last e with tile_offsets[e] ≤ tile (it has tiles, so tile < tile_offsets[e + 1]);
        # scalar loads that hit L1, done once per tile
        lo = pid * 0
        hi = num_experts + pid * 0
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            right = tl.load(tile_offsets_ptr + mid) <= tile
            lo = tl.where(right, mid, lo)
            hi = tl.where(right, hi, mid)
        expert = lo
        local = tile - tl.load(tile_offsets_ptr + expert)
        row_begin = tl.load(expert_offsets_ptr + expert)
        row_end = tl.load(expert_offsets_ptr + expert + 1)
        num_blocks = tl.cdiv(row_end - row_begin, BLOCK_ROWS)
        if ROW_BLOCKS_INNER:
            h_tile = local // num_blocks
            block = local % num_blocks
        else:
            h_tile = local % num_h_tiles
            block = local // num_h_tiles
        h0 = h_tile * BLOCK_H
        r0 = row_begin + block * BLOCK_ROWS

        acc = tl.zeros((BLOCK_H, BLOCK_ROWS), tl.float32)  # outᵀ: [H-tile, rows]
        for step in range(0, num_steps):
            term = step % NUM_TERMS  # CONCAT_TERMS: Wg·dg and Wu·du of one I-block in turn, as today's kernel D
            i0 = step // NUM_TERMS * BLOCK_I
            rows_term = term ^ rows_flip  # the entry of the term axis that holds this term
            weights_term = term ^ weights_flip
            # [BLOCK_ROWS, BLOCK_I] block of the term's rows (used transposed: the N side)
            v = rows_desc.load([rows_term, r0, i0]).reshape(BLOCK_ROWS, BLOCK_I)
            if TWO_TERMS and not CONCAT_TERMS:
                v2 = rows2_desc.load([0, r0, i0]).reshape(BLOCK_ROWS, BLOCK_I)
            # [BLOCK_H, BLOCK_I] tile of the term's W_e (the M side)
            if WEIGHT_TMA:
                if TRANSPOSED_WEIGHTS:
                    w = w_desc.load([weights_term, expert, i0, h0]).reshape(BLOCK_I, BLOCK_H).T
                    if TWO_TERMS and not CONCAT_TERMS:
                        w2 = w2_desc.load([0, expert, i0, h0]).reshape(BLOCK_I, BLOCK_H).T
                else:
                    w = w_desc.load([weights_term, expert, h0, i0]).reshape(BLOCK_H, BLOCK_I)
                    if TWO_TERMS and not CONCAT_TERMS:
                        w2 = w2_desc.load([0, expert, h0, i0]).reshape(BLOCK_H, BLOCK_I)
            else:
                hs = h0 + tl.arange(0, BLOCK_H)
                cols = i0 + tl.arange(0, BLOCK_I)
                w_offsets = expert.to(tl.int64) * expert_stride + hs[:, None] * stride_h + cols[None, :] * stride_i
                w_mask = (hs < hidden_size)[:, None] & (cols < inter_size)[None, :]
                w_base = weights_ptr + weights_term.to(tl.int64) * weights_term_stride
                w = tl.load(w_base + w_offsets, mask=w_mask, other=0.0)
                if TWO_TERMS and not CONCAT_TERMS:
                    w2 = tl.load(weights_ptr + weights_term_stride + w_offsets, mask=w_mask, other=0.0)
            acc = dot16(operand(w, OPERAND_DTYPE, INTERPRETER), v.T, acc, INTERPRETER)
            if TWO_TERMS and not CONCAT_TERMS:
                acc = dot16(operand(w2, OPERAND_DTYPE, INTERPRETER), v2.T, acc, INTERPRETER)

        # the tile is complete: its rows to their slots, once
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < row_end
        slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
        hs_out = h0 + tl.arange(0, BLOCK_H)
        tl.store(out_slot_ptr + slots[None, :].to(tl.int64) * hidden_size + hs_out[:, None], acc,
                 mask=(hs_out < hidden_size)[:, None] & row_ok[None, :])


# --------------------------------------------------------------------------------------------------
# host side


@dataclass(frozen=True)
class TmaSlotProjectionConfig:
    """Tile sizes and launch parameters of :func:`slot_projection_tma_kernel`, per use.

    Tiles are (BLOCK_H, BLOCK_ROWS, BLOCK_I): weight rows per tile (the M side, a multiple of 64 on the
    GPU for 8 warps: 128 or 256), expert rows per tile (the N side) and intermediate columns per reduction
    step. ``backward_*``: the two-term launch (Wgᵀ dg + Wuᵀ du); ``forward_*``: the one-term launch (Wd aw).
    Stages count pipelined reduction steps of one term each (a weight block and a rows block): the
    backward's paired form (two terms per step, where the terms cannot share a descriptor) takes half as many,
    and always nested loops. The measured ones: :func:`~.choose.choose_tma_slot_projection_config`.
    """

    backward_tile: tuple[int, int, int] = (128, 64, 64)
    backward_warps: int = 8
    backward_stages: int = 6  # reduction steps (of one term) in flight
    forward_tile: tuple[int, int, int] = (128, 64, 64)
    forward_warps: int = 8
    forward_stages: int = 6
    weight_tma: bool = True  # fp32 weights by TMA (else pointer loads); 16-bit weights always by TMA
    row_blocks_inner: bool = True  # an expert's tiles numbered with row blocks inner (weight slab shared)
    concat_terms: bool = True  # the backward's two terms as one reduction through one descriptor (else paired)
    flatten: bool = True  # one software pipeline across a program's tiles (tl.range(flatten=True))

    def __post_init__(self):
        for name in ("backward_tile", "forward_tile"):
            tile = getattr(self, name)
            if len(tile) != 3 or any(b < 16 or b & (b - 1) for b in tile):
                raise ValueError(f"{name}: expected powers of two ≥ 16 (BLOCK_H, BLOCK_ROWS, BLOCK_I), got {tile}")
            if max(tile) > 256:
                raise ValueError(f"{name}: a TMA box side is at most 256 elements, got {tile}")

    def launch_params(self, two_terms: bool, paired: bool = False) -> tuple[tuple[int, int, int], int, int]:
        """(tile, num_warps, num_stages) of the two-term (backward) or one-term (forward) launch; ``paired``:
        the backward's form with both terms in every step (half the stages: the same shared memory)."""
        if two_terms:
            stages = max(2, self.backward_stages // 2) if paired else self.backward_stages
            return self.backward_tile, self.backward_warps, stages
        return self.forward_tile, self.forward_warps, self.forward_stages


def tma_slot_projection_fits(hidden_size: int, intermediate_size: int, weight_bytes: int = 2,
                             transposed_weights: bool = True) -> bool:
    """Whether TMA can address the rows (I 16-bit values) and the weights (inner width × ``weight_bytes``):
    multiples of 16 bytes."""
    inner = hidden_size if transposed_weights else intermediate_size
    return intermediate_size * 2 % 16 == 0 and inner * weight_bytes % 16 == 0


OPERAND_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
TMA_STRIDE_LIMIT = 2**40  # bytes: a TMA global stride is below 2⁴⁰ and a multiple of 16


def _element_distance(first: torch.Tensor, second: torch.Tensor) -> int:
    """Elements from ``first``'s first element to ``second``'s (same dtype; negative where ``second`` lies lower)."""
    return (second.data_ptr() - first.data_ptr()) // first.element_size()


def _term_axis_fits(distance_bytes: int, interpreter: bool) -> bool:
    """Whether two tensors ``distance_bytes`` apart can be one TMA descriptor's term axis (a stride TMA takes;
    the interpreter has no limit)."""
    return distance_bytes != 0 and distance_bytes % 16 == 0 and (interpreter or abs(distance_bytes) < TMA_STRIDE_LIMIT)


def two_term_form(config: TmaSlotProjectionConfig, weights1, weights2, rows1, rows2) -> str:
    """How the backward's two terms run: "concat" (one descriptor with a term axis over each pair: the
    pairs' distances are TMA strides, and ``config.concat_terms``) or "paired" (a descriptor per term)."""
    interpreter = interpreter_enabled()
    fits = all(_term_axis_fits(_element_distance(a, b) * a.element_size(), interpreter)
               for a, b in ((weights1, weights2), (rows1, rows2)))
    return "concat" if config.concat_terms and fits else "paired"


def launch_slot_projection_tma(config: TmaSlotProjectionConfig, routing, weights1, weights2, rows1, rows2,
                               out_slot, *, transposed_weights: bool, num_programs: int) -> None:
    """Kernel D, TMA-fed and persistent: out_slot[slot(p)] = W1_e v1[p] (+ W2_e v2[p]) for every sorted p.

    backward: ``(Wg, Wu, dg, du, dX_slot, transposed_weights=True)`` — Wg, Wu [E, I, H], out = Wgᵀ dg + Wuᵀ du;
    forward: ``(Wd, None, aw, None, y_slot, transposed_weights=False)`` — Wd [E, H, I], out = Wd aw.
    ``routing``: :class:`~.routing.ExpertRouting` (sorted_slot [T·K] int32, expert_offsets [E + 1] int32);
    ``rows1``, ``rows2`` [≥ T·K, I] in bf16 or fp16, rows in sorted order; the weights in the rows' dtype
    or fp32 (the fp32 interface: rounded to the rows' dtype in registers); ``out_slot`` [≥ T·K, H] fp32,
    row = slot id: every slot row is written, nothing else.
    ``num_programs``: the persistent grid (the number of SMs on the GPU). No host synchronisation:
    capturable in a CUDA graph. On CUDA it installs a torch-backed Triton allocator
    (``triton.set_allocator``) for the descriptors the kernel builds on the device.
    """
    two_terms = weights2 is not None and weights2 is not weights1
    if two_terms != (rows2 is not None and rows2 is not rows1):
        raise ValueError("weights2 and rows2: give both (two terms) or neither")
    if not two_terms:
        weights2, rows2 = weights1, rows1
    E = weights1.shape[0]
    H = out_slot.shape[1]
    I = rows1.shape[1]
    expected = (E, I, H) if transposed_weights else (E, H, I)
    for name, w in (("weights1", weights1), ("weights2", weights2)):
        if tuple(w.shape) != expected:
            raise ValueError(f"{name}: expected {list(expected)} (transposed_weights={transposed_weights}), "
                             f"got {list(w.shape)}")
    if rows1.dtype not in OPERAND_DTYPES or rows2.dtype != rows1.dtype or tuple(rows2.shape) != tuple(rows1.shape):
        raise TypeError(f"rows1, rows2: expected one 16-bit dtype and shape, got {rows1.dtype} {list(rows1.shape)}, "
                        f"{rows2.dtype} {list(rows2.shape)}")
    if {weights1.dtype, weights2.dtype} - {rows1.dtype, torch.float32} or weights1.dtype != weights2.dtype:
        raise TypeError(f"weights: expected {rows1.dtype} or float32 (both alike), got {weights1.dtype}, "
                        f"{weights2.dtype}")
    if out_slot.dtype != torch.float32:
        raise TypeError(f"out_slot: expected float32, got {out_slot.dtype}")
    num_slots = routing.sorted_slot.numel()
    if routing.expert_offsets.numel() != E + 1 or rows1.shape[0] < num_slots or out_slot.shape[0] < num_slots:
        raise ValueError("routing, rows and out_slot disagree: expected expert_offsets [E + 1], rows and out_slot "
                         "with at least T·K rows")
    for name, t in dict(weights1=weights1, weights2=weights2, rows1=rows1, rows2=rows2, out_slot=out_slot).items():
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous (row-major) tensor")
    weight_tma = weights1.dtype != torch.float32 or bool(config.weight_tma)
    if not tma_slot_projection_fits(H, I, weights1.element_size() if weight_tma else 2, transposed_weights):
        raise ValueError(f"H = {H}, I = {I}: rows of the rows or weights are not a multiple of 16 bytes (TMA)")
    for name, t in dict(rows1=rows1, rows2=rows2, weights1=weights1, weights2=weights2).items():
        if t.data_ptr() % 16:
            raise ValueError(f"{name}: base address not 16-byte aligned (TMA)")
    if num_slots == 0 or E == 0:
        return  # no slots: nothing to write

    interpreter = interpreter_enabled()
    weights_base, weights_stride, weights_flip, rows_base, rows_stride, rows_flip = weights1, 0, 0, rows1, 0, 0
    concat = False
    if two_terms:
        weights_delta, rows_delta = _element_distance(weights1, weights2), _element_distance(rows1, rows2)
        concat = two_term_form(config, weights1, weights2, rows1, rows2) == "concat"
        if concat:  # a term axis from the lower address up (TMA strides are unsigned)
            weights_base, weights_stride, weights_flip = (
                (weights1, weights_delta, 0) if weights_delta >= 0 else (weights2, -weights_delta, 1)
            )
            rows_base, rows_stride, rows_flip = (rows1, rows_delta, 0) if rows_delta >= 0 else (rows2, -rows_delta, 1)
        else:  # paired: term 1's tensors at their signed distance from term 0's
            weights_stride, rows_stride = weights_delta, rows_delta
    if rows1.is_cuda and not interpreter:
        install_tma_allocator(rows1.device)
    paired = two_terms and not concat
    tile, warps, stages = config.launch_params(two_terms, paired=paired)
    block_h, block_rows, block_i = tile
    tile_offsets = torch.empty(E + 1, dtype=torch.int32, device=rows1.device)
    tile_offsets_kernel[(1,)](
        routing.expert_offsets, tile_offsets, E, triton.cdiv(H, block_h),
        BLOCK_ROWS=block_rows, BLOCK_E=min(1024, triton.next_power_of_2(E)), num_warps=4,
    )
    slot_projection_tma_kernel[(num_programs,)](
        weights_base, weights_stride, weights_flip, rows_base, rows_stride, rows_flip, out_slot,
        routing.sorted_slot, routing.expert_offsets, tile_offsets, E, rows1.shape[0], H, I,
        TWO_TERMS=two_terms, CONCAT_TERMS=concat, TRANSPOSED_WEIGHTS=transposed_weights, WEIGHT_TMA=weight_tma,
        OPERAND_DTYPE=OPERAND_DTYPES[rows1.dtype], NUM_PROGRAMS=num_programs, SEARCH_STEPS=(E - 1).bit_length(),
        ROW_BLOCKS_INNER=bool(config.row_blocks_inner), FLATTEN=bool(config.flatten) and not paired,
        INTERPRETER=interpreter,
        BLOCK_H=block_h, BLOCK_ROWS=block_rows, BLOCK_I=block_i, num_warps=warps, num_stages=stages,
    )
