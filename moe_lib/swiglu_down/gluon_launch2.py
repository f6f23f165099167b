"""P1's launch 2 in Gluon: one warp issues TMA copies, two warpgroups issue wgmma (the faithful path's, on Hopper).

Dataflow (T tokens, H hidden, I intermediate; dG, dU from launch 1, each [T, I] as hi and, with WITH_LO, lo halves):

    dWg = dG_hiᵀ · x + dG_loᵀ · x                  tiles [BLOCK_M of I, BLOCK_N of H], K = T   (A read transposed)
    dWu = dU_hiᵀ · x + dU_loᵀ · x                  likewise
    dx  = dG_hi · Wg + dG_lo · Wg + dU_hi · Wu + dU_lo · Wu
                                                   tiles [BLOCK_M of T, BLOCK_N of H], K = 2I: the K steps over
                                                   I of dG with Wg's rows, then of dU with Wu's
    dWd = dyᵀ · intermediate                       with ``grad_down_tiles`` (launch 1 then has none): tiles
                                                   [BLOCK_M of H, WEIGHT_N of I], K = T, waiting for nothing

Each program takes one output tile (the weight-gradient tiles first: their reductions over T are the long ones).
Its loading warp copies each K step's A tile (and its lo half) and B tile by TMA into the next buffer of a ring in
shared memory: a `ready` mbarrier per buffer (completed by the copy engine when the bytes have landed) and an
`empty` one (completed by the multiplying warps when their MMAs on it are done). The two warpgroups wait on `ready`,
issue `acc += A_hi·B` and `acc += A_lo·B` on the same B tile asynchronously, wait only for the step before, and hand
its buffer back; at the end the tile goes out through shared memory by TMA. Each tile kind has its own
warp-specialised region, chosen at run time: with several kinds' loops in one region ptxas serialises the wgmma
(each waiting for the one before; ``scripts/p1/p1_compile_check.py`` reports it). Where the weight-gradient
tiles are short (to 512 tokens) a fixed number of programs take them in turn instead (``weight_grad_programs``), and
issued by programmatic dependent launch the loading warp may send its first steps' tiles of x, Wg, Wu (inputs of the
call, not launch 1's) before its wait for launch 1 (``inputs_before_wait``).

The readable version of the same arithmetic is launch 2 of :mod:`.kernels` (``grad_x_and_grad_gate_up_kernel``):
under the interpreter, on a CPU, and wherever TMA cannot address the rows, :func:`prepare_second_launch_gluon` is not
used: the chooser (:mod:`.choose`) picks another design there. Against cuBLAS's same arithmetic and the Triton launch 2:
``notes/p1/design-13.md``; its forms: :data:`.designs.gluon.FORMS`.
"""

from __future__ import annotations

from dataclasses import dataclass

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_wait  # griddepcontrol.wait

from ..encoded_launch import descriptor, prepared_launch
from ..tiling import cdiv

TRACE_FIELDS = ("start_ns", "proceed_ns", "end_ns", "sm", "kind")  # a traced program's row (see record_program)


def hi_lo_descriptors(d_gate, d_up, block_shape) -> tuple:
    """Descriptors of dG hi, dG lo, dU hi, dU lo ([1 or 2, T, I]: hi and, on the faithful path, lo) in one tile shape;
    without lo halves the hi ones repeat for lo (each descriptor is ≈ 6 µs of host work a call)."""
    dg_hi, du_hi = descriptor(d_gate[0], block_shape), descriptor(d_up[0], block_shape)
    if len(d_gate) == 1:
        return dg_hi, dg_hi, du_hi, du_hi
    return dg_hi, descriptor(d_gate[1], block_shape), du_hi, descriptor(d_up[1], block_shape)


@gluon.jit
def clock_stamp(anchor):
    """(the GPU's global timer in ns, this program's SM); ``anchor``: any int32 scalar (the asm's input)."""
    now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [anchor], dtype=gl.int64, is_pure=False,
                                    pack=1)
    sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [anchor], dtype=gl.int32, is_pure=True, pack=1)
    return now, sm


@gluon.jit
def record_program(trace_ptr, program, start, proceed, sm, kind):
    """A traced program's row of TRACE_FIELDS: when it started, when it could go on (launch 2 issued by programmatic
    dependent launch: past its wait for launch 1; with INPUTS_BEFORE_WAIT the loading warp waits instead, and the
    row shows its start), when it ended (now), its SM and its tile kind (0: the weight-gradient tiles that reduce over
    T, 1: the tiles of fixed length, dA's or dx's, 2: dWd's tiles in launch 2)."""
    end, _ = clock_stamp(program)
    row = trace_ptr + program.to(gl.int64) * 5
    gl.store(row, start)
    gl.store(row + 1, proceed)
    gl.store(row + 2, end)
    gl.store(row + 3, sm.to(gl.int64))
    gl.store(row + 4, kind.to(gl.int64))


@gluon.jit
def ring_barriers(BUFFERS: gl.constexpr):
    """The ring's (ready, empty) mbarriers, one of each per buffer, initialised (count 1) and fenced."""
    ready = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    return ready, empty


@gluon.jit
def load_a_step(a_desc, a_lo_desc, a_bufs, a_lo_bufs, bar, slot, off_m, k, A_K_MAJOR: gl.constexpr,
                WITH_LO: gl.constexpr):
    """One K step's A tile (and its lo half) into buffer ``slot``, completing ``bar``."""
    if A_K_MAJOR:
        tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(slot))
        if WITH_LO:
            tma.async_copy_global_to_shared(a_lo_desc, [off_m, k], bar, a_lo_bufs.index(slot))
    else:
        tma.async_copy_global_to_shared(a_desc, [k, off_m], bar, a_bufs.index(slot))
        if WITH_LO:
            tma.async_copy_global_to_shared(a_lo_desc, [k, off_m], bar, a_lo_bufs.index(slot))


