"""A probe for launch 2's products in Gluon: warp-specialised TMA loads and warpgroup MMAs, with the hi/lo halves.

    PYTHONPATH=. python scripts/p1_gluon_probe.py --compile-only [--variants ...]  # sm_90 on the CPU
    PYTHONPATH=. python scripts/p1_gluon_probe.py [--tokens 2447,8192]          # on a GPU: each product alone
    PYTHONPATH=. python scripts/p1_gluon_probe.py --launch2 [--tokens ...]      # on a GPU: launch 2 whole

The faithful path's launch 2 runs two products with both halves of dGate, dUp (``data/results/NOTES.md``, design 4):

    [dWg; dWu] = Σ_t [dG | dU]_hi[t]ᵀ x[t] + [dG | dU]_lo[t]ᵀ x[t]      M = 2I, N = H, K = T   (A read transposed)
    dx         = [dG | dU]_hi · [Wg; Wu] + [dG | dU]_lo · [Wg; Wu]       M = T,  N = H, K = 2I

ncu put the Triton version (cp.async pipeline, every warp loading and multiplying) at 72–74% tensor-pipe activity,
with 29–31% of its stalls on the pipeline's CTA barrier. Here one warp only issues TMA loads into a ring of shared
memory buffers (``ready``/``empty`` mbarriers per buffer), and two warpgroups only issue wgmma: per K step
``acc += A_hi·B`` and ``acc += A_lo·B`` on the same B tile, then wait until the step before is done and hand its
buffer back; each output tile stored by TMA. Launch 2 whole (``--launch2``) runs the weight-gradient tiles, then the
dx tiles, one per program (``launch2_kernel``), or on a persistent grid with one tile kind per program, or with two
warpgroups taking tiles in turn (ping-pong). Each program's tile kind gets its own warp-specialised region: with
both kinds' loops in one region ptxas serialises the wgmma (``--compile-only`` reports it, as it reports registers,
stack and shared memory). Every output is checked against float64 of (hi + lo)·B and timed by CUDA-graph replay after
an L2 flush, beside cuBLAS running the same arithmetic as one bf16 GEMM per product ([hi | lo] against [B; B]) and,
for launch 2 whole, the faithful path's Triton launch 2. Prints one table; with $OUT set, writes it as JSON there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moe_lib.swiglu_down.gluon_launch2 import load_steps, mma_steps, ring_barriers, store_tile

H, I = 2048, 768
# name -> (BLOCK_M, BLOCK_N, BLOCK_K, buffers, warps of the MMA partition, maxnreg, K steps of MMAs kept in flight)
VARIANTS = {
    "m128n256k64b2": (128, 256, 64, 2, 8, 168, 1),
    "m128n256k32b4": (128, 256, 32, 4, 8, 168, 1),
    "m128n256k32b4f2": (128, 256, 32, 4, 8, 168, 2),
    "m128n128k64b4": (128, 128, 64, 4, 8, 168, 1),
    "m128n128k64b4f2": (128, 128, 64, 4, 8, 168, 2),
    "m128n128k64b4w4": (128, 128, 64, 4, 4, 232, 1),
}
# the ping-pong launch's: (BLOCK_M, BLOCK_N, BLOCK_K, buffers, 4 warps per MMA warpgroup, maxnreg, in flight);
# each warpgroup holds a BLOCK_M × BLOCK_N fp32 accumulator (128 registers a thread at 128 × 128 or 64 × 256)
PINGPONG_VARIANTS = {
    "pp_m128n128k64b3": (128, 128, 64, 3, 4, 168, 1),
    "pp_m64n256k64b3": (64, 256, 64, 3, 4, 168, 1),
    "pp_m128n128k32b6": (128, 128, 32, 6, 4, 168, 1),
}
VARIANTS.update(PINGPONG_VARIANTS)
# launch 2's variants whose output tile is staged in the ring's B buffers once the main loop is done, instead of
# a buffer of its own (64 KB at 128 × 256): room for 3 buffers of 64-deep K steps (192 KB)
C_IN_RING_VARIANTS = {"m128n256k64b3r": (128, 256, 64, 3, 8, 168, 1)}
VARIANTS.update(C_IN_RING_VARIANTS)
# the variants tried as one launch of both products' tiles (--launch2)
LAUNCH2_VARIANTS = ["m128n256k32b4", "m128n256k32b4f2", "m128n128k64b4", "m128n128k64b4f2"]


@gluon.jit
def load_partition(a_desc, a_lo_desc, b_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, k_steps,
                   A_K_MAJOR: gl.constexpr, WITH_LO: gl.constexpr, step0=0):  # fmt: skip
    """One warp: for each K step, wait until the ring's next buffer is free, then load A (and A_lo) and B into it
    (``step0``: the ring's steps before this tile; :func:`moe_lib.swiglu_down.gluon_launch2.load_steps`)."""
    load_steps(a_desc, a_lo_desc, b_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, k_steps, step0,
               A_K_MAJOR, WITH_LO)  # fmt: skip


@gluon.jit
def mma_and_store(a_bufs, a_lo_bufs, b_bufs, ready, empty, c_desc, c_smem, off_m, off_n, k_steps,
                  A_K_MAJOR: gl.constexpr, IN_FLIGHT: gl.constexpr, num_warps: gl.constexpr, step0=0,
                  WAIT_STORE: gl.constexpr = True):  # fmt: skip
    """One tile with both halves: its accumulator lives and dies here, so that no branch of the caller hands it on
    (a value merged out of a branch puts moves between the wgmma of a pipeline stage, and ptxas then serialises
    them: each wgmma waits for the one before)."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    acc = mma_steps(a_bufs, a_lo_bufs, b_bufs, ready, empty, k_steps, acc, A_K_MAJOR, 1, IN_FLIGHT, step0)
    store_tile(acc, c_desc, c_smem, off_m, off_n)
    if WAIT_STORE:  # the program's last tile: its store must leave shared memory before the program ends
        tma.store_wait(pendings=0)


@gluon.jit
def mma_partition(a_bufs, a_lo_bufs, b_bufs, ready, empty, c_desc, c_smem, off_m, off_n, k_steps,
                  A_K_MAJOR: gl.constexpr, WITH_LO: gl.constexpr, IN_FLIGHT: gl.constexpr,
                  num_warps: gl.constexpr):  # fmt: skip
    """The warpgroups: per K step acc += A·B (and A_lo·B), IN_FLIGHT steps' MMAs in flight, then the tile's store."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    acc = mma_steps(a_bufs, a_lo_bufs, b_bufs, ready, empty, k_steps, acc, A_K_MAJOR, WITH_LO, IN_FLIGHT)
    store_tile(acc, c_desc, c_smem, off_m, off_n)
    tma.store_wait(pendings=0)


@gluon.jit
def hilo_gemm_kernel(a_desc, a_lo_desc, b_desc, c_desc, K, A_K_MAJOR: gl.constexpr, WITH_LO: gl.constexpr,
                     BUFFERS: gl.constexpr, IN_FLIGHT: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """C[M, N] = A·B (+ A_lo·B), one [BLOCK_M, BLOCK_N] tile per program, tiles in column-major order (the programs
    running at once share their B columns)."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[0]
    LO_BUFFERS: gl.constexpr = BUFFERS if WITH_LO else 1
    tiles_m = gl.cdiv(c_desc.shape[0], BLOCK_M)
    pid = gl.program_id(0)
    off_m = (pid % tiles_m) * BLOCK_M
    off_n = (pid // tiles_m) * BLOCK_N
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    a_lo_bufs = gl.allocate_shared_memory(a_lo_desc.dtype, [LO_BUFFERS] + a_lo_desc.block_type.shape,
                                          a_lo_desc.layout)  # fmt: skip
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [BUFFERS] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready, empty = ring_barriers(BUFFERS)
    k_steps = gl.cdiv(K, BLOCK_K)
    gl.warp_specialize([
        (mma_partition, (a_bufs, a_lo_bufs, b_bufs, ready, empty, c_desc, c_smem, off_m, off_n, k_steps, A_K_MAJOR,
                         WITH_LO, IN_FLIGHT, num_warps)),
        (load_partition, (a_desc, a_lo_desc, b_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, k_steps,
                          A_K_MAJOR, WITH_LO)),
    ], [1], [40])  # fmt: skip


@gluon.jit
def launch2_rings(gu_a, dx_a, x_desc, BUFFERS: gl.constexpr):
    """Launch 2's ring buffers: A and A_lo as one allocation each, seen as [BLOCK_M, BLOCK_K] tiles (dx) or
    [BLOCK_K, BLOCK_M] tiles (the weight gradients), and B."""
    a_mk_bufs = gl.allocate_shared_memory(dx_a.dtype, [BUFFERS] + dx_a.block_type.shape, dx_a.layout)
    a_lo_mk_bufs = gl.allocate_shared_memory(dx_a.dtype, [BUFFERS] + dx_a.block_type.shape, dx_a.layout)
    a_km_bufs = a_mk_bufs._reinterpret(gu_a.dtype, [BUFFERS] + gu_a.block_type.shape, gu_a.layout)
    a_lo_km_bufs = a_lo_mk_bufs._reinterpret(gu_a.dtype, [BUFFERS] + gu_a.block_type.shape, gu_a.layout)
    b_bufs = gl.allocate_shared_memory(x_desc.dtype, [BUFFERS] + x_desc.block_type.shape, x_desc.layout)
    return a_mk_bufs, a_lo_mk_bufs, a_km_bufs, a_lo_km_bufs, b_bufs


@gluon.jit
def launch2_kernel(gu_a, gu_a_lo, x_desc, gu_c, dx_a, dx_a_lo, w_desc, dx_c, T, BUFFERS: gl.constexpr,
                   IN_FLIGHT: gl.constexpr, num_warps: gl.constexpr, C_IN_RING: gl.constexpr = False):  # fmt: skip
    """Launch 2 with both halves: [dWg; dWu] = hiᵀ·x + loᵀ·x tiles first (K = T), then dx = hi·W + lo·W tiles
    (K = 2I), one tile per program; the A buffers are one allocation seen as [BLOCK_M, BLOCK_K] tiles (dx) or
    [BLOCK_K, BLOCK_M] tiles (the weight gradients)."""
    BLOCK_M: gl.constexpr = gu_c.block_type.shape[0]
    BLOCK_N: gl.constexpr = gu_c.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
    gu_tiles_m = gl.cdiv(gu_c.shape[0], BLOCK_M)
    gu_tiles = gu_tiles_m * gl.cdiv(gu_c.shape[1], BLOCK_N)
    dx_tiles_m = gl.cdiv(dx_c.shape[0], BLOCK_M)
    is_dx, off_m, off_n, k_steps = tile_of(gl.program_id(0), gu_tiles, gu_tiles_m, dx_tiles_m, gl.cdiv(T, BLOCK_K),
                                           gl.cdiv(dx_a.shape[1], BLOCK_K), BLOCK_M, BLOCK_N)  # fmt: skip
    a_mk_bufs, a_lo_mk_bufs, a_km_bufs, a_lo_km_bufs, b_bufs = launch2_rings(gu_a, dx_a, x_desc, BUFFERS)
    if C_IN_RING:  # every load has landed and every MMA is done before the tile is stored
        c_smem = b_bufs._reinterpret(gu_c.dtype, gu_c.block_type.shape, gu_c.layout)
    else:
        c_smem = gl.allocate_shared_memory(gu_c.dtype, gu_c.block_type.shape, gu_c.layout)
    ready, empty = ring_barriers(BUFFERS)
    # one warp-specialised region per tile kind, chosen at run time: with both kinds' loops in one region the merged
    # values put moves between the wgmma of a pipeline stage, and ptxas serialises them (compiled for sm_90)
    if is_dx:
        gl.warp_specialize([
            (mma_and_store, (a_mk_bufs, a_lo_mk_bufs, b_bufs, ready, empty, dx_c, c_smem, off_m, off_n, k_steps, True,
                             IN_FLIGHT, num_warps)),
            (load_partition, (dx_a, dx_a_lo, w_desc, a_mk_bufs, a_lo_mk_bufs, b_bufs, ready, empty, off_m, off_n,
                              k_steps, True, 1)),
        ], [1], [40])  # fmt: skip
    else:
        gl.warp_specialize([
            (mma_and_store, (a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, gu_c, c_smem, off_m, off_n, k_steps,
                             False, IN_FLIGHT, num_warps)),
            (load_partition, (gu_a, gu_a_lo, x_desc, a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, off_m, off_n,
                              k_steps, False, 1)),
        ], [1], [40])  # fmt: skip


@gluon.jit
def tile_of(t, gu_tiles, gu_tiles_m, dx_tiles_m, gu_k_steps, dx_k_steps, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr):  # fmt: skip
    """Tile ``t`` of launch 2: (is a dx tile, first row, first column, K steps); the weight-gradient tiles first."""
    is_dx = t >= gu_tiles
    tile = gl.where(is_dx, t - gu_tiles, t)
    tiles_m = gl.where(is_dx, dx_tiles_m, gu_tiles_m)
    return is_dx, (tile % tiles_m) * BLOCK_M, (tile // tiles_m) * BLOCK_N, gl.where(is_dx, dx_k_steps, gu_k_steps)


@gluon.jit
def kind_load_partition(a_desc, a_lo_desc, b_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, first, tiles, stride,
                        tiles_m, k_steps, A_K_MAJOR: gl.constexpr, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr):  # fmt: skip
    """The loading warp of a persistent program's tiles of one kind (first, first + stride, ...): it runs ahead into
    the next tile's K steps while the warpgroups store the last one."""
    step0 = 0
    for t in range(first, tiles, stride):
        load_partition(a_desc, a_lo_desc, b_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, (t % tiles_m) * BLOCK_M,
                       (t // tiles_m) * BLOCK_N, k_steps, A_K_MAJOR, 1, step0)  # fmt: skip
        step0 += k_steps


@gluon.jit
def kind_mma_partition(a_bufs, a_lo_bufs, b_bufs, ready, empty, c_desc, c_smem, first, tiles, stride, tiles_m, k_steps,
                       A_K_MAJOR: gl.constexpr, IN_FLIGHT: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    step0 = 0
    for t in range(first, tiles, stride):
        mma_and_store(a_bufs, a_lo_bufs, b_bufs, ready, empty, c_desc, c_smem, (t % tiles_m) * BLOCK_M,
                      (t // tiles_m) * BLOCK_N, k_steps, A_K_MAJOR, IN_FLIGHT, num_warps, step0, False)  # fmt: skip
        step0 += k_steps
    tma.store_wait(pendings=0)


@gluon.jit
def launch2_persistent_kernel(gu_a, gu_a_lo, x_desc, gu_c, dx_a, dx_a_lo, w_desc, dx_c, T, gu_programs,
                              BUFFERS: gl.constexpr, IN_FLIGHT: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """:func:`launch2_kernel` on a persistent grid: the first ``gu_programs`` programs take the weight-gradient tiles
    in turn, the others the dx tiles (each program one tile kind, so one warp-specialised region whose wgmma ptxas
    leaves unserialised)."""
    BLOCK_M: gl.constexpr = gu_c.block_type.shape[0]
    BLOCK_N: gl.constexpr = gu_c.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
    gu_tiles_m = gl.cdiv(gu_c.shape[0], BLOCK_M)
    dx_tiles_m = gl.cdiv(dx_c.shape[0], BLOCK_M)
    a_mk_bufs, a_lo_mk_bufs, a_km_bufs, a_lo_km_bufs, b_bufs = launch2_rings(gu_a, dx_a, x_desc, BUFFERS)
    c_smem = gl.allocate_shared_memory(gu_c.dtype, gu_c.block_type.shape, gu_c.layout)
    ready, empty = ring_barriers(BUFFERS)
    pid = gl.program_id(0)
    if pid < gu_programs:
        tiles = gu_tiles_m * gl.cdiv(gu_c.shape[1], BLOCK_N)
        k_steps = gl.cdiv(T, BLOCK_K)
        gl.warp_specialize([
            (kind_mma_partition, (a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, gu_c, c_smem, pid, tiles, gu_programs,
                                  gu_tiles_m, k_steps, False, IN_FLIGHT, num_warps)),
            (kind_load_partition, (gu_a, gu_a_lo, x_desc, a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, pid, tiles,
                                   gu_programs, gu_tiles_m, k_steps, False, BLOCK_M, BLOCK_N)),
        ], [1], [40])  # fmt: skip
    else:
        tiles = dx_tiles_m * gl.cdiv(dx_c.shape[1], BLOCK_N)
        k_steps = gl.cdiv(dx_a.shape[1], BLOCK_K)
        first = pid - gu_programs
        stride = gl.num_programs(0) - gu_programs
        gl.warp_specialize([
            (kind_mma_partition, (a_mk_bufs, a_lo_mk_bufs, b_bufs, ready, empty, dx_c, c_smem, first, tiles, stride,
                                  dx_tiles_m, k_steps, True, IN_FLIGHT, num_warps)),
            (kind_load_partition, (dx_a, dx_a_lo, w_desc, a_mk_bufs, a_lo_mk_bufs, b_bufs, ready, empty, first, tiles,
                                   stride, dx_tiles_m, k_steps, True, BLOCK_M, BLOCK_N)),
        ], [1], [40])  # fmt: skip


@gluon.jit
def pingpong_load_partition(gu_a, gu_a_lo, x_desc, dx_a, dx_a_lo, w_desc, a_mk_bufs, a_lo_mk_bufs, a_km_bufs,
                            a_lo_km_bufs, b_bufs, ready, empty, tile_counts):  # fmt: skip
    """The ping-pong launch's loading warp: every tile of the program (pid, pid + programs, ...), of either kind."""
    BLOCK_M: gl.constexpr = gu_a.block_type.shape[1]
    BLOCK_N: gl.constexpr = x_desc.block_type.shape[1]
    tiles, gu_tiles, gu_tiles_m, dx_tiles_m, gu_k_steps, dx_k_steps = tile_counts
    step0 = 0
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        is_dx, off_m, off_n, k_steps = tile_of(t, gu_tiles, gu_tiles_m, dx_tiles_m, gu_k_steps, dx_k_steps, BLOCK_M,
                                               BLOCK_N)  # fmt: skip
        if is_dx:
            load_partition(dx_a, dx_a_lo, w_desc, a_mk_bufs, a_lo_mk_bufs, b_bufs, ready, empty, off_m, off_n, k_steps,
                           True, 1, step0)  # fmt: skip
        else:
            load_partition(gu_a, gu_a_lo, x_desc, a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, off_m, off_n,
                           k_steps, False, 1, step0)  # fmt: skip
        step0 += k_steps


@gluon.jit
def pingpong_consumer(a_mk_bufs, a_lo_mk_bufs, a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, gu_c, dx_c, c_smem,
                      order, tile_counts, CONSUMER: gl.constexpr, IN_FLIGHT: gl.constexpr):  # fmt: skip
    """One warpgroup of the ping-pong launch: of this program's tiles (pid, pid + programs, ...) the ones whose
    place in that list has CONSUMER's parity; its epilogue runs while the other warpgroup multiplies. The two take
    turns at the main loop (``order``: each waits for the other's last main loop to end), so that neither waits on
    a ring buffer more than one use ahead, where a barrier's phase parity could not tell the uses apart."""
    BLOCK_M: gl.constexpr = gu_c.block_type.shape[0]
    BLOCK_N: gl.constexpr = gu_c.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    tiles, gu_tiles, gu_tiles_m, dx_tiles_m, gu_k_steps, dx_k_steps = tile_counts
    step0 = 0
    place = 0
    turn = 0
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        is_dx, off_m, off_n, k_steps = tile_of(t, gu_tiles, gu_tiles_m, dx_tiles_m, gu_k_steps, dx_k_steps, BLOCK_M,
                                               BLOCK_N)  # fmt: skip
        if place % 2 == CONSUMER:
            # consumer 0's first wait passes on the fresh barrier; consumer 1's waits for consumer 0's first turn
            mbarrier.wait(order.index(CONSUMER), (turn & 1) ^ (1 - CONSUMER))
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
            if is_dx:
                acc = mma_steps(a_mk_bufs, a_lo_mk_bufs, b_bufs, ready, empty, k_steps, acc, True, 1, IN_FLIGHT,
                                step0)  # fmt: skip
                mbarrier.arrive(order.index(1 - CONSUMER), count=1)
                store_tile(acc, dx_c, c_smem, off_m, off_n)
            else:
                acc = mma_steps(a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, k_steps, acc, False, 1, IN_FLIGHT,
                                step0)  # fmt: skip
                mbarrier.arrive(order.index(1 - CONSUMER), count=1)
                store_tile(acc, gu_c, c_smem, off_m, off_n)
            turn += 1
        step0 += k_steps
        place += 1
    tma.store_wait(pendings=0)


@gluon.jit
def launch2_pingpong_kernel(gu_a, gu_a_lo, x_desc, gu_c, dx_a, dx_a_lo, w_desc, dx_c, T, BUFFERS: gl.constexpr,
                            IN_FLIGHT: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """:func:`launch2_persistent_kernel` with two MMA warpgroups (num_warps = 4 each) taking the program's tiles in
    turn, each with its own accumulator and output buffer, and one loading warp feeding both from one ring."""
    gl.static_assert(num_warps == 4, "the default partition is one of the two MMA warpgroups")
    BLOCK_M: gl.constexpr = gu_c.block_type.shape[0]
    BLOCK_N: gl.constexpr = gu_c.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
    gu_tiles_m = gl.cdiv(gu_c.shape[0], BLOCK_M)
    gu_tiles = gu_tiles_m * gl.cdiv(gu_c.shape[1], BLOCK_N)
    dx_tiles_m = gl.cdiv(dx_c.shape[0], BLOCK_M)
    tiles = gu_tiles + dx_tiles_m * gl.cdiv(dx_c.shape[1], BLOCK_N)
    tile_counts = (tiles, gu_tiles, gu_tiles_m, dx_tiles_m, gl.cdiv(T, BLOCK_K), gl.cdiv(dx_a.shape[1], BLOCK_K))
    a_mk_bufs, a_lo_mk_bufs, a_km_bufs, a_lo_km_bufs, b_bufs = launch2_rings(gu_a, dx_a, x_desc, BUFFERS)
    c_smem_0 = gl.allocate_shared_memory(gu_c.dtype, gu_c.block_type.shape, gu_c.layout)
    c_smem_1 = gl.allocate_shared_memory(gu_c.dtype, gu_c.block_type.shape, gu_c.layout)
    ready = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (pingpong_consumer, (a_mk_bufs, a_lo_mk_bufs, a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, gu_c, dx_c,
                             c_smem_0, order, tile_counts, 0, IN_FLIGHT)),
        (pingpong_consumer, (a_mk_bufs, a_lo_mk_bufs, a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, gu_c, dx_c,
                             c_smem_1, order, tile_counts, 1, IN_FLIGHT)),
        (pingpong_load_partition, (gu_a, gu_a_lo, x_desc, dx_a, dx_a_lo, w_desc, a_mk_bufs, a_lo_mk_bufs,
                                   a_km_bufs, a_lo_km_bufs, b_bufs, ready, empty, tile_counts)),
    ], [4, 1], [232, 40])  # fmt: skip


def launch2_descriptors(hi, lo, x, w, grad_gate_up, grad_x, block):
    gu = descriptors(hi, lo, x, grad_gate_up, False, block)
    dx = descriptors(hi, lo, w, grad_x, True, block)
    return (*gu, *dx)


def launch2(hi, lo, x, w, grad_gate_up, grad_x, *, variant: str, persistent: bool = False):
    """[dWg; dWu] = (hi + lo)ᵀ·x and dx = (hi + lo)·W in one launch; hi, lo [T, 2I], x [T, H], W [2I, H]."""
    block_m, block_n, block_k, buffers, warps, maxnreg, in_flight = VARIANTS[variant]
    descs = launch2_descriptors(hi, lo, x, w, grad_gate_up, grad_x, (block_m, block_n, block_k))
    tiles = sum(triton.cdiv(c.shape[0], block_m) * triton.cdiv(c.shape[1], block_n) for c in (grad_gate_up, grad_x))
    programs = min(tiles, torch.cuda.get_device_properties(hi.device).multi_processor_count)
    if variant in PINGPONG_VARIANTS:
        launch2_pingpong_kernel[(programs,)](*descs, x.shape[0], buffers, in_flight, num_warps=warps, maxnreg=maxnreg)
    elif persistent:
        launch2_persistent_kernel[(programs,)](*descs, x.shape[0], persistent_split(x.shape[0], block_m, block_n,
                                               block_k, programs), buffers, in_flight, num_warps=warps,
                                               maxnreg=maxnreg)  # fmt: skip
    else:
        launch2_kernel[(tiles,)](*descs, x.shape[0], buffers, in_flight, C_IN_RING=variant in C_IN_RING_VARIANTS,
                                 num_warps=warps, maxnreg=maxnreg)  # fmt: skip


def persistent_split(T: int, block_m: int, block_n: int, block_k: int, programs: int) -> int:
    """How many of the persistent launch's programs take the weight-gradient tiles: the split whose busiest program
    has the fewest K steps (each kind's tiles dealt out in turn to its programs), at least one program per kind."""
    gu_tiles = triton.cdiv(2 * I, block_m) * triton.cdiv(H, block_n)
    dx_tiles = triton.cdiv(T, block_m) * triton.cdiv(H, block_n)

    def busiest(gu_programs: int) -> int:
        return max(triton.cdiv(gu_tiles, gu_programs) * triton.cdiv(T, block_k),
                   triton.cdiv(dx_tiles, programs - gu_programs) * triton.cdiv(2 * I, block_k))  # fmt: skip

    return min(range(1, programs), key=busiest)


def descriptors(a, a_lo, b, c, a_k_major: bool, block):
    block_m, block_n, block_k = block
    a_block = [block_m, block_k] if a_k_major else [block_k, block_m]

    def desc(tensor, shape):
        return TensorDescriptor.from_tensor(tensor, shape, gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16))

    return desc(a, a_block), desc(a_lo if a_lo is not None else a, a_block), desc(b, [block_k, block_n]), \
        desc(c, [block_m, block_n])  # fmt: skip


def hilo_gemm(a, a_lo, b, c, *, a_k_major: bool, variant: str):
    """c = a·b (+ a_lo·b); ``a`` [M, K] when ``a_k_major``, else given as aᵀ [K, M]; all bf16, row-major."""
    block_m, block_n, block_k, buffers, warps, maxnreg, in_flight = VARIANTS[variant]
    a_desc, a_lo_desc, b_desc, c_desc = descriptors(a, a_lo, b, c, a_k_major, (block_m, block_n, block_k))
    K = a.shape[1] if a_k_major else a.shape[0]
    grid = (triton.cdiv(c.shape[0], block_m) * triton.cdiv(c.shape[1], block_n),)
    hilo_gemm_kernel[grid](a_desc, a_lo_desc, b_desc, c_desc, K, a_k_major, int(a_lo is not None), buffers,
                           in_flight, num_warps=warps, maxnreg=maxnreg)  # fmt: skip
    return c


def products(T: int):
    """The two products' shapes: name -> (M, N, K, A K-major)."""
    return {"dWgu": (2 * I, H, T, False), "dx": (T, H, 2 * I, True)}


def compile_report(kernel, arguments: dict, constexprs: dict, warps: int, maxnreg: int) -> str:
    """Registers, stack, shared memory, HGMMA and TMA-load counts and ptxas's serialisation of one kernel compiled
    for sm_90, or the compiler's last line where it fails."""
    from moe_lib.bench.sm90 import compile_gluon_for_sm90, first_error_line, resources, sass_counts, wgmma_serialized

    try:
        compiled = compile_gluon_for_sm90(kernel, arguments, constexprs, warps=warps, maxnreg=maxnreg)
    except Exception as exc:  # report and go on
        return "FAIL " + first_error_line(exc, 300)
    sass = sass_counts(compiled, ["HGMMA", "UTMALDG"])
    return (f"{resources(compiled)} HGMMA={sass['HGMMA']} UTMALDG={sass['UTMALDG']} wgmma serialised: "
            f"{wgmma_serialized(compiled)}")  # fmt: skip


def compile_only(names: list[str]) -> None:
    T = 256
    print(f"{'variant':18s} {'product':5s} {'lo':3s} resources")
    for variant, (block_m, block_n, block_k, buffers, warps, maxnreg, in_flight) in VARIANTS.items():
        if variant in PINGPONG_VARIANTS or variant in C_IN_RING_VARIANTS or variant not in names:
            continue  # the ping-pong: a launch-2 design only (below)
        for product, (M, N, K, a_k_major) in products(T).items():
            a = torch.empty((M, K) if a_k_major else (K, M), dtype=torch.bfloat16)
            b = torch.empty((K, N), dtype=torch.bfloat16)
            c = torch.empty((M, N), dtype=torch.bfloat16)
            descs = descriptors(a, a, b, c, a_k_major, (block_m, block_n, block_k))
            arguments = dict(zip(["a_desc", "a_lo_desc", "b_desc", "c_desc"], descs, strict=True), K="i32")
            for with_lo in (1, 0):
                constexprs = {"A_K_MAJOR": a_k_major, "WITH_LO": with_lo, "BUFFERS": buffers, "IN_FLIGHT": in_flight,
                              "num_warps": warps}  # fmt: skip
                report = compile_report(hilo_gemm_kernel, arguments, constexprs, warps, maxnreg)
                print(f"{variant:18s} {product:5s} {with_lo:3d} {report}", flush=True)
    launch2_names = LAUNCH2_VARIANTS + list(PINGPONG_VARIANTS) + list(C_IN_RING_VARIANTS)
    for variant in [name for name in launch2_names if name in names]:
        block_m, block_n, block_k, buffers, warps, maxnreg, in_flight = VARIANTS[variant]
        hi = torch.empty((T, 2 * I), dtype=torch.bfloat16)
        x, w = torch.empty((T, H), dtype=torch.bfloat16), torch.empty((2 * I, H), dtype=torch.bfloat16)
        descs = launch2_descriptors(hi, hi, x, w, torch.empty_like(w), torch.empty_like(x), (block_m, block_n, block_k))
        arg_names = ["gu_a", "gu_a_lo", "x_desc", "gu_c", "dx_a", "dx_a_lo", "w_desc", "dx_c"]
        arguments = dict(zip(arg_names, descs, strict=True), T="i32", gu_programs="i32")
        constexprs = {"BUFFERS": buffers, "IN_FLIGHT": in_flight, "num_warps": warps,
                      "C_IN_RING": variant in C_IN_RING_VARIANTS}  # fmt: skip
        kernels = ((launch2_pingpong_kernel,) if variant in PINGPONG_VARIANTS else (launch2_kernel,)
                   if variant in C_IN_RING_VARIANTS else (launch2_kernel, launch2_persistent_kernel))  # fmt: skip
        for kernel in kernels:
            report = compile_report(kernel, arguments, constexprs, warps, maxnreg)
            print(f"{variant:18s} {kernel.__name__} {report}", flush=True)


def time_launch2(tokens, variants, flush) -> list[dict]:
    """Both products with both halves: the Gluon launch 2 against the faithful path's Triton launch 2 (the default
    tiles for the token count) and cuBLAS's two GEMMs with the same arithmetic, every one checked against float64."""
    from moe_lib.bench import timing
    from moe_lib.swiglu_down.launch import (
        choose_config,
        launch_grad_x_and_grad_gate_up,
        launch_plan,
        split_workspaces,
    )

    rows = []
    for T in tokens:
        gen = torch.Generator(device="cuda").manual_seed(T)
        full = torch.randn((T, 2 * I), device="cuda", generator=gen)
        hi = full.to(torch.bfloat16)
        lo = (full - hi.float()).to(torch.bfloat16)
        x = torch.randn((T, H), device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn((2 * I, H), device="cuda", generator=gen) / H**0.5).to(torch.bfloat16)
        a64 = hi.double() + lo.double()
        want_gu, want_dx = a64.T @ x.double(), a64 @ w.double()
        grad_gate_up = torch.empty((2 * I, H), device="cuda", dtype=torch.bfloat16)
        grad_x = torch.empty((T, H), device="cuda", dtype=torch.bfloat16)
        d_gate = torch.stack([hi[:, :I], lo[:, :I]]).contiguous()
        d_up = torch.stack([hi[:, I:], lo[:, I:]]).contiguous()
        config = choose_config(T, H, I, interpreter=False, with_lo=True, max_programs=132)
        plan = launch_plan(T, H, I, config)
        workspaces = split_workspaces(plan, torch.device("cuda"))
        stacked_gu_a, stacked_gu_b = torch.cat([hi, lo]).T, torch.cat([x, x])
        stacked_dx_a, stacked_dx_b = torch.cat([hi, lo], dim=1), torch.cat([w, w])

        def cublas():
            torch.mm(stacked_gu_a, stacked_gu_b, out=grad_gate_up)
            torch.mm(stacked_dx_a, stacked_dx_b, out=grad_x)

        def triton_launch2():
            launch_grad_x_and_grad_gate_up(x, w[:I], w[I:], d_gate, d_up, grad_x, grad_gate_up[:I], grad_gate_up[I:],
                                           config, plan, True, workspaces)  # fmt: skip

        calls = {"cublas, two GEMMs": cublas, "triton launch 2 (default)": triton_launch2}
        for variant in variants:
            calls[f"gluon {variant}"] = lambda v=variant: launch2(hi, lo, x, w, grad_gate_up, grad_x, variant=v)
            if variant not in PINGPONG_VARIANTS | C_IN_RING_VARIANTS:  # the persistent form has its own out buffer
                calls[f"gluon {variant} persistent"] = lambda v=variant: launch2(
                    hi, lo, x, w, grad_gate_up, grad_x, variant=v, persistent=True)
        for name, call in calls.items():
            row = dict(T=T, product="launch 2", impl=name)
            try:
                grad_gate_up.fill_(float("nan"))
                grad_x.fill_(float("nan"))
                call()
                torch.cuda.synchronize()
                err = max(((got.double() - want).abs().max() / want.abs().max()).item()
                          for got, want in ((grad_gate_up, want_gu), (grad_x, want_dx)))  # fmt: skip
                row["max_err"] = err
                if not (err < 2e-2):
                    raise RuntimeError(f"wrong: relative error {err:.3g}")
                row["us"] = timing.graph_median_ms(call, flush) * 1e3
                row["tflops"] = 2 * 2 * (2 * 2 * I * H * T) / (row["us"] * 1e6)
            except Exception as exc:  # report and go on
                lines = [line for line in str(exc).splitlines() if line.strip()]
                row["error"] = (lines[-1] if lines else type(exc).__name__)[:200]
            rows.append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--tokens", default="2447,8192")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--launch2", action="store_true",
                        help="both products in one launch against the faithful path's Triton launch 2")  # fmt: skip
    args = parser.parse_args()
    unknown = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    if not all(t.strip().isdigit() and int(t) > 0 for t in args.tokens.split(",")):
        raise SystemExit(f"--tokens: expected a comma list of positive integers, got {args.tokens!r}")
    if args.compile_only:
        return compile_only(args.variants.split(","))
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --compile-only)")
    from moe_lib.bench import timing

    flush = timing.L2Flusher("cuda")
    rows = []
    if args.launch2:
        rows = time_launch2([int(t) for t in args.tokens.split(",")], args.variants.split(","), flush)
        args.tokens = ""
    for T in [int(t) for t in args.tokens.split(",") if t]:
        gen = torch.Generator(device="cuda").manual_seed(T)
        for product, (M, N, K, a_k_major) in products(T).items():
            full = torch.randn((M, K) if a_k_major else (K, M), device="cuda", generator=gen, dtype=torch.float32)
            hi = full.to(torch.bfloat16)
            lo = (full - hi.float()).to(torch.bfloat16)
            b = (torch.randn((K, N), device="cuda", generator=gen) / K**0.5).to(torch.bfloat16)
            a64 = hi.double() + lo.double()
            want = (a64 if a_k_major else a64.T) @ b.double()
            scale = want.abs().max().item()
            # cuBLAS, the same arithmetic: [hi | lo] · [b; b] as one bf16 GEMM over 2K, and the hi half alone
            hi_mk = hi if a_k_major else hi.T
            lo_mk = lo if a_k_major else lo.T
            stacked_a = torch.cat([hi_mk, lo_mk], dim=1).contiguous() if a_k_major else torch.cat([hi, lo]).T
            stacked_b = torch.cat([b, b])
            calls = {"cublas hi+lo": lambda: torch.mm(stacked_a, stacked_b), "cublas hi": lambda: torch.mm(hi_mk, b)}
            for variant in [v for v in args.variants.split(",") if v not in PINGPONG_VARIANTS | C_IN_RING_VARIANTS]:
                out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
                calls[f"gluon {variant}"] = (lambda v=variant, o=out: hilo_gemm(hi, lo, b, o, a_k_major=a_k_major,
                                                                                 variant=v))  # fmt: skip
            for name, call in calls.items():
                row = dict(T=T, product=product, impl=name)
                try:
                    got = call()
                    torch.cuda.synchronize()
                    err = ((got.double() - want).abs().max() / scale).item()
                    row["max_err"] = err
                    row["ok"] = bool(err < 2e-2 and torch.isfinite(got).all().item())
                    if not row["ok"] and name.startswith("gluon"):
                        raise RuntimeError(f"wrong: relative error {err:.3g}")
                    row["us"] = timing.graph_median_ms(call, flush) * 1e3
                    row["tflops"] = 2 * M * N * K * (2 if "lo" in name or name.startswith("gluon") else 1) / (
                        row["us"] * 1e6)
                except Exception as exc:  # report and go on
                    lines = [line for line in str(exc).splitlines() if line.strip()]
                    row["error"] = (lines[-1] if lines else type(exc).__name__)[:200]
                rows.append(row)
                print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    print(f"\n{'T':>6} {'product':8} {'impl':24} {'µs':>8} {'TFLOP/s':>8} {'max rel err':>11}")
    for row in rows:
        if "error" in row:
            print(f"{row['T']:>6} {row['product']:8} {row['impl']:24} failed: {row['error']}")
        else:
            print(f"{row['T']:>6} {row['product']:8} {row['impl']:24} {row['us']:8.1f} {row['tflops']:8.0f} "
                  f"{row['max_err']:11.2e}")  # fmt: skip
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "p1_gluon_probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
