"""P1's launch 1 in Gluon: one warp issues TMA copies, two warpgroups issue wgmma (the faithful path's, on Hopper).

Dataflow (T tokens, H hidden, I intermediate; s = the saved gate_sigmoid):

    dWd = dyᵀ · intermediate                         tiles [BLOCK_M of H, GRAD_DOWN_N of I], K = T (A read transposed;
                                                     or in launch 2, ``grad_down_tiles`` False)
    dA  = dy · Wd                                    tiles [BLOCK_M of T, BLOCK_N of I], K = H
          epilogue: dUp = dA ⊙ gate_silu,  dGate = dA ⊙ s ⊙ (1 + gate ⊙ (1 − s)) ⊙ up
          -> stored in the input dtype as hi and, with WITH_LO, lo = value − hi (dA never leaves the chip)

Each program takes one output tile (the dWd tiles first: their reductions over T are the long ones). The machinery
is launch 2's (:mod:`.gluon_launch2`): a loading warp copies each K step's A and B tiles by TMA into a ring of
shared-memory buffers with `ready` and `empty` mbarriers, two warpgroups issue the wgmma, one warp-specialised region
per tile kind (so that ptxas does not serialise the wgmma). A dWd tile is launch 2's weight-gradient region with dy
for dG and the intermediate for x. A dA tile ends in the dSwiGLU epilogue: once its main loop is done, the four
saved tiles arrive by TMA into the ring's buffers (free by then), each is read into the accumulator's register
layout in turn, and dUp's, then dGate's halves go out through shared memory by TMA. With ``d_a_block_n`` twice
``block_n`` a dA tile is two such tiles side by side over one A tile per K step (two accumulators, each step's A
read once for both: more products per byte brought in), whose epilogues run one after the other.

The readable version of the same arithmetic is launch 1 of :mod:`.kernels` (``d_intermediate_and_grad_down_kernel``):
under the interpreter, on a CPU, and wherever TMA cannot address the rows, :func:`prepare_first_launch_gluon` is not
used (see ``TileConfig.gluon_first_launch``).
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
from triton.language.extra.cuda import gdc_launch_dependents  # griddepcontrol.launch_dependents

from ..encoded_launch import descriptor, prepared_launch
from ..tiling import cdiv
from .gluon_launch2 import (
    clock_stamp,
    hi_lo_descriptors,
    load_steps,
    record_program,
    ring_barriers,
    store_tile,
    tile_product,
    weight_grad_region,
)
from .runtime import SplitWorkspace


@gluon.jit
def store_halves(value, hi_desc, lo_desc, c_smem, off_m, off_n, WITH_LO: gl.constexpr):
    """An fp32 tile out as hi = round(value) and, with WITH_LO, lo = round(value − hi), through ``c_smem`` by TMA."""
    hi = value.to(hi_desc.dtype)
    store_tile(hi, hi_desc, c_smem, off_m, off_n)
    if WITH_LO:
        store_tile(value - hi.to(gl.float32), lo_desc, c_smem, off_m, off_n)


@gluon.jit
def stage_and_store(value, buffer, desc, off_m, off_n):
    """A tile in ``desc``'s dtype (or fp32, rounded to it), out by TMA through ``buffer`` (shared memory no store is
    reading)."""
    buffer.store(value.to(desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [off_m, off_n], buffer)


@gluon.jit
def load_saved_tiles(saved_a, saved_b, saved_ready, gate_desc, gate_sigmoid_desc, gate_silu_desc, up_desc, off_m,
                     off_n):
    """The four saved [BLOCK_M, BLOCK_N] tiles of a dA tile by TMA into the ring's buffers (``saved_a``: silu, σ;
    ``saved_b``: gate, up), completing ``saved_ready``."""
    mbarrier.expect(saved_ready, 4 * gate_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(gate_silu_desc, [off_m, off_n], saved_ready, saved_a.index(0))
    tma.async_copy_global_to_shared(gate_sigmoid_desc, [off_m, off_n], saved_ready, saved_a.index(1))
    tma.async_copy_global_to_shared(gate_desc, [off_m, off_n], saved_ready, saved_b.index(0))
    tma.async_copy_global_to_shared(up_desc, [off_m, off_n], saved_ready, saved_b.index(1))


@gluon.jit
def swiglu_epilogue(d_a, saved_a, saved_b, saved_ready, phase, gate_desc, gate_sigmoid_desc, gate_silu_desc, up_desc,
                    dg_desc, dg_lo_desc, du_desc, du_lo_desc, c_smem, off_m, off_n, WITH_LO: gl.constexpr,
                    STORES_IN_FLIGHT: gl.constexpr = False, LOADED_AHEAD: gl.constexpr = False):
    """dGate, dUp of one [BLOCK_M, BLOCK_N] dA tile (in registers) from the four saved tiles, which TMA brings into the
    ring's buffers (``saved_a``: silu, σ; ``saved_b``: gate, up) once nothing else needs them (asked for here, or with
    LOADED_AHEAD by the loading warp as the main loop frees their buffers); ``phase`` is this epilogue's parity on
    ``saved_ready``. The output halves go out through ``c_smem`` one after the other, or with STORES_IN_FLIGHT each
    through a saved tile's buffer once that tile is read (dU hi through silu's, dG hi through σ's, dG lo through the
    gate's; dU lo through ``c_smem``), all four stores in flight at once."""
    layout: gl.constexpr = d_a.type.layout
    if not LOADED_AHEAD:
        if STORES_IN_FLIGHT:
            tma.store_wait(pendings=0)  # a wide tile's first half: its stores read the buffers the loads overwrite
        gl.thread_barrier()  # both warpgroups past their last MMA (and reads of earlier saved tiles) before TMA writes
        load_saved_tiles(saved_a, saved_b, saved_ready, gate_desc, gate_sigmoid_desc, gate_silu_desc, up_desc, off_m,
                         off_n)
    mbarrier.wait(saved_ready, phase)
    # one saved tile at a time into registers, in the accumulator's layout (the order of kernels.store_swiglu_grads)
    d_up = d_a * saved_a.index(0).load(layout).to(gl.float32)
    if STORES_IN_FLIGHT:
        gl.thread_barrier()  # every warp has read silu before its buffer takes dU
        d_up_hi = d_up.to(du_desc.dtype)
        stage_and_store(d_up_hi, saved_a.index(0), du_desc, off_m, off_n)
        if WITH_LO:
            stage_and_store(d_up - d_up_hi.to(gl.float32), c_smem, du_lo_desc, off_m, off_n)
    else:
        store_halves(d_up, du_desc, du_lo_desc, c_smem, off_m, off_n, WITH_LO)
    s = saved_a.index(1).load(layout).to(gl.float32)
    d_gate = d_a * s * (1.0 + saved_b.index(0).load(layout).to(gl.float32) * (1.0 - s))
    d_gate = d_gate * saved_b.index(1).load(layout).to(gl.float32)
    if STORES_IN_FLIGHT:
        gl.thread_barrier()  # every warp has read σ and the gate before their buffers take dG
        d_gate_hi = d_gate.to(dg_desc.dtype)
        stage_and_store(d_gate_hi, saved_a.index(1), dg_desc, off_m, off_n)
        if WITH_LO:
            stage_and_store(d_gate - d_gate_hi.to(gl.float32), saved_b.index(0), dg_lo_desc, off_m, off_n)
    else:
        store_halves(d_gate, dg_desc, dg_lo_desc, c_smem, off_m, off_n, WITH_LO)


