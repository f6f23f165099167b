"""C_p[e] = A_p[rows_e]ᵀ · B_p[rows_e] per expert on Hopper in Gluon: the grouped engine's varlen-K form (weight
gradients), up to three products in one launch.

    A_p [M_total, M_p]   rows sorted by expert: expert e owns rows offsets[e] ≤ r < offsets[e + 1] (any row stride
                         of 16-byte multiples: dg and du may be column views of one [M_total, 2I] tensor)
    B_p [M_total, N_p]   the same rows
    C_p [E, M_p, N_p]    C_p[e] = Σ_{offsets[e] ≤ r < offsets[e+1]} A_p[r]ᵀ B_p[r], fp32 accumulation, bf16 or fp32
                         out; exact zeros for an expert without rows (no loads); all C_p laid out row by row, or
                         all transposed views (C_pᵀ [E, N_p, M_p] row by row: each tile stored transposed)
    MoE's weight gradients: dWg_e = dgᵀ x_s, dWu_e = duᵀ x_s ([I, H] each), dWd_e = dy_sᵀ aw ([H, I]).

Tiles: every expert has the same ⌈M_p / BLOCK_M⌉ · ⌈N_p / BLOCK_N⌉ output tiles of problem p (its rows only set
the K length), so tile t maps to (expert, problem, tile) by arithmetic (:func:`tile_place`), no walk: expert-major
(all problems' tiles of expert e, problem by problem, then expert e + 1's), :mod:`.gluon_gemm`'s grouped order
inside one problem of one expert. Program p of P takes tiles p, p + P, ... (:func:`schedule` lists them). The
programs running at once work on one or two experts: they read the same few MB of rows (those of A_p and B_p of
one expert) from L2, and the gate and up products, which share x_s, follow each other while x_s's rows are there.

Per tile, the machinery of :mod:`.gluon_gemm`: a TMA loading warp fills a ring of mbarrier'd buffers, cooperative or
ping-pong wgmma consumers run the K loop (the ring's steps numbered on from tile to tile; a tile's step count is
its expert's ⌈n_e / BLOCK_K⌉). A's tile is [BLOCK_K, BLOCK_M] of A's rows, read by the wgmma through a permuted
view (Aᵀ's tile); B's [BLOCK_K, BLOCK_N] as it lies. The output tile goes out by TMA through a 3-D descriptor of
C_p [E, M_p, N_p] ([1, BLOCK_M, BLOCK_N] boxes), which clips it at M_p and N_p inside the expert's matrix.

The ragged K end: an expert's last step would read the next expert's rows. The loading warp reads an expert's rows
through TMA descriptors it makes on the device over those rows alone ([n_e, M_p] and [n_e, N_p] from row
offsets[e]), so TMA fills the rows past n_e with zeros: nothing of the neighbour (not even an Inf or a NaN) enters.
It makes a pair each time its tiles move to another (expert, problem) that has rows (a visit), alternating
between two pairs (two call sites, two global scratch slots): before it rewrites a pair it waits until the loads
that read it two visits before have landed (TMA may read a descriptor after the copy is issued), which they
normally have. The descriptors need Triton's global scratch allocator (:func:`moe_lib.tma.install_tma_allocator`).

Gathered operands (:class:`.gathered.Gathered`: the MoE layer's x_s and dy_s, read through the routing instead of
written out): the loading partition has GATHER_WARPS warps; each thread copies its 16-byte pieces of the step's
rows source[index[r]] into the ring's buffer by cp.async (zero-filled past the expert's rows and past the
columns, as TMA fills; the step's indices loaded a step ahead), the other operand still by TMA, and arrives on
the step's barrier once its copies have landed (cp.async.mbarrier.arrive.noinc: the barrier counts TMA's expect
and every loading thread). The consumers fence the generic proxy's writes before their wgmma reads them.

Every element of every C_p[e] is written by one tile once: deterministic, no atomics. The offsets stay on the
device: no host sync, a grid from E and the shapes alone (CUDA-graph capturable).

The same schedule in plain Triton, for the interpreter and for reading: :mod:`.grouped_wgrad_tl`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..encoded_launch import KernelLaunches, shared_layout, signature
from ..tiling import cdiv, grouped_tile
from ..tma import aligned, install_tma_allocator
from .gathered import GATHER_WARPS, Gathered, check_gathered, gather_sources, step_indices
from .gluon_gemm import (
    CONSUMER_REGISTERS,
    ELEMENT_BYTES,
    LOADER_REGISTERS,
    SHARED_MEMORY_LIMIT,
    GemmConfig,
    launch_memoised,
    sm_count,
    tile_k_loop,
    tile_origin,
)

MAX_PROBLEMS = 3
OUT_DTYPES = (torch.bfloat16, torch.float32)
DEFAULT_CONFIG = GemmConfig()  # cooperative, 128 × 256 × 64 tiles, 3 stages
FP32_CONFIG = GemmConfig(128, 128, 64, 4)  # an fp32 128 × 256 output tile (128 KB) leaves too little for a ring
DESCRIPTOR_BYTES = 4 * 128  # the device descriptors' shared-memory templates: two pairs of 128 bytes
# whether the consumers fence cp.async's writes before their wgmma read them (Triton's own cp.async pipelines and
# CUTLASS's sm90 multistage mainloop do not)
FENCE_GATHERED = True
# whether the loading warp, before it rewrites a descriptor pair, waits for every step in flight to land rather than
# only the steps that read that pair (a check of the fault in notes/p2/engine-wgrad.md, "A fault when another
# process shares the GPU": scripts/p2/shared_gpu_check.py --wait-every-step); set before the first launch
WAIT_EVERY_STEP = False
# their registers after setmaxnreg (a step's addresses and the next step's indices), by consumers: what the
# consumers' accumulators leave (ping-pong's two 128 × 128 accumulators need more than cooperative's one 128 × 256)
GATHER_LOADER_REGISTERS = {"cooperative": 128, "pingpong": 104}
# an output in two column parts (transposed views): the right part is stored in boxes of this many of C_pᵀ's rows,
# so that no box starts before its row 0; the boundary must be a multiple of it
SPLIT_ROWS = 64


# --- the tile schedule on the host ----------------------------------------------------------------------------------


def problem_tiles(shapes: Sequence[tuple[int, int]], config: GemmConfig) -> list[int]:
    """Output tiles of one expert's C_p [M_p, N_p], for each problem."""
    return [cdiv(m, config.block_m) * cdiv(n, config.block_n) for m, n in shapes]


