"""A P1 design for few tokens (design 5): one launch, 2-D weight tiles streamed in chunks, waits per I-block.

Every token in one token block: T ≤ 128 (the chooser sends at most that many here).

    phase 1, tile (c, b) of Wd [H, I] (rows h ∈ H-tile c, columns i ∈ I-block b), chunk by chunk along H:
        dA_c[:, b]  = Σ_k dy[:, c_k] · Wd[c_k, b]                 fp32 partial → workspace (c_k: chunk k of c)
        dWd[c_k, b] = dy[:, c_k]ᵀ · intermediate[:, b]            written directly, chunk by chunk
    phase 2, tile (b, c) of Wg, Wu [I, H] (rows i ∈ I-block b, columns h ∈ H-tile c), once the phase-1
    tiles of I-block b have all arrived:
        dA[:, b]    = Σ_c' dA_c'[:, b]                            (c' = 0, 1, …: a fixed order)
        dGate, dUp  = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)),  dA ⊙ gate_silu    (fp32, s = gate_sigmoid; once)
        dx_b[:, c_k] = dGate · Wg[b, c_k] + dUp · Wu[b, c_k]      fp32 partial → workspace, chunk by chunk
        dWg[b, c_k] = dGateᵀ · x[:, c_k] ;  dWu[b, c_k] = dUpᵀ · x[:, c_k]        written directly, chunk by chunk
    the last tile of H-tile c to arrive:  dx[:, c] = Σ_b' dx_b'[:, c]   (b' = 0, 1, …)
    or, with ``dx_sum_slices`` = S, tiles (b, c) with b < S once all of H-tile c have arrived:
                                          dx[rows of slice b, c] = Σ_b' dx_b'[rows of slice b, c]

Why: at few tokens the work is the weights, read once and their gradients written once (9.4 MB each way at H =
2048, I = 768, bf16), and design 3 (one launch of narrow tiles, since removed) spent its time in chains of
dependent narrow loads (32 bytes per weight row). Here every program holds one phase-1 and one phase-2 tile whose
rows are ≥ 128 contiguous bytes. Between the phases a program waits only for the phase-1 tiles of its own I-block
(an arrival counter per phase-2 I-block), not for the whole grid.

A tile is an I-block (64 columns of I, wider where there are more I-blocks than SMs) by a span of H (``span_h1``,
``span_h2``) covered in chunks of a power-of-two block (``block_h1``, ``block_h2``; 32 KB of each weight), the
last chunk masked where the span ends:
- one chunk (the span at most the block, the benchmark's shape): the tile is held whole, and the program sets the
  loads of all its weight tiles going at its start (Wd into registers; Wg, Wu either into registers too or
  prefetched into L2, ``weights_ahead``), so the memory system is busy from the first cycle;
- several chunks (a span longer than the block: the model shapes, where whole tiles overflowed the shared memory):
  the tile is streamed, each chunk loop software-pipelined by Triton (``chunk_stages``), dA accumulated over the
  chunks in registers, dGate and dUp computed once, every gradient chunk written as it is made.
:meth:`FewTokensConfig.for_shape` derives the blocks, spans and chunks from (T, H, I, SMs).

The products are fp32 accumulations on the tensor cores. With ``with_lo`` (the faithful path) dGate
and dUp enter dx, dWg and dWu as 16-bit hi/lo pairs (hi = bf16(v), lo = bf16(v − hi)): both halves
multiply the same weight or x tile, as ``kernels.accumulate_product(..., A_HAS_LO)`` does; without it
they are rounded to the input dtype (the fast path). 16-bit inputs only. For one token,
``cuda_cores`` (:func:`one_token_kernel`) keeps the tiles and the exchange and takes every product on the CUDA cores
in fp32: a few hundred FMAs per thread, no operand staged in shared memory, no output tile transposed, exact
products (both paths then give the same result).

What the time depends on in Triton (read off the TTGIR and PTX for sm_90, ``scripts/p1/p1_few_tokens_check.py``):
- every product puts the weight (or x) tile on the M side and the few tokens on the N side: dAᵀ = Wdᵀ·dyᵀ,
  dx_bᵀ = Wgᵀ·dGateᵀ + Wuᵀ·dUpᵀ, dWgᵀ = xᵀ·dGate. They run as wgmma with dGate, dUp taken from shared
  memory; with dGate as a register operand Triton gave every tile it was computed from (the partials,
  the saved tensors) that operand's layout, each load then converted through shared memory in turn.
- Triton moves a dot operand into shared memory where the operand is defined: for a loaded tile, a wait
  for the load right there, before any later load is issued. Every dot operand of a tile held whole goes through
  :func:`once` at its point of use instead, so all independent loads are on their way first.
- a scalar atomic's result is broadcast with a CTA barrier on the spot; :func:`arrive` keeps it in one
  thread until it is needed, so the dWg, dWu stores do not wait for the dx arrival's round trip.

Waiting needs every program resident at once: at most one program per SM (``supports`` checks the grid against the
device's SMs), and nothing else running beside the launch, or a cooperative launch (``cooperative``), with which
CUDA guarantees residency (or refuses the launch) even beside kernels on other streams. The interpreter runs
programs one after another, so there the phases run as two launches (``PHASE``), and a sliced dx sum as a third
(:func:`dx_slices_kernel`). Counters (int64, zeroed once, never reset):
    [0]                  +1 per program and launch: program p's launch number g = (its arrival) // grid
    [1 + b]              +1 per phase-1 tile overlapping phase-2 I-block b: block b is ready in launch g
                         once it reaches (g + 1) · (the tiles overlapping b)
    [1 + N_I2 + c]       +1 per phase-2 tile of H-tile c: arrival N_I2 − 1 (mod N_I2) is the last
Sums run in a fixed order whatever the arrival order, so results are deterministic.

Seeing where the time goes: ``run(..., trace=)`` (GPU only) has every program stamp the GPU's global clock at each
of :data:`TRACE_POINTS` and note its SM; ``scripts/p1/p1_few_tokens_trace.py`` runs it and :func:`trace_timeline`
sums it up (notebook 04 draws the programs' timelines).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ...dispatch import interpreter_enabled
from ...tiling import cdiv
from .. import runtime
from ..kernels import load_block, mma, store_tile, swiglu_grads, wait_for
from ..runtime import INTERPRETER_DEVICE, Device, SplitWorkspace, device_of
from .base import SIXTEEN_BIT, Inputs, Outputs, on_triton

# how the Wg, Wu tiles get on their way before the wait (WEIGHTS_AHEAD)
WEIGHTS_AHEAD = {"after_phase1": 0, "prefetch": 1, "registers": 2}
# partial sums unrolled at most this many loads at a time (:func:`summed_partials`): 112 at once (I 14336) held
# 255 registers, 128 (I 16384) spilled, compiled for sm_90
PARTS_UNROLLED = tl.constexpr(16)


@triton.jit
def prefetch_block_to_l2(ptr, off_m, off_n, M, N, stride_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Asks L2 for the 128-byte lines of the [BLOCK_M, BLOCK_N] block at (off_m, off_n) (GPU only): one
    ``prefetch.global.L2`` per line, no registers held, nothing waited for. Indices are clamped into
    [M, N] (an empty block prefetches the matrix's last line again; harmless)."""
    LINE: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth  # elements per 128 bytes
    LINES: tl.constexpr = (BLOCK_N + LINE - 1) // LINE
    rows = tl.minimum(off_m + tl.arange(0, BLOCK_M), M - 1)
    cols = tl.minimum(off_n + tl.arange(0, LINES) * LINE, N - 1)
    ptrs = ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def halves(d, dtype: tl.constexpr):
    """(hi, lo) of fp32 ``d`` in ``dtype``: hi = d rounded, lo = what that rounding lost (hi + lo ≈ d to about
    twice the dtype's precision)."""
    hi = d.to(dtype)
    return hi, (d - hi.to(tl.float32)).to(dtype)


@triton.jit
def mma_pair(acc, other, hi, lo, UPCAST: tl.constexpr, PRECISION: tl.constexpr, WITH_LO: tl.constexpr):
    """acc + other · hi, and with WITH_LO + other · lo (see :func:`halves`)."""
    acc = mma(other, hi, acc, UPCAST, PRECISION)
    if WITH_LO:
        acc = mma(other, lo, acc, UPCAST, PRECISION)
    return acc


@triton.jit
def mma_halves(acc, other, d, D_TRANSPOSED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               WITH_LO: tl.constexpr):
    """acc + other · dᵀ (D_TRANSPOSED) or acc + other · d, with d [tokens, n] fp32 taken in other's dtype:
    hi = d rounded, and with WITH_LO also lo = what that rounding lost (acc + other·hi + other·lo).
    The weight or x tile is the left operand (the M side), dGate, dUp the right one: a right operand
    reaches the tensor cores through shared memory from whatever layout it is in, so the elementwise
    work on dGate, dUp and the loads it reads keep their ordinary layouts."""
    hi, lo = halves(d, other.dtype)
    if D_TRANSPOSED:
        hi = tl.trans(hi)
        lo = tl.trans(lo)
    return mma_pair(acc, other, hi, lo, UPCAST, PRECISION, WITH_LO)