@gluon.jit
def d_intermediate_partition(a_bufs, b_bufs, ready, empty, saved_a, saved_b, saved_ready, gate_desc,
                             gate_sigmoid_desc, gate_silu_desc, up_desc, dg_desc, dg_lo_desc, du_desc, du_lo_desc,
                             c_smem, off_m, off_n, k_steps, rotation, WITH_LO: gl.constexpr,
                             STORES_IN_FLIGHT: gl.constexpr, SAVED_EARLY: gl.constexpr,
                             num_warps: gl.constexpr):
    """The two warpgroups of a dA tile: dA = Σ_h dy[t, h] Wd[h, i] over the ring, then the dSwiGLU epilogue. K step
    i in the ring's buffer (i + ``rotation``) mod BUFFERS; with SAVED_EARLY the loading warp has asked for the saved
    tiles."""
    BLOCK_M: gl.constexpr = dg_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dg_desc.block_type.shape[1]
    d_a = tile_product(a_bufs, a_bufs, b_bufs, ready, empty, k_steps, BLOCK_M, BLOCK_N, True, False, num_warps,
                       rotation)
    swiglu_epilogue(d_a, saved_a, saved_b, saved_ready, 0, gate_desc, gate_sigmoid_desc, gate_silu_desc, up_desc,
                    dg_desc, dg_lo_desc, du_desc, du_lo_desc, c_smem, off_m, off_n, WITH_LO, STORES_IN_FLIGHT,
                    SAVED_EARLY)
    tma.store_wait(pendings=0)