@gluon.jit
def load_steps(a_desc, a_lo_desc, b_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, k_steps, step0,
               A_K_MAJOR: gl.constexpr, WITH_LO: gl.constexpr, k_first=0, rotation=0,
               B_BEFORE_WAIT: gl.constexpr = False):
    """The loading warp: K steps 0 .. k_steps − 1 of A (its lo half with WITH_LO) and B, from element ``k_first`` of
    the reduction on, into the ring's buffers, the ring's steps ``step0`` on (ring step i in buffer (i + ``rotation``)
    mod BUFFERS, its phase that of i). A [M, K] row-major when A_K_MAJOR, else given as Aᵀ [K, M]; B [K, N].
    With B_BEFORE_WAIT (B an input of the call, A launch 1's): the first steps' B tiles, as many as the ring holds,
    go out before the wait for launch 1 (``griddepcontrol.wait``), their A tiles after it."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[0]
    STEP_BYTES: gl.constexpr = b_desc.block_type.nbytes + a_desc.block_type.nbytes * (1 + WITH_LO)
    early = 0
    if B_BEFORE_WAIT:
        early = gl.minimum(k_steps, BUFFERS)
        for step in range(early):
            i = step0 + step
            slot = (i + rotation) % BUFFERS
            mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), STEP_BYTES)
            tma.async_copy_global_to_shared(b_desc, [k_first + step * BLOCK_K, off_n], ready.index(slot),
                                            b_bufs.index(slot))
        gdc_wait()
        for step in range(early):
            slot = (step0 + step + rotation) % BUFFERS
            load_a_step(a_desc, a_lo_desc, a_bufs, a_lo_bufs, ready.index(slot), slot, off_m,
                        k_first + step * BLOCK_K, A_K_MAJOR, WITH_LO)
    for step in range(early, k_steps):
        i = step0 + step
        slot = (i + rotation) % BUFFERS
        mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)  # a fresh barrier counts as released
        bar = ready.index(slot)
        mbarrier.expect(bar, STEP_BYTES)
        k = k_first + step * BLOCK_K
        load_a_step(a_desc, a_lo_desc, a_bufs, a_lo_bufs, bar, slot, off_m, k, A_K_MAJOR, WITH_LO)
        tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_bufs.index(slot))


@gluon.jit
def mma_steps(a_bufs, a_lo_bufs, b_bufs, ready, empty, k_steps, acc, A_K_MAJOR: gl.constexpr,
              WITH_LO: gl.constexpr, IN_FLIGHT: gl.constexpr = 1, step0=0, rotation=0):
    """acc += A·B (and A_lo·B) over the ring's next ``k_steps`` buffers (the ring's steps ``step0`` on, ``rotation`` as
    in :func:`load_steps`), IN_FLIGHT steps' MMAs running while the next is issued, each buffer handed back once its
    MMAs are done."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    for step in range(k_steps):
        i = step0 + step
        slot = (i + rotation) % BUFFERS
        mbarrier.wait(ready.index(slot), (i // BUFFERS) & 1)
        if A_K_MAJOR:
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot), acc, is_async=True)
            if WITH_LO:
                acc = warpgroup_mma(a_lo_bufs.index(slot), b_bufs.index(slot), acc, is_async=True)
        else:
            acc = warpgroup_mma(a_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc, is_async=True)
            if WITH_LO:
                acc = warpgroup_mma(a_lo_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=IN_FLIGHT * (1 + WITH_LO), deps=(acc,))
        mbarrier.arrive(empty.index((i + rotation + BUFFERS - IN_FLIGHT) % BUFFERS), count=1, pred=step >= IN_FLIGHT)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for j in gl.static_range(IN_FLIGHT):  # the last steps' buffers
        last = step0 + k_steps - IN_FLIGHT + j
        mbarrier.arrive(empty.index((last + rotation) % BUFFERS), count=1, pred=last >= step0)
    return acc