@triton.jit
def saved_tiles(gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, off_t, off_i, T, I,
                BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    """The saved gate, gate_sigmoid, gate_silu and up tiles of the [BLOCK_T, BLOCK_I] block at (off_t, off_i)."""
    return (load_block(gate_ptr, off_t, off_i, T, I, I, BLOCK_T, BLOCK_I),
            load_block(gate_sigmoid_ptr, off_t, off_i, T, I, I, BLOCK_T, BLOCK_I),
            load_block(gate_silu_ptr, off_t, off_i, T, I, I, BLOCK_T, BLOCK_I),
            load_block(up_ptr, off_t, off_i, T, I, I, BLOCK_T, BLOCK_I))


@triton.jit
def phase1_tile(pid, H, I, SPAN_H1: tl.constexpr, SPAN_I1: tl.constexpr, N_H1: tl.constexpr, N_I1: tl.constexpr):
    """(c1, has_tile, off_h1, off_i1, h1_end, i1_end) of program ``pid``'s phase-1 tile (c1, b1) = (pid mod N_H1,
    pid div N_H1) of Wd: its H-block, whether it has one (past the tile count the tile lies beyond I: every load and
    store of it is masked off, and it arrives nowhere), where it starts and where it ends (a block's rows or columns
    past its span are masked off)."""
    c1, b1 = pid % N_H1, pid // N_H1
    off_h1, off_i1 = c1 * SPAN_H1, b1 * SPAN_I1
    return c1, pid < N_H1 * N_I1, off_h1, off_i1, tl.minimum(off_h1 + SPAN_H1, H), tl.minimum(off_i1 + SPAN_I1, I)


@triton.jit
def phase2_tile(pid, H, I, SPAN_I2: tl.constexpr, SPAN_H2: tl.constexpr, N_I2: tl.constexpr, N_H2: tl.constexpr):
    """(b2, c2, has_tile, off_i2, off_h2, i2_end, h2_end) of program ``pid``'s phase-2 tile (b2, c2) = (pid div N_H2,
    pid mod N_H2) of Wg, Wu, as :func:`phase1_tile`."""
    b2, c2 = pid // N_H2, pid % N_H2
    off_i2, off_h2 = b2 * SPAN_I2, c2 * SPAN_H2
    return b2, c2, pid < N_I2 * N_H2, off_i2, off_h2, tl.minimum(off_i2 + SPAN_I2, I), tl.minimum(off_h2 + SPAN_H2, H)


@triton.jit
def summed_partials(partials_ptr, part_stride, off_m, off_n, M, N, stride_m,
                    PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Σ_p partials[p][block] for p = 0, 1, …, PARTS − 1 in that order (fp32, ``part_stride`` elements apart),
    read past L1 (other programs wrote them). Unrolled: all PARTS loads are in flight together, or, of more than
    PARTS_UNROLLED, that many at a time (each load in flight holds its registers)."""
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    ptrs = partials_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PARTS <= PARTS_UNROLLED:
        for p in tl.static_range(PARTS):
            total += tl.load(ptrs + p * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
    else:
        for group in range(PARTS // PARTS_UNROLLED):
            for p in tl.static_range(PARTS_UNROLLED):
                part = group * PARTS_UNROLLED + p
                total += tl.load(ptrs + part * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
        GROUPED: tl.constexpr = PARTS // PARTS_UNROLLED * PARTS_UNROLLED
        for p in tl.static_range(PARTS - GROUPED):
            total += tl.load(ptrs + (GROUPED + p) * part_stride, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def grad_down_tile(dy, inter, ready, grad_down_weight_ptr, off_h1, off_i1, h1_end, I: tl.constexpr,
                   BLOCK_H1: tl.constexpr, BLOCK_I1: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                   ONCE_BY_MOVE: tl.constexpr):
    """dWd[c1, b1] = dyᵀ · intermediate over one token block (dy [BLOCK_T, BLOCK_H1], inter [BLOCK_T, BLOCK_I1]),
    stored."""
    acc_down = mma(tl.trans(dy), once(inter, ready, ONCE_BY_MOVE), tl.zeros((BLOCK_H1, BLOCK_I1), dtype=tl.float32),
                   UPCAST, PRECISION)
    store_tile(grad_down_weight_ptr, acc_down, off_h1, off_i1, h1_end, I, I, BLOCK_H1, BLOCK_I1)


@triton.jit
def arrive(counter_ptr, active, SEM: tl.constexpr, THREADS: tl.constexpr):
    """Adds 1 to an int64 counter, once for the program (where ``active``); returns the count it found as
    element 0 of a [THREADS] tensor (read it with :func:`first`). One element per thread, so that no
    barrier waits for the atomic here: a scalar atomic's result is broadcast on the spot, this one only
    where it is used."""
    lanes = tl.arange(0, THREADS)
    return tl.atomic_add(counter_ptr + lanes * 0, tl.full((THREADS,), 1, tl.int64), mask=(lanes == 0) & active,
                         sem=SEM, scope="gpu")


@triton.jit
def first(values):
    """Element 0 of a 1-D tensor, as a scalar every thread holds."""
    return tl.sum(tl.where(tl.arange(0, values.shape[0]) == 0, values, 0))


@triton.jit
def once(tile, ready, BY_MOVE: tl.constexpr):
    """``tile`` as a value defined here, where ``ready`` (a run-time true) is known. Triton moves a dot operand
    into shared memory right where the operand is defined, and for a loaded tile that means waiting for
    the load there; passed through this, the wait happens at the point of use, after every load issued
    above it is on its way. BY_MOVE (GPU only): through an identity move in inline PTX instead of a select on
    ``ready``, the same placement without a select per register (ptxas folds the moves)."""
    if BY_MOVE:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [tile], dtype=tile.dtype, is_pure=False,
                                         pack=32 // tile.dtype.primitive_bitwidth)
    return tl.where(ready, tile, tl.zeros_like(tile))


# what each slot of a program's trace holds (TRACE): %globaltimer in ns at these points, then the SM it ran on
TRACE_POINTS = ("start", "dA partial stored", "dWd stored", "dA ready", "dx partial stored", "dWg, dWu stored",
                "end")
TRACE_SLOTS = len(TRACE_POINTS) + 1
TRACE_END = tl.constexpr(len(TRACE_POINTS) - 1)  # the slot of "end"; the SM's number follows it, the last slot


@triton.jit
def stamp(trace_ptr, slot, TRACE: tl.constexpr):
    """With TRACE: the GPU's global clock (ns) into ``trace_ptr[slot]``, once every thread of the program got
    here (GPU only: inline PTX). The stores issued above are on their way, not necessarily done; the last
    stamp (``fence``) waits for them."""
    if TRACE:
        tl.debug_barrier()
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [slot], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(trace_ptr + slot, now)


@triton.jit
def stamp_sm(trace_ptr, slot, TRACE: tl.constexpr):
    """With TRACE: the number of the SM this program runs on into ``trace_ptr[slot]``."""
    if TRACE:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [slot], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(trace_ptr + slot, sm.to(tl.int64))


@triton.jit
def fence(TRACE: tl.constexpr):
    """With TRACE: waits until this thread's stores so far are visible to the whole GPU."""
    if TRACE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def few_tokens_kernel(
    grad_output_ptr,  # dy [T, H]
    x_ptr,  # x [T, H]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, intermediate_ptr,  # saved forward, each [T, I]
    grad_x_ptr,  # out: dx [T, H]
    grad_gate_weight_ptr, grad_up_weight_ptr,  # out: dWg, dWu [I, H]
    grad_down_weight_ptr,  # out: dWd [H, I]
    da_partials_ptr,  # fp32 workspace [N_H1, T, I]: dA_c, the partial dA of phase-1 H-tile c
    dx_partials_ptr,  # fp32 workspace [N_I2, T, H]: dx_b, the partial dx of phase-2 I-block b
    counters_ptr,  # int64 [1 + N_I2 + N_H2]: launches, dA arrivals per phase-2 I-block, dx arrivals per H-tile
    trace_ptr,  # int64 [grid, TRACE_SLOTS] (TRACE): when each program reached each of TRACE_POINTS, and its SM
    T,  # tokens, at most BLOCK_T
    H: tl.constexpr, I: tl.constexpr,  # hidden and intermediate size, compiled in: index arithmetic and bounds fold
    PHASE: tl.constexpr,  # 0: both phases, waiting between them; 1 or 2: that phase alone (interpreter)
    BLOCK_T: tl.constexpr,  # every token in one block (the N side of dA and dx, the reduction of dWd, dWg, dWu)
    BLOCK_H1: tl.constexpr, BLOCK_I1: tl.constexpr,  # a phase-1 chunk: Wd rows (H) × columns (I)
    BLOCK_I2: tl.constexpr, BLOCK_H2: tl.constexpr,  # a phase-2 chunk: Wg, Wu rows (I) × columns (H)
    SPAN_H1: tl.constexpr, SPAN_H2: tl.constexpr,  # the H a tile covers: cdiv(SPAN, BLOCK) chunks, the last masked
    N_H1: tl.constexpr, N_I1: tl.constexpr,  # phase-1 tiles along H and I: cdiv(H, SPAN_H1), cdiv(I, BLOCK_I1)
    N_I2: tl.constexpr, N_H2: tl.constexpr,  # phase-2 tiles along I and H: cdiv(I, BLOCK_I2), cdiv(H, SPAN_H2)
    WEIGHTS_AHEAD: tl.constexpr,  # one chunk: Wg, Wu tiles 0 loaded after phase 1 (before the wait), 1 the same and
                                  # prefetched into L2 at the start, 2 loaded into registers at the start
    THREADS: tl.constexpr,  # 32 · num_warps (see arrive)
    UPCAST: tl.constexpr,  # fp32 dots (the interpreter's bf16 dot is wrong)
    PRECISION: tl.constexpr,  # tl.dot input_precision for fp32 operands
    WITH_LO: tl.constexpr,  # dGate, dUp as hi/lo pairs in every product (the faithful path)
    TRACE: tl.constexpr,  # stamp the global clock at each of TRACE_POINTS into trace_ptr (GPU only)
    COUNT_LATE: tl.constexpr,  # read the launch count (an atomic's round trip) just before the wait, not at the start
    STAGE_EARLY: tl.constexpr,  # one chunk: stage phase 2's Wg, Wu and x tiles for the tensor cores before the wait
    ONCE_BY_MOVE: tl.constexpr,  # once() by an identity move in inline PTX, not a select (GPU only)
    SAVED_LATE: tl.constexpr,  # the saved gate, s, silu, up tiles loaded after phase 1, not at the start
    DX_SUM_SLICES: tl.constexpr,  # dx's sum over the I-blocks split by rows over the first this many phase-2
                                  # programs of each H-tile (1: the last to arrive sums it all)
    GRAD_DOWN_LATE: tl.constexpr,  # dWd after phase 2's stores (before dx's sum), not before the wait
    CHUNK_STAGES: tl.constexpr,  # several chunks: the chunk loops software-pipelined this deep (tl.range num_stages)
):
    pid = tl.program_id(0)
    trace_ptr += pid * (TRACE_END + 2)
    stamp(trace_ptr, 0, TRACE)
    stamp_sm(trace_ptr, TRACE_END + 1, TRACE)
    # this program's tiles (whole blocks along I)
    c1, has_tile1, off_h1, off_i1, h1_end, _ = phase1_tile(pid, H, I, SPAN_H1, BLOCK_I1, N_H1, N_I1)
    b2, c2, has_tile2, off_i2, off_h2, _, h2_end = phase2_tile(pid, H, I, BLOCK_I2, SPAN_H2, N_I2, N_H2)
    TI = T * I
    # one chunk: the tile is held whole, its loads set going at the start; several: streamed, chunk by chunk
    H_CHUNKS1: tl.constexpr = (SPAN_H1 + BLOCK_H1 - 1) // BLOCK_H1
    H_CHUNKS2: tl.constexpr = (SPAN_H2 + BLOCK_H2 - 1) // BLOCK_H2

    # ---- every load that depends on nothing, set going at the start; nothing waits for them here
    if PHASE != 2 and H_CHUNKS1 == 1:
        w_down = load_block(down_weight_ptr, off_h1, off_i1, h1_end, I, I, BLOCK_H1, BLOCK_I1)
    if (PHASE != 2) or GRAD_DOWN_LATE:  # (the interpreter's phase 2 alone writes a late dWd)
        if H_CHUNKS1 == 1:
            dy = load_block(grad_output_ptr, 0, off_h1, T, h1_end, H, BLOCK_T, BLOCK_H1)
        inter = load_block(intermediate_ptr, 0, off_i1, T, I, I, BLOCK_T, BLOCK_I1)
    if PHASE != 1:
        if H_CHUNKS2 == 1:
            if WEIGHTS_AHEAD == 1:
                prefetch_block_to_l2(gate_weight_ptr, off_i2, off_h2, I, h2_end, H, BLOCK_I2, BLOCK_H2)
                prefetch_block_to_l2(up_weight_ptr, off_i2, off_h2, I, h2_end, H, BLOCK_I2, BLOCK_H2)
            if WEIGHTS_AHEAD == 2:
                w_gate = load_block(gate_weight_ptr, off_i2, off_h2, I, h2_end, H, BLOCK_I2, BLOCK_H2)
                w_up = load_block(up_weight_ptr, off_i2, off_h2, I, h2_end, H, BLOCK_I2, BLOCK_H2)
            x_block = load_block(x_ptr, 0, off_h2, T, h2_end, H, BLOCK_T, BLOCK_H2)
        if not SAVED_LATE:
            gate, s, gate_silu, up = saved_tiles(gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, 0, off_i2, T, I,
                                                 BLOCK_T, BLOCK_I2)
    if PHASE == 0:  # this launch's number: the launch counter grows by the grid size per launch
        launch_arrival = arrive(counters_ptr, True, "relaxed", THREADS)
        if COUNT_LATE:  # the launch count's round trip is waited for at the wait only
            ready = I > 0
        else:
            launch_number = first(launch_arrival) // tl.num_programs(0)
            ready = launch_number >= 0
    else:
        ready = T >= 0

    # ---- phase 1: the partial dA_c1[:, b1] = dy · Wd[c1, b1], then dWd[c1, b1] = dyᵀ · intermediate
    if PHASE != 2:
        if H_CHUNKS1 == 1:
            w_down_t = tl.trans(once(w_down, ready, ONCE_BY_MOVE))  # the M side of dAᵀ = Wdᵀ · dyᵀ (see mma_halves)
            dy = once(dy, ready, ONCE_BY_MOVE)
            d_a = mma(w_down_t, tl.trans(dy), tl.zeros((BLOCK_I1, BLOCK_T), dtype=tl.float32), UPCAST, PRECISION)
        else:
            d_a = streamed_d_a(down_weight_ptr, grad_output_ptr, off_h1, off_i1, h1_end, T, H, I, BLOCK_T, BLOCK_H1,
                               BLOCK_I1, H_CHUNKS1, UPCAST, PRECISION, CHUNK_STAGES)
        store_tile(da_partials_ptr + c1 * TI, tl.trans(d_a), 0, off_i1, T, I, I, BLOCK_T, BLOCK_I1)
        tl.debug_barrier()  # every thread's partial is stored before the arrivals are counted
        stamp(trace_ptr, 1, TRACE)
        # one arrival on each phase-2 I-block this tile overlaps (release: the partial goes with it)
        for b in range(off_i1 // BLOCK_I2, (tl.minimum(off_i1 + BLOCK_I1, I) - 1) // BLOCK_I2 + 1):
            tl.atomic_add(counters_ptr + 1 + b, 1, mask=has_tile1, sem="release", scope="gpu")
        if not GRAD_DOWN_LATE:  # dWd after the arrivals: off the path that other programs wait on
            if H_CHUNKS1 == 1:
                grad_down_tile(dy, inter, ready, grad_down_weight_ptr, off_h1, off_i1, h1_end, I, BLOCK_H1, BLOCK_I1,
                               UPCAST, PRECISION, ONCE_BY_MOVE)
            else:
                streamed_grad_down(grad_output_ptr, inter, grad_down_weight_ptr, off_h1, off_i1, h1_end, T, H, I,
                                   BLOCK_T, BLOCK_H1, BLOCK_I1, H_CHUNKS1, UPCAST, PRECISION)
        stamp(trace_ptr, 2, TRACE)

    if PHASE != 1:
        if WEIGHTS_AHEAD != 2 and H_CHUNKS2 == 1:
            w_gate = load_block(gate_weight_ptr, off_i2, off_h2, I, h2_end, H, BLOCK_I2, BLOCK_H2)
            w_up = load_block(up_weight_ptr, off_i2, off_h2, I, h2_end, H, BLOCK_I2, BLOCK_H2)
        if SAVED_LATE:  # the saved tiles after phase 1, on their way during the wait
            gate, s, gate_silu, up = saved_tiles(gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, 0, off_i2, T, I,
                                                 BLOCK_T, BLOCK_I2)
        if STAGE_EARLY and H_CHUNKS2 == 1:  # the phase-2 operands staged for the tensor cores while the wait spins
            w_gate_t = tl.trans(once(w_gate, ready, ONCE_BY_MOVE))
            w_up_t = tl.trans(once(w_up, ready, ONCE_BY_MOVE))
            x_t = tl.trans(once(x_block, ready, ONCE_BY_MOVE))
        if PHASE == 0:  # wait for the phase-1 tiles overlapping I-block b2 (none of the others)
            overlapping = (tl.minimum(off_i2 + BLOCK_I2, I) - 1) // BLOCK_I1 - off_i2 // BLOCK_I1 + 1
            if COUNT_LATE:
                launch_number = first(launch_arrival) // tl.num_programs(0)
            if has_tile2:
                wait_for(counters_ptr + 1 + b2, (launch_number + 1) * (N_H1 * overlapping))
            stamp(trace_ptr, 3, TRACE)

        # ---- phase 2: the partial dx_b2[:, c2], then dWg[b2, c2] = dGateᵀ · x and dWu[b2, c2] = dUpᵀ · x
        dx_partial_ptr = dx_partials_ptr + b2 * (T * H)
        t_end = tl.where(has_tile2, T, 0)  # no partial from a program without a phase-2 tile
        d_a = summed_partials(da_partials_ptr, TI, 0, off_i2, T, I, I, N_H1, BLOCK_T, BLOCK_I2)
        if not STAGE_EARLY and H_CHUNKS2 == 1:  # the M sides of dx_bᵀ = Wgᵀ · dGateᵀ + Wuᵀ · dUpᵀ, once the partials
            w_gate_t = tl.trans(once(w_gate, ready, ONCE_BY_MOVE))  # are on their way
            w_up_t = tl.trans(once(w_up, ready, ONCE_BY_MOVE))
        d_gate, d_up = swiglu_grads(d_a, gate, s, gate_silu, up)
        if H_CHUNKS2 == 1:
            acc_x = tl.zeros((BLOCK_H2, BLOCK_T), dtype=tl.float32)
            acc_x = mma_halves(acc_x, w_gate_t, d_gate, True, UPCAST, PRECISION, WITH_LO)
            acc_x = mma_halves(acc_x, w_up_t, d_up, True, UPCAST, PRECISION, WITH_LO)
            store_tile(dx_partial_ptr, tl.trans(acc_x), 0, off_h2, t_end, h2_end, H, BLOCK_T, BLOCK_H2)
        else:  # dGate, dUp as the products take them, once for every chunk
            gate_hi, gate_lo = halves(d_gate, gate_weight_ptr.dtype.element_ty)
            up_hi, up_lo = halves(d_up, gate_weight_ptr.dtype.element_ty)
            streamed_dx_partial(gate_weight_ptr, up_weight_ptr, gate_hi, gate_lo, up_hi, up_lo, dx_partial_ptr, off_i2,
                                off_h2, h2_end, t_end, H, I, BLOCK_T, BLOCK_I2, BLOCK_H2, H_CHUNKS2, UPCAST, PRECISION,
                                WITH_LO, CHUNK_STAGES)
        tl.debug_barrier()
        arrived = arrive(counters_ptr + 1 + N_I2 + c2, has_tile2, "acq_rel", THREADS)
        stamp(trace_ptr, 4, TRACE)
        if H_CHUNKS2 == 1:
            if not STAGE_EARLY:
                x_t = tl.trans(once(x_block, ready, ONCE_BY_MOVE))  # the M side of dWgᵀ = xᵀ · dGate, dWuᵀ = xᵀ · dUp
            acc_w = mma_halves(tl.zeros((BLOCK_H2, BLOCK_I2), dtype=tl.float32), x_t, d_gate, False, UPCAST,
                               PRECISION, WITH_LO)
            store_tile(grad_gate_weight_ptr, tl.trans(acc_w), off_i2, off_h2, I, h2_end, H, BLOCK_I2, BLOCK_H2)
            acc_w = mma_halves(tl.zeros((BLOCK_H2, BLOCK_I2), dtype=tl.float32), x_t, d_up, False, UPCAST,
                               PRECISION, WITH_LO)
            store_tile(grad_up_weight_ptr, tl.trans(acc_w), off_i2, off_h2, I, h2_end, H, BLOCK_I2, BLOCK_H2)
        else:
            streamed_gate_up_grads(x_ptr, gate_hi, gate_lo, up_hi, up_lo, grad_gate_weight_ptr, grad_up_weight_ptr,
                                   off_i2, off_h2, h2_end, T, H, I, BLOCK_T, BLOCK_I2, BLOCK_H2, H_CHUNKS2, UPCAST,
                                   PRECISION, WITH_LO, CHUNK_STAGES)
        stamp(trace_ptr, 5, TRACE)
        if GRAD_DOWN_LATE:  # phase 1's dWd tile, while the stores above drain
            if H_CHUNKS1 == 1:
                grad_down_tile(dy, inter, ready, grad_down_weight_ptr, off_h1, off_i1, h1_end, I, BLOCK_H1, BLOCK_I1,
                               UPCAST, PRECISION, ONCE_BY_MOVE)
            else:
                streamed_grad_down(grad_output_ptr, inter, grad_down_weight_ptr, off_h1, off_i1, h1_end, T, H, I,
                                   BLOCK_T, BLOCK_H1, BLOCK_I1, H_CHUNKS1, UPCAST, PRECISION)

        # ---- dx[:, c2] = Σ_b dx_b[:, c2] in b order
        if DX_SUM_SLICES == 1:  # by the last phase-2 tile of H-tile c2 to arrive
            if has_tile2 & (first(arrived) % N_I2 == N_I2 - 1):
                dx_slice_sum(dx_partials_ptr, grad_x_ptr, 0, off_h2, h2_end, T, H, N_I2, BLOCK_T, BLOCK_H2, H_CHUNKS2)
        elif PHASE == 0:  # by rows, over the H-tile's first DX_SUM_SLICES programs, once every partial has arrived
            if has_tile2 & (b2 < DX_SUM_SLICES):
                wait_for(counters_ptr + 1 + N_I2 + c2, (launch_number + 1) * N_I2)
                dx_slice_sum(dx_partials_ptr, grad_x_ptr, b2, off_h2, h2_end, T, H, N_I2, BLOCK_T // DX_SUM_SLICES,
                             BLOCK_H2, H_CHUNKS2)
    fence(TRACE)
    stamp(trace_ptr, TRACE_END, TRACE)


@triton.jit
def dx_slice_sum(dx_partials_ptr, grad_x_ptr, slice_index, off_h, h_end, T, H: tl.constexpr, N_I2: tl.constexpr,
                 SLICE_T: tl.constexpr, BLOCK_H: tl.constexpr, H_CHUNKS: tl.constexpr):
    """dx[rows, off_h : h_end] = Σ_b dx_b[rows, off_h : h_end] (b = 0, 1, …, N_I2 − 1 in that order) for the SLICE_T
    rows of slice ``slice_index`` (rows past T masked off), in H_CHUNKS chunks of BLOCK_H columns."""
    off_t = slice_index * SLICE_T
    for k in range(H_CHUNKS):
        off_chunk = off_h + k * BLOCK_H
        total = summed_partials(dx_partials_ptr, T * H, off_t, off_chunk, T, h_end, H, N_I2, SLICE_T, BLOCK_H)
        store_tile(grad_x_ptr, total, off_t, off_chunk, T, h_end, H, SLICE_T, BLOCK_H)


@triton.jit
def dx_slices_kernel(
    dx_partials_ptr,  # fp32 [N_I2, T, H]: dx_b, the partial dx of phase-2 I-block b (written by phase 2)
    grad_x_ptr,  # out: dx [T, H]
    T,
    H: tl.constexpr, N_I2: tl.constexpr, N_H2: tl.constexpr, SPAN_H2: tl.constexpr,
    SLICES: tl.constexpr, SLICE_T: tl.constexpr, BLOCK_H2: tl.constexpr,
):
    """The sliced dx sum of :func:`few_tokens_kernel` (``DX_SUM_SLICES``) as a launch of its own, after phase 2, for
    the interpreter (which runs programs one after another, so none could wait for another): program p sums slice
    p // N_H2 of H-tile p % N_H2, as the launch's phase-2 program (slice, H-tile) does on the GPU."""
    pid = tl.program_id(0)
    slice_index, c2 = pid // N_H2, pid % N_H2
    off_h2 = c2 * SPAN_H2
    dx_slice_sum(dx_partials_ptr, grad_x_ptr, slice_index, off_h2, tl.minimum(off_h2 + SPAN_H2, H), T, H, N_I2,
                 SLICE_T, BLOCK_H2, (SPAN_H2 + BLOCK_H2 - 1) // BLOCK_H2)


# ---- a tile of several chunks (more H than one chunk holds): loops over the chunks, each loop software-pipelined
# by Triton (STAGES: the next chunks' loads in flight while a chunk's products run)


@triton.jit
def streamed_d_a(down_weight_ptr, grad_output_ptr, off_h1, off_i1, h1_end, T, H: tl.constexpr, I: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_H1: tl.constexpr, BLOCK_I1: tl.constexpr, H_CHUNKS: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, STAGES: tl.constexpr):
    """The partial dAᵀ [BLOCK_I1, BLOCK_T] = Σ_k Wd[chunk k, b1]ᵀ · dy[:, chunk k]ᵀ over the tile's H-chunks (chunk k:
    rows off_h1 + k · BLOCK_H1 onwards, below h1_end), accumulated in registers."""
    acc = tl.zeros((BLOCK_I1, BLOCK_T), dtype=tl.float32)
    for k in tl.range(H_CHUNKS, num_stages=STAGES):
        off_h = off_h1 + k * BLOCK_H1
        w_down = load_block(down_weight_ptr, off_h, off_i1, h1_end, I, I, BLOCK_H1, BLOCK_I1)
        dy = load_block(grad_output_ptr, 0, off_h, T, h1_end, H, BLOCK_T, BLOCK_H1)
        acc = mma(tl.trans(w_down), tl.trans(dy), acc, UPCAST, PRECISION)
    return acc


@triton.jit
def streamed_grad_down(grad_output_ptr, inter, grad_down_weight_ptr, off_h1, off_i1, h1_end, T, H: tl.constexpr,
                       I: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H1: tl.constexpr, BLOCK_I1: tl.constexpr,
                       H_CHUNKS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """dWd[chunk k, b1] = dy[:, chunk k]ᵀ · intermediate for each H-chunk of the tile, stored as it is made (dy read
    again: L2 hits)."""
    for k in range(H_CHUNKS):
        off_h = off_h1 + k * BLOCK_H1
        dy = load_block(grad_output_ptr, 0, off_h, T, h1_end, H, BLOCK_T, BLOCK_H1)
        acc = mma(tl.trans(dy), inter, tl.zeros((BLOCK_H1, BLOCK_I1), dtype=tl.float32), UPCAST, PRECISION)
        store_tile(grad_down_weight_ptr, acc, off_h, off_i1, h1_end, I, I, BLOCK_H1, BLOCK_I1)


@triton.jit
def streamed_dx_partial(gate_weight_ptr, up_weight_ptr, gate_hi, gate_lo, up_hi, up_lo, dx_partial_ptr, off_i2,
                        off_h2, h2_end, t_end, H: tl.constexpr, I: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_I2: tl.constexpr, BLOCK_H2: tl.constexpr, H_CHUNKS: tl.constexpr, UPCAST: tl.constexpr,
                        PRECISION: tl.constexpr, WITH_LO: tl.constexpr, STAGES: tl.constexpr):
    """dx_b2[:, chunk k]ᵀ = Wg[b2, chunk k]ᵀ · dGateᵀ + Wu[b2, chunk k]ᵀ · dUpᵀ for each H-chunk of the tile, stored
    (rows below t_end) as it is made; dGate, dUp [BLOCK_T, BLOCK_I2] as hi/lo pairs (:func:`halves`)."""
    gate_hi_t, gate_lo_t, up_hi_t, up_lo_t = tl.trans(gate_hi), tl.trans(gate_lo), tl.trans(up_hi), tl.trans(up_lo)
    for k in tl.range(H_CHUNKS, num_stages=STAGES):
        off_h = off_h2 + k * BLOCK_H2
        w_gate = load_block(gate_weight_ptr, off_i2, off_h, I, h2_end, H, BLOCK_I2, BLOCK_H2)
        w_up = load_block(up_weight_ptr, off_i2, off_h, I, h2_end, H, BLOCK_I2, BLOCK_H2)
        acc_x = tl.zeros((BLOCK_H2, BLOCK_T), dtype=tl.float32)
        acc_x = mma_pair(acc_x, tl.trans(w_gate), gate_hi_t, gate_lo_t, UPCAST, PRECISION, WITH_LO)
        acc_x = mma_pair(acc_x, tl.trans(w_up), up_hi_t, up_lo_t, UPCAST, PRECISION, WITH_LO)
        store_tile(dx_partial_ptr, tl.trans(acc_x), 0, off_h, t_end, h2_end, H, BLOCK_T, BLOCK_H2)


@triton.jit
def streamed_gate_up_grads(x_ptr, gate_hi, gate_lo, up_hi, up_lo, grad_gate_weight_ptr, grad_up_weight_ptr, off_i2,
                           off_h2, h2_end, T, H: tl.constexpr, I: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_I2: tl.constexpr, BLOCK_H2: tl.constexpr, H_CHUNKS: tl.constexpr,
                           UPCAST: tl.constexpr, PRECISION: tl.constexpr, WITH_LO: tl.constexpr,
                           STAGES: tl.constexpr):
    """dWg[b2, chunk k]ᵀ = x[:, chunk k]ᵀ · dGate and dWu[b2, chunk k]ᵀ = x[:, chunk k]ᵀ · dUp for each H-chunk of the
    tile, stored as they are made."""
    for k in tl.range(H_CHUNKS, num_stages=STAGES):
        off_h = off_h2 + k * BLOCK_H2
        x_t = tl.trans(load_block(x_ptr, 0, off_h, T, h2_end, H, BLOCK_T, BLOCK_H2))
        acc_w = mma_pair(tl.zeros((BLOCK_H2, BLOCK_I2), dtype=tl.float32), x_t, gate_hi, gate_lo, UPCAST, PRECISION,
                         WITH_LO)
        store_tile(grad_gate_weight_ptr, tl.trans(acc_w), off_i2, off_h, I, h2_end, H, BLOCK_I2, BLOCK_H2)
        acc_w = mma_pair(tl.zeros((BLOCK_H2, BLOCK_I2), dtype=tl.float32), x_t, up_hi, up_lo, UPCAST, PRECISION,
                         WITH_LO)
        store_tile(grad_up_weight_ptr, tl.trans(acc_w), off_i2, off_h, I, h2_end, H, BLOCK_I2, BLOCK_H2)


@triton.jit
def load_row(ptr, row, off_n, M, N, stride_m, BLOCK_N: tl.constexpr):
    """ptr[row, off_n : off_n + BLOCK_N] as a 1-D block in ptr's dtype; 0 where row ≥ M or a column ≥ N."""
    cols = off_n + tl.arange(0, BLOCK_N)
    return tl.load(ptr + row * stride_m + cols, mask=(row < M) & (cols < N), other=0.0)


@triton.jit
def store_row(ptr, row, values, off_n, M, N, stride_m, BLOCK_N: tl.constexpr):
    """ptr[row, off_n : off_n + BLOCK_N] = values (in ptr's dtype) where row < M and the column < N."""
    cols = off_n + tl.arange(0, BLOCK_N)
    tl.store(ptr + row * stride_m + cols, values.to(ptr.dtype.element_ty), mask=(row < M) & (cols < N))


@triton.jit
def one_token_kernel(
    grad_output_ptr,  # dy [1, H]
    x_ptr,  # x [1, H]
    gate_weight_ptr, up_weight_ptr,  # Wg, Wu [I, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr, intermediate_ptr,  # saved forward, each [1, I]
    grad_x_ptr,  # out: dx [1, H]
    grad_gate_weight_ptr, grad_up_weight_ptr,  # out: dWg, dWu [I, H]
    grad_down_weight_ptr,  # out: dWd [H, I]
    da_partials_ptr,  # fp32 workspace [N_H1, 1, I]: dA_c, the partial dA of phase-1 H-tile c
    dx_partials_ptr,  # fp32 workspace [N_I2, 1, H]: dx_b, the partial dx of phase-2 I-block b
    counters_ptr,  # int64 [1 + N_I2 + N_H2]: launches, dA arrivals per phase-2 I-block, dx arrivals per H-tile
    trace_ptr,  # int64 [grid, TRACE_SLOTS] (TRACE): when each program reached each of TRACE_POINTS, and its SM
    T,  # tokens: 1 (0: nothing to add, every output written as zeros)
    H: tl.constexpr, I: tl.constexpr,  # hidden and intermediate size
    PHASE: tl.constexpr,  # 0: both phases, waiting between them; 1 or 2: that phase alone (interpreter)
    BLOCK_H1: tl.constexpr, BLOCK_I1: tl.constexpr,  # a phase-1 chunk: Wd rows (H) × columns (I)
    BLOCK_I2: tl.constexpr, BLOCK_H2: tl.constexpr,  # a phase-2 chunk: Wg, Wu rows (I) × columns (H)
    SPAN_H1: tl.constexpr, SPAN_I1: tl.constexpr,  # the H and I a phase-1 tile covers (H: in chunks; I: ≤ its block)
    SPAN_I2: tl.constexpr, SPAN_H2: tl.constexpr,  # the I and H a phase-2 tile covers (I: ≤ its block; H: in chunks)
    N_H1: tl.constexpr, N_I1: tl.constexpr,  # phase-1 tiles along H and I: cdiv(H, SPAN_H1), cdiv(I, SPAN_I1)
    N_I2: tl.constexpr, N_H2: tl.constexpr,  # phase-2 tiles along I and H: cdiv(I, SPAN_I2), cdiv(H, SPAN_H2)
    THREADS: tl.constexpr,  # 32 · num_warps (see arrive)
    TRACE: tl.constexpr,  # stamp the global clock at each of TRACE_POINTS into trace_ptr (GPU only)
    GRAD_DOWN_LATE: tl.constexpr,  # dWd after phase 2's stores (before dx's sum), not before the wait
):
    """:func:`few_tokens_kernel`'s tiles, exchange and waits for one token, every product on the CUDA cores:

        phase 1:  dA_c1[b1]   = Σ_h Wd[h, b1] dy[h]           a sum down the Wd tile's rows, in the tile's layout
                  dWd[c1, b1] = dy[c1] ⊗ intermediate[b1]     an outer product, stored as it lies
        phase 2:  dx_b2[c2]   = Σ_i Wg[i, c2] dGate[i] + Wu[i, c2] dUp[i]
                  dWg[b2, c2] = dGate[b2] ⊗ x[c2],  dWu[b2, c2] = dUp[b2] ⊗ x[c2]

    A tile of one chunk is loaded whole at the start, with everything else that depends on no other program (the
    token's rows); a tile of several chunks is streamed, chunk by chunk, each chunk's products taken as it arrives.
    Products in fp32 from the 16-bit weights and the fp32 dGate, dUp: exact, so both paths (faithful and fast) get the
    same, more precise result. No operand is staged in shared memory and no output tile is transposed: the weight
    tiles stay in the registers they were loaded into, and only the sums down their rows cross threads."""
    pid = tl.program_id(0)
    trace_ptr += pid * (TRACE_END + 2)
    stamp(trace_ptr, 0, TRACE)
    stamp_sm(trace_ptr, TRACE_END + 1, TRACE)
    c1, has_tile1, off_h1, off_i1, h1_end, i1_end = phase1_tile(pid, H, I, SPAN_H1, SPAN_I1, N_H1, N_I1)
    b2, c2, has_tile2, off_i2, off_h2, i2_end, h2_end = phase2_tile(pid, H, I, SPAN_I2, SPAN_H2, N_I2, N_H2)
    TI = T * I
    H_CHUNKS1: tl.constexpr = (SPAN_H1 + BLOCK_H1 - 1) // BLOCK_H1
    H_CHUNKS2: tl.constexpr = (SPAN_H2 + BLOCK_H2 - 1) // BLOCK_H2

    # ---- every load that depends on no other program, at the start; nothing waits for them here
    if PHASE != 2 and H_CHUNKS1 == 1:
        w_down = load_block(down_weight_ptr, off_h1, off_i1, h1_end, i1_end, I, BLOCK_H1, BLOCK_I1)
    if (PHASE != 2) or GRAD_DOWN_LATE:  # (the interpreter's phase 2 alone writes a late dWd)
        if H_CHUNKS1 == 1:
            dy = load_row(grad_output_ptr, 0, off_h1, T, h1_end, H, BLOCK_H1).to(tl.float32)
        inter = load_row(intermediate_ptr, 0, off_i1, T, i1_end, I, BLOCK_I1)
    if PHASE != 1:
        if H_CHUNKS2 == 1:
            w_gate = load_block(gate_weight_ptr, off_i2, off_h2, i2_end, h2_end, H, BLOCK_I2, BLOCK_H2)
            w_up = load_block(up_weight_ptr, off_i2, off_h2, i2_end, h2_end, H, BLOCK_I2, BLOCK_H2)
            x = load_row(x_ptr, 0, off_h2, T, h2_end, H, BLOCK_H2)
        gate = load_row(gate_ptr, 0, off_i2, T, i2_end, I, BLOCK_I2)
        s = load_row(gate_sigmoid_ptr, 0, off_i2, T, i2_end, I, BLOCK_I2)
        gate_silu = load_row(gate_silu_ptr, 0, off_i2, T, i2_end, I, BLOCK_I2)
        up = load_row(up_ptr, 0, off_i2, T, i2_end, I, BLOCK_I2)
    if PHASE == 0:
        launch_arrival = arrive(counters_ptr, True, "relaxed", THREADS)

    # ---- phase 1: the partial dA_c1[b1], then dWd[c1, b1]
    if PHASE != 2:
        if H_CHUNKS1 == 1:
            d_a = tl.sum(w_down.to(tl.float32) * dy[:, None], axis=0)
        else:
            d_a = tl.zeros((BLOCK_I1,), dtype=tl.float32)
            for k in range(H_CHUNKS1):
                off_h = off_h1 + k * BLOCK_H1
                w_down = load_block(down_weight_ptr, off_h, off_i1, h1_end, i1_end, I, BLOCK_H1, BLOCK_I1)
                dy_chunk = load_row(grad_output_ptr, 0, off_h, T, h1_end, H, BLOCK_H1).to(tl.float32)
                d_a += tl.sum(w_down.to(tl.float32) * dy_chunk[:, None], axis=0)
        store_row(da_partials_ptr + c1 * TI, 0, d_a, off_i1, tl.where(has_tile1, T, 0), i1_end, I, BLOCK_I1)
        tl.debug_barrier()  # every thread's partial is stored before the arrivals are counted
        stamp(trace_ptr, 1, TRACE)
        for b in range(off_i1 // SPAN_I2, (i1_end - 1) // SPAN_I2 + 1):
            tl.atomic_add(counters_ptr + 1 + b, 1, mask=has_tile1, sem="release", scope="gpu")
        if not GRAD_DOWN_LATE:
            if H_CHUNKS1 == 1:
                store_tile(grad_down_weight_ptr, dy[:, None] * inter.to(tl.float32)[None, :], off_h1, off_i1, h1_end,
                           i1_end, I, BLOCK_H1, BLOCK_I1)
            else:
                one_token_grad_down(grad_output_ptr, inter, grad_down_weight_ptr, off_h1, off_i1, h1_end, i1_end, T, H,
                                    I, BLOCK_H1, BLOCK_I1, H_CHUNKS1)
        stamp(trace_ptr, 2, TRACE)

    if PHASE != 1:
        if PHASE == 0:  # wait for the phase-1 tiles overlapping I-block b2
            overlapping = (i2_end - 1) // SPAN_I1 - off_i2 // SPAN_I1 + 1
            launch_number = first(launch_arrival) // tl.num_programs(0)
            if has_tile2:
                wait_for(counters_ptr + 1 + b2, (launch_number + 1) * (N_H1 * overlapping))
            stamp(trace_ptr, 3, TRACE)

        # ---- phase 2: the partial dx_b2[c2], then dWg[b2, c2] and dWu[b2, c2]
        if N_H1 <= PARTS_UNROLLED:
            d_a = tl.zeros((BLOCK_I2,), dtype=tl.float32)
            cols = off_i2 + tl.arange(0, BLOCK_I2)
            for c in tl.static_range(N_H1):  # the partials in a fixed order, read past L1 (other programs wrote them)
                d_a += tl.load(da_partials_ptr + c * TI + cols, mask=(T > 0) & (cols < i2_end), other=0.0,
                               cache_modifier=".cg")
        else:
            d_a = tl.sum(summed_partials(da_partials_ptr, TI, 0, off_i2, tl.where(T > 0, 1, 0), i2_end, I, N_H1, 1,
                                         BLOCK_I2), axis=0)
        d_gate, d_up = swiglu_grads(d_a, gate, s, gate_silu, up)
        if H_CHUNKS2 == 1:
            dx = tl.sum(w_gate.to(tl.float32) * d_gate[:, None] + w_up.to(tl.float32) * d_up[:, None], axis=0)
            store_row(dx_partials_ptr + b2 * (T * H), 0, dx, off_h2, tl.where(has_tile2, T, 0), h2_end, H, BLOCK_H2)
        else:
            dx_partial_ptr = dx_partials_ptr + b2 * (T * H)
            for k in range(H_CHUNKS2):
                off_h = off_h2 + k * BLOCK_H2
                w_gate = load_block(gate_weight_ptr, off_i2, off_h, i2_end, h2_end, H, BLOCK_I2, BLOCK_H2)
                w_up = load_block(up_weight_ptr, off_i2, off_h, i2_end, h2_end, H, BLOCK_I2, BLOCK_H2)
                dx = tl.sum(w_gate.to(tl.float32) * d_gate[:, None] + w_up.to(tl.float32) * d_up[:, None], axis=0)
                store_row(dx_partial_ptr, 0, dx, off_h, tl.where(has_tile2, T, 0), h2_end, H, BLOCK_H2)
        tl.debug_barrier()
        arrived = arrive(counters_ptr + 1 + N_I2 + c2, has_tile2, "acq_rel", THREADS)
        stamp(trace_ptr, 4, TRACE)
        if H_CHUNKS2 == 1:
            x = x.to(tl.float32)
            store_tile(grad_gate_weight_ptr, d_gate[:, None] * x[None, :], off_i2, off_h2, i2_end, h2_end, H,
                       BLOCK_I2, BLOCK_H2)
            store_tile(grad_up_weight_ptr, d_up[:, None] * x[None, :], off_i2, off_h2, i2_end, h2_end, H, BLOCK_I2,
                       BLOCK_H2)
        else:
            for k in range(H_CHUNKS2):
                off_h = off_h2 + k * BLOCK_H2
                x = load_row(x_ptr, 0, off_h, T, h2_end, H, BLOCK_H2).to(tl.float32)
                store_tile(grad_gate_weight_ptr, d_gate[:, None] * x[None, :], off_i2, off_h, i2_end, h2_end, H,
                           BLOCK_I2, BLOCK_H2)
                store_tile(grad_up_weight_ptr, d_up[:, None] * x[None, :], off_i2, off_h, i2_end, h2_end, H,
                           BLOCK_I2, BLOCK_H2)
        stamp(trace_ptr, 5, TRACE)
        if GRAD_DOWN_LATE:  # phase 1's dWd tile, while the stores above drain
            if H_CHUNKS1 == 1:
                store_tile(grad_down_weight_ptr, dy[:, None] * inter.to(tl.float32)[None, :], off_h1, off_i1, h1_end,
                           i1_end, I, BLOCK_H1, BLOCK_I1)
            else:
                one_token_grad_down(grad_output_ptr, inter, grad_down_weight_ptr, off_h1, off_i1, h1_end, i1_end, T, H,
                                    I, BLOCK_H1, BLOCK_I1, H_CHUNKS1)

        # ---- the last phase-2 tile of H-tile c2 to arrive: dx[c2] = Σ_b dx_b[c2] in b order
        if has_tile2 & (first(arrived) % N_I2 == N_I2 - 1):
            dx_slice_sum(dx_partials_ptr, grad_x_ptr, 0, off_h2, h2_end, T, H, N_I2, 1, BLOCK_H2, H_CHUNKS2)
    fence(TRACE)
    stamp(trace_ptr, TRACE_END, TRACE)


@triton.jit
def one_token_grad_down(grad_output_ptr, inter, grad_down_weight_ptr, off_h1, off_i1, h1_end, i1_end, T,
                        H: tl.constexpr, I: tl.constexpr, BLOCK_H1: tl.constexpr, BLOCK_I1: tl.constexpr,
                        H_CHUNKS: tl.constexpr):
    """dWd[chunk k, b1] = dy[chunk k] ⊗ intermediate[b1] for each H-chunk of the tile (dy read again: L2 hits)."""
    for k in range(H_CHUNKS):
        off_h = off_h1 + k * BLOCK_H1
        dy = load_row(grad_output_ptr, 0, off_h, T, h1_end, H, BLOCK_H1).to(tl.float32)
        store_tile(grad_down_weight_ptr, dy[:, None] * inter.to(tl.float32)[None, :], off_h, off_i1, h1_end, i1_end, I,
                   BLOCK_H1, BLOCK_I1)


@dataclass(frozen=True)
class FewTokensConfig:
    """Tiles of the few-token design: phase 1 over Wd [H, I], phase 2 over Wg, Wu [I, H] (see the module)."""

    name: ClassVar[str] = "few_tokens"

    block_t: int = 16  # every token in one block, at most 128 (≥ 16 on the GPU: the K side of the dWd, dWg, dWu
    # products; see cuda_cores)
    block_h1: int = 256  # Wd rows (H) of a phase-1 chunk
    block_i1: int = 64  # Wd columns (I) of a phase-1 tile: 128 contiguous bytes per row in bf16
    block_i2: int = 128  # Wg, Wu rows (I) of a phase-2 tile
    block_h2: int = 128  # Wg, Wu columns (H) of a phase-2 chunk: 256 contiguous bytes per row in bf16
    weights_ahead: str = "registers"  # one chunk: Wg, Wu before the wait: "after_phase1", "prefetch" (L2), "registers"
    warps: int = 8
    stages: int = 1
    # the H a phase-1 / phase-2 tile covers (0: one block). Up to its block, the tile is one chunk, held whole, the
    # rest of the block masked off (e.g. 11 phase-1 tiles of 187 rows in 256-row blocks: 11 × 12 = 132 programs at
    # H = 2048, I = 768); beyond it, the tile is streamed in cdiv(span, block) chunks, the last one masked
    span_h1: int = 0
    span_h2: int = 0
    # a cooperative launch (CUDA's guarantee that every program is resident at once, or a launch error): the
    # waits between programs cannot hang when another kernel holds SMs beside this one (another stream)
    cooperative: bool = False
    # the launch count (one atomic per program on one counter) read just before the wait between the phases; else
    # at the start, where the dot operands' staging waits for it (``once``)
    count_late: bool = False
    # one chunk: phase 2's Wg, Wu and x tiles staged in shared memory for the tensor cores before the wait (while it
    # spins); else after it, beside the loads of the dA partials
    stage_before_wait: bool = False
    # the dot operands' staging placed by an identity move in inline PTX instead of a select on a run-time true
    # (``once``): compiled for sm_90 at 16 tokens, 2160 instructions instead of 2640 (faithful; the selects and the
    # byte permutes around them go); not under the interpreter, which runs no inline PTX
    once_by_move: bool = False
    # the saved gate, gate_sigmoid, gate_silu and up tiles loaded after phase 1 (on their way during the wait) instead
    # of at the start, where they hold registers through phase 1
    saved_late: bool = False
    # dx's sum over the I-blocks' partials split by rows over this many phase-2 programs of each H-tile (a power of
    # two, at most block_t and the I-blocks), each waiting for the tile's last partial; else (1) the last program of
    # the H-tile to arrive sums every row alone
    dx_sum_slices: int = 1
    # one token, every product on the CUDA cores in fp32 (:func:`one_token_kernel`): the fields above that place the
    # tensor cores' operands (block_t, weights_ahead, count_late, stage_before_wait, once_by_move) do not apply
    cuda_cores: bool = False
    # with cuda_cores, the I a phase-1 / phase-2 tile covers, at most its block (0: the block): e.g. 96 columns of
    # 128-wide blocks, so that 16 × 8 = 128 programs share H = 2048, I = 768 (the tensor-core form takes whole blocks)
    span_i1: int = 0
    span_i2: int = 0
    # phase 1's dWd tile computed and stored after phase 2's dWg, dWu stores (while they drain, before dx's sum)
    # instead of between the dA arrivals and the wait, where it held up the program's first poll (trace at 1 token:
    # the partial stored at 4.9 µs, dWd at 6.4, the wait over at 7.7)
    grad_down_late: bool = False
    # tiles of several chunks: their chunk loops software-pipelined this deep (Triton's num_stages of the loop: the
    # next chunk_stages - 1 chunks' loads in flight during a chunk's products); 3 ran 10-20% faster than 2 on the
    # H200 at 7 and 64 tokens (notes/p1/design-27.md)
    chunk_stages: int = 3

    @classmethod
    def for_shape(cls, num_tokens: int, hidden_size: int, intermediate_size: int, sms: int) -> FewTokensConfig:
        """The tiles for a call of T tokens (at most 128) at H × I on a GPU of ``sms`` SMs.

        The options, each measured faster at H 2048, I 768 on the H200 (notes/p1/design-05.md, design-09.md to
        design-12.md): one token on the CUDA cores (``cuda_cores``; exact fp32 products) with 256 × 64 phase-1 and
        128 × 128 phase-2 tiles; 2-128 tokens in one token block of 16, 32, 64 or 128 with phase-2 tiles of
        :data:`ONE_BLOCK_PHASE2_TILE`, the saved tiles loaded after phase 1 (``saved_late``), dx's sum split by
        rows (:data:`DX_SUM_SLICES`), the launch count read late and phase 2's operands staged before the wait
        (``count_late``, ``stage_before_wait``), placed by identity moves (``once_by_move``), in a cooperative
        launch.

        Any shape: a tile is one I-block (64 columns of I; widened, with as many fewer H rows per chunk, where
        there are more I-blocks than SMs) by a span of H. Where the tiles of one chunk each fit in ``sms`` programs
        (the benchmark's shape: 8 × 12), that is the tiling; else the H of a tile grows, in chunks of the same
        size, to the fewest chunks that let the tiles fit, spread over as many tiles as fit: the weights are
        streamed through each program a chunk (32 KB) at a time, never held whole. Chunks narrow where their
        accumulators would spill (:func:`streamed_chunk`), and where rows of H are not a multiple of
        :data:`ROW_ALIGN` long (one token then on the tensor cores too)."""
        T, H, I = num_tokens, hidden_size, intermediate_size
        if T == 1 and H % ROW_ALIGN == 0:  # every product on the CUDA cores (one_token_kernel): 1.2-1.9 us faster
            config = cls(cuda_cores=True, cooperative=True)  # on the H200
        else:  # one token block
            block_i2, block_h2 = ONE_BLOCK_PHASE2_TILE
            config = cls(block_t=max(16, triton.next_power_of_2(T)), block_i2=block_i2, block_h2=block_h2,
                         count_late=True, stage_before_wait=True, once_by_move=True, cooperative=True,
                         saved_late=True, dx_sum_slices=DX_SUM_SLICES)
        widest = MAX_BLOCK_I if config.cuda_cores else min(MAX_BLOCK_I, TOKEN_TILE_ELEMENTS // config.block_t)
        block_i1, block_h1 = widened(config.block_i1, config.block_h1, I, sms, widest)
        block_i2, block_h2 = widened(config.block_i2, config.block_h2, I, sms, widest)
        span_h1, span_h2 = h_span(H, cdiv(I, block_i1), block_h1, sms), h_span(H, cdiv(I, block_i2), block_h2, sms)
        if H % ROW_ALIGN:  # rows of H loaded element by element: a tile held whole holds half the H
            if not span_h1:
                block_h1 //= 2
                span_h1 = h_span(H, cdiv(I, block_i1), block_h1, sms)
            if not span_h2:
                block_h2 //= 2
                span_h2 = h_span(H, cdiv(I, block_i2), block_h2, sms)
        if not config.cuda_cores:  # a streamed tile's chunks narrower where its accumulators would not fit
            block_h1 = streamed_chunk(block_h1, span_h1, config.block_t + block_i1)
            block_h2 = streamed_chunk(block_h2, span_h2, config.block_t + block_i2)
        config = dataclasses.replace(config, block_i1=block_i1, block_h1=block_h1, block_i2=block_i2,
                                     block_h2=block_h2, span_h1=span_h1, span_h2=span_h2)
        phase2_i_blocks = config.tiles(H, I)[2]
        if config.block_t == MAX_BLOCK_T and H % 16:  # misaligned shared-memory reads on the H200 (notes/p1/races.md)
            config = dataclasses.replace(config, dx_sum_slices=1)
        while config.dx_sum_slices > min(phase2_i_blocks, config.block_t):  # as many as there are I-blocks to sum
            config = dataclasses.replace(config, dx_sum_slices=config.dx_sum_slices // 2)
        return config

    def supports(self, num_tokens, hidden_size, intermediate_size, dtype, device: Device, *, aligned=True):
        """Why this config cannot run such a call (None: it can). Rows need not be aligned (pointer loads)."""
        T, H, I = num_tokens, hidden_size, intermediate_size
        if dtype not in SIXTEEN_BIT:
            return f"the few-token tiles are sized for 16-bit operands, got {dtype}"
        reason = self.invalid_fields(H, I)
        if reason:
            return reason
        if self.cuda_cores and T > 1:
            return f"cuda_cores takes one token, got {T}"
        if not self.cuda_cores and T > self.block_t:
            return f"every token goes in one token block: {T} tokens against block_t {self.block_t}"
        if device.kind == "cuda" and H % ROW_ALIGN and T > MAX_UNALIGNED_TOKENS:
            return (f"rows of H ({H}) not a multiple of {ROW_ALIGN} elements are loaded element by element, which "
                    f"spills registers beyond {MAX_UNALIGNED_TOKENS} tokens")
        widest = max(self.block_i1, self.block_i2)
        if not self.cuda_cores and self.block_t * widest > TOKEN_TILE_ELEMENTS:
            return (f"its [tokens, I-block] tiles of {self.block_t} × {widest} would exceed {TOKEN_TILE_ELEMENTS} "
                    "elements, which the registers hold")
        grid = self.grid_size(H, I)
        if grid > device.sms:
            return (f"its waits need every program resident: {grid} programs for H {H}, I {I} against "
                    f"{device.sms} SMs")
        if device.kind == "cuda" and device.shared_memory < SHARED_MEMORY:
            return (f"its chunks are sized for {SHARED_MEMORY} bytes of shared memory per program (sm_90), the device "
                    f"has {device.shared_memory}")
        return on_triton(device)

    def invalid_fields(self, hidden_size: int, intermediate_size: int) -> str | None:
        """What is wrong with the fields for H × I (None: nothing)."""
        if self.weights_ahead not in WEIGHTS_AHEAD:
            return f"weights_ahead must be one of {list(WEIGHTS_AHEAD)}, got {self.weights_ahead!r}"
        if not 1 <= self.block_t <= MAX_BLOCK_T:
            return f"block_t must be between 1 and {MAX_BLOCK_T} (one token block), got {self.block_t}"
        for name in ("block_h1", "block_i1", "block_i2", "block_h2"):
            block = getattr(self, name)
            if block < 1 or block & (block - 1):
                return f"{name} must be a power of two, got {block}"
        for phase, elements in ((1, self.block_h1 * self.block_i1), (2, self.block_i2 * self.block_h2)):
            if elements > CHUNK_ELEMENTS:
                return (f"a phase-{phase} chunk of {elements} weight elements exceeds {CHUNK_ELEMENTS}: more would not "
                        f"fit the {SHARED_MEMORY} bytes of shared memory at 128 tokens")
        if self.span_h1 < 0 or self.span_h2 < 0:
            return f"span_h1, span_h2 must be ≥ 0 (0: one block), got {self.span_h1}, {self.span_h2}"
        for name, span, block in (("span_i1", self.span_i1, self.block_i1), ("span_i2", self.span_i2, self.block_i2)):
            if not 0 <= span <= block:
                return f"{name} must be between 1 and its block ({block}), or 0 for the block; got {span}"
        if not self.cuda_cores and (self.span_i1 or self.span_i2):
            return (f"span_i1, span_i2 need cuda_cores (the tensor-core form takes whole I-blocks), got "
                    f"{self.span_i1}, {self.span_i2}")
        slices, i_blocks = self.dx_sum_slices, self.tiles(hidden_size, intermediate_size)[2]
        if slices < 1 or slices & (slices - 1) or slices > min(self.block_t, i_blocks):
            return (f"dx_sum_slices must be a power of two between 1 and block_t ({self.block_t}) and the phase-2 "
                    f"I-blocks ({i_blocks}), got {slices}")
        if self.chunk_stages < 1:
            return f"chunk_stages must be ≥ 1, got {self.chunk_stages}"
        return None

    @property
    def spans(self) -> tuple[int, int]:
        """(SPAN_H1, SPAN_H2): the H each phase's tile covers."""
        return self.span_h1 or self.block_h1, self.span_h2 or self.block_h2

    @property
    def i_spans(self) -> tuple[int, int]:
        """(SPAN_I1, SPAN_I2): the I each phase's tile covers (shorter than its block with ``cuda_cores`` only)."""
        return self.span_i1 or self.block_i1, self.span_i2 or self.block_i2

    @property
    def chunks(self) -> tuple[int, int]:
        """H-chunks per tile of each phase: 1 where the tile is held whole."""
        (span_h1, span_h2) = self.spans
        return cdiv(span_h1, self.block_h1), cdiv(span_h2, self.block_h2)

    def tiles(self, hidden_size: int, intermediate_size: int) -> tuple[int, int, int, int]:
        """(N_H1, N_I1, N_I2, N_H2): phase-1 tiles along H and I, phase-2 tiles along I and H."""
        H, I = hidden_size, intermediate_size
        (span_h1, span_h2), (span_i1, span_i2) = self.spans, self.i_spans
        return cdiv(H, span_h1), cdiv(I, span_i1), cdiv(I, span_i2), cdiv(H, span_h2)

    def grid_size(self, hidden_size: int, intermediate_size: int) -> int:
        """Programs of the launch: one phase-1 tile and one phase-2 tile each, the larger count of the two."""
        n_h1, n_i1, n_i2, n_h2 = self.tiles(hidden_size, intermediate_size)
        return max(n_h1 * n_i1, n_i2 * n_h2)

    def launch(self, hidden_size: int, intermediate_size: int, *, with_lo: bool, interpreter: bool = False,
               trace: bool = False, phase: int = 0) -> tuple[triton.JITFunction, dict]:
        """(kernel, compile-time arguments) of this config's launch at H × I for 16-bit inputs: what :meth:`run`
        passes, and what an offline compile for sm_90 compiles (:func:`kernel_argument_types` gives the rest)."""
        H, I = hidden_size, intermediate_size
        n_h1, n_i1, n_i2, n_h2 = self.tiles(H, I)
        (span_h1, span_h2), (span_i1, span_i2) = self.spans, self.i_spans
        common = dict(H=H, I=I, PHASE=phase, BLOCK_H1=self.block_h1, BLOCK_I1=self.block_i1, BLOCK_I2=self.block_i2,
                      BLOCK_H2=self.block_h2, SPAN_H1=span_h1, SPAN_H2=span_h2, N_H1=n_h1, N_I1=n_i1, N_I2=n_i2,
                      N_H2=n_h2, THREADS=32 * self.warps, TRACE=trace, GRAD_DOWN_LATE=self.grad_down_late)
        if self.cuda_cores:
            return one_token_kernel, dict(common, SPAN_I1=span_i1, SPAN_I2=span_i2)
        ahead = WEIGHTS_AHEAD[self.weights_ahead]
        if interpreter and self.weights_ahead == "prefetch":  # the interpreter runs no inline PTX
            ahead = WEIGHTS_AHEAD["after_phase1"]
        return few_tokens_kernel, dict(
            common, BLOCK_T=self.block_t, WEIGHTS_AHEAD=ahead, UPCAST=interpreter, PRECISION="tf32", WITH_LO=with_lo,
            COUNT_LATE=self.count_late, STAGE_EARLY=self.stage_before_wait,
            ONCE_BY_MOVE=self.once_by_move and not interpreter, SAVED_LATE=self.saved_late,
            DX_SUM_SLICES=self.dx_sum_slices, CHUNK_STAGES=self.chunk_stages,
        )

    def run(self, inputs: Inputs, *, with_lo: bool, out: Outputs, trace: torch.Tensor | None = None) -> None:
        """One launch (two phases as two launches under the interpreter, and the sliced dx sum as a third).
        ``with_lo``: dGate and dUp enter the products as hi/lo pairs (the faithful path). ``trace`` (GPU
        only): an int64 [grid, TRACE_SLOTS] tensor that gets each program's clock at each of TRACE_POINTS
        and its SM (:func:`trace_timeline` sums runs of it up)."""
        x = inputs.x
        T, H = x.shape
        I = inputs.gate_weight.shape[0]
        # meta tensors launch nothing (moe_lib.bench.p1_compile records the launches): no device limits to check
        reason = self.supports(T, H, I, x.dtype, INTERPRETER_DEVICE if x.is_meta else device_of(x))
        if reason is not None:
            raise ValueError(f"config: {reason}")
        n_h1, n_i1, n_i2, n_h2 = self.tiles(H, I)
        grid = self.grid_size(H, I)
        interpreter = interpreter_enabled()
        if trace is not None and (interpreter or trace.shape != (grid, TRACE_SLOTS) or trace.dtype != torch.int64):
            raise ValueError(f"trace: expected an int64 tensor of shape ({grid}, {TRACE_SLOTS}) on a GPU, got "
                             f"{tuple(trace.shape)} {trace.dtype} under {'the interpreter' if interpreter else 'CUDA'}")
        da_partials = runtime.allocate((n_h1, T, I), dtype=torch.float32, device=x.device)
        dx_partials = runtime.allocate((n_i2, T, H), dtype=torch.float32, device=x.device)
        # one counter set per tiling: the counts per launch depend on it
        blocks = (self.block_h1, self.block_i1, self.block_i2, self.block_h2)
        slot = f"few-tokens counters H={H} I={I} blocks {blocks} spans {self.spans} {self.i_spans}"
        counters = SplitWorkspace.counters(slot, 1, 2 * (1 + n_i2 + n_h2), x.device).view(torch.int64)
        launch_options = dict(num_warps=self.warps, num_stages=self.stages,
                              **({"launch_cooperative_grid": True} if self.cooperative and not interpreter else {}))
        for phase in (1, 2) if interpreter else (0,):
            kernel, constexprs = self.launch(H, I, with_lo=with_lo, interpreter=interpreter, trace=trace is not None,
                                             phase=phase)
            kernel[(grid,)](*inputs, *out, da_partials, dx_partials, counters,
                            counters if trace is None else trace,  # no trace: a pointer never written
                            T, **constexprs, **launch_options)
        slices = 1 if self.cuda_cores else self.dx_sum_slices
        if interpreter and slices > 1 and T > 0:  # the sliced dx sum after phase 2 (on the GPU: inside the launch)
            dx_slices_kernel[(slices * n_h2,)](dx_partials, out.grad_x, T, H, n_i2, n_h2, self.spans[1], slices,
                                               self.block_t // slices, self.block_h2, num_warps=self.warps)


def kernel_argument_types(kernel, element: str = "bf16") -> dict[str, str]:
    """The Triton type of each run-time argument of :func:`few_tokens_kernel` or :func:`one_token_kernel` for inputs
    of ``element`` type (what an offline compile needs besides :meth:`FewTokensConfig.launch`)."""

    def kind(name: str) -> str:
        if name.endswith("partials_ptr"):
            return "*fp32"
        if name in ("counters_ptr", "trace_ptr"):
            return "*i64"
        return f"*{element}" if name.endswith("_ptr") else "i32"

    return {param.name: kind(param.name) for param in kernel.params if not param.is_constexpr}


# one token block: dx's sum over the phase-2 I-blocks split by rows over this many programs of each H-tile (fewer
# where there are fewer I-blocks). On the H200 by graph replay, two rounds (notes/p1/design-11.md), with the
# 128-row phase-2 tiles and 4 slices: faithful 40.5-41.4 us against 46.9-47.5 at 128 tokens, 37.4-38.2 against
# 42.0-42.1 at 96, 28.6-28.7 against 31.5-31.9 at 64, 21.8-22.0 against 23.5-23.6 at 32, 19.5-19.7 against 20.1 at
# 16; fast 20.9-21.1 against 22.3-22.4 at 32, 19.0-19.1 against 19.5-19.8 at 16; 2 slices took half of that gain.
# With the 64-row tiles (ONE_BLOCK_PHASE2_TILE, 12 I-blocks) 8 slices, 4 were 0.3-1.6 us slower at 16-64 tokens
DX_SUM_SLICES = 8
# one token block: phase 2's tiles (Wg, Wu rows of I, columns of H): 64 × 256 instead of 128 × 128, so that each
# program sums half the dA partial bytes (64 of I's columns over the same 8 H-blocks; at 128 tokens 256 KB against
# 512 KB, which ncu showed the launch waiting on) and dx's rows get 12 partials from 8 column blocks. On the H200 by
# graph replay, two runs (notes/p1/design-12.md): faithful 18.7-18.9 us against 19.5-19.6 at 16 tokens, 20.2-21.2
# against 22.1-22.2 at 32, 24.7 against 26.4 at 48, 27.1-27.6 against 28.3 at 64, a tie at 2 and 96-128; fast 17.1
# against 17.6 at 4, 18.2-18.6 against 18.9-19.0 at 16, 19.6-20.6 against 21.2 at 32
ONE_BLOCK_PHASE2_TILE = (64, 256)
MAX_BLOCK_T = 128  # every token in one block (the chooser sends at most 128 here)
# rows of H a multiple of this many elements (16 bytes) load in vectors. Shorter steps load element by element
# and spill sooner (compiled for sm_90): one_token_kernel 304 bytes of stack at H 16382, 5 KB at H 3001, so one token
# takes the tensor cores' form there, and a tile held whole half the H (544 bytes at H 3001, none with half); beyond
# MAX_UNALIGNED_TOKENS tokens every tiling tried spilled (8 bytes to 1.7 KB at H 3001, 64-128 tokens)
ROW_ALIGN = 8
MAX_UNALIGNED_TOKENS = 16
# the weight elements of one chunk: 32 KB in bf16, what the benchmark's tiles hold (256 × 64 of Wd, 64 × 256 of Wg and
# of Wu); compiled for sm_90 within the shared memory at every T to 128 (notes/p1/design-27.md)
CHUNK_ELEMENTS = 16384
MAX_BLOCK_I = 256  # I-blocks widen to this at most (then 64 H rows or columns per chunk)
# a program's [tokens, I-block] tiles (dA, the saved tiles, dGate, dUp) at most this many elements: at 128 tokens
# 128-wide I-blocks spilled registers, compiled for sm_90 (notes/p1/design-27.md)
TOKEN_TILE_ELEMENTS = 8192
# a streamed chunk's accumulators, H-chunk × (tokens + I-block) fp32 elements, at most this many (80 registers a
# thread at 8 warps): beyond it the kernel spilled at 64 tokens, compiled for sm_90 (notes/p1/design-27.md)
ACCUMULATOR_ELEMENTS = 20480
SHARED_MEMORY = 232448  # bytes of shared memory per program the chunks are sized for (sm_90's opt-in limit)
H_SPAN_ALIGN = 64  # a tile's H span of several chunks, a multiple of this (128-byte lines in bf16)


def widened(block_i: int, block_h: int, intermediate_size: int, sms: int, widest: int) -> tuple[int, int]:
    """(block_i, block_h): the I-block doubled, and the H-chunk halved (the same elements), while there are more
    I-blocks than SMs and the I-block is narrower than ``widest``."""
    while cdiv(intermediate_size, block_i) > sms and block_i < widest:
        block_i, block_h = 2 * block_i, block_h // 2
    return block_i, block_h


def streamed_chunk(block_h: int, span_h: int, other_side: int) -> int:
    """The H-chunk of a tile that spans ``span_h`` (0: one chunk, kept as it is): halved while a chunk's
    accumulators, block_h × ``other_side`` fp32 elements (dx's [chunk, tokens] and dWg's [chunk, I-block] in phase
    2, dWd's and the chunk's dy in phase 1), exceed ACCUMULATOR_ELEMENTS."""
    while span_h and block_h > 16 and block_h * other_side > ACCUMULATOR_ELEMENTS:
        block_h //= 2
    return block_h


def h_span(hidden_size: int, i_blocks: int, block_h: int, sms: int) -> int:
    """The H of a tile: one chunk (0, the block) where the tiles of one chunk fit the SMs beside ``i_blocks``
    I-blocks; else H spread over as many tiles as fit (one where even that many do not), the span a multiple of
    H_SPAN_ALIGN, which the tile streams in chunks of ``block_h``."""
    h_tiles = max(1, sms // i_blocks)
    if cdiv(hidden_size, block_h) <= h_tiles:
        return 0
    return cdiv(cdiv(hidden_size, h_tiles), H_SPAN_ALIGN) * H_SPAN_ALIGN



def trace_timeline(traces: torch.Tensor) -> dict[str, tuple[float, float]]:
    """What a traced launch spent where: ``traces`` int64 [runs, grid, TRACE_SLOTS] (``run(..., trace=)`` of
    several runs, zero where a program never reached a point). For each of TRACE_POINTS, (the median program,
    the latest program) in µs since the run's first program started, each the median over the runs."""
    times = traces[..., : len(TRACE_POINTS)].double()
    times = torch.where(traces[..., : len(TRACE_POINTS)] > 0, times, torch.nan)
    since_start = (times - times[..., 0].amin(dim=1)[:, None, None]) / 1e3  # [runs, grid, points], µs
    median_program = since_start.nanquantile(0.5, dim=1).nanmedian(dim=0).values
    latest_program = torch.where(since_start.isnan(), -torch.inf, since_start).amax(dim=1).nanmedian(dim=0).values
    return {point: (float(m), float(latest)) for point, m, latest in zip(TRACE_POINTS, median_program, latest_program,
                                                                         strict=True)}