@gluon.jit
def d_intermediate_wide_partition(a_bufs, b_bufs, ready, empty, saved_a, saved_b, saved_ready, gate_desc,
                                  gate_sigmoid_desc, gate_silu_desc, up_desc, dg_desc, dg_lo_desc, du_desc, du_lo_desc,
                                  c_smem, off_m, off_n, k_steps, WITH_LO: gl.constexpr,
                                  STORES_IN_FLIGHT: gl.constexpr, num_warps: gl.constexpr):
    """A dA tile of two [BLOCK_M, BLOCK_N] halves side by side: each K step's A tile (``a_bufs``) against the step's
    two B tiles (``b_bufs`` 2·slot and 2·slot + 1) into two accumulators, then each half's dSwiGLU epilogue."""
    BLOCK_M: gl.constexpr = dg_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dg_desc.block_type.shape[1]
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    left = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    right = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    for step in range(k_steps):
        slot = step % BUFFERS
        mbarrier.wait(ready.index(slot), (step // BUFFERS) & 1)
        left = warpgroup_mma(a_bufs.index(slot), b_bufs.index(2 * slot), left, is_async=True)
        right = warpgroup_mma(a_bufs.index(slot), b_bufs.index(2 * slot + 1), right, is_async=True)
        left, right = warpgroup_mma_wait(num_outstanding=2, deps=(left, right))  # the step before is done
        mbarrier.arrive(empty.index((step + BUFFERS - 1) % BUFFERS), count=1, pred=step >= 1)
    left, right = warpgroup_mma_wait(num_outstanding=0, deps=(left, right))
    mbarrier.arrive(empty.index((k_steps + BUFFERS - 1) % BUFFERS), count=1, pred=k_steps >= 1)
    swiglu_epilogue(left, saved_a, saved_b, saved_ready, 0, gate_desc, gate_sigmoid_desc, gate_silu_desc, up_desc,
                    dg_desc, dg_lo_desc, du_desc, du_lo_desc, c_smem, off_m, off_n, WITH_LO,
                    STORES_IN_FLIGHT)
    swiglu_epilogue(right, saved_a, saved_b, saved_ready, 1, gate_desc, gate_sigmoid_desc, gate_silu_desc, up_desc,
                    dg_desc, dg_lo_desc, du_desc, du_lo_desc, c_smem, off_m, off_n + BLOCK_N, WITH_LO,
                    STORES_IN_FLIGHT)
    tma.store_wait(pendings=0)


@gluon.jit
def d_intermediate_wide_load_partition(dy_desc, wd_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k_steps):
    """The wide dA tile's K steps over H: dy's [BLOCK_M, BLOCK_K] tile and Wd's two [BLOCK_K, BLOCK_N] tiles side by
    side (beyond I TMA fills them with zeros)."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = wd_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = wd_desc.block_type.shape[1]
    STEP_BYTES: gl.constexpr = dy_desc.block_type.nbytes + 2 * wd_desc.block_type.nbytes
    for step in range(k_steps):
        slot = step % BUFFERS
        mbarrier.wait(empty.index(slot), ((step // BUFFERS) & 1) ^ 1)  # a fresh barrier counts as released
        bar = ready.index(slot)
        mbarrier.expect(bar, STEP_BYTES)
        k = step * BLOCK_K
        tma.async_copy_global_to_shared(dy_desc, [off_m, k], bar, a_bufs.index(slot))
        tma.async_copy_global_to_shared(wd_desc, [k, off_n], bar, b_bufs.index(2 * slot))
        tma.async_copy_global_to_shared(wd_desc, [k, off_n + BLOCK_N], bar, b_bufs.index(2 * slot + 1))


@gluon.jit
def d_intermediate_load_partition(dy_desc, wd_desc, a_bufs, b_bufs, ready, empty, off_m, off_n, k_steps, k_first,
                                  rotation, saved_a, saved_b, saved_ready, gate_desc, gate_sigmoid_desc, gate_silu_desc,
                                  up_desc, SAVED_EARLY: gl.constexpr):
    """dA's K steps over H from element ``k_first`` on, step i in the ring's buffer (i + ``rotation``) mod BUFFERS:
    dy's [BLOCK_M, BLOCK_K] tiles as they lie, Wd's [BLOCK_K, BLOCK_N] ones. With SAVED_EARLY then the saved tiles,
    into the ring's first buffers as soon as the main loop has released them: ``rotation`` puts the last K steps in the
    ring's last buffers, so that the first ones are free a few steps before the main loop ends."""
    load_steps(dy_desc, dy_desc, wd_desc, a_bufs, a_bufs, b_bufs, ready, empty, off_m, off_n, k_steps, 0, True,
               False, k_first, rotation)
    if SAVED_EARLY:
        BUFFERS: gl.constexpr = a_bufs.type.shape[0]
        # the ring buffers the four saved tiles cover: two tiles [BLOCK_M, BLOCK_N] in A's [BLOCK_M, BLOCK_K] buffers
        # and two in B's [BLOCK_K, BLOCK_N] ones
        A_COVERED: gl.constexpr = 2 * saved_a.type.shape[2] // a_bufs.type.shape[2]
        B_COVERED: gl.constexpr = 2 * saved_b.type.shape[1] // b_bufs.type.shape[1]
        COVERED: gl.constexpr = A_COVERED if A_COVERED > B_COVERED else B_COVERED
        for slot in gl.static_range(COVERED):
            # the K step that used this buffer last: the last i < k_steps with (i + rotation) mod BUFFERS = slot
            last = k_steps - 1 - (k_steps - 1 + rotation - slot + BUFFERS) % BUFFERS
            # its release by the multiplying warps: phase i // BUFFERS of the buffer's `empty` barrier (a buffer the
            # loop never used counts as released)
            mbarrier.wait(empty.index(slot), gl.where(last >= 0, (last // BUFFERS) & 1, 1))
        load_saved_tiles(saved_a, saved_b, saved_ready, gate_desc, gate_sigmoid_desc, gate_silu_desc, up_desc, off_m,
                         off_n)


@gluon.jit(do_not_specialize=("T", "I"))  # one compiled kernel for every T, I: see prepare_first_launch_gluon
def first_launch_kernel(
    dy_t_desc,  # with WITH_GRAD_DOWN: dy [T, H] as [BLOCK_K, BLOCK_M] tiles (Aᵀ of dWd)
    intermediate_desc,  # with WITH_GRAD_DOWN: intermediate [T, I] as [BLOCK_K, GRAD_DOWN_N] tiles (B of dWd)
    dy_desc,  # dy [T, H] as [BLOCK_M, BLOCK_K] tiles (A of dA)
    wd_desc,  # Wd [H, I] as [BLOCK_K, BLOCK_N] tiles (B of dA)
    gate_desc, gate_sigmoid_desc, gate_silu_desc, up_desc,  # saved forward [T, I] as [BLOCK_M, BLOCK_N] tiles
    dg_desc, dg_lo_desc, du_desc, du_lo_desc,  # out: dGate, dUp [T, I] hi and lo as [BLOCK_M, BLOCK_N] tiles
    dwd_desc,  # with WITH_GRAD_DOWN, out: dWd [H, I] as [BLOCK_M, GRAD_DOWN_N] tiles (GRAD_DOWN_N: see the config)
    trace_ptr,  # with TRACE: int64 [programs, 5], a row of gluon_launch2.TRACE_FIELDS per program
    T, I,
    WITH_LO: gl.constexpr,  # store dGate, dUp as hi/lo pairs (the faithful path); else hi alone
    BUFFERS: gl.constexpr,  # buffers of the ring
    D_A_HALVES: gl.constexpr,  # BLOCK_N-wide halves of a dA tile: 1, or 2 side by side (two B tiles per K step)
    D_A_FIRST: gl.constexpr,  # dA's tiles take the first program ids (else dWd's do)
    EARLY_DEPENDENTS: gl.constexpr,  # let a launch 2 issued by programmatic dependent launch start from here on
    STORES_IN_FLIGHT: gl.constexpr,  # the dSwiGLU epilogue's four stores at once, through the saved tiles' buffers
    SAVED_EARLY: gl.constexpr,  # the loading warp asks for the saved tiles as the main loop frees their buffers
    WITH_GRAD_DOWN: gl.constexpr,  # dWd's tiles in this launch (else launch 2 takes them and the dWd arguments idle)
    TRACE: gl.constexpr,  # record each program's start, end and SM (a diagnostic build: scripts/p1/p1_program_trace.py)
    num_warps: gl.constexpr,  # of the multiplying partition (8: two warpgroups)
):
    BLOCK_M: gl.constexpr = dg_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = dg_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = wd_desc.block_type.shape[0]
    if WITH_GRAD_DOWN:
        GRAD_DOWN_N: gl.constexpr = dwd_desc.block_type.shape[1]
        gl.static_assert(BLOCK_N % GRAD_DOWN_N == 0 or GRAD_DOWN_N == 2 * BLOCK_N or GRAD_DOWN_N == 4 * BLOCK_N,
                         "the dWd tiles' width divides the dA tiles' or is twice or four times it")
        # B tiles of the dA ring a K step's dWd B tile covers (2 or 4 for dWd tiles wider than the dA tiles)
        GRAD_DOWN_B_TILES: gl.constexpr = GRAD_DOWN_N // BLOCK_N if GRAD_DOWN_N > BLOCK_N else 1
        grad_down_tiles_n = gl.cdiv(I, GRAD_DOWN_N)
        grad_down_tiles = gl.cdiv(dy_desc.shape[1], BLOCK_M) * grad_down_tiles_n
    else:  # nothing of dWd's tiles is compiled in, and their three descriptors may repeat others
        GRAD_DOWN_B_TILES: gl.constexpr = 1
        grad_down_tiles: gl.constexpr = 0
    B_TILES: gl.constexpr = D_A_HALVES if D_A_HALVES > GRAD_DOWN_B_TILES else GRAD_DOWN_B_TILES
    pid = gl.program_id(0)
    if TRACE:
        start, sm = clock_stamp(pid)
    if EARLY_DEPENDENTS:  # once every program has started: launch 2's programs then wait for this launch's end
        gdc_launch_dependents()
    if D_A_FIRST and WITH_GRAD_DOWN:  # programs 0 .. dA tiles − 1 take dA's tiles, the rest dWd's
        pid = (pid + grad_down_tiles) % gl.num_programs(0)
    a_bufs = gl.allocate_shared_memory(dy_desc.dtype, [BUFFERS] + dy_desc.block_type.shape, dy_desc.layout)
    b_bufs = gl.allocate_shared_memory(wd_desc.dtype, [BUFFERS * B_TILES] + wd_desc.block_type.shape,
                                       wd_desc.layout)
    # the output tile's buffer: the dA epilogue's [BLOCK_M, BLOCK_N] and dWd's [BLOCK_M, GRAD_DOWN_N] share its bytes
    if GRAD_DOWN_B_TILES > 1:
        grad_down_c_smem = gl.allocate_shared_memory(dwd_desc.dtype, dwd_desc.block_type.shape, dwd_desc.layout)
        c_smem = grad_down_c_smem._reinterpret(dg_desc.dtype, [GRAD_DOWN_B_TILES] + dg_desc.block_type.shape,
                                               dg_desc.layout).index(0)
    else:
        c_smem = gl.allocate_shared_memory(dg_desc.dtype, dg_desc.block_type.shape, dg_desc.layout)
    # after a dA tile's main loop the ring holds its four saved tiles: two in the A buffers, two in the B buffers
    gl.static_assert(BUFFERS * BLOCK_K >= 2 * BLOCK_N, "the ring holds four saved tiles")
    saved_a = a_bufs._reinterpret(gate_desc.dtype, [BUFFERS * BLOCK_K // BLOCK_N] + gate_desc.block_type.shape,
                                  gate_desc.layout)
    saved_b = b_bufs._reinterpret(gate_desc.dtype,
                                  [BUFFERS * B_TILES * BLOCK_K // BLOCK_M] + gate_desc.block_type.shape,
                                  gate_desc.layout)
    ready, empty = ring_barriers(BUFFERS)
    saved_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(saved_ready, count=1)
    fence_async_shared()
    if WITH_GRAD_DOWN:
        grad_down = pid < grad_down_tiles
    else:
        grad_down: gl.constexpr = False
    if grad_down:  # dWd's tiles: Σ_t dy[t, h] intermediate[t, i] over the T tokens
        a_t_bufs = a_bufs._reinterpret(dy_t_desc.dtype, [BUFFERS] + dy_t_desc.block_type.shape, dy_t_desc.layout)
        if GRAD_DOWN_B_TILES == 1:
            grad_down_c_smem = c_smem._reinterpret(dwd_desc.dtype,
                                                   [BLOCK_N // GRAD_DOWN_N] + dwd_desc.block_type.shape,
                                                   dwd_desc.layout).index(0)
        # the dWd tiles see the ring's bytes in their own tile shape (narrower than its B tiles, or twice as wide)
        intermediate_bufs = b_bufs._reinterpret(intermediate_desc.dtype,
                                                [BUFFERS * B_TILES * BLOCK_N // GRAD_DOWN_N]
                                                + intermediate_desc.block_type.shape,
                                                intermediate_desc.layout)
        off_m = (pid // grad_down_tiles_n) * BLOCK_M
        off_n = (pid % grad_down_tiles_n) * GRAD_DOWN_N
        weight_grad_region(dy_t_desc, dy_t_desc, intermediate_desc, dwd_desc, a_t_bufs, a_t_bufs, intermediate_bufs,
                           ready, empty, grad_down_c_smem, off_m, off_n, gl.cdiv(T, BLOCK_K), False, False,
                           num_warps)
    else:  # dA's tiles, then dGate, dUp from them
        tile = pid - grad_down_tiles
        off_m = (tile % gl.cdiv(T, BLOCK_M)) * BLOCK_M  # row blocks fastest: the programs at once share Wd's tiles
        off_n = (tile // gl.cdiv(T, BLOCK_M)) * BLOCK_N * D_A_HALVES
        k_steps = gl.cdiv(dy_desc.shape[1], BLOCK_K)
        if D_A_HALVES == 2:
            gl.warp_specialize([
                (d_intermediate_wide_partition, (a_bufs, b_bufs, ready, empty, saved_a, saved_b, saved_ready, gate_desc,
                                                 gate_sigmoid_desc, gate_silu_desc, up_desc, dg_desc, dg_lo_desc,
                                                 du_desc, du_lo_desc, c_smem, off_m, off_n, k_steps, WITH_LO,
                                                 STORES_IN_FLIGHT, num_warps)),
                (d_intermediate_wide_load_partition, (dy_desc, wd_desc, a_bufs, b_bufs, ready, empty, off_m, off_n,
                                                      k_steps)),
            ], [1], [40])
        else:
            # with the saved tiles asked for early, the ring starts where its last step falls in its last buffer
            rotation = (BUFFERS - k_steps % BUFFERS) % BUFFERS if SAVED_EARLY else 0
            gl.warp_specialize([
                (d_intermediate_partition, (a_bufs, b_bufs, ready, empty, saved_a, saved_b, saved_ready, gate_desc,
                                            gate_sigmoid_desc, gate_silu_desc, up_desc, dg_desc, dg_lo_desc, du_desc,
                                            du_lo_desc, c_smem, off_m, off_n, k_steps, rotation, WITH_LO,
                                            STORES_IN_FLIGHT, SAVED_EARLY, num_warps)),
                (d_intermediate_load_partition, (dy_desc, wd_desc, a_bufs, b_bufs, ready, empty, off_m, off_n,
                                                 k_steps, 0, rotation, saved_a, saved_b, saved_ready, gate_desc,
                                                 gate_sigmoid_desc, gate_silu_desc, up_desc, SAVED_EARLY)),
            ], [1], [40])
    if TRACE:
        record_program(trace_ptr, gl.program_id(0), start, start, sm, (pid >= grad_down_tiles).to(gl.int32))


@dataclass(frozen=True)
class GluonFirstLaunchConfig:
    """Tiles of :func:`first_launch_kernel` (one shape for both tile kinds: they share the ring and the output
    buffer)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    buffers: int = 4  # 4 × 32 KB, plus 32 KB for the output tile
    warps: int = 8  # of the multiplying partition: two warpgroups, each 64 rows of the tile
    maxnreg: int = 168  # registers a thread at launch (12 warps with the loading one's warpgroup)
    # width of the dWd tiles (block_n or a divisor): narrower ones, more of them, shorten the launch's critical path
    # where its dWd tiles, fewer than the SMs at 128 × 128 (96 at H = 2048, I = 768), each reduce over all T tokens;
    # or twice or four times block_n, where the dA tiles are narrow (each K step's dWd B tile then covers two or four
    # of the dA ring's B buffers, and the ring's B buffers are as many times more)
    grad_down_block_n: int = 128
    # width of the dA tiles: block_n, or twice it (two accumulators over one A tile per K step)
    d_a_block_n: int = 128
    # dA's tiles take the first program ids: where they are the launch's longest (K = H against T) and come in more
    # than one wave with the dWd tiles, started first they leave no tail of their own
    d_a_first: bool = False
    # a launch 2 issued by programmatic dependent launch (``GluonSecondLaunchConfig.programmatic``) may start once
    # every program of this launch has started (else once they have all ended)
    early_dependents: bool = False
    # the dSwiGLU epilogue's four output halves stored at once, each through a saved tile's buffer once that tile is
    # read (else one after the other through the one output buffer, each waiting for the store before)
    stores_in_flight: bool = False
    # the loading warp asks for a dA tile's four saved tiles as soon as the main loop has released the ring buffers
    # they go into (the ring started where its last steps fall in its last buffers), instead of the multiplying warps
    # once the main loop has ended: their arrival overlaps the last K steps (dA tiles block_n wide, not split)
    saved_tiles_early: bool = False
    # dWd's tiles in this launch; False: launch 2 takes them (``GluonSecondLaunchConfig.grad_down_tiles``), where they
    # need not wait for this launch and fill the SMs its last wave leaves, and this launch is dA's tiles alone
    grad_down_tiles: bool = True
    def __post_init__(self):
        if self.block_n % self.grad_down_block_n and self.grad_down_block_n not in (2 * self.block_n, 4 * self.block_n):
            raise ValueError(f"config: grad_down_block_n must divide block_n ({self.block_n}) or be twice or four "
                             f"times it, got {self.grad_down_block_n}")
        if self.d_a_block_n not in (self.block_n, 2 * self.block_n):
            raise ValueError(f"config: d_a_block_n must be block_n or twice it, got {self.d_a_block_n}")
        if self.saved_tiles_early and self.d_a_block_n != self.block_n:
            raise ValueError("config: saved_tiles_early takes dA tiles block_n wide (each half of a wide tile asks for "
                             "its saved tiles in turn)")

    @property
    def d_a_halves(self) -> int:
        """``block_n``-wide halves of a dA tile (the kernel's D_A_HALVES): 1 or 2."""
        return self.d_a_block_n // self.block_n

    def d_a_tiles(self, num_tokens: int, intermediate_size: int) -> int:
        """dA's output tiles (one program each)."""
        return cdiv(num_tokens, self.block_m) * cdiv(intermediate_size, self.d_a_block_n)

    def programs(self, num_tokens: int, hidden_size: int, intermediate_size: int) -> int:
        """Programs of the launch: dWd's tiles (unless launch 2 takes them), then dA's tiles."""
        grad_down_tiles = cdiv(hidden_size, self.block_m) * cdiv(intermediate_size, self.grad_down_block_n)
        grad_down_tiles *= self.grad_down_tiles
        return grad_down_tiles + self.d_a_tiles(num_tokens, intermediate_size)

    def constexprs(self, with_lo: bool, traced: bool = False) -> dict:
        """The kernel's compile-time arguments after T and I, by name in its argument order (``num_warps`` aside)."""
        return dict(WITH_LO=with_lo, BUFFERS=self.buffers, D_A_HALVES=self.d_a_halves, D_A_FIRST=self.d_a_first,
                    EARLY_DEPENDENTS=self.early_dependents, STORES_IN_FLIGHT=self.stores_in_flight,
                    SAVED_EARLY=self.saved_tiles_early, WITH_GRAD_DOWN=self.grad_down_tiles,
                    TRACE=traced)

    def descriptors(self, grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate, d_gate, d_up,
                    grad_down_weight):
        """The kernel's 13 descriptors in its argument order: dyᵀ, intermediate, dy, Wd; the saved gate, σ, silu, up;
        dG hi, dG lo, dU hi, dU lo, dWd (lo descriptors repeat hi ones without lo halves; without ``grad_down_tiles``
        dWd's three, unused, repeat dy's, Wd's and dG hi's: each descriptor is ≈ 6 µs of host work a call)."""
        bm, bn, bk, dn = self.block_m, self.block_n, self.block_k, self.grad_down_block_n
        dy, wd = descriptor(grad_output, (bm, bk)), descriptor(down_weight, (bk, bn))
        saved = [descriptor(tensor, (bm, bn)) for tensor in (gate, gate_sigmoid, gate_silu, up)]
        dg_hi, dg_lo, du_hi, du_lo = hi_lo_descriptors(d_gate, d_up, (bm, bn))
        if self.grad_down_tiles:
            dy_t, grad_down_b, dwd = (descriptor(grad_output, (bk, bm)), descriptor(intermediate, (bk, dn)),
                                      descriptor(grad_down_weight, (bm, dn)))
        else:
            dy_t, grad_down_b, dwd = dy, wd, dg_hi
        return (dy_t, grad_down_b, dy, wd, *saved, dg_hi, dg_lo, du_hi, du_lo, dwd)


ENCODED_LAUNCHES: dict = {}  # (device, dtype, with_lo, config) → EncodedLaunch of the kernel compiled for them


def prepare_first_launch_gluon(config: GluonFirstLaunchConfig, grad_output, down_weight, gate, gate_sigmoid,
                               gate_silu, up, intermediate, d_gate, d_up, grad_down_weight, *, with_lo: bool,
                               trace=None):
    """Launch 1 in Gluon made ready: returns the callable that launches it (dGate, dUp into [1 or 2, T, I], hi and
    with ``with_lo`` lo; dWd). On a Hopper GPU; 16-bit contiguous operands whose rows TMA can address
    (:func:`moe_lib.tma.rows_fit`), T ≥ 1. No host synchronisation. ``trace``: an int64 [programs, 5] tensor for a row
    of ``gluon_launch2.TRACE_FIELDS`` per program (a build that records them), or None. As for launch 2
    (:func:`.gluon_launch2.prepare_second_launch_gluon`), the first call per device, dtype, ``with_lo`` and config
    compiles through Triton's JIT, later ones go to the compiled kernel's launcher."""
    T, H = grad_output.shape
    I = down_weight.shape[1]
    descriptors = config.descriptors(grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
                                     d_gate, d_up, grad_down_weight)
    trace_or_placeholder = SplitWorkspace.placeholders(grad_output.device)[1] if trace is None else trace
    key = (grad_output.device, grad_output.dtype, with_lo, config, trace is not None)
    return prepared_launch(ENCODED_LAUNCHES, key, first_launch_kernel, config.programs(T, H, I),
                           (*descriptors, trace_or_placeholder, T, I,
                            *config.constexprs(with_lo, trace is not None).values()),
                           warps=config.warps, maxnreg=config.maxnreg,
                           device=grad_output.device)