@gluon.jit
def store_tile(acc, c_desc, c_smem, off_m, off_n):
    """The fp32 tile into c_desc's dtype, out through shared memory by TMA (waiting for the tile before)."""
    tma.store_wait(pendings=0)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def count_in_partial(acc, partials_ptr, counters_ptr, tile, split, SPLITS: gl.constexpr):
    """Split ``split`` of output tile ``tile`` parks its fp32 partial ``acc`` in the workspace (``partials_ptr``:
    [tiles, SPLITS, BLOCK_M, BLOCK_N]) and counts itself in on the tile's counter; returns whether it arrived last.
    The counters only grow (by SPLITS a tile a call), so the last is the one that sees a count ≡ SPLITS − 1 (mod
    SPLITS, a power of two). The readable version: ``kernels.combine_splits``."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    BLOCK_N: gl.constexpr = acc.shape[1]
    layout: gl.constexpr = acc.type.layout
    offsets = (gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))[:, None] * BLOCK_N
               + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))[None, :])
    partial = partials_ptr + (tile.to(gl.int64) * SPLITS + split) * (BLOCK_M * BLOCK_N)
    gl.store(partial + offsets, acc)
    gl.thread_barrier()  # every thread's part of the partial is stored before the arrival is counted
    arrived = gl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return (arrived & (SPLITS - 1)) == SPLITS - 1


@gluon.jit
def sum_partials_into(partials_ptr, tile, destination, SPLITS: gl.constexpr, num_warps: gl.constexpr):
    """Σ_s partial_s of tile ``tile`` (the workspace [tiles, SPLITS, BLOCK_M, BLOCK_N] at ``partials_ptr``) in split
    order, so the same sum whichever split arrived last, into the [BLOCK_M, BLOCK_N] shared-memory tile
    ``destination`` in its dtype. Row block by row block, each thread's 16-byte loads of every split's block in flight
    at once, so the sum needs no more registers than a 64 × 256 tile in the wgmma layout (``num_warps`` warps: 128
    fp32 a thread a block): the whole tile beside one partial would take twice that, and its loads would then go out
    a few at a time. The readable version: ``kernels.combine_splits``."""
    BLOCK_M: gl.constexpr = destination.type.shape[0]
    BLOCK_N: gl.constexpr = destination.type.shape[1]
    FITTING_ROWS: gl.constexpr = 128 * 32 * num_warps // (SPLITS * BLOCK_N)
    ROWS: gl.constexpr = BLOCK_M if FITTING_ROWS > BLOCK_M else FITTING_ROWS
    gl.static_assert(BLOCK_M % ROWS == 0, "the row blocks tile the output tile")
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    offsets = (gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))[:, None] * BLOCK_N
               + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))[None, :])
    tile_partials = partials_ptr + tile.to(gl.int64) * (SPLITS * BLOCK_M * BLOCK_N)
    for row in gl.static_range(0, BLOCK_M, ROWS):
        block = tile_partials + row * BLOCK_N + offsets
        total = gl.load(block, cache_modifier=".cg")
        for s in gl.static_range(1, SPLITS):
            total += gl.load(block + s * (BLOCK_M * BLOCK_N), cache_modifier=".cg")
        destination.slice(row, ROWS, dim=0).store(total.to(destination.dtype))


@gluon.jit
def store_sum_of_partials(partials_ptr, tile, c_desc, c_smem, off_m, off_n, SPLITS: gl.constexpr,
                          num_warps: gl.constexpr):
    """The last split of output tile ``tile`` to arrive: the partials' sum (:func:`sum_partials_into`) into ``c_smem``
    in c_desc's dtype, then out by TMA."""
    tma.store_wait(pendings=0)  # c_smem is free
    sum_partials_into(partials_ptr, tile, c_smem, SPLITS, num_warps)
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def tile_product(a_bufs, a_lo_bufs, b_bufs, ready, empty, k_steps, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 A_K_MAJOR: gl.constexpr, WITH_LO: gl.constexpr, num_warps: gl.constexpr, rotation=0,
                 step0=0):
    """The fp32 [BLOCK_M, BLOCK_N] tile Σ A·B (and A_lo·B) over the ring's ``k_steps`` steps from ``step0`` on (step i
    in buffer (i + ``rotation``) mod BUFFERS), in the layout of the warpgroups' wgmma (``num_warps`` warps, each
    warpgroup 64 rows)."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    return mma_steps(a_bufs, a_lo_bufs, b_bufs, ready, empty, k_steps, acc, A_K_MAJOR, WITH_LO, 1, step0, rotation)


@gluon.jit
def mma_partition(a_bufs, a_lo_bufs, b_bufs, ready, empty, c_desc, c_smem, off_m, off_n, k_steps,
                  A_K_MAJOR: gl.constexpr, WITH_LO: gl.constexpr, num_warps: gl.constexpr):
    """The two warpgroups: one tile, its accumulator living and dying here, then its store."""
    acc = tile_product(a_bufs, a_lo_bufs, b_bufs, ready, empty, k_steps, c_desc.block_type.shape[0],
                       c_desc.block_type.shape[1], A_K_MAJOR, WITH_LO, num_warps)
    store_tile(acc, c_desc, c_smem, off_m, off_n)
    tma.store_wait(pendings=0)


@gluon.jit
def weight_grad_load_partition(a_desc, a_lo_desc, x_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n,
                               k_steps, WITH_LO: gl.constexpr, INPUTS_BEFORE_WAIT: gl.constexpr):
    load_steps(a_desc, a_lo_desc, x_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, k_steps, 0, False,
               WITH_LO, B_BEFORE_WAIT=INPUTS_BEFORE_WAIT)


@gluon.jit
def grad_x_partition(a_bufs, a_lo_bufs, b_bufs, ready, empty, dx_desc, c_smem, off_m, off_n, k_steps, partials_ptr,
                     counters_ptr, tile, split, WITH_LO: gl.constexpr, SPLITS: gl.constexpr,
                     num_warps: gl.constexpr):
    """The two warpgroups of a dx tile: its K steps (with SPLITS > 1 one split's), then its store; a split parks its
    partial and counts itself in, and the split that arrives last stores the sum of all of them."""
    acc = tile_product(a_bufs, a_lo_bufs, b_bufs, ready, empty, k_steps, dx_desc.block_type.shape[0],
                       dx_desc.block_type.shape[1], True, WITH_LO, num_warps)
    if SPLITS == 1:
        store_tile(acc, dx_desc, c_smem, off_m, off_n)
    elif count_in_partial(acc, partials_ptr, counters_ptr, tile, split, SPLITS):
        store_sum_of_partials(partials_ptr, tile, dx_desc, c_smem, off_m, off_n, SPLITS, num_warps)
    tma.store_wait(pendings=0)


@gluon.jit
def grad_x_load_partition(dg_desc, dg_lo_desc, wg_desc, du_desc, du_lo_desc, wu_desc, a_bufs, a_lo_bufs, b_bufs,
                          ready, empty, off_m, off_n, half_steps, first_step, end_step, WITH_LO: gl.constexpr,
                          INPUTS_BEFORE_WAIT: gl.constexpr):
    """dx's K steps ``first_step`` .. ``end_step`` − 1 of 2 · ``half_steps``: those below ``half_steps`` over I of dG
    against Wg's rows, the rest of dU against Wu's (TMA fills the last step's rows beyond I with zeros in both
    operands). With INPUTS_BEFORE_WAIT the first steps' Wg, Wu tiles (as many as the ring holds) go out before the
    wait for launch 1, their dG, dU tiles after it."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = wg_desc.block_type.shape[0]
    STEP_BYTES: gl.constexpr = wg_desc.block_type.nbytes + dg_desc.block_type.nbytes * (1 + WITH_LO)
    first = first_step
    if INPUTS_BEFORE_WAIT:  # a fresh ring: its first BUFFERS steps are free
        early = gl.minimum(end_step - first_step, BUFFERS)
        for step in range(early):
            j = first_step + step
            mbarrier.expect(ready.index(step), STEP_BYTES)
            if j < half_steps:
                tma.async_copy_global_to_shared(wg_desc, [j * BLOCK_K, off_n], ready.index(step), b_bufs.index(step))
            else:
                tma.async_copy_global_to_shared(wu_desc, [(j - half_steps) * BLOCK_K, off_n], ready.index(step),
                                                b_bufs.index(step))
        gdc_wait()
        for step in range(early):
            j = first_step + step
            if j < half_steps:
                load_a_step(dg_desc, dg_lo_desc, a_bufs, a_lo_bufs, ready.index(step), step, off_m, j * BLOCK_K, True,
                            WITH_LO)
            else:
                load_a_step(du_desc, du_lo_desc, a_bufs, a_lo_bufs, ready.index(step), step, off_m,
                            (j - half_steps) * BLOCK_K, True, WITH_LO)
        first = first_step + gl.maximum(early, 0)
    gate_steps = gl.maximum(gl.minimum(end_step, half_steps) - first, 0)
    up_first = gl.maximum(first, half_steps)
    load_steps(dg_desc, dg_lo_desc, wg_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, gate_steps,
               first - first_step, True, WITH_LO, first * BLOCK_K)
    load_steps(du_desc, du_lo_desc, wu_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n,
               gl.maximum(end_step - up_first, 0), first - first_step + gate_steps, True, WITH_LO,
               (up_first - half_steps) * BLOCK_K)


@gluon.jit
def weight_grad_region(a_t_desc, a_lo_t_desc, x_desc, c_desc, a_t_bufs, a_lo_t_bufs, b_bufs, ready, empty, c_smem,
                       off_m, off_n, k_steps, WITH_LO: gl.constexpr, INPUTS_BEFORE_WAIT: gl.constexpr,
                       num_warps: gl.constexpr):
    """One weight-gradient tile (dWg's or dWu's, by the descriptors given) as its own warp-specialised region."""
    gl.warp_specialize([
        (mma_partition, (a_t_bufs, a_lo_t_bufs, b_bufs, ready, empty, c_desc, c_smem, off_m, off_n, k_steps, False,
                         WITH_LO, num_warps)),
        (weight_grad_load_partition, (a_t_desc, a_lo_t_desc, x_desc, a_t_bufs, a_lo_t_bufs, b_bufs, ready, empty,
                                      off_m, off_n, k_steps, WITH_LO, INPUTS_BEFORE_WAIT)),
    ], [1], [40])


@gluon.jit
def weight_grad_tile_origin(t, weight_tiles, weight_tiles_n, BLOCK_M: gl.constexpr, WEIGHT_N: gl.constexpr):
    """(row, column) of weight-gradient tile ``t``: dWg's tiles 0 .. weight_tiles − 1, then dWu's."""
    tile = t % weight_tiles
    return (tile // weight_tiles_n) * BLOCK_M, (tile % weight_tiles_n) * WEIGHT_N


@gluon.jit
def weight_grad_tiles_partition(a_bufs, a_lo_bufs, b_bufs, ready, empty, dwg_desc, dwu_desc, c_smem, first, stride,
                                weight_tiles, weight_tiles_n, k_steps, WITH_LO: gl.constexpr,
                                num_warps: gl.constexpr):
    """The two warpgroups of a program that takes weight-gradient tiles ``first``, ``first`` + ``stride``, ...: each
    tile's K steps (the ring's count running on from tile to tile), then its store, which drains while the next
    tile's products run."""
    BLOCK_M: gl.constexpr = dwg_desc.block_type.shape[0]
    WEIGHT_N: gl.constexpr = dwg_desc.block_type.shape[1]
    step0 = 0
    for t in range(first, 2 * weight_tiles, stride):
        off_m, off_n = weight_grad_tile_origin(t, weight_tiles, weight_tiles_n, BLOCK_M, WEIGHT_N)
        acc = tile_product(a_bufs, a_lo_bufs, b_bufs, ready, empty, k_steps, BLOCK_M, WEIGHT_N, False, WITH_LO,
                           num_warps, 0, step0)
        if t < weight_tiles:
            store_tile(acc, dwg_desc, c_smem, off_m, off_n)
        else:
            store_tile(acc, dwu_desc, c_smem, off_m, off_n)
        step0 += k_steps
    tma.store_wait(pendings=0)


@gluon.jit
def load_weight_grad_tile(dg_t_desc, dg_lo_t_desc, du_t_desc, du_lo_t_desc, x_desc, a_bufs, a_lo_bufs, b_bufs, ready,
                          empty, t, weight_tiles, weight_tiles_n, k_steps, step0, WITH_LO: gl.constexpr,
                          B_BEFORE_WAIT: gl.constexpr):
    """Weight-gradient tile ``t``'s K steps (dWg's from dG, else dWu's from dU) into the ring from step ``step0``."""
    BLOCK_M: gl.constexpr = dg_t_desc.block_type.shape[1]
    WEIGHT_N: gl.constexpr = x_desc.block_type.shape[1]
    off_m, off_n = weight_grad_tile_origin(t, weight_tiles, weight_tiles_n, BLOCK_M, WEIGHT_N)
    if t < weight_tiles:
        load_steps(dg_t_desc, dg_lo_t_desc, x_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, k_steps,
                   step0, False, WITH_LO, B_BEFORE_WAIT=B_BEFORE_WAIT)
    else:
        load_steps(du_t_desc, du_lo_t_desc, x_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, k_steps,
                   step0, False, WITH_LO, B_BEFORE_WAIT=B_BEFORE_WAIT)


@gluon.jit
def weight_grad_tiles_load_partition(dg_t_desc, dg_lo_t_desc, du_t_desc, du_lo_t_desc, x_desc, a_bufs, a_lo_bufs,
                                     b_bufs, ready, empty, first, stride, weight_tiles, weight_tiles_n, k_steps,
                                     WITH_LO: gl.constexpr, INPUTS_BEFORE_WAIT: gl.constexpr):
    """The loading warp of the same program: each of its tiles' K steps in turn, running ahead into the next tile's
    while the last one's are multiplied and stored (with INPUTS_BEFORE_WAIT the first tile's first x tiles before the
    wait for launch 1)."""
    step0 = 0
    t0 = first
    if INPUTS_BEFORE_WAIT:
        load_weight_grad_tile(dg_t_desc, dg_lo_t_desc, du_t_desc, du_lo_t_desc, x_desc, a_bufs, a_lo_bufs, b_bufs,
                              ready, empty, first, weight_tiles, weight_tiles_n, k_steps, 0, WITH_LO, True)
        step0 = k_steps
        t0 = first + stride
    for t in range(t0, 2 * weight_tiles, stride):
        load_weight_grad_tile(dg_t_desc, dg_lo_t_desc, du_t_desc, du_lo_t_desc, x_desc, a_bufs, a_lo_bufs, b_bufs,
                              ready, empty, t, weight_tiles, weight_tiles_n, k_steps, step0, WITH_LO, False)
        step0 += k_steps


@gluon.jit(do_not_specialize=("T", "I"))  # one compiled kernel for every T, I: see prepare_second_launch_gluon
def second_launch_kernel(
    dg_t_desc, dg_lo_t_desc, du_t_desc, du_lo_t_desc,  # dG, dU hi and lo [T, I] as [BLOCK_K, BLOCK_M] tiles (Aᵀ)
    dg_desc, dg_lo_desc, du_desc, du_lo_desc,  # the same tensors as [BLOCK_M, BLOCK_K] tiles (A)
    x_desc,  # x [T, H] as [BLOCK_K, WEIGHT_N] tiles
    wg_desc, wu_desc,  # Wg, Wu [I, H] as [BLOCK_K, BLOCK_N] tiles
    dwg_desc, dwu_desc,  # out: dWg, dWu [I, H] as [BLOCK_M, WEIGHT_N] tiles (WEIGHT_N = BLOCK_N or a divisor of it)
    dx_desc,  # out: dx [T, H] as [BLOCK_M, BLOCK_N] tiles
    dy_t_desc,  # with GRAD_DOWN: dy [T, H] as [BLOCK_K, BLOCK_M] tiles (Aᵀ of dWd)
    intermediate_desc,  # with GRAD_DOWN: intermediate [T, I] as [BLOCK_K, GRAD_DOWN_N] tiles (B of dWd)
    dwd_desc,  # with GRAD_DOWN, out: dWd [H, I] as [BLOCK_M, GRAD_DOWN_N] tiles (GRAD_DOWN_N: WEIGHT_N or a divisor)
    dx_partials_ptr,  # with GRAD_X_SPLITS > 1: fp32 workspace [dx tiles, GRAD_X_SPLITS, BLOCK_M, BLOCK_N]
    dx_counters_ptr,  # with GRAD_X_SPLITS > 1: int32 arrival counters, one per dx tile (they only grow)
    trace_ptr,  # with TRACE: int64 [programs, 5], a row of TRACE_FIELDS per program
    T, I,
    WITH_LO: gl.constexpr,  # both halves of dG, dU (the faithful path); else the hi halves alone
    BUFFERS: gl.constexpr,  # buffers of the ring
    GRAD_X_FIRST: gl.constexpr,  # dx's tiles take the first program ids (else dWg's and dWu's do)
    PROGRAMMATIC: gl.constexpr,  # issued by programmatic dependent launch: wait for launch 1 before anything else
    GRAD_X_SPLITS: gl.constexpr,  # programs a dx tile, each a piece of its K steps (a power of two)
    WEIGHT_GRAD_PERSISTENT: gl.constexpr,  # the grid's programs beyond dx's take the weight-gradient tiles in turn
    INPUTS_BEFORE_WAIT: gl.constexpr,  # with PROGRAMMATIC: the loading warp's first x, Wg, Wu tiles before the wait
    GRAD_DOWN: gl.constexpr,  # dWd's tiles here (launch 1 has none), on the first program ids, waiting for nothing
    GRAD_DOWN_AFTER_WEIGHT_GRAD: gl.constexpr,  # with GRAD_DOWN: dWd's programs after dWg's and dWu's, not first
    TRACE: gl.constexpr,  # record each program's start, end and SM (a diagnostic build: scripts/p1/p1_program_trace.py)
    num_warps: gl.constexpr,  # of the multiplying partition (8: two warpgroups)
):
    BLOCK_M: gl.constexpr = dx_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dx_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[0]
    LO_BUFFERS: gl.constexpr = BUFFERS if WITH_LO else 1
    WEIGHT_N: gl.constexpr = dwg_desc.block_type.shape[1]
    gl.static_assert(BLOCK_N % WEIGHT_N == 0, "the weight-gradient tiles' width divides the dx tiles'")
    weight_tiles_n = gl.cdiv(dx_desc.shape[1], WEIGHT_N)
    weight_tiles = gl.cdiv(I, BLOCK_M) * weight_tiles_n  # of dWg, and as many of dWu
    # with GRAD_DOWN dWd's tiles take programs 0 .. grad_down_tiles − 1, and the rest of the grid is laid out below
    GRAD_DOWN_N: gl.constexpr = dwd_desc.block_type.shape[1]  # dWd's tiles' width (WEIGHT_N or a divisor of it)
    gl.static_assert(WEIGHT_N % GRAD_DOWN_N == 0, "dWd's tiles' width divides the weight-gradient tiles'")
    grad_down_tiles_n = gl.cdiv(I, GRAD_DOWN_N)
    grad_down_tiles = gl.cdiv(dx_desc.shape[1], BLOCK_M) * grad_down_tiles_n if GRAD_DOWN else 0
    programs = gl.num_programs(0) - grad_down_tiles
    # programs taking weight-gradient tiles: one a tile, or with WEIGHT_GRAD_PERSISTENT those the grid has beyond
    # dx's, each taking tiles p, p + programs, ...
    if WEIGHT_GRAD_PERSISTENT:
        weight_programs = programs - gl.cdiv(T, BLOCK_M) * gl.cdiv(dx_desc.shape[1], BLOCK_N) * GRAD_X_SPLITS
    else:
        weight_programs = 2 * weight_tiles
    pid = gl.program_id(0)
    if TRACE:
        start, sm = clock_stamp(pid)
        proceed = start
    grad_down_tile = pid
    if GRAD_DOWN:
        if GRAD_DOWN_AFTER_WEIGHT_GRAD:  # the weight-gradient tiles' programs, then dWd's, then dx's
            grad_down_tile = pid - weight_programs
            grad_down = (grad_down_tile >= 0) & (grad_down_tile < grad_down_tiles)
            pid = gl.where(pid < weight_programs, pid, pid - grad_down_tiles)
        else:  # dWd's programs first
            grad_down = pid < grad_down_tiles
            pid = pid - grad_down_tiles
    else:
        grad_down: gl.constexpr = False  # so that nothing of dWd's tiles is compiled in
    # pid: the weight-gradient and dx tiles' program id (dWd's tiles aside)
    if GRAD_X_FIRST:  # programs 0 .. dx tiles − 1 take dx's tiles, the rest the weight-gradient ones
        pid = (pid + weight_programs) % programs
    a_bufs = gl.allocate_shared_memory(dg_desc.dtype, [BUFFERS] + dg_desc.block_type.shape, dg_desc.layout)
    a_lo_bufs = gl.allocate_shared_memory(dg_desc.dtype, [LO_BUFFERS] + dg_desc.block_type.shape, dg_desc.layout)
    a_t_bufs = a_bufs._reinterpret(dg_t_desc.dtype, [BUFFERS] + dg_t_desc.block_type.shape, dg_t_desc.layout)
    a_lo_t_bufs = a_lo_bufs._reinterpret(dg_t_desc.dtype, [LO_BUFFERS] + dg_t_desc.block_type.shape,
                                         dg_t_desc.layout)
    b_bufs = gl.allocate_shared_memory(wg_desc.dtype, [BUFFERS] + wg_desc.block_type.shape, wg_desc.layout)
    c_smem = gl.allocate_shared_memory(dx_desc.dtype, dx_desc.block_type.shape, dx_desc.layout)
    # the weight-gradient tiles see the same bytes in their own (possibly narrower) tile shape
    WIDTHS: gl.constexpr = BLOCK_N // WEIGHT_N
    x_bufs = b_bufs._reinterpret(x_desc.dtype, [BUFFERS * WIDTHS] + x_desc.block_type.shape, x_desc.layout)
    weight_c_smem = c_smem._reinterpret(dwg_desc.dtype, [WIDTHS] + dwg_desc.block_type.shape, dwg_desc.layout)
    ready, empty = ring_barriers(BUFFERS)
    if PROGRAMMATIC and not INPUTS_BEFORE_WAIT and not grad_down:  # dG, dU are launch 1's: wait for its writes
        gdc_wait()
        if TRACE:
            proceed, _ = clock_stamp(pid)
    if grad_down:  # dWd's tiles: Σ_t dy[t, h] intermediate[t, i] over the T tokens, from the call's inputs alone
        # the intermediate's and dWd's tiles in the ring's B buffers and the output buffer, in their own width
        intermediate_bufs = b_bufs._reinterpret(intermediate_desc.dtype,
                                                [BUFFERS * BLOCK_N // GRAD_DOWN_N] + intermediate_desc.block_type.shape,
                                                intermediate_desc.layout)
        grad_down_c_smem = c_smem._reinterpret(dwd_desc.dtype, [BLOCK_N // GRAD_DOWN_N] + dwd_desc.block_type.shape,
                                               dwd_desc.layout)
        weight_grad_region(dy_t_desc, dy_t_desc, intermediate_desc, dwd_desc, a_t_bufs, a_t_bufs, intermediate_bufs,
                           ready, empty, grad_down_c_smem.index(0), (grad_down_tile // grad_down_tiles_n) * BLOCK_M,
                           (grad_down_tile % grad_down_tiles_n) * GRAD_DOWN_N, gl.cdiv(T, BLOCK_K), False, False,
                           num_warps)
    elif pid < weight_programs:  # dWg's tiles, then dWu's: Σ_t A[t, m] x[t, n] over the T tokens
        k_steps = gl.cdiv(T, BLOCK_K)
        if WEIGHT_GRAD_PERSISTENT:  # tiles pid, pid + weight_programs, ...
            gl.warp_specialize([
                (weight_grad_tiles_partition, (a_t_bufs, a_lo_t_bufs, x_bufs, ready, empty, dwg_desc, dwu_desc,
                                               weight_c_smem.index(0), pid, weight_programs, weight_tiles,
                                               weight_tiles_n, k_steps, WITH_LO, num_warps)),
                (weight_grad_tiles_load_partition, (dg_t_desc, dg_lo_t_desc, du_t_desc, du_lo_t_desc, x_desc,
                                                    a_t_bufs, a_lo_t_bufs, x_bufs, ready, empty, pid, weight_programs,
                                                    weight_tiles, weight_tiles_n, k_steps, WITH_LO,
                                                    INPUTS_BEFORE_WAIT)),
            ], [1], [40])
        else:  # tile pid
            off_m, off_n = weight_grad_tile_origin(pid, weight_tiles, weight_tiles_n, BLOCK_M, WEIGHT_N)
            if pid < weight_tiles:
                weight_grad_region(dg_t_desc, dg_lo_t_desc, x_desc, dwg_desc, a_t_bufs, a_lo_t_bufs, x_bufs, ready,
                                   empty, weight_c_smem.index(0), off_m, off_n, k_steps, WITH_LO, INPUTS_BEFORE_WAIT,
                                   num_warps)
            else:
                weight_grad_region(du_t_desc, du_lo_t_desc, x_desc, dwu_desc, a_t_bufs, a_lo_t_bufs, x_bufs, ready,
                                   empty, weight_c_smem.index(0), off_m, off_n, k_steps, WITH_LO, INPUTS_BEFORE_WAIT,
                                   num_warps)
    else:  # dx's tiles: Σ_k dG[t, k] Wg[k, n] + Σ_k dU[t, k] Wu[k, n], each over GRAD_X_SPLITS programs in turn
        tile = (pid - weight_programs) // GRAD_X_SPLITS
        split = (pid - weight_programs) % GRAD_X_SPLITS
        off_m = (tile % gl.cdiv(T, BLOCK_M)) * BLOCK_M  # row blocks fastest: the programs at once share Wg, Wu tiles
        off_n = (tile // gl.cdiv(T, BLOCK_M)) * BLOCK_N
        half_steps = gl.cdiv(I, BLOCK_K)
        split_steps = gl.cdiv(2 * half_steps, GRAD_X_SPLITS)
        first_step = split * split_steps
        end_step = gl.minimum(first_step + split_steps, 2 * half_steps)
        gl.warp_specialize([
            (grad_x_partition, (a_bufs, a_lo_bufs, b_bufs, ready, empty, dx_desc, c_smem, off_m, off_n,
                                gl.maximum(end_step - first_step, 0), dx_partials_ptr, dx_counters_ptr, tile, split,
                                WITH_LO, GRAD_X_SPLITS, num_warps)),
            (grad_x_load_partition, (dg_desc, dg_lo_desc, wg_desc, du_desc, du_lo_desc, wu_desc, a_bufs, a_lo_bufs,
                                     b_bufs, ready, empty, off_m, off_n, half_steps, first_step, end_step, WITH_LO,
                                     INPUTS_BEFORE_WAIT)),
        ], [1], [40])
    if TRACE:
        kind = (pid >= weight_programs).to(gl.int32)
        if GRAD_DOWN:
            kind = gl.where(grad_down, 2, kind)
        record_program(trace_ptr, gl.program_id(0), start, proceed, sm, kind)


@dataclass(frozen=True)
class GluonSecondLaunchConfig:
    """Tiles of :func:`second_launch_kernel` (the probe's fastest before its wgmma were unserialised)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 32
    buffers: int = 4  # at 128 × 256 × 32 with lo halves: 4 × 32 KB, plus 64 KB for the output tile
    warps: int = 8  # of the multiplying partition: two warpgroups, each 64 rows of the tile
    maxnreg: int = 168  # registers a thread at launch (12 warps with the loading one's warpgroup: 64.5 K of 64 K)
    # width of the dWg, dWu tiles (block_n or a divisor): narrower ones, twice as many, shorten the launch's critical
    # path where its 96 weight-gradient tiles of 128 × 256, fewer than the SMs, each reduce over all T tokens
    weight_block_n: int = 256
    # dx's tiles take the first program ids: where they are the launch's longest (K = 2I against T) and come in
    # more than one wave with the weight-gradient tiles, started first they leave no tail of their own
    grad_x_first: bool = False
    # issued by programmatic dependent launch: its programs may start on the SMs launch 1's last ones leave free, set
    # up their ring and wait there (``griddepcontrol.wait``) until launch 1 has completed, so that the launch's own
    # start-up overlaps launch 1's tail (with ``GluonFirstLaunchConfig.early_dependents`` from launch 1's last wave on)
    programmatic: bool = False
    # programs a dx tile, each a piece of its K = 2I steps, summed in split order by the one that arrives last (a
    # power of two): where the few dx tiles (at 128 tokens 16 of 64 × 256) each stream ~1 MB of operands through one
    # SM, their reduction spread over more SMs shortens the launch's critical path
    grad_x_splits: int = 1
    # programs for the dWg and dWu tiles: 0, one a tile; else at most this many, each taking tiles p, p + programs,
    # ... with its loading warp running into the next tile's K steps while the last is multiplied and stored (where
    # the weight-gradient tiles are short and come in several waves beside the dx tiles, each program's fixed cost
    # is paid once instead of once a tile)
    weight_grad_programs: int = 0
    # with ``programmatic``: each program's loading warp sends its first K steps' tiles of the call's inputs (x, Wg,
    # Wu: launch 1 writes none of them) before its wait for launch 1, and their dG, dU tiles after it, so that those
    # loads' round trips overlap launch 1's tail instead of following it (the multiplying warps wait on the ring)
    inputs_before_wait: bool = False
    # dWd's tiles here, on the first program ids, instead of in launch 1 (``GluonFirstLaunchConfig.grad_down_tiles``
    # False): they read only the call's inputs (dy, the intermediate), so they wait for nothing and start on the SMs
    # launch 1's last wave leaves free, as weight-gradient tiles of launch 2's shape (BLOCK_M of H, WEIGHT_N of I)
    grad_down_tiles: bool = False
    # with ``grad_down_tiles``: dWd's tiles take the program ids after the weight-gradient tiles' instead of the first
    # ones, so that where the weight-gradient tiles are long (K = T) they all start as launch 1 ends and dWd's fill
    # the SMs left (the weight-gradient tiles first: not with ``grad_x_first``, nor with persistent programs)
    grad_down_after_weight_grad: bool = False
    # with ``grad_down_tiles``: the width of dWd's tiles (0: ``weight_block_n``; else it or a divisor), narrower ones
    # more and shorter (at 8192 tokens 48 tiles of 128 × 256 held 48 SMs for 84 µs beside the 96 weight-gradient tiles)
    grad_down_block_n: int = 0

    def __post_init__(self):
        if self.grad_x_splits < 1 or self.grad_x_splits & (self.grad_x_splits - 1):
            raise ValueError(f"config: grad_x_splits must be a power of two, got {self.grad_x_splits}")
        if self.inputs_before_wait and not self.programmatic:
            raise ValueError("config: inputs_before_wait needs programmatic (a wait for launch 1 to go before)")
        if self.grad_down_after_weight_grad and not (self.grad_down_tiles and not self.grad_x_first
                                                     and not self.weight_grad_programs):
            raise ValueError("config: grad_down_after_weight_grad needs grad_down_tiles, the weight-gradient tiles "
                             "first (not grad_x_first) and one program a tile (weight_grad_programs 0)")
        if self.grad_down_block_n and self.weight_block_n % self.grad_down_block_n:
            raise ValueError(f"config: grad_down_block_n must be 0 or divide weight_block_n ({self.weight_block_n}), "
                             f"got {self.grad_down_block_n}")
        if self.weight_grad_programs < 0:
            raise ValueError(f"config: weight_grad_programs must be 0 (one a tile) or more, got "
                             f"{self.weight_grad_programs}")

    def grad_x_tiles(self, num_tokens: int, hidden_size: int) -> int:
        """dx's output tiles (each ``grad_x_splits`` programs)."""
        return cdiv(num_tokens, self.block_m) * cdiv(hidden_size, self.block_n)

    def weight_grad_programs_for(self, hidden_size: int, intermediate_size: int) -> int:
        """Programs taking dWg's and dWu's tiles: one a tile, or at most ``weight_grad_programs``."""
        # not triton.cdiv: a constexpr function, ~3 µs a call on the host
        tiles = 2 * cdiv(intermediate_size, self.block_m) * cdiv(hidden_size, self.weight_block_n)
        return min(tiles, self.weight_grad_programs) if self.weight_grad_programs else tiles

    @property
    def grad_down_width(self) -> int:
        """The width of dWd's tiles here: ``grad_down_block_n``, or ``weight_block_n`` where that is 0."""
        return self.grad_down_block_n or self.weight_block_n

    def grad_down_tile_count(self, hidden_size: int, intermediate_size: int) -> int:
        """dWd's tiles in this launch (none unless ``grad_down_tiles``)."""
        return cdiv(hidden_size, self.block_m) * cdiv(intermediate_size, self.grad_down_width) * self.grad_down_tiles

    def programs(self, num_tokens: int, hidden_size: int, intermediate_size: int) -> int:
        """Programs of the launch: dWd's tiles (with ``grad_down_tiles``), those of dWg's and dWu's tiles, then dx's
        tiles' splits."""
        return (self.grad_down_tile_count(hidden_size, intermediate_size)
                + self.weight_grad_programs_for(hidden_size, intermediate_size)
                + self.grad_x_tiles(num_tokens, hidden_size) * self.grad_x_splits)

    def constexprs(self, with_lo: bool, traced: bool = False) -> dict:
        """The kernel's compile-time arguments after T and I, by name in its argument order (``num_warps`` aside)."""
        return dict(WITH_LO=with_lo, BUFFERS=self.buffers, GRAD_X_FIRST=self.grad_x_first,
                    PROGRAMMATIC=self.programmatic, GRAD_X_SPLITS=self.grad_x_splits,
                    WEIGHT_GRAD_PERSISTENT=self.weight_grad_programs > 0, INPUTS_BEFORE_WAIT=self.inputs_before_wait,
                    GRAD_DOWN=self.grad_down_tiles, GRAD_DOWN_AFTER_WEIGHT_GRAD=self.grad_down_after_weight_grad,
                    TRACE=traced)

    def descriptors(self, x, gate_weight, up_weight, d_gate, d_up, grad_x, grad_gate_weight, grad_up_weight,
                    grad_output, intermediate, grad_down_weight):
        """The kernel's 17 TMA descriptors, in its argument order (lo descriptors repeat hi ones without lo halves;
        without ``grad_down_tiles`` dWd's three, unused, repeat dG hi's Aᵀ, x's and dWg's: each descriptor is ≈ 6 µs of
        host work a call)."""
        bm, bn, bk, wn = self.block_m, self.block_n, self.block_k, self.weight_block_n
        transposed = hi_lo_descriptors(d_gate, d_up, (bk, bm))
        as_they_lie = hi_lo_descriptors(d_gate, d_up, (bm, bk))
        x_tiles, dwg = descriptor(x, (bk, wn)), descriptor(grad_gate_weight, (bm, wn))
        if self.grad_down_tiles:
            dy_t, grad_down_b, dwd = (descriptor(grad_output, (bk, bm)),
                                      descriptor(intermediate, (bk, self.grad_down_width)),
                                      descriptor(grad_down_weight, (bm, self.grad_down_width)))
        else:
            dy_t, grad_down_b, dwd = transposed[0], x_tiles, dwg
        return (*transposed, *as_they_lie, x_tiles, descriptor(gate_weight, (bk, bn)), descriptor(up_weight, (bk, bn)),
                dwg, descriptor(grad_up_weight, (bm, wn)), descriptor(grad_x, (bm, bn)), dy_t, grad_down_b,
                dwd)


ENCODED_LAUNCHES: dict = {}  # (device, dtype, with_lo, config) → EncodedLaunch of the kernel compiled for them


def prepare_second_launch_gluon(config: GluonSecondLaunchConfig, x, gate_weight, up_weight, d_gate, d_up, grad_x,
                                grad_gate_weight, grad_up_weight, grad_x_workspace, *, with_lo: bool,
                                grad_down_operands, trace=None):
    """Launch 2 in Gluon made ready before launch 1: returns the callable that launches it (dx, dWg and dWu from
    dGate, dUp: [1 or 2, T, I], hi and with ``with_lo`` lo). On a Hopper GPU; 16-bit contiguous operands whose rows
    TMA can address (:func:`moe_lib.tma.rows_fit`), T ≥ 1. No host synchronisation. ``grad_x_workspace``: (fp32
    partials, int32 counters) of the dx tiles' splits (``runtime.SplitWorkspace``; unused with ``grad_x_splits`` 1).
    ``grad_down_operands``: (dy, intermediate, dWd) for dWd's tiles (read and written only with ``grad_down_tiles``).
    ``trace``: an
    int64 [programs, 5] tensor for a row of TRACE_FIELDS per program (a build of the kernel that records them), or None.

    In NVIDIA's method the host time between launch 1 and launch 2 shows in the span wherever it exceeds launch 1's
    GPU time. Triton's ``kernel[grid](...)`` builds, binds and specialises the 14 descriptors and encodes them on the
    host each call (~180 µs on the H200's machine; ~20 µs for a Triton launch of pointers): so here the descriptors
    are built and, after the first call, encoded now, and what is left for after launch 1 is one call into the
    launcher of the kernel compiled on the first call (:func:`~moe_lib.encoded_launch.prepared_launch`), kept per
    device, dtype, ``with_lo`` and config, which fix every specialisation (T and I are not specialised; the
    descriptors' block shapes and layouts follow from the config and dtype)."""
    T, H = x.shape
    I = gate_weight.shape[0]
    descriptors = config.descriptors(x, gate_weight, up_weight, d_gate, d_up, grad_x, grad_gate_weight,
                                     grad_up_weight, *grad_down_operands)
    key = (x.device, x.dtype, with_lo, config, trace is not None)
    trace_or_placeholder = grad_x_workspace[1] if trace is None else trace
    return prepared_launch(ENCODED_LAUNCHES, key, second_launch_kernel, config.programs(T, H, I),
                           (*descriptors, *grad_x_workspace, trace_or_placeholder, T, I,
                            *config.constexprs(with_lo, trace is not None).values()),
                           warps=config.warps, maxnreg=config.maxnreg, device=x.device,
                           options=dict(launch_pdl=True) if config.programmatic else None)