def tile_place(tile: int, shapes: Sequence[tuple[int, int]], config: GemmConfig) -> tuple[int, int, int, int]:
    """(expert, problem, first row, first column) of tile ``tile``: expert-major, problem by problem inside an
    expert, the grouped order inside a problem (what the kernels compute on the device)."""
    tiles = problem_tiles(shapes, config)
    expert, local = divmod(tile, sum(tiles))
    problem = 0
    while local >= tiles[problem]:
        local -= tiles[problem]
        problem += 1
    tiles_n = cdiv(shapes[problem][1], config.block_n)
    m, n = grouped_tile(local, tiles[problem] // tiles_n, tiles_n, config.group_m)
    return expert, problem, m * config.block_m, n * config.block_n


def total_tiles(num_experts: int, shapes: Sequence[tuple[int, int]], config: GemmConfig) -> int:
    return num_experts * sum(problem_tiles(shapes, config))


def grid(num_experts: int, shapes: Sequence[tuple[int, int]], config: GemmConfig, sms: int) -> int:
    """Programs of a launch: one per SM (or ``config.programs``), never more than the tiles."""
    return max(1, min(config.programs or sms, total_tiles(num_experts, shapes, config)))


def schedule(num_experts: int, shapes: Sequence[tuple[int, int]], config: GemmConfig,
             programs: int) -> list[list[tuple[int, int, int, int]]]:
    """The tiles each program takes, in its order, as (expert, problem, first row, first column)."""
    order = [tile_place(t, shapes, config) for t in range(total_tiles(num_experts, shapes, config))]
    return [order[p::programs] for p in range(programs)]


def visits(tiles: list[tuple[int, int, int, int]]) -> int:
    """Descriptor pairs a program makes for its tiles: the runs of one (expert, problem) (empty experts count too:
    the kernel skips those, having no rows to read)."""
    return sum(1 for i, t in enumerate(tiles) if i == 0 or t[:2] != tiles[i - 1][:2])


# --- the kernel -------------------------------------------------------------------------------------------------


@gluon.jit
def pick(problem, x0, x1, x2):
    """x0, x1 or x2 by the problem's index (a run-time value)."""
    x = x0
    if problem == 1:
        x = x1
    if problem == 2:
        x = x2
    return x


@gluon.jit
def out_rows(c_desc, TRANSPOSED: gl.constexpr):
    """M_p of a problem's output descriptor: over C_p [E, M_p, N_p], or with TRANSPOSED over C_pᵀ [E, N_p, M_p]."""
    if TRANSPOSED:
        return c_desc.shape[2]
    else:
        return c_desc.shape[1]


@gluon.jit
def out_cols(c_desc, TRANSPOSED: gl.constexpr):
    """N_p of a problem's output descriptor (see :func:`out_rows`)."""
    if TRANSPOSED:
        return c_desc.shape[1]
    else:
        return c_desc.shape[2]


@gluon.jit
def first_cols(c0_desc, c1_desc, TRANSPOSED: gl.constexpr, SPLIT: gl.constexpr):
    """N_0: C_0's columns, or with SPLIT those of its two column parts, c0_desc's and c1_desc's, together."""
    if SPLIT:
        return out_cols(c0_desc, TRANSPOSED) + out_cols(c1_desc, TRANSPOSED)
    else:
        return out_cols(c0_desc, TRANSPOSED)


@gluon.jit
def problem_tile_counts(c0_desc, c1_desc, c2_desc, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        PROBLEMS: gl.constexpr, TRANSPOSED: gl.constexpr, SPLIT: gl.constexpr):
    """Output tiles of one expert per problem (0 for the problems past PROBLEMS)."""
    n0 = first_cols(c0_desc, c1_desc, TRANSPOSED, SPLIT)
    tiles0 = gl.cdiv(out_rows(c0_desc, TRANSPOSED), BLOCK_M) * gl.cdiv(n0, BLOCK_N)
    tiles1 = tiles0 * 0
    tiles2 = tiles0 * 0
    if PROBLEMS > 1:
        tiles1 = gl.cdiv(out_rows(c1_desc, TRANSPOSED), BLOCK_M) * gl.cdiv(out_cols(c1_desc, TRANSPOSED), BLOCK_N)
    if PROBLEMS > 2:
        tiles2 = gl.cdiv(out_rows(c2_desc, TRANSPOSED), BLOCK_M) * gl.cdiv(out_cols(c2_desc, TRANSPOSED), BLOCK_N)
    return tiles0, tiles1, tiles2


@gluon.jit
def tile_place_device(tile, tiles0, tiles1, tiles2):
    """(expert, problem, the tile's number among the problem's tiles of the expert, the number of the first tile
    past that problem's tiles of the expert): :func:`tile_place`'s arithmetic."""
    per_expert = tiles0 + tiles1 + tiles2
    expert = tile // per_expert
    local = tile % per_expert
    problem = (local >= tiles0).to(gl.int32) + (local >= tiles0 + tiles1).to(gl.int32)
    before = (problem >= 1).to(gl.int32) * tiles0 + (problem >= 2).to(gl.int32) * tiles1  # earlier problems' tiles
    run_end = expert * per_expert + before + pick(problem, tiles0, tiles1, tiles2)
    return expert, problem, local - before, run_end


@gluon.jit
def wait_landed(ready, first, last, issued, BUFFERS: gl.constexpr):
    """Waits until the ring's steps first .. last have landed. ``issued``: the steps issued so far; a step that many
    minus BUFFERS or more back has landed (its buffer was handed back before a later step refilled it)."""
    for i in range(gl.maximum(first, issued - BUFFERS), last + 1):
        mbarrier.wait(ready.index(i % BUFFERS), (i // BUFFERS) & 1)


@gluon.jit
def wait_before_rewrite(ready, first, last, issued, BUFFERS: gl.constexpr, WAIT_ALL: gl.constexpr):
    """Before a descriptor pair is rewritten: waits until the steps first .. last that read it have landed (with
    WAIT_ALL, every step issued so far)."""
    if WAIT_ALL:
        wait_landed(ready, 0, issued - 1, issued, BUFFERS)
    else:
        wait_landed(ready, first, last, issued, BUFFERS)


@gluon.jit
def load_run(a_desc, b_desc, a_src, b_src, a_stride, b_stride, index_ptr, a_gather, b_gather, rows, m, n, a_bufs,
             b_bufs, ready, empty, i, local, count, tiles_m, tiles_n, k_steps, GROUP_M: gl.constexpr,
             GATHERS: gl.constexpr, WARPS: gl.constexpr):
    """Every K step of ``count`` tiles of one (expert, problem), ``local``, ``local`` + P, ... among its tiles, into
    the ring from step i on; returns the next step. An operand with ``a_gather`` / ``b_gather`` is copied by every
    thread from its source (``index_ptr``: the expert's first row's index) by cp.async, the other by TMA; a step's
    indices are loaded one step ahead (a step's rows are the same in every tile of the run), so that their
    latency passes under the step before; with GATHERS every thread's copies arrive on the step's barrier once
    landed."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    A_BYTES: gl.constexpr = BLOCK_M * BLOCK_K * 2
    B_BYTES: gl.constexpr = BLOCK_N * BLOCK_K * 2
    programs = gl.num_programs(0)
    if GATHERS:
        a_rows = step_indices(index_ptr, rows, a_gather, BLOCK_K, BLOCK_M, WARPS)
        b_rows = step_indices(index_ptr, rows, b_gather, BLOCK_K, BLOCK_N, WARPS)
    for j in range(count):
        off_m, off_n = tile_origin(local + j * programs, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        for step in range(k_steps):
            slot = i % BUFFERS
            k = step * BLOCK_K
            if GATHERS:
                a_from, a_mask = gather_sources(a_rows, a_src, a_stride, rows - k, off_m, m, BLOCK_M, WARPS)
                b_from, b_mask = gather_sources(b_rows, b_src, b_stride, rows - k, off_n, n, BLOCK_N, WARPS)
                ahead = ((step + 1) % k_steps) * BLOCK_K  # the next step's rows: this tile's, or the next tile's first
                a_rows = step_indices(index_ptr + ahead, rows - ahead, a_gather, BLOCK_K, BLOCK_M, WARPS)
                b_rows = step_indices(index_ptr + ahead, rows - ahead, b_gather, BLOCK_K, BLOCK_N, WARPS)
            mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)  # a fresh barrier counts as released
            bar = ready.index(slot)
            # the bytes TMA brings (a tile's full bytes, zero-filled ones included), or an arrival without any
            if a_gather & b_gather:
                mbarrier.arrive(bar, count=1)
            elif a_gather:
                mbarrier.expect(bar, B_BYTES)
            elif b_gather:
                mbarrier.expect(bar, A_BYTES)
            else:
                mbarrier.expect(bar, A_BYTES + B_BYTES)
            if GATHERS:
                if a_gather:
                    async_copy.async_copy_global_to_shared(a_bufs.index(slot), a_from, mask=a_mask)
                else:
                    tma.async_copy_global_to_shared(a_desc, [k, off_m], bar, a_bufs.index(slot))
                if b_gather:
                    async_copy.async_copy_global_to_shared(b_bufs.index(slot), b_from, mask=b_mask)
                else:
                    tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_bufs.index(slot))
                # each thread's copies (none, where nothing is gathered) arrive once they have landed
                async_copy.mbarrier_arrive(bar, increment_count=False)
            else:
                tma.async_copy_global_to_shared(a_desc, [k, off_m], bar, a_bufs.index(slot))
                tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_bufs.index(slot))
            i += 1
    return i


@gluon.jit
def wgrad_load_partition(a0_ptr, b0_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, a0_stride, b0_stride, a1_stride,
                         b1_stride, a2_stride, b2_stride, c0_desc, c1_desc, c2_desc, a_bufs, b_bufs, ready, empty,
                         offsets_ptr, index_ptr, num_experts, PROBLEMS: gl.constexpr, GROUP_M: gl.constexpr,
                         GATHER_A: gl.constexpr, GATHER_B: gl.constexpr, WARPS: gl.constexpr,
                         WAIT_ALL: gl.constexpr, TRANSPOSED: gl.constexpr, SPLIT: gl.constexpr):
    """The loading partition: the program's tiles run by run (a run: its tiles of one expert and problem), each run's
    descriptors made over the expert's rows, every K step of the run's tiles into the ring (a gathered operand's
    rows copied through the index instead). Before it rewrites a pair it waits for the loads that read it (with
    WAIT_ALL, for every step in flight)."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[1]
    BLOCK_M: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    A_LAYOUT: gl.constexpr = a_bufs.type.layout
    B_LAYOUT: gl.constexpr = b_bufs.type.layout
    tiles0, tiles1, tiles2 = problem_tile_counts(c0_desc, c1_desc, c2_desc, BLOCK_M, BLOCK_N, PROBLEMS, TRANSPOSED,
                                                 SPLIT)
    total = num_experts * (tiles0 + tiles1 + tiles2)
    programs = gl.num_programs(0)
    tile = gl.program_id(0)
    i = 0  # the ring's step, running on from tile to tile
    runs = 0  # runs with rows so far: run r reads through descriptor pair r % 2
    first0 = 0  # the ring steps pair 0 (then pair 1) loaded in its last run: last < first before any
    last0 = -1
    first1 = 0
    last1 = -1
    while tile < total:
        expert, problem, local, run_end = tile_place_device(tile, tiles0, tiles1, tiles2)
        count = gl.cdiv(run_end - tile, programs)  # this program's tiles of the run
        begin = gl.load(offsets_ptr + expert)
        rows = gl.load(offsets_ptr + expert + 1) - begin
        k_steps = gl.cdiv(rows, BLOCK_K)  # 0 for an expert without rows: its tiles are zeros, nothing to load
        if k_steps > 0:
            m = pick(problem, out_rows(c0_desc, TRANSPOSED), out_rows(c1_desc, TRANSPOSED),
                     out_rows(c2_desc, TRANSPOSED))
            n = pick(problem, first_cols(c0_desc, c1_desc, TRANSPOSED, SPLIT), out_cols(c1_desc, TRANSPOSED),
                     out_cols(c2_desc, TRANSPOSED))
            a_stride = pick(problem, a0_stride, a1_stride, a2_stride).to(gl.int64)
            b_stride = pick(problem, b0_stride, b1_stride, b2_stride).to(gl.int64)
            a_base = pick(problem, a0_ptr, a1_ptr, a2_ptr) + begin.to(gl.int64) * a_stride
            b_base = pick(problem, b0_ptr, b1_ptr, b2_ptr) + begin.to(gl.int64) * b_stride
            tiles_n = gl.cdiv(n, BLOCK_N)
            tiles_m = gl.cdiv(m, BLOCK_M)
            a_gather = (GATHER_A >> problem) & 1  # A_p's rows through the index (its pointer: the source's)
            b_gather = (GATHER_B >> problem) & 1
            a_src = pick(problem, a0_ptr, a1_ptr, a2_ptr)
            b_src = pick(problem, b0_ptr, b1_ptr, b2_ptr)
            run_index = index_ptr + begin  # the expert's first row's source index
            # the expert's rows alone: TMA fills the rows past them with zeros (a gathered operand's descriptor,
            # made as the other's, is never used)
            if runs % 2 == 0:
                wait_before_rewrite(ready, first0, last0, i, BUFFERS, WAIT_ALL)
                a_desc = tma.make_tensor_descriptor(a_base, [rows, m], [a_stride, 1], [BLOCK_K, BLOCK_M], A_LAYOUT)
                b_desc = tma.make_tensor_descriptor(b_base, [rows, n], [b_stride, 1], [BLOCK_K, BLOCK_N], B_LAYOUT)
                first0 = i
                i = load_run(a_desc, b_desc, a_src, b_src, a_stride, b_stride, run_index, a_gather, b_gather, rows, m,
                             n, a_bufs, b_bufs, ready, empty, i, local, count, tiles_m, tiles_n, k_steps, GROUP_M,
                             GATHER_A | GATHER_B, WARPS)
                last0 = i - 1
            else:
                wait_before_rewrite(ready, first1, last1, i, BUFFERS, WAIT_ALL)
                a_desc = tma.make_tensor_descriptor(a_base, [rows, m], [a_stride, 1], [BLOCK_K, BLOCK_M], A_LAYOUT)
                b_desc = tma.make_tensor_descriptor(b_base, [rows, n], [b_stride, 1], [BLOCK_K, BLOCK_N], B_LAYOUT)
                first1 = i
                i = load_run(a_desc, b_desc, a_src, b_src, a_stride, b_stride, run_index, a_gather, b_gather, rows, m,
                             n, a_bufs, b_bufs, ready, empty, i, local, count, tiles_m, tiles_n, k_steps, GROUP_M,
                             GATHER_A | GATHER_B, WARPS)
                last1 = i - 1
            runs += 1
        tile += count * programs


@gluon.jit
def box_and_tile(c_tile, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, TRANSPOSED: gl.constexpr):
    """(the output buffer as its 2-D box, the same buffer as the [BLOCK_M, BLOCK_N] tile the accumulator is stored
    into: the box itself, or with TRANSPOSED the [BLOCK_N, BLOCK_M] box's transposed view)."""
    if TRANSPOSED:
        box = c_tile.reshape([BLOCK_N, BLOCK_M])
        return box, box.permute([1, 0])
    else:
        box = c_tile.reshape([BLOCK_M, BLOCK_N])
        return box, box


@gluon.jit
def store_tile(c_desc, expert, off_m, off_n, c_tile, TRANSPOSED: gl.constexpr):
    """The output tile at (off_m, off_n) of C_p[expert] by TMA (with TRANSPOSED, C_pᵀ's box at (off_n, off_m))."""
    if TRANSPOSED:
        tma.async_copy_shared_to_global(c_desc, [expert, off_n, off_m], c_tile)
    else:
        tma.async_copy_shared_to_global(c_desc, [expert, off_m, off_n], c_tile)


@gluon.jit
def store_right_part(c1_desc, expert, off_m, row, c_tile):
    """With SPLIT, the rows of a [1, BLOCK_N, BLOCK_M] tile of C_0ᵀ at ``row`` of the right part (negative where the
    tile begins in the left part) that fall in that part, by TMA in [1, CHUNK, BLOCK_M] boxes (the right part's
    descriptor): no box starts before its row 0, and each chunk lies wholly on one side (the boundary and the
    tiles are multiples of CHUNK rows)."""
    BLOCK_N: gl.constexpr = c_tile.type.shape[1]
    CHUNK: gl.constexpr = c1_desc.block_type.shape[1]
    for j in gl.static_range(BLOCK_N // CHUNK):
        if row + j * CHUNK >= 0:
            chunk = c_tile.slice(j * CHUNK, CHUNK, 1)
            tma.async_copy_shared_to_global(c1_desc, [expert, row + j * CHUNK, off_m], chunk)


@gluon.jit
def zero_fill(c_smem, WARPS: gl.constexpr):
    """Zeros into the output tile's shared memory, 16 rows at a time (few registers: no accumulator rewritten)."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    CHUNK: gl.constexpr = 16
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])
    zeros = gl.zeros((CHUNK, BLOCK_N), dtype=c_smem.dtype, layout=layout)
    for r in gl.static_range(0, BLOCK_M, CHUNK):
        c_smem.slice(r, CHUNK, dim=0).store(zeros)


@gluon.jit
def wgrad_consumer_partition(a_bufs, b_bufs, ready, empty, turns, c0_desc, c1_desc, c2_desc, c_bufs, offsets_ptr,
                             num_experts, PROBLEMS: gl.constexpr, GROUP_M: gl.constexpr, FENCE: gl.constexpr,
                             ME: gl.constexpr, CONSUMERS: gl.constexpr, WARPS: gl.constexpr,
                             OUT_BUFS: gl.constexpr, TRANSPOSED: gl.constexpr, SPLIT: gl.constexpr):
    """Consumer ME of CONSUMERS (WARPS warps): the program's tiles ME, ME + CONSUMERS, ... of its own (the ring's
    steps counted over all the program's tiles, each its expert's step count), each its K loop and its store. With
    two consumers each K loop waits for its turn and passes it on once its last wgmma is issued. With FENCE (some
    buffers written by cp.async) each step fences the generic proxy's writes before its wgmma reads them. With
    OUT_BUFS = 2 its tiles take two output buffers in turn, so that a tile's store is still in flight while the next
    tile is written (where an expert's rows are a step or two, the stores are most of a tile's time). With
    TRANSPOSED the outputs are C_pᵀ [E, N_p, M_p]: each tile is stored into its buffer transposed, a [BLOCK_N,
    BLOCK_M] box. With SPLIT, C_0 is two column parts (c0_desc's columns, then c1_desc's): a tile across the
    boundary is stored into both, each descriptor clipping what is outside its part."""
    BLOCK_M: gl.constexpr = a_bufs.type.shape[2]
    BLOCK_N: gl.constexpr = b_bufs.type.shape[2]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[1]
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    c_tile = c_bufs.index(ME * OUT_BUFS)  # [1, BLOCK_M, BLOCK_N] (TRANSPOSED: [1, BLOCK_N, BLOCK_M]), as the boxes
    c_box, c_smem = box_and_tile(c_tile, BLOCK_M, BLOCK_N, TRANSPOSED)
    tiles0, tiles1, tiles2 = problem_tile_counts(c0_desc, c1_desc, c2_desc, BLOCK_M, BLOCK_N, PROBLEMS, TRANSPOSED,
                                                 SPLIT)
    total = num_experts * (tiles0 + tiles1 + tiles2)
    programs = gl.num_programs(0)
    tile = gl.program_id(0)
    i = 0  # the ring's step of the program's tile
    n = 0  # the program's tiles so far
    while tile < total:
        expert, problem, local, _ = tile_place_device(tile, tiles0, tiles1, tiles2)
        begin = gl.load(offsets_ptr + expert)
        k_steps = gl.cdiv(gl.load(offsets_ptr + expert + 1) - begin, BLOCK_K)
        if n % CONSUMERS == ME:
            m = pick(problem, out_rows(c0_desc, TRANSPOSED), out_rows(c1_desc, TRANSPOSED),
                     out_rows(c2_desc, TRANSPOSED))
            n_p = pick(problem, first_cols(c0_desc, c1_desc, TRANSPOSED, SPLIT), out_cols(c1_desc, TRANSPOSED),
                       out_cols(c2_desc, TRANSPOSED))
            tiles_n = gl.cdiv(n_p, BLOCK_N)
            off_m, off_n = tile_origin(local, gl.cdiv(m, BLOCK_M), tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
            if OUT_BUFS > 1:  # this tile's buffer: the one whose store was issued OUT_BUFS tiles ago
                c_tile = c_bufs.index(ME * OUT_BUFS + (n // CONSUMERS) % OUT_BUFS)
                c_box, c_smem = box_and_tile(c_tile, BLOCK_M, BLOCK_N, TRANSPOSED)
            if CONSUMERS > 1:  # consumer 0's first turn is free (a fresh barrier), consumer 1's first waits for it
                mbarrier.wait(turns.index(ME), ((n // CONSUMERS) & 1) ^ (1 - ME))
            if k_steps > 0:
                acc = tile_k_loop(a_bufs, b_bufs, ready, empty, acc, i, k_steps, True, False, FENCE)
                if CONSUMERS > 1:
                    mbarrier.arrive(turns.index(1 - ME), count=1)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((i + k_steps - 1) % BUFFERS), count=1)
                tma.store_wait(pendings=OUT_BUFS - 1)  # the store that last read c_smem has left it
                c_smem.store(acc.to(c0_desc.dtype))
            else:  # an expert without rows: exact zeros, no loads
                if CONSUMERS > 1:
                    mbarrier.arrive(turns.index(1 - ME), count=1)
                tma.store_wait(pendings=OUT_BUFS - 1)
                zero_fill(c_box, WARPS)
            fence_async_shared()
            if SPLIT:  # C_0ᵀ's two row parts: the tile into each it reaches
                left = out_cols(c0_desc, TRANSPOSED)
                if off_n < left:  # the left part's descriptor clips the rows past it
                    store_tile(c0_desc, expert, off_m, off_n, c_tile, TRANSPOSED)
                if off_n + BLOCK_N > left:  # the right part's in chunks of its box's rows, those past the boundary
                    store_right_part(c1_desc, expert, off_m, off_n - left, c_tile)
            elif problem == 0:
                store_tile(c0_desc, expert, off_m, off_n, c_tile, TRANSPOSED)
            elif problem == 1:
                store_tile(c1_desc, expert, off_m, off_n, c_tile, TRANSPOSED)
            else:
                store_tile(c2_desc, expert, off_m, off_n, c_tile, TRANSPOSED)
        i += k_steps
        n += 1
        tile += programs
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_wgrad_kernel(
    a0_ptr, b0_ptr,  # problem 0: A_0 [M_total, M_0] and B_0 [M_total, N_0] bf16, rows sorted by expert
    a1_ptr, b1_ptr,  # problem 1 (PROBLEMS > 1), else any pointers, never read
    a2_ptr, b2_ptr,  # problem 2 (PROBLEMS > 2), else any pointers, never read
    a0_stride, b0_stride, a1_stride, b1_stride, a2_stride, b2_stride,  # their row strides (elements)
    c0_desc,  # out: C_0 [E, M_0, N_0] (bf16 or fp32) as [1, BLOCK_M, BLOCK_N] tiles
    c1_desc,  # out: C_1 [E, M_1, N_1] likewise (PROBLEMS > 1), else any descriptor like c0_desc, never written
    c2_desc,  # out: C_2 [E, M_2, N_2] likewise (PROBLEMS > 2), else any descriptor like c0_desc, never written
    offsets_ptr,  # [E + 1] int32: expert e's rows are offsets[e] ≤ r < offsets[e + 1]
    index_ptr,  # [M_total] int32: a gathered operand's row r is its source's row index[r]; else offsets_ptr, unread
    num_experts,  # E
    PROBLEMS: gl.constexpr,  # products in the launch: 1, 2 or 3
    GATHER_A: gl.constexpr,  # bit p set: A_p is gathered (a_p_ptr, a_p_stride: its source [T, M_p]); else 0
    GATHER_B: gl.constexpr,  # bit p set: B_p is gathered (b_p_ptr, b_p_stride: its source [T, N_p]); else 0
    LOADER_WARPS: gl.constexpr,  # warps of the loading partition: 1, or GATHER_WARPS where any operand is gathered
    WAIT_ALL: gl.constexpr,  # the loading warp waits for every step in flight before it rewrites a descriptor pair
    FENCE_GATHERS: gl.constexpr,  # whether the consumers fence gathered buffers before their wgmma (FENCE_GATHERED)
    BLOCK_K: gl.constexpr,  # rows (K) a step
    BUFFERS: gl.constexpr,  # buffers of the ring
    GROUP_M: gl.constexpr,  # row tiles taken together in a problem's tile order
    PINGPONG: gl.constexpr,  # two one-warpgroup consumers on alternate tiles; else one of num_warps (8) warps
    CONSUMER_REGS: gl.constexpr,  # with PINGPONG: the second consumer's registers
    LOADER_REGS: gl.constexpr,  # the loading partition's registers
    OUT_BUFS: gl.constexpr,  # output tiles a consumer has in shared memory, taken in turn: 1 or 2 (output_buffers)
    TRANSPOSED: gl.constexpr,  # the c_p_desc are over C_pᵀ [E, N_p, M_p] in [1, BLOCK_N, BLOCK_M] boxes
    SPLIT: gl.constexpr,  # PROBLEMS 1, TRANSPOSED: C_0 in two column parts, c0_desc's then c1_desc's ([1, SPLIT_ROWS,
                          # BLOCK_M] boxes)
    num_warps: gl.constexpr,  # of the default partition: the cooperative consumer, or ping-pong's first (4)
):
    BLOCK_M: gl.constexpr = c0_desc.block_type.shape[2] if TRANSPOSED else c0_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = c0_desc.block_type.shape[1] if TRANSPOSED else c0_desc.block_type.shape[2]
    CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
    GATHERS: gl.constexpr = (GATHER_A | GATHER_B) != 0
    # a step lands with TMA's bytes (one arrival, the expect) and, with gathers, each loading thread's copies
    READY_COUNT: gl.constexpr = 1 + 32 * LOADER_WARPS if GATHERS else 1
    A_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_M], gl.bfloat16)
    B_LAYOUT: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], gl.bfloat16)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [BUFFERS, BLOCK_K, BLOCK_M], A_LAYOUT)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [BUFFERS, BLOCK_K, BLOCK_N], B_LAYOUT)
    c_bufs = gl.allocate_shared_memory(c0_desc.dtype, [CONSUMERS * OUT_BUFS] + c0_desc.block_type.shape,
                                       c0_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(BUFFERS):
        mbarrier.init(ready.index(i), count=READY_COUNT)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation is seen by the copy engine (the async proxy)
    # the argument tuples written out in each call: a tuple held in a variable turns its constexprs into tensors
    if PINGPONG:
        gl.warp_specialize([
            (wgrad_consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c0_desc, c1_desc, c2_desc, c_bufs,
                                        offsets_ptr, num_experts, PROBLEMS, GROUP_M, FENCE_GATHERS, 0, 2, num_warps,
                                        OUT_BUFS, TRANSPOSED, SPLIT)),
            (wgrad_consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c0_desc, c1_desc, c2_desc, c_bufs,
                                        offsets_ptr, num_experts, PROBLEMS, GROUP_M, FENCE_GATHERS, 1, 2, 4, OUT_BUFS,
                                        TRANSPOSED, SPLIT)),
            (wgrad_load_partition, (a0_ptr, b0_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, a0_stride, b0_stride,
                                    a1_stride, b1_stride, a2_stride, b2_stride, c0_desc, c1_desc, c2_desc, a_bufs,
                                    b_bufs, ready, empty, offsets_ptr, index_ptr, num_experts, PROBLEMS, GROUP_M,
                                    GATHER_A, GATHER_B, LOADER_WARPS, WAIT_ALL, TRANSPOSED, SPLIT)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (wgrad_consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c0_desc, c1_desc, c2_desc, c_bufs,
                                        offsets_ptr, num_experts, PROBLEMS, GROUP_M, FENCE_GATHERS, 0, 1, num_warps,
                                        OUT_BUFS, TRANSPOSED, SPLIT)),
            (wgrad_load_partition, (a0_ptr, b0_ptr, a1_ptr, b1_ptr, a2_ptr, b2_ptr, a0_stride, b0_stride,
                                    a1_stride, b1_stride, a2_stride, b2_stride, c0_desc, c1_desc, c2_desc, a_bufs,
                                    b_bufs, ready, empty, offsets_ptr, index_ptr, num_experts, PROBLEMS, GROUP_M,
                                    GATHER_A, GATHER_B, LOADER_WARPS, WAIT_ALL, TRANSPOSED, SPLIT)),
        ], [LOADER_WARPS], [LOADER_REGS])


LAUNCHES = KernelLaunches(grouped_wgrad_kernel)  # its compiled launches, kept per key (gluon_gemm.ENCODED_LAUNCHES)


# --- the host side ----------------------------------------------------------------------------------------------


def shared_bytes(config: GemmConfig, out_dtype: torch.dtype, buffers: int = 1) -> int:
    """Shared memory of the ring, ``buffers`` output tiles a consumer (in ``out_dtype``) and the descriptors'
    templates."""
    ring = config.stages * (config.block_m + config.block_n) * config.block_k * ELEMENT_BYTES
    tile = config.block_m * config.block_n * torch.empty((), dtype=out_dtype).element_size()
    return ring + config.output_tiles * buffers * tile + DESCRIPTOR_BYTES


def output_buffers(config: GemmConfig, out_dtype: torch.dtype) -> int:
    """Output tiles a consumer has in shared memory: two where they fit beside the ring (a short ring's configs,
    for experts of a K step or two), else one."""
    return 2 if shared_bytes(config, out_dtype, 2) <= SHARED_MEMORY_LIMIT else 1


def default_config(out_dtype: torch.dtype) -> GemmConfig:
    """The tiles of a launch with ``out_dtype`` outputs: :data:`FP32_CONFIG` for fp32, else :data:`DEFAULT_CONFIG`
    (a gathered B at 256 × 128 tiles was slower: notes/p2/engine-wgrad.md, "The gathered operand on the narrow
    side")."""
    return FP32_CONFIG if out_dtype == torch.float32 else DEFAULT_CONFIG


def check_tma_rows(name: str, tensor: torch.Tensor) -> None:
    """ValueError naming ``name`` where TMA cannot address the 2-D tensor's rows: unit column stride, row strides of
    16-byte multiples, a 16-byte aligned start."""
    if tensor.shape[1] > 1 and tensor.stride(1) != 1:
        raise ValueError(f"{name}: expected rows of contiguous elements (column stride 1), got strides "
                         f"{tuple(tensor.stride())}")
    if (tensor.stride(0) * tensor.element_size()) % 16:
        raise ValueError(f"{name}: TMA needs a row stride of a multiple of 16 bytes, got {tensor.stride(0)} elements")
    if tensor.device.type != "meta" and not aligned(tensor):
        raise ValueError(f"{name}: TMA needs the tensor to start on a 16-byte boundary")


def check_arguments(problems, offsets, *, outs=None, out_dtype: torch.dtype = torch.bfloat16,
                    config: GemmConfig | None = None) -> tuple[int, list[tuple[int, int]], torch.dtype]:
    """Raises TypeError/ValueError naming the argument where :func:`grouped_weight_grad` cannot take it, before any
    work; returns (E, [(M_p, N_p)], the output dtype). Offsets' values stay on the device and are not checked: they
    must rise from offsets[0] = 0 to offsets[E] ≤ M_total."""
    if not isinstance(problems, Sequence) or isinstance(problems, torch.Tensor | str):
        raise TypeError(f"problems: expected a sequence of (A, B) pairs, got {type(problems).__name__}")
    if not 1 <= len(problems) <= MAX_PROBLEMS:
        raise ValueError(f"problems: expected 1 to {MAX_PROBLEMS} (A, B) pairs, got {len(problems)}")
    if not isinstance(offsets, torch.Tensor):
        raise TypeError(f"offsets: expected a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets: expected torch.int32, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        raise ValueError(f"offsets: expected a 1-D tensor of E + 1 ≥ 1 elements, got shape {tuple(offsets.shape)}")
    if not offsets.is_contiguous():
        raise ValueError(f"offsets: expected a contiguous tensor, got strides {tuple(offsets.stride())}")
    num_experts = offsets.shape[0] - 1
    device, rows, shapes, index = offsets.device, None, [], None
    for p, pair in enumerate(problems):
        if isinstance(pair, Gathered) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(f"problems[{p}]: expected an (A, B) pair of tensors, got {type(pair).__name__}")
        for name, operand in ((f"problems[{p}].a", pair[0]), (f"problems[{p}].b", pair[1])):
            tensor = operand
            if isinstance(operand, Gathered):  # its rows read through the index; the source's rows are checked
                check_gathered(name, operand)
                if index is None:
                    index = operand.index
                elif operand.index is not index:
                    raise ValueError(f"{name}.index: the gathered operands of one launch share one index tensor "
                                     f"(the first one's)")
                tensor = operand.source
            elif not isinstance(operand, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor or a Gathered, got {type(operand).__name__}")
            if tensor.dtype != torch.bfloat16:
                raise TypeError(f"{name}: expected torch.bfloat16, got {tensor.dtype}")
            if tensor.dim() != 2:
                raise ValueError(f"{name}: expected a 2-D tensor [M_total, columns], got shape {tuple(tensor.shape)}")
            if tensor.device != device:
                raise ValueError(f"{name}: expected the device of offsets ({device}), got {tensor.device}")
            rows = operand.shape[0] if rows is None else rows
            if operand.shape[0] != rows:
                raise ValueError(f"{name}: expected {rows} rows (M_total, as problems[0].a), got shape "
                                 f"{tuple(operand.shape)}")
            check_tma_rows(name, tensor)
        shapes.append((pair[0].shape[1], pair[1].shape[1]))
    if outs is not None:
        if not isinstance(outs, Sequence) or isinstance(outs, torch.Tensor):
            raise TypeError(f"outs: expected a sequence of {len(problems)} tensors, got {type(outs).__name__}")
        if len(outs) != len(problems):
            raise ValueError(f"outs: expected {len(problems)} tensors (one a problem), got {len(outs)}")
        flat = output_tensors(outs)
        first = flat[0] if flat else None
        for p, (out, (m, n)) in enumerate(zip(outs, shapes, strict=True)):
            if column_parts(out):  # C_0 in two column parts
                if len(problems) != 1 or len(out) != 2:
                    raise ValueError(f"outs[{p}]: two column parts of one output are taken for a launch of one "
                                     f"product only, as a pair; got {len(out)} parts beside {len(problems)} products")
                left = out[0].shape[2] if isinstance(out[0], torch.Tensor) and out[0].dim() == 3 else 0
                if not 0 < left < n:
                    raise ValueError(f"outs[{p}][0]: expected [E, M_p, N_left] with 0 < N_left < N_p = {n}")
                check_output(f"outs[{p}][0]", out[0], (num_experts, m, left), first, device)
                check_output(f"outs[{p}][1]", out[1], (num_experts, m, n - left), first, device)
                if not transposed(out[0]) or left % SPLIT_ROWS:
                    raise ValueError(f"outs[{p}]: column parts are taken as transposed views, the left one's columns "
                                     f"a multiple of {SPLIT_ROWS}; got strides {tuple(out[0].stride())} and "
                                     f"{left} columns")
            else:
                check_output(f"outs[{p}]", out, (num_experts, m, n), first, device)
        out_dtype = first.dtype
    elif out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype: expected one of {OUT_DTYPES}, got {out_dtype}")
    element = torch.empty((), dtype=out_dtype).element_size()
    for p, (_, n) in enumerate(shapes):
        if (n * element) % 16:
            raise ValueError(f"problems[{p}].b: TMA needs the output's rows (N_p = {n} columns of {out_dtype}) to "
                             f"be a multiple of 16 bytes")
    config = config or default_config(out_dtype)
    if not isinstance(config, GemmConfig):
        raise TypeError(f"config: expected a GemmConfig, got {type(config).__name__}")
    if shared_bytes(config, out_dtype) > SHARED_MEMORY_LIMIT:
        raise ValueError(f"config: {shared_bytes(config, out_dtype)} bytes of shared memory with {out_dtype} "
                         f"output tiles, more than the {SHARED_MEMORY_LIMIT} an sm_90 block may use (fewer stages or "
                         f"a narrower tile)")
    return num_experts, shapes, out_dtype


def unchecked_sizes(problems, offsets, outs, out_dtype: torch.dtype) -> tuple[int, list[tuple[int, int]], torch.dtype]:
    """(E, [(M_p, N_p)], the output dtype) as :func:`check_arguments` returns them for arguments it takes, without
    its checks (a trusted caller's)."""
    shapes = [(a.shape[1], b.shape[1]) for a, b in problems]
    return offsets.shape[0] - 1, shapes, output_tensors(outs)[0].dtype if outs is not None else out_dtype


def column_parts(out) -> bool:
    """Whether an output is given as its column parts (a tuple or list of tensors: C_0 = [left | right])."""
    return isinstance(out, tuple | list) and all(isinstance(part, torch.Tensor) for part in out)


def output_tensors(outs) -> list[torch.Tensor]:
    """The output tensors of ``outs``, an output in column parts counted as its parts."""
    flat = []
    for out in outs:
        flat += list(out) if column_parts(out) else [out]
    return flat


def check_output(name: str, out, shape: tuple[int, int, int], first, device) -> None:
    """TypeError/ValueError naming ``name`` where ``out`` cannot be written as [E, M_p, N_p] ``shape`` beside the
    launch's ``first`` output (its dtype and layout)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if out.dtype not in OUT_DTYPES:
        raise TypeError(f"{name}: expected one of {OUT_DTYPES}, got {out.dtype}")
    if not isinstance(first, torch.Tensor) or out.dtype != first.dtype:
        raise TypeError(f"{name}: expected {getattr(first, 'dtype', None)} like outs[0], got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} ([E, M_p, N_p]), got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"{name}: expected the device of offsets ({device}), got {out.device}")
    rows_strides = (out.stride(0), out.stride(2 if transposed(out) else 1))  # those of C_p or of C_pᵀ
    if out.stride(1 if transposed(out) else 2) != 1 or any(s * out.element_size() % 16 for s in rows_strides):
        raise ValueError(f"{name}: expected contiguous rows (or contiguous columns: a transposed view) whose "
                         f"other strides are multiples of 16 bytes (a column slice of a wider tensor may be), "
                         f"got strides {tuple(out.stride())}")
    if transposed(out) != transposed(first):
        raise ValueError(f"{name}: expected the layout of outs[0] (all rows contiguous, or all columns), got "
                         f"strides {tuple(out.stride())} beside {tuple(first.stride())}")
    if out.device.type != "meta" and not aligned(out):
        raise ValueError(f"{name}: TMA needs the tensor to start on a 16-byte boundary")


def transposed(out: torch.Tensor) -> bool:
    """Whether an output C_p [E, M_p, N_p] is a transposed view (its columns contiguous: C_pᵀ [E, N_p, M_p] lies
    row by row), as the MoE layer's gate and up gradients are when x is the A operand."""
    return out.stride(2) != 1 and out.shape[2] > 1


def output_descriptor(out: torch.Tensor, config: GemmConfig, box_rows: int | None = None) -> TensorDescriptor:
    """A host TMA descriptor of C_p [E, M_p, N_p] in [1, BLOCK_M, BLOCK_N] boxes (of C_pᵀ [E, N_p, M_p] in [1,
    BLOCK_N, BLOCK_M] boxes, or [1, ``box_rows``, BLOCK_M], where ``out`` is a transposed view): it clips a tile at
    M_p and N_p inside each expert's matrix."""
    dtype = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[out.dtype]
    if transposed(out):
        block = (1, box_rows or config.block_n, config.block_m)
        return TensorDescriptor.from_tensor(out.transpose(1, 2), list(block), shared_layout(block, dtype))
    block = (1, config.block_m, config.block_n)
    return TensorDescriptor.from_tensor(out, list(block), shared_layout(block, dtype))


def launch_arguments(config: GemmConfig, problems, offsets, outs) -> tuple[dict, dict]:
    """(the kernel's run-time arguments by name, its compile-time arguments by name) for these tensors: what
    :func:`grouped_weight_grad` launches and what ``scripts/p2/wgrad_probe.py --compile-only`` compiles (meta
    tensors do; there the pointers and strides are types). Problems past the given ones repeat problem 0 (never
    read, never written; its output's descriptor object itself, which an encoded launch encodes once)."""
    padded = list(problems) + [problems[0]] * (MAX_PROBLEMS - len(problems))
    flat = output_tensors(outs)  # C_0's two column parts take the first two descriptors (SPLIT)
    split = len(flat) > len(outs)
    out_descs = [output_descriptor(out, config, SPLIT_ROWS if split and p == 1 else None) for p, out in enumerate(flat)]
    padded_out_descs = out_descs + [out_descs[0]] * (MAX_PROBLEMS - len(flat))
    arguments, index, gather_a, gather_b = {}, offsets, 0, 0
    for p, (a, b) in enumerate(problems):
        gather_a |= isinstance(a, Gathered) << p
        gather_b |= isinstance(b, Gathered) << p
        index = a.index if isinstance(a, Gathered) else b.index if isinstance(b, Gathered) else index
    tensors = [[x.source if isinstance(x, Gathered) else x for x in pair] for pair in padded]
    for p, (a, b) in enumerate(tensors):
        arguments.update({f"a{p}_ptr": a, f"b{p}_ptr": b})
    for p, (a, b) in enumerate(tensors):
        arguments.update({f"a{p}_stride": a.stride(0), f"b{p}_stride": b.stride(0)})
    for p, out_desc in enumerate(padded_out_descs):
        arguments[f"c{p}_desc"] = out_desc
    arguments.update(offsets_ptr=offsets, index_ptr=index, num_experts=offsets.shape[0] - 1)
    gathers = bool(gather_a | gather_b)
    constexprs = dict(PROBLEMS=len(problems), GATHER_A=gather_a, GATHER_B=gather_b,
                      LOADER_WARPS=GATHER_WARPS if gathers else 1, WAIT_ALL=WAIT_EVERY_STEP,
                      FENCE_GATHERS=gathers and FENCE_GATHERED,
                      BLOCK_K=config.block_k, BUFFERS=config.stages, OUT_BUFS=output_buffers(config, flat[0].dtype),
                      GROUP_M=config.group_m, PINGPONG=config.pingpong, CONSUMER_REGS=CONSUMER_REGISTERS,
                      LOADER_REGS=GATHER_LOADER_REGISTERS[config.consumers] if gathers else LOADER_REGISTERS,
                      TRANSPOSED=transposed(flat[0]), SPLIT=split, num_warps=config.warps)
    return arguments, constexprs


def grouped_weight_grad(problems, offsets: torch.Tensor, *, outs=None, out_dtype: torch.dtype = torch.bfloat16,
                        config: GemmConfig | None = None, check: bool = True) -> list[torch.Tensor]:
    """[C_p for each (A_p, B_p) in ``problems``]: C_p[e] = A_p[rows_e]ᵀ · B_p[rows_e] for the rows offsets[e] ≤ r <
    offsets[e + 1] of each expert e, fp32-accumulated, into ``outs`` (new [E, M_p, N_p] tensors of ``out_dtype``,
    bf16 or fp32, where None; else their dtype), exact zeros for an expert without rows. One launch for 1 to 3
    problems. ``problems``: (A_p [M_total, M_p], B_p [M_total, N_p]) bf16 pairs over the same rows, each with rows
    TMA can address (column views of a wider tensor too), or a :class:`.gathered.Gathered` whose rows are read
    through its index (all gathered operands of a launch share one index). ``offsets``: int32 [E + 1] on the
    device, rising from 0 to at most M_total (not checked: no host sync). ``config``: tiles and ring
    (:func:`default_config` where None). On a Hopper GPU; capturable in a CUDA
    graph. ``check``: False for a trusted caller that has checked its arguments as :func:`check_arguments` does (the
    MoE layer, once a call), sparing those checks' host time."""
    if check:
        num_experts, shapes, out_dtype = check_arguments(problems, offsets, outs=outs, out_dtype=out_dtype,
                                                         config=config)
    else:
        num_experts, shapes, out_dtype = unchecked_sizes(problems, offsets, outs, out_dtype)
    config = config or default_config(out_dtype)
    if offsets.device.type != "cuda":
        raise ValueError(f"offsets: the Gluon weight-gradient kernel runs on a CUDA (Hopper) GPU, got a tensor on "
                         f"{offsets.device}")
    if outs is None:
        outs = [torch.empty((num_experts, m, n), dtype=out_dtype, device=offsets.device) for m, n in shapes]
    outs = list(outs)
    live = [p for p, (m, n) in enumerate(shapes) if m and n]  # a product with no output elements takes no tiles
    if num_experts == 0 or not live:
        return outs
    if problems[0][0].shape[0] == 0:  # no rows at all: every expert's gradient is zero
        for out in output_tensors(outs):
            out.zero_()
        return outs
    install_tma_allocator(offsets.device)  # the global scratch of the descriptors the loading warp makes
    live_problems, live_outs = [problems[p] for p in live], [outs[p] for p in live]

    def make():
        arguments, constexprs = launch_arguments(config, live_problems, offsets, live_outs)
        return grid(num_experts, [shapes[p] for p in live], config, sm_count(offsets.device)), arguments, constexprs

    # everything the launch is made of (a gathered operand by its source and index): a repeated call reuses it
    operands = [[(x.source, x.index) if isinstance(x, Gathered) else x for x in pair] for pair in live_problems]
    call_key = (offsets.device, config, signature((operands, offsets, live_outs)))
    launch_memoised(LAUNCHES, call_key, make, maxnreg=config.maxnreg, device=offsets.device)
    return outs
