"""C = A · B_e per expert on Hopper in Gluon, with the MoE layer's epilogues: the grouped (varlen-M) form of
:mod:`.gluon_gemm`'s persistent kernel.

    A [M_total, K]            rows sorted by expert: expert e owns rows offsets[e] ≤ r < offsets[e + 1]
    B [E, N, K] or [E, K, N]  one matrix per expert (held transposed, as x·Wᵀ needs, or as it lies, as dy·Wd does)
    P = A[r] · B_e            the product of a row, fp32; then per epilogue, each output [M_total, N]:

    none        out = P (bf16, or fp32)
    row_scale   out = P · w[r]                       (w = ``scale``, the routing weight of each sorted row)
    swiglu      g = A·gate_eᵀ, u = A·up_eᵀ           (B = [gate; up] stacked [E, 2N, K], or the pair (gate, up))
                out = silu(g)·u, gate_out = g, up_out = u   (each optional, bf16)
    dswiglu     dAp = P = dy·Wd_e, with the saved g, u (``gate``, ``up``) and w:
                a = silu(g)·u, dA = w·dAp, dgate_out = dA·u·σ(g)(1 + g(1 − σ(g))), dup_out = dA·silu(g),
                scaled_act_out = w·a, topk_partial[j, r] = Σ_{n in column tile j} dAp[r, n]·a[r, n]
                with the saved s, silu (``gate_sigmoid``, ``gate_silu``, both or neither): those in place of σ(g)
                and silu(g) everywhere (a = silu·u, dgate_out = dA·u·s(1 + g(1 − s)), dup_out = dA·silu)
    B as a pair along K: A = [A₀ | A₁] (K = 2·K_h), B = (B₀, B₁) each [E, K_h, N]: P = A₀·B₀_e + A₁·B₁_e

Tiles: expert e has ⌈n_e / BLOCK_M⌉ · ⌈N / BLOCK_N⌉ output tiles (none for an expert without rows), its row tiles
anchored at its first row offsets[e] (so no tile spans two experts' rows of C), in :mod:`.gluon_gemm`'s grouped
order inside the expert; the experts' tiles are numbered one after the other, expert by expert. Program p of G
takes tiles p, p + G, p + 2G, ... (:func:`schedule` lists them on the host). Each partition finds a tile's expert by
walking the offsets forward (:func:`expert_of`): the tiles a program takes only grow, so the walk visits each expert
once a program, two scalar loads each, and needs no prefix sum written beforehand: one launch, no host sync, a
grid from M_total and E alone (CUDA-graph capturable).

Per tile, the machinery of :mod:`.gluon_gemm`: a TMA loading warp fills a ring of mbarrier'd buffers, cooperative or
ping-pong wgmma consumers run the K loop (its steps numbered on from tile to tile). A's tile is read at the
expert's rows; a tile at an expert's end reads some of the next expert's rows too, which only feed output rows that
are not stored (a row of C depends on its own row of A alone). B's tile comes from the expert's slice of a 2-D
descriptor over [E·N, K] (row e·N + n) or [E·K, N] (row e·K + k). Past N, B's rows are the next expert's: they feed
only columns ≥ N, which no store writes. Past K, A's columns are zeros (TMA fills them); in the [E, K, N] form B's
rows there would be the next expert's, so that form takes K a multiple of BLOCK_K (:func:`check_arguments`).

SwiGLU: a tile of BLOCK_N / 2 output columns j loads, each K step, a box of gate rows j and one of up rows j into
the two halves of its B buffer (from the stacked weights' rows j and N + j, or from the two weights of a pair, one
descriptor each), so the accumulator's halves are g and u of the same columns (a gate box past N reads up rows or
the next expert's: both feed only columns ≥ N, never stored). The reshape, permute and split into the halves need
no shared memory: each thread holds both halves of its columns.
A pair along K: K steps below K_h read B₀_e's rows, the rest B₁_e's (K_h a multiple of BLOCK_K, so that no step
straddles the two); A's steps run on through its 2·K_h columns.

A gathered A (:class:`.gathered.Gathered`, ``GATHER_A``: the MoE layer's x_s and dy_s read through the routing
instead of written out first): the loading partition has GATHER_WARPS warps; they load a tile's BLOCK_M indices
once, then each K step every thread copies its 16-byte pieces of the rows source[index[r]] into the ring's buffer
by cp.async (zeros past the expert's rows and past K, as TMA fills), B still by TMA, and arrives on the step's
barrier once its copies have landed (cp.async.mbarrier.arrive.noinc: the barrier counts TMA's expect and every
loading thread). The consumers fence the generic proxy's writes before their wgmma reads them.

Outputs: a bf16 output tile goes into a shared-memory buffer, then out by TMA store where its rows all belong to
its expert (or end at the tensor's edge, where TMA clips), else by masked stores from shared memory, 16 bytes a
thread, row chunk by row chunk, so that it never writes the next expert's rows. A tile writing several outputs
(swiglu's a, g, u; dswiglu's dg, du, aw) takes a consumer's output buffers in turn, each reused once the TMA store
that last read it is done (as many buffers as fit beside the ring: :func:`output_buffers`). dswiglu's saved g and u
tiles come in by TMA into the consumer's first two output buffers while its K loop runs; its epilogue takes the
tile's columns in two halves (fewer values live at once), writing dg and du over the g and u they come from (each
thread its own elements), and w·a through the third buffer (or the first, once dg's store has left it).
Through the ring (``SAVED_THROUGH_RING``, the default for one cooperative consumer; ``RING_CHUNKS`` in the kernel): no
output tiles at all. After a tile's K steps the loaders bring its saved u and g BLOCK_K columns a step into the
ring's next buffers (u in the A buffer, g in the first BLOCK_M × BLOCK_K of the B buffer), and the epilogue takes
each chunk as it lands: the accumulator's matching columns, dg and du written over that g and u and stored from
there, w·a through two small staging chunks; a chunk's buffers go back to the loaders once its stores have read them.
With the saved σ and silu (``SAVED``, a compile-time switch; whole saved tiles, never through the ring), those two tiles
come in by TMA too, into the third and fourth output buffers, beside g and u: whole 16-byte rows under the K loop, where
loads in the accumulator's layout (two adjacent columns a thread) would wait for its end and move 4-byte pieces. Four
tiles take four output buffers a consumer, so the ring has fewer stages (:data:`DSWIGLU_SAVED_CONFIG`: 3 at 128 × 128);
w·a is written over the silu it comes from and leaves from the fourth buffer. An fp32 C and dswiglu's topk_partial (one
value a row) leave from registers by masked stores (an fp32 row's quad of threads writes a whole 32-byte sector). Every
output element for rows offsets[0] ≤ r < offsets[E] is written once: deterministic, no atomics.

The same schedule and epilogues in plain Triton, for the interpreter and for reading: :mod:`.grouped_tl`.
"""

from __future__ import annotations

import dataclasses

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..encoded_launch import KernelLaunches, descriptor, shared_layout, signature
from ..tiling import cdiv, grouped_tile
from ..tma import aligned, rows_fit
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

EPILOGUES = ("none", "row_scale", "swiglu", "dswiglu")  # the kernel's EPILOGUE is the index
SCALE_DTYPES = (torch.float32, torch.bfloat16)
DEFAULT_CONFIG = GemmConfig()  # cooperative, 128 × 256 × 64 tiles, 3 stages: the dense probe's best at large M
# dswiglu's saved g and u and its three outputs take three 128 × 128 tiles of shared memory (two would do: see
# output_buffers), and its epilogue's registers a 128 × 128 accumulator at most
DSWIGLU_CONFIG = GemmConfig(128, 128, 64, 4)
SAVED_ACTIVATIONS = ("gate_sigmoid", "gate_silu")  # dswiglu's optional saved σ(g) and silu(g), both or neither
# the tensors each epilogue takes besides a, b and offsets, and those it cannot do without
TAKES = {
    "none": ("out",),
    "row_scale": ("out", "scale"),
    "swiglu": ("out", "gate_out", "up_out"),
    "dswiglu": ("gate", "up", "scale", "dgate_out", "dup_out", "scaled_act_out", "topk_partial", *SAVED_ACTIVATIONS),
}
NEEDS = {"none": (), "row_scale": ("scale",), "swiglu": (), "dswiglu": ("gate", "up", "scale")}
TENSORS = ("out", "scale", "gate", "up", "gate_out", "up_out", "dgate_out", "dup_out", "scaled_act_out",
           "topk_partial", *SAVED_ACTIVATIONS)
BARRIER_BYTES = 1024  # the mbarriers' share of shared memory, with room for their alignment
# the loading partition's registers after setmaxnreg where A is gathered (a tile's row starts, a step's addresses),
# by consumers; the consumers keep the rest of the 64 K
GATHER_LOADER_REGISTERS = {"cooperative": 48, "pingpong": 48}
# a gathered A loaded by four one-warp partitions, each its share of the tile's rows (part 0 B's TMA too), rather than
# by one four-warp partition, whose Gluon lowering puts four barriers among its warps a step (its sm_90 PTX); QuACK's
# loading warps run apart the same way (notes/p2/engine-layer.md, "Gathered A in parts": faster at every case measured).
GATHER_IN_PARTS = True
# dswiglu's saved g and u brought through the ring itself, BLOCK_K columns a step after the tile's K steps (u in a
# step's A buffer, g in its B buffer), and its epilogue taken a BLOCK_K-column chunk at a time as they land: no whole
# g or u tile in shared memory, so a 128 × 256 tile keeps a deep ring (notes/p2/engine-layer.md, "dswiglu's saved
# tiles through the ring": dswiglu 14-22% faster).
SAVED_THROUGH_RING = True
# the tiles dswiglu takes through the ring: the plain product's best (notes/p2/engine-layer.md, "dswiglu's product
# alone"), its ring as deep as fits beside w·a's two staging chunks (ring_shared_bytes: 230,400 bytes)
RING_DSWIGLU_CONFIG = GemmConfig(128, 256, 64, 4)


def switches() -> tuple[bool, ...]:
    """The module's switches as they stand: a launch's key holds them, so that a launch made with one of them off is
    never reused with it on."""
    return GATHER_IN_PARTS, SAVED_THROUGH_RING


# --- the tile schedule on the host ----------------------------------------------------------------------------------


def output_columns(config: GemmConfig, epilogue: str = "none") -> int:
    """Output columns a tile: BLOCK_N, or half of it with swiglu (a tile's product holds gate and up columns)."""
    return config.block_n // 2 if epilogue == "swiglu" else config.block_n


def expert_tiles(offsets: list[int], n: int, config: GemmConfig, epilogue: str = "none") -> list[int]:
    """Tiles of each expert: ⌈rows / BLOCK_M⌉ · ⌈N / columns⌉ for n output columns (0 for an expert without rows)."""
    columns = output_columns(config, epilogue)
    return [cdiv(end - begin, config.block_m) * cdiv(n, columns)
            for begin, end in zip(offsets[:-1], offsets[1:], strict=True)]


def tile_bound(m_total: int, num_experts: int, n: int, config: GemmConfig, epilogue: str = "none") -> int:
    """At most this many tiles for any offsets of M_total rows over E experts: Σ ⌈n_e / BM⌉ ≤ ⌈M_total / BM⌉ +
    min(E, M_total) (each expert with rows adds at most one partial row tile). The host's grid uses it: it needs
    no look at the offsets, which stay on the device."""
    return (cdiv(m_total, config.block_m) + min(num_experts, m_total)) * cdiv(n, output_columns(config, epilogue))


def grid(m_total: int, num_experts: int, n: int, config: GemmConfig, sms: int, epilogue: str = "none") -> int:
    """Programs of a launch: one per SM (or ``config.programs``), never more than :func:`tile_bound`."""
    return max(1, min(config.programs or sms, tile_bound(m_total, num_experts, n, config, epilogue)))


def schedule(offsets: list[int], n: int, config: GemmConfig, programs: int,
             epilogue: str = "none") -> list[list[tuple[int, int, int]]]:
    """The tiles each program takes, in its order, as (expert, first row, first output column): what the kernels'
    walk (:func:`expert_of`) finds on the device."""
    columns = output_columns(config, epilogue)
    tiles_n = cdiv(n, columns)
    order = []
    for expert, tiles in enumerate(expert_tiles(offsets, n, config, epilogue)):
        for local in range(tiles):
            m, col = grouped_tile(local, tiles // tiles_n, tiles_n, config.group_m)
            order.append((expert, offsets[expert] + m * config.block_m, col * columns))
    return [order[p::programs] for p in range(programs)]


def default_config(epilogue: str, saved: bool = False) -> GemmConfig:
    """The config :func:`grouped_gemm` takes where none is given: DSWIGLU_CONFIG for dswiglu (DSWIGLU_SAVED_CONFIG
    where it reads the ``saved`` σ and silu; with SAVED_THROUGH_RING RING_DSWIGLU_CONFIG), else DEFAULT_CONFIG."""
    if epilogue == "dswiglu":
        if saved:
            return DSWIGLU_SAVED_CONFIG
        if SAVED_THROUGH_RING:
            return RING_DSWIGLU_CONFIG
        return DSWIGLU_CONFIG
    return DEFAULT_CONFIG


def partial_rows(n: int, config: GemmConfig) -> int:
    """Rows of dswiglu's topk_partial [rows, M_total]: one per column tile of the N = I output columns."""
    return cdiv(n, output_columns(config, "dswiglu"))


# --- shared memory ------------------------------------------------------------------------------------------------


def shared_bytes(config: GemmConfig, epilogue: str, buffers: int) -> int:
    """Shared memory of the ring, ``buffers`` bf16 output tiles a consumer and the mbarriers."""
    ring = config.stages * (config.block_m + config.block_n) * config.block_k * ELEMENT_BYTES
    tile = config.block_m * output_columns(config, epilogue) * ELEMENT_BYTES
    return ring + config.output_tiles * buffers * tile + BARRIER_BYTES


def saved_through_ring(config: GemmConfig, epilogue: str, saved: bool = False) -> bool:
    """Whether dswiglu brings its saved g and u through the ring (SAVED_THROUGH_RING): without the saved σ and silu,
    one cooperative consumer, a step's B buffer room for g's BLOCK_M × BLOCK_K chunk (BLOCK_N a multiple of BLOCK_M)
    and the tile's columns whole chunks."""
    return (SAVED_THROUGH_RING and epilogue == "dswiglu" and not saved and not config.pingpong
            and config.block_n % config.block_m == 0 and config.block_n % config.block_k == 0)


def ring_chunks(config: GemmConfig, epilogue: str, saved: bool = False) -> int:
    """The ring's steps a tile takes past its K steps: dswiglu's saved g and u a BLOCK_K-column chunk a step where
    they come through the ring (:func:`saved_through_ring`), else none."""
    return config.block_n // config.block_k if saved_through_ring(config, epilogue, saved) else 0


def ring_shared_bytes(config: GemmConfig, writes_scaled_act: bool) -> int:
    """Shared memory of dswiglu through the ring: the ring, w·a's two BLOCK_M × BLOCK_K staging chunks where it is
    written, the mbarriers."""
    ring = config.stages * (config.block_m + config.block_n) * config.block_k * ELEMENT_BYTES
    staging = 2 * config.block_m * config.block_k * ELEMENT_BYTES if writes_scaled_act else 0
    return ring + staging + BARRIER_BYTES


def least_buffers(epilogue: str, tiles: int, saved: bool = False) -> int:
    """Output buffers a consumer cannot do without: dswiglu's saved tiles land there first (g and u; with the
    ``saved`` σ and silu four), any other epilogue's outputs take turns in one (none for an fp32 C)."""
    if epilogue == "dswiglu":
        return 4 if saved else 2
    return min(tiles, 1)


def output_buffers(config: GemmConfig, epilogue: str, tiles: int, saved: bool = False) -> int:
    """Output buffers a consumer has in shared memory for ``tiles`` bf16 outputs a tile: one each (dswiglu at least
    two: its saved g and u land there first; four with the ``saved`` σ and silu), or as many as fit beside the ring,
    taken in turn; 0 for none (an fp32 C leaves from registers). Fewer than :func:`least_buffers`: the config does
    not fit (:func:`check_arguments`)."""
    wanted = max(tiles, least_buffers(epilogue, tiles, saved))
    return max(b for b in range(wanted + 1) if b == 0 or shared_bytes(config, epilogue, b) <= SHARED_MEMORY_LIMIT)


def stages_that_fit(config: GemmConfig, epilogue: str, buffers: int) -> GemmConfig:
    """``config`` with the most stages (at most its own) whose ring fits beside ``buffers`` output tiles a consumer;
    unchanged where none does (the checks then refuse it)."""
    for stages in range(config.stages, 1, -1):
        fitted = dataclasses.replace(config, stages=stages)
        if shared_bytes(fitted, epilogue, buffers) <= SHARED_MEMORY_LIMIT:
            return fitted
    return config


# dswiglu with the saved σ and silu: DSWIGLU_CONFIG's tiles, its ring cut to fit the four saved tiles (3 stages)
DSWIGLU_SAVED_CONFIG = stages_that_fit(DSWIGLU_CONFIG, "dswiglu", least_buffers("dswiglu", 3, saved=True))


# --- the kernel -------------------------------------------------------------------------------------------------


@gluon.jit
def expert_of(offsets_ptr, num_experts, tile, expert, first, last, tiles_n, BLOCK_M: gl.constexpr):
    """(expert, first, last) walked forward to the expert whose tiles first ≤ t < last hold ``tile``; expert is
    num_experts once ``tile`` is past the last expert's tiles. Start from (-1, 0, 0)."""
    while (tile >= last) & (expert < num_experts):
        expert += 1
        begin = gl.load(offsets_ptr + gl.minimum(expert, num_experts))
        end = gl.load(offsets_ptr + gl.minimum(expert + 1, num_experts))  # past the last expert: no rows
        first = last
        last = first + gl.cdiv(end - begin, BLOCK_M) * tiles_n
    return expert, first, last


@gluon.jit
def tile_place(offsets_ptr, tile, expert, first, last, tiles_n, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """(first row, first column, the expert's end row) of ``tile``, one of ``expert``'s tiles first ≤ t < last."""
    begin = gl.load(offsets_ptr + expert)
    end = gl.load(offsets_ptr + expert + 1)
    off_m, off_n = tile_origin(tile - first, (last - first) // tiles_n, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
    return begin + off_m, off_n, end


@gluon.jit
def load_b_step(b_desc, b2_desc, b_buf, bar, expert, rows, off_n, k, B_TRANSPOSED: gl.constexpr,
                B_PAIR: gl.constexpr, EPILOGUE: gl.constexpr):
    """One K step's B tile of ``expert`` into ``b_buf`` by TMA, arriving on ``bar``: from the expert's slice of the
    stacked weights (``rows`` of B's 2-D view an expert), or of the pair's first or second weight."""
    HALF: gl.constexpr = b_desc.block_type.shape[0]
    if EPILOGUE == 2:  # gate rows j and up rows j of the tile's output columns, half a buffer each
        row = expert * rows + off_n
        tma.async_copy_global_to_shared(b_desc, [row, k], bar, b_buf.slice(0, HALF))
        if B_PAIR == 1:  # the up weight's own descriptor
            tma.async_copy_global_to_shared(b2_desc, [row, k], bar, b_buf.slice(HALF, HALF))
        else:  # stacked: up rows follow the expert's N gate rows
            tma.async_copy_global_to_shared(b_desc, [row + rows // 2, k], bar, b_buf.slice(HALF, HALF))
    elif B_PAIR == 2:  # along K: the first K_h columns of A meet B₀, the rest B₁
        if k < rows:
            tma.async_copy_global_to_shared(b_desc, [expert * rows + k, off_n], bar, b_buf)
        else:
            tma.async_copy_global_to_shared(b2_desc, [expert * rows + k - rows, off_n], bar, b_buf)
    elif B_TRANSPOSED:
        tma.async_copy_global_to_shared(b_desc, [expert * rows + off_n, k], bar, b_buf)
    else:
        tma.async_copy_global_to_shared(b_desc, [expert * rows + k, off_n], bar, b_buf)


@gluon.jit
def saved_g_chunk(b_bufs, slot, gin_desc):
    """dswiglu through the ring: where g's chunk lands, the first BLOCK_M × BLOCK_K of the step's B buffer, in the
    layout of the saved tiles' descriptor ``gin_desc``."""
    BLOCK_M: gl.constexpr = gin_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = gin_desc.block_type.shape[1]
    B_BUFFER: gl.constexpr = b_bufs.type.shape[1] * b_bufs.type.shape[2]
    chunks = b_bufs.index(slot)._reinterpret(gl.bfloat16, [B_BUFFER // (BLOCK_M * BLOCK_K), BLOCK_M, BLOCK_K],
                                             gin_desc.layout)
    return chunks.index(0)


@gluon.jit
def load_saved_chunk(gin_desc, uin_desc, a_bufs, b_bufs, bar, slot, off_m, off_n, chunk):
    """dswiglu through the ring: columns off_n + chunk·BLOCK_K on of the tile's saved u into the step's A buffer and
    of its g into the first BLOCK_M × BLOCK_K of its B buffer, by TMA on ``bar``."""
    BLOCK_K: gl.constexpr = gin_desc.block_type.shape[1]
    mbarrier.expect(bar, 2 * gin_desc.block_type.nbytes)
    column = off_n + chunk * BLOCK_K
    tma.async_copy_global_to_shared(uin_desc, [off_m, column], bar, a_bufs.index(slot))
    tma.async_copy_global_to_shared(gin_desc, [off_m, column], bar, saved_g_chunk(b_bufs, slot, gin_desc))


@gluon.jit
def grouped_load_partition(a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, num_experts, tiles_n,
                           k_steps, a_src_ptr, a_stride, index_ptr, gin_desc, uin_desc, B_TRANSPOSED: gl.constexpr,
                           B_PAIR: gl.constexpr, GROUP_M: gl.constexpr, EPILOGUE: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GATHER_A: gl.constexpr, WARPS: gl.constexpr,
                           RING_CHUNKS: gl.constexpr):
    """The loading warp: every K step of the program's tiles (BLOCK_N output columns each), in order, into the ring;
    B's tile from the expert's slice of the stacked weights (of the pair's first or second weight). With GATHER_A
    (WARPS warps): A's tile rows source[index[r]] copied by every thread with cp.async (the tile's indices loaded
    once a tile; zeros past the expert's rows and past K, as TMA fills), arriving on the step's barrier once landed,
    B's by TMA. RING_CHUNKS (dswiglu's saved tiles through the ring): after a tile's K steps, that many steps more,
    each a BLOCK_K-column chunk of its saved g and u (:func:`load_saved_chunk`)."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    B_BYTES: gl.constexpr = b_desc.block_type.nbytes
    STEP_B_BYTES: gl.constexpr = 2 * B_BYTES if EPILOGUE == 2 else B_BYTES  # swiglu: 2 boxes
    # the bytes TMA brings a step (a tile's full bytes, zero-filled ones included)
    STEP_BYTES: gl.constexpr = STEP_B_BYTES if GATHER_A else a_desc.block_type.nbytes + STEP_B_BYTES
    K = a_desc.shape[1]
    rows = b_desc.shape[0] // num_experts  # an expert's rows of B's 2-D view: N, 2N (gate; up), K or a pair's K_h
    tile = gl.program_id(0)
    expert, first, last = expert_of(offsets_ptr, num_experts, tile, gl.to_tensor(-1), gl.to_tensor(0),
                                     gl.to_tensor(0), tiles_n, BLOCK_M)
    i = 0  # the ring's step, running on from tile to tile
    while expert < num_experts:
        off_m, off_n, row_end = tile_place(offsets_ptr, tile, expert, first, last, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        if GATHER_A:  # the tile's source rows, the same every K step
            source_rows = step_indices(index_ptr + off_m, row_end - off_m, 1, BLOCK_M, BLOCK_K, WARPS)
        for step in range(k_steps):
            slot = i % BUFFERS
            k = step * BLOCK_K
            if GATHER_A:
                a_from, a_mask = gather_sources(source_rows, a_src_ptr, a_stride, row_end - off_m, k, K, BLOCK_K,
                                                WARPS)
            mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)  # a fresh barrier counts as released
            bar = ready.index(slot)
            mbarrier.expect(bar, STEP_BYTES)
            if GATHER_A:
                async_copy.async_copy_global_to_shared(a_bufs.index(slot), a_from, mask=a_mask)
            else:
                tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(slot))
            load_b_step(b_desc, b2_desc, b_bufs.index(slot), bar, expert, rows, off_n, k, B_TRANSPOSED, B_PAIR,
                        EPILOGUE)
            if GATHER_A:  # each thread's copies arrive once they have landed
                async_copy.mbarrier_arrive(bar, increment_count=False)
            i += 1
        for chunk in range(RING_CHUNKS):
            slot = i % BUFFERS
            mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)
            load_saved_chunk(gin_desc, uin_desc, a_bufs, b_bufs, ready.index(slot), slot, off_m, off_n, chunk)
            if GATHER_A:  # the barrier counts every loading thread's arrival
                async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
            i += 1
        tile += gl.num_programs(0)
        expert, first, last = expert_of(offsets_ptr, num_experts, tile, expert, first, last, tiles_n, BLOCK_M)


@gluon.jit
def grouped_gather_part_partition(a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, num_experts,
                                  tiles_n, k_steps, a_src_ptr, a_stride, index_ptr, gin_desc, uin_desc,
                                  B_TRANSPOSED: gl.constexpr, B_PAIR: gl.constexpr, GROUP_M: gl.constexpr,
                                  EPILOGUE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                  PART: gl.constexpr, PARTS: gl.constexpr, RING_CHUNKS: gl.constexpr):
    """With GATHER_PARTS, one of PARTS one-warp loading partitions: every K step of the program's tiles, its share of
    the A tile's rows (PART·BLOCK_M/PARTS on) copied by cp.async through the routing, arriving on the step's barrier
    once landed; part 0 also sets the barrier's expected bytes and issues B's TMA. Each warp its own control flow: no
    barrier among the loading warps a step (a four-warp partition has four). RING_CHUNKS: after a tile's K steps,
    that many steps of its saved g and u (:func:`load_saved_chunk`), part 0's TMA, every part's arrival."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    ROWS: gl.constexpr = BLOCK_M // PARTS
    B_BYTES: gl.constexpr = b_desc.block_type.nbytes
    STEP_B_BYTES: gl.constexpr = 2 * B_BYTES if EPILOGUE == 2 else B_BYTES  # swiglu: 2 boxes
    K = a_desc.shape[1]
    rows = b_desc.shape[0] // num_experts
    tile = gl.program_id(0)
    expert, first, last = expert_of(offsets_ptr, num_experts, tile, gl.to_tensor(-1), gl.to_tensor(0),
                                     gl.to_tensor(0), tiles_n, BLOCK_M)
    i = 0
    while expert < num_experts:
        off_m, off_n, row_end = tile_place(offsets_ptr, tile, expert, first, last, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        first_row = off_m + PART * ROWS
        source_rows = step_indices(index_ptr + first_row, row_end - first_row, 1, ROWS, BLOCK_K, 1)
        for step in range(k_steps):
            slot = i % BUFFERS
            k = step * BLOCK_K
            a_from, a_mask = gather_sources(source_rows, a_src_ptr, a_stride, row_end - first_row, k, K, BLOCK_K, 1)
            mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)
            bar = ready.index(slot)
            if PART == 0:
                mbarrier.expect(bar, STEP_B_BYTES)
                load_b_step(b_desc, b2_desc, b_bufs.index(slot), bar, expert, rows, off_n, k, B_TRANSPOSED, B_PAIR,
                            EPILOGUE)
            async_copy.async_copy_global_to_shared(a_bufs.index(slot).slice(PART * ROWS, ROWS, dim=0), a_from,
                                                   mask=a_mask)
            async_copy.mbarrier_arrive(bar, increment_count=False)
            i += 1
        for chunk in range(RING_CHUNKS):
            slot = i % BUFFERS
            mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)
            if PART == 0:
                load_saved_chunk(gin_desc, uin_desc, a_bufs, b_bufs, ready.index(slot), slot, off_m, off_n, chunk)
            async_copy.mbarrier_arrive(ready.index(slot), increment_count=False)
            i += 1
        tile += gl.num_programs(0)
        expert, first, last = expert_of(offsets_ptr, num_experts, tile, expert, first, last, tiles_n, BLOCK_M)


@gluon.jit
def store_rows(c_smem, c_ptr, row_stride, off_m, off_n, row_end, n_cols, WARPS: gl.constexpr):
    """The tile in ``c_smem`` to the output's rows off_m ≤ r < row_end (columns < n_cols, rows ``row_stride``
    elements apart) by masked stores, a chunk of rows at a time (16 bytes a thread): a TMA store would also write
    the rows past row_end, the next expert's."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    COLUMN_THREADS: gl.constexpr = 32 if BLOCK_N >= 256 else BLOCK_N // 8  # 8 elements (16 bytes) a thread
    CHUNK: gl.constexpr = 2 * (32 // COLUMN_THREADS) * WARPS
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COLUMN_THREADS, COLUMN_THREADS], [WARPS, 1], [1, 0])
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    col_ok = gl.expand_dims(gl.max_constancy(cols < n_cols, 8), 0)  # N a multiple of 8 (checked on the host)
    for r in gl.static_range(0, BLOCK_M, CHUNK):
        values = c_smem.slice(r, CHUNK, dim=0).load(layout)
        row = off_m + r + rows
        mask = gl.expand_dims(row < row_end, 1) & col_ok
        starts = gl.multiple_of(row.to(gl.int64) * row_stride, 8)  # rows 16 bytes apart (checked on the host)
        gl.store(c_ptr + gl.expand_dims(starts, 1) + gl.expand_dims(cols, 0), values, mask=mask)


@gluon.jit
def put_tile(value, c_bufs, desc, ptr, off_m, off_n, row_end, whole, SLOT: gl.constexpr, ME: gl.constexpr,
             OUT_BUFS: gl.constexpr, WARPS: gl.constexpr):
    """The tile ``value`` (registers) in bf16 to its output (``desc`` for TMA, ``ptr`` for masked stores) through
    consumer ME's output buffer SLOT mod OUT_BUFS, SLOT counting the tile's outputs from 0."""
    if SLOT >= OUT_BUFS:  # the buffer's last reader, the TMA store of output SLOT − OUT_BUFS, is done
        tma.store_wait(pendings=OUT_BUFS - 1)
    c_smem = c_bufs.index(ME * OUT_BUFS + SLOT % OUT_BUFS)
    c_smem.store(value.to(gl.bfloat16))
    fence_async_shared()
    if whole:  # no row of another expert (TMA clips at M_total)
        tma.async_copy_shared_to_global(desc, [off_m, off_n], c_smem)
    else:
        store_rows(c_smem, ptr, desc.strides[0], off_m, off_n, row_end, desc.shape[1], WARPS)


@gluon.jit
def store_registers(value, ptr, row_stride, off_m, off_n, row_end, n_cols, layout: gl.constexpr):
    """The tile ``value`` (registers, ``layout``) to the output's rows off_m ≤ r < row_end, columns < n_cols, by
    masked stores straight from the registers."""
    BLOCK_M: gl.constexpr = value.type.shape[0]
    BLOCK_N: gl.constexpr = value.type.shape[1]
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    # a thread's two adjacent columns in one store: N even, rows 16 bytes apart (checked on the host)
    mask = gl.expand_dims(rows < row_end, 1) & gl.expand_dims(gl.max_constancy(cols < n_cols, 2), 0)
    starts = gl.multiple_of(rows.to(gl.int64) * row_stride, 2)
    gl.store(ptr + gl.expand_dims(starts, 1) + gl.expand_dims(cols, 0), value.to(ptr.dtype.element_ty), mask=mask)


@gluon.jit
def dswiglu_half(dap, g_smem, u_smem, scale_ptr, off_m, row_end):
    """Half a tile's columns of dswiglu: dg and du written over the saved g and u they come from (each thread its
    own elements), returning (Σ dAp·a over the columns, a row vector; w·a in bf16)."""
    BLOCK_M: gl.constexpr = dap.type.shape[0]
    layout: gl.constexpr = dap.type.layout
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    w = gl.expand_dims(gl.load(scale_ptr + rows, mask=rows < row_end, other=0.0).to(gl.float32), 1)
    g = g_smem.load(layout).to(gl.float32)
    u = u_smem.load(layout).to(gl.float32)
    sigmoid = 1.0 / (1.0 + gl.exp(-g))
    silu = g * sigmoid
    a = silu * u
    dA = dap * w
    g_smem.store((dA * u * sigmoid * (1.0 + g - silu)).to(gl.bfloat16))  # silu'(g) = σ(g)(1 + g(1 − σ(g)))
    u_smem.store((dA * silu).to(gl.bfloat16))
    return gl.sum(dap * a, axis=1), (a * w).to(gl.bfloat16)


@gluon.jit
def dswiglu_pair(dap, g_smem, u_smem, scale_ptr, off_m, row_end, HALF: gl.constexpr):
    """:func:`dswiglu_half` of the two halves of ``dap``'s columns in turn (its g and u tiles ``g_smem``,
    ``u_smem``), w·a not kept; returns their Σ dAp·a, left + right."""
    BLOCK_M: gl.constexpr = dap.type.shape[0]
    left, right = gl.split(gl.permute(gl.reshape(dap, [BLOCK_M, 2, HALF]), [0, 2, 1]))  # columns < HALF, ≥ HALF
    part_left, _ = dswiglu_half(left, g_smem.slice(0, HALF, dim=1), u_smem.slice(0, HALF, dim=1), scale_ptr, off_m,
                                row_end)
    part_right, _ = dswiglu_half(right, g_smem.slice(HALF, HALF, dim=1), u_smem.slice(HALF, HALF, dim=1), scale_ptr,
                                 off_m, row_end)
    return part_left + part_right


@gluon.jit
def dswiglu_half_saved(dap, g_smem, u_smem, sigmoid_smem, silu_smem, scale_ptr, off_m, row_end,
                       WRITE_OUT: gl.constexpr):
    """:func:`dswiglu_half` with the saved s and silu (read as bf16, in place of σ(g) and silu(g)): dg = dA·u·s(1 +
    g(1 − s)), du = dA·silu and (WRITE_OUT) w·a, a = silu·u, written over the g, u and silu they come from (each
    thread its own elements; each tile read just before its last use, fewer values live at once), returning
    Σ dAp·a over the columns (a row vector)."""
    BLOCK_M: gl.constexpr = dap.type.shape[0]
    layout: gl.constexpr = dap.type.layout
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    w = gl.expand_dims(gl.load(scale_ptr + rows, mask=rows < row_end, other=0.0).to(gl.float32), 1)
    u = u_smem.load(layout).to(gl.float32)
    silu = silu_smem.load(layout).to(gl.float32)
    a = silu * u
    part = gl.sum(dap * a, axis=1)
    if WRITE_OUT:
        silu_smem.store((a * w).to(gl.bfloat16))
    dA = dap * w
    u_smem.store((dA * silu).to(gl.bfloat16))
    g = g_smem.load(layout).to(gl.float32)
    sigmoid = sigmoid_smem.load(layout).to(gl.float32)
    g_smem.store((dA * u * sigmoid * (1.0 + g * (1.0 - sigmoid))).to(gl.bfloat16))  # silu ≠ g·s: no shortcut
    return part


@gluon.jit
def dswiglu_tile(acc, c_bufs, outputs, off_m, off_n, row_end, whole, WRITE_OUT: gl.constexpr,
                 WRITE_PARTIAL: gl.constexpr, SAVED: gl.constexpr, ME: gl.constexpr, OUT_BUFS: gl.constexpr,
                 WARPS: gl.constexpr):
    """dswiglu's epilogue for the tile dAp = ``acc``, its saved g and u in consumer ME's first two output buffers
    (with SAVED the saved σ and silu in the third and fourth): two halves of its columns in turn (fewer values live
    at once; quarters where the accumulator is 128 fp32 a thread, a cooperative 128 × 256 or a ping-pong 128 × 128
    tile, and w·a is not written here), dg and du out from the first two buffers, then w·a through the third output
    buffer (or the first once dg's store has left it; with SAVED from the fourth, written over silu) and Σ dAp·a
    from registers."""
    c_desc, c_ptr, g_desc, g_ptr, u_desc, u_ptr, gin_desc, uin_desc, scale_ptr, partial_ptr = outputs[:10]
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    HALF: gl.constexpr = BLOCK_N // 2
    g_smem = c_bufs.index(ME * OUT_BUFS)
    u_smem = c_bufs.index(ME * OUT_BUFS + 1)
    left, right = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, HALF]), [0, 2, 1]))  # columns < HALF, ≥ HALF
    if SAVED:  # w·a goes out over the saved silu (the fourth buffer), not through a buffer of its own
        s_smem = c_bufs.index(ME * OUT_BUFS + 2)
        silu_smem = c_bufs.index(ME * OUT_BUFS + 3)
        part_left = dswiglu_half_saved(left, g_smem.slice(0, HALF, dim=1), u_smem.slice(0, HALF, dim=1),
                                       s_smem.slice(0, HALF, dim=1), silu_smem.slice(0, HALF, dim=1), scale_ptr,
                                       off_m, row_end, WRITE_OUT)
        part_right = dswiglu_half_saved(right, g_smem.slice(HALF, HALF, dim=1), u_smem.slice(HALF, HALF, dim=1),
                                        s_smem.slice(HALF, HALF, dim=1), silu_smem.slice(HALF, HALF, dim=1),
                                        scale_ptr, off_m, row_end, WRITE_OUT)
    elif not WRITE_OUT and BLOCK_M * BLOCK_N >= 4096 * WARPS:  # quarters: 128 fp32 a thread or more, no w·a held
        QUARTER: gl.constexpr = HALF // 2
        part_left = dswiglu_pair(left, g_smem.slice(0, HALF, dim=1), u_smem.slice(0, HALF, dim=1), scale_ptr, off_m,
                                 row_end, QUARTER)
        part_right = dswiglu_pair(right, g_smem.slice(HALF, HALF, dim=1), u_smem.slice(HALF, HALF, dim=1), scale_ptr,
                                  off_m, row_end, QUARTER)
    else:
        part_left, aw_left = dswiglu_half(left, g_smem.slice(0, HALF, dim=1), u_smem.slice(0, HALF, dim=1),
                                          scale_ptr, off_m, row_end)
        part_right, aw_right = dswiglu_half(right, g_smem.slice(HALF, HALF, dim=1), u_smem.slice(HALF, HALF, dim=1),
                                            scale_ptr, off_m, row_end)
    fence_async_shared()
    if whole:  # no row of another expert (TMA clips at M_total)
        tma.async_copy_shared_to_global(g_desc, [off_m, off_n], g_smem)
        tma.async_copy_shared_to_global(u_desc, [off_m, off_n], u_smem)
    else:
        store_rows(g_smem, g_ptr, g_desc.strides[0], off_m, off_n, row_end, g_desc.shape[1], WARPS)
        store_rows(u_smem, u_ptr, u_desc.strides[0], off_m, off_n, row_end, u_desc.shape[1], WARPS)
    if WRITE_PARTIAL:  # a row's share of its routing weight's gradient, one row of topk_partial a column tile
        part = part_left + part_right
        rows = off_m + gl.arange(0, BLOCK_M, layout=part.type.layout)
        gl.store(partial_ptr + (off_n // BLOCK_N).to(gl.int64) * c_desc.shape[0] + rows, part, mask=rows < row_end)
    if WRITE_OUT:
        if SAVED:  # w·a is in the fourth buffer already
            aw_smem = c_bufs.index(ME * OUT_BUFS + 3)
            if whole:
                tma.async_copy_shared_to_global(c_desc, [off_m, off_n], aw_smem)
            else:
                store_rows(aw_smem, c_ptr, c_desc.strides[0], off_m, off_n, row_end, c_desc.shape[1], WARPS)
        else:
            aw = gl.reshape(gl.permute(gl.join(aw_left, aw_right), [0, 2, 1]), [BLOCK_M, BLOCK_N])
            put_tile(aw, c_bufs, c_desc, c_ptr, off_m, off_n, row_end, whole, 2, ME, OUT_BUFS, WARPS)


@gluon.jit
def column_half(x, RIGHT: gl.constexpr):
    """The left (columns < half) or RIGHT half of ``x``'s columns: a split of the registers, no data moved."""
    BLOCK_M: gl.constexpr = x.type.shape[0]
    HALF: gl.constexpr = x.type.shape[1] // 2
    left, right = gl.split(gl.permute(gl.reshape(x, [BLOCK_M, 2, HALF]), [0, 2, 1]))
    if RIGHT:
        return right
    return left


@gluon.jit
def column_chunk(x, CHUNK: gl.constexpr, CHUNKS: gl.constexpr):
    """Chunk CHUNK of CHUNKS (1, 2, 4 or 8) equal column chunks of ``x``, by halving."""
    if CHUNKS >= 2:
        x = column_half(x, (CHUNK * 2 // CHUNKS) % 2)
    if CHUNKS >= 4:
        x = column_half(x, (CHUNK * 4 // CHUNKS) % 2)
    if CHUNKS >= 8:
        x = column_half(x, (CHUNK * 8 // CHUNKS) % 2)
    return x


@gluon.jit
def dswiglu_ring_tile(acc, a_bufs, b_bufs, aw_bufs, ready, empty, step, outputs, off_m, off_n, row_end, whole,
                      WRITE_OUT: gl.constexpr, WRITE_PARTIAL: gl.constexpr, CHUNKS: gl.constexpr,
                      WARPS: gl.constexpr):
    """dswiglu's epilogue for the tile dAp = ``acc`` with its saved g and u through the ring: CHUNKS steps from
    ``step`` on, each a BLOCK_K-column chunk (u in the step's A buffer, g at the start of its B buffer,
    :func:`load_saved_chunk`), taken as it lands: dg and du written over the g and u they come from and stored from
    there, w·a through two staging chunks ``aw_bufs`` in turn; each step's buffer handed back once its stores have
    read it. Σ dAp·a from registers, once a tile."""
    c_desc, c_ptr, g_desc, g_ptr, u_desc, u_ptr, gin_desc, uin_desc, scale_ptr, partial_ptr = outputs[:10]
    BLOCK_M: gl.constexpr = acc.type.shape[0]
    BLOCK_N: gl.constexpr = acc.type.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.type.shape[2]
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    STORES: gl.constexpr = 3 if WRITE_OUT else 2  # TMA stores a chunk: dg, du (and w·a)
    for chunk in gl.static_range(CHUNKS):
        i = step + chunk
        slot = i % BUFFERS
        mbarrier.wait(ready.index(slot), (i // BUFFERS) & 1)
        u_smem = a_bufs.index(slot)
        g_smem = saved_g_chunk(b_bufs, slot, gin_desc)
        chunk_part, aw = dswiglu_half(column_chunk(acc, chunk, CHUNKS), g_smem, u_smem, scale_ptr, off_m, row_end)
        if chunk == 0:
            part = chunk_part
        else:
            part = part + chunk_part
        if WRITE_OUT:  # its staging chunk's last store (two chunks back) was waited for a chunk ago
            aw_bufs.index(chunk % 2).store(aw)
        fence_async_shared()
        column = off_n + chunk * BLOCK_K
        if whole:  # no row of another expert (TMA clips at M_total and N)
            tma.async_copy_shared_to_global(g_desc, [off_m, column], g_smem)
            tma.async_copy_shared_to_global(u_desc, [off_m, column], u_smem)
            if WRITE_OUT:
                tma.async_copy_shared_to_global(c_desc, [off_m, column], aw_bufs.index(chunk % 2))
        else:
            store_rows(g_smem, g_ptr, g_desc.strides[0], off_m, column, row_end, g_desc.shape[1], WARPS)
            store_rows(u_smem, u_ptr, u_desc.strides[0], off_m, column, row_end, u_desc.shape[1], WARPS)
            if WRITE_OUT:
                store_rows(aw_bufs.index(chunk % 2), c_ptr, c_desc.strides[0], off_m, column, row_end,
                           c_desc.shape[1], WARPS)
        if chunk > 0:  # the chunk before's stores have read its buffers: hand them back
            tma.store_wait(pendings=STORES)
            gl.thread_barrier()
            mbarrier.arrive(empty.index((i + BUFFERS - 1) % BUFFERS), count=1)
    tma.store_wait(pendings=0)
    gl.thread_barrier()
    mbarrier.arrive(empty.index((step + CHUNKS - 1) % BUFFERS), count=1)
    if WRITE_PARTIAL:  # a row's share of its routing weight's gradient, one row of topk_partial a column tile
        rows = off_m + gl.arange(0, BLOCK_M, layout=part.type.layout)
        gl.store(partial_ptr + (off_n // BLOCK_N).to(gl.int64) * c_desc.shape[0] + rows, part, mask=rows < row_end)


@gluon.jit
def load_saved_tiles(c_bufs, saved, outputs, off_m, off_n, SAVED_TILES: gl.constexpr, SAVED: gl.constexpr,
                     ME: gl.constexpr, OUT_BUFS: gl.constexpr):
    """dswiglu: the tile's saved g and u (with SAVED σ and silu too) by TMA into consumer ME's output buffers, on its
    ``saved`` barrier, once the last tile's stores have left those buffers."""
    gin_desc, uin_desc = outputs[6], outputs[7]
    tma.store_wait(pendings=0)  # the last tile's stores have left the buffers
    gl.thread_barrier()  # and its masked stores have read them
    fence_async_shared()
    mbarrier.expect(saved.index(ME), SAVED_TILES * gin_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(gin_desc, [off_m, off_n], saved.index(ME), c_bufs.index(ME * OUT_BUFS))
    tma.async_copy_global_to_shared(uin_desc, [off_m, off_n], saved.index(ME), c_bufs.index(ME * OUT_BUFS + 1))
    if SAVED:  # the saved σ and silu tiles into the third and fourth
        tma.async_copy_global_to_shared(outputs[10], [off_m, off_n], saved.index(ME), c_bufs.index(ME * OUT_BUFS + 2))
        tma.async_copy_global_to_shared(outputs[11], [off_m, off_n], saved.index(ME), c_bufs.index(ME * OUT_BUFS + 3))


@gluon.jit
def grouped_consumer_partition(a_bufs, b_bufs, c_bufs, ready, empty, turns, saved, outputs, offsets_ptr, num_experts,
                               tiles_n, k_steps, B_TRANSPOSED: gl.constexpr, GROUP_M: gl.constexpr,
                               EPILOGUE: gl.constexpr, OUT_BUFS: gl.constexpr, WRITE_OUT: gl.constexpr,
                               WRITE_GATE: gl.constexpr, WRITE_UP: gl.constexpr, WRITE_PARTIAL: gl.constexpr,
                               SAVED: gl.constexpr, ME: gl.constexpr, CONSUMERS: gl.constexpr, WARPS: gl.constexpr,
                               GATHER_A: gl.constexpr, RING_CHUNKS: gl.constexpr):
    """Consumer ME of CONSUMERS (WARPS warps): the program's tiles ME, ME + CONSUMERS, ... of its own (the ring's
    steps counted over all the program's tiles), each its K loop, its epilogue and its stores. With two consumers
    each K loop waits for its turn and passes it on once its last wgmma is issued (as :mod:`.gluon_gemm`). With
    GATHER_A (A's buffers written by cp.async) each step fences those writes before its wgmma reads them. dswiglu's
    saved tiles land in the output buffers once the last tile's stores have left them, at the tile's start.
    RING_CHUNKS (dswiglu): the saved tiles come through the ring after the K steps, a chunk a step
    (:func:`dswiglu_ring_tile`). ``outputs``: the kernel's c, g, u descriptors and pointers, its saved g and u
    descriptors, scale and partial (with SAVED then the saved σ's and silu's descriptors)."""
    c_desc, c_ptr, g_desc, g_ptr, u_desc, u_ptr, gin_desc, uin_desc, scale_ptr, partial_ptr = outputs[:10]
    SAVED_TILES: gl.constexpr = 4 if SAVED else 2  # dswiglu's saved tiles: g, u (and σ, silu)
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1] * (RING_CHUNKS if RING_CHUNKS > 0 else 1)  # output columns
    ACC_N: gl.constexpr = 2 * BLOCK_N if EPILOGUE == 2 else BLOCK_N  # the product's columns: swiglu's gate, up
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, ACC_N, 16])
    M_total = c_desc.shape[0]  # every output and saved tile's descriptor has M_total rows
    acc = gl.zeros((BLOCK_M, ACC_N), dtype=gl.float32, layout=layout)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    tile = pid + ME * programs
    expert, first, last = expert_of(offsets_ptr, num_experts, tile, gl.to_tensor(-1), gl.to_tensor(0),
                                     gl.to_tensor(0), tiles_n, BLOCK_M)
    n = 0  # this consumer's tiles so far
    while expert < num_experts:
        off_m, off_n, row_end = tile_place(offsets_ptr, tile, expert, first, last, tiles_n, GROUP_M, BLOCK_M,
                                           BLOCK_N)
        if EPILOGUE == 3 and RING_CHUNKS == 0:  # dswiglu: saved g, u tiles in
            load_saved_tiles(c_bufs, saved, outputs, off_m, off_n, SAVED_TILES, SAVED, ME, OUT_BUFS)
        step0 = ((tile - pid) // programs) * (k_steps + RING_CHUNKS)  # the program's tiles before this one
        if CONSUMERS > 1:  # consumer 0's first turn is free (a fresh barrier), consumer 1's first waits for it
            mbarrier.wait(turns.index(ME), (n & 1) ^ (1 - ME))
        acc = tile_k_loop(a_bufs, b_bufs, ready, empty, acc, step0, k_steps, False, B_TRANSPOSED, GATHER_A)
        if CONSUMERS > 1:
            mbarrier.arrive(turns.index(1 - ME), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step0 + k_steps - 1) % BUFFERS), count=1)
        whole = (off_m + BLOCK_M <= row_end) | (row_end >= M_total)  # every row the expert's, or TMA clips them
        rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        if EPILOGUE <= 1:  # none, row_scale: the routing weight of each row before the rounding
            out = acc
            if EPILOGUE == 1:
                out = acc * gl.expand_dims(gl.load(scale_ptr + rows, mask=rows < row_end, other=0.0).to(gl.float32), 1)
            if OUT_BUFS == 0:  # an fp32 C: no rounding, no shared memory
                store_registers(out, c_ptr, c_desc.strides[0], off_m, off_n, row_end, c_desc.shape[1], layout)
            else:
                tma.store_wait(pendings=0)  # the last tile's store has left the buffer
                put_tile(out, c_bufs, c_desc, c_ptr, off_m, off_n, row_end, whole, 0, ME, OUT_BUFS, WARPS)
        if EPILOGUE == 2:  # swiglu: the accumulator's halves are g and u of the same columns
            gate, up = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
            tma.store_wait(pendings=0)  # the last tile's stores have left the buffers
            if WRITE_OUT:
                put_tile(gate / (1.0 + gl.exp(-gate)) * up, c_bufs, c_desc, c_ptr, off_m, off_n, row_end, whole, 0,
                         ME, OUT_BUFS, WARPS)
            if WRITE_GATE:
                put_tile(gate, c_bufs, g_desc, g_ptr, off_m, off_n, row_end, whole, WRITE_OUT, ME, OUT_BUFS, WARPS)
            if WRITE_UP:
                put_tile(up, c_bufs, u_desc, u_ptr, off_m, off_n, row_end, whole, WRITE_OUT + WRITE_GATE, ME,
                         OUT_BUFS, WARPS)
        if EPILOGUE == 3 and RING_CHUNKS > 0:  # dswiglu, the saved g and u a chunk at a time through the ring
            dswiglu_ring_tile(acc, a_bufs, b_bufs, c_bufs, ready, empty, step0 + k_steps, outputs, off_m, off_n,
                              row_end, whole, WRITE_OUT, WRITE_PARTIAL, RING_CHUNKS, WARPS)
        elif EPILOGUE == 3:  # dswiglu, in fp32 from dAp (the accumulator) and the saved bf16 g and u
            mbarrier.wait(saved.index(ME), n & 1)
            dswiglu_tile(acc, c_bufs, outputs, off_m, off_n, row_end, whole, WRITE_OUT,
                         WRITE_PARTIAL, SAVED, ME, OUT_BUFS, WARPS)
        n += 1
        tile += CONSUMERS * programs
        expert, first, last = expert_of(offsets_ptr, num_experts, tile, expert, first, last, tiles_n, BLOCK_M)
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_gemm_kernel(
    a_desc,  # A [M_total, K], rows sorted by expert, as [BLOCK_M, BLOCK_K] tiles
    b_desc,  # B_TRANSPOSED: the experts' Bᵀ stacked, [E·N, K], as [BLOCK_N, BLOCK_K] tiles; else B [E·K, N] as
             # [BLOCK_K, BLOCK_N] tiles. swiglu: [E·2N, K] (gate rows, then up rows) or a pair's gate [E·N, K], as
             # [BLOCK_N, BLOCK_K] tiles; a pair along K: B₀ [E·K_h, N] as [BLOCK_K, BLOCK_N] tiles
    b2_desc,  # a pair's second weight (swiglu's up [E·N, K], or B₁ [E·K_h, N]) as b_desc's tiles; else b_desc again
    c_desc,  # out: C [M_total, N] (swiglu: silu(g)·u; dswiglu: scaled_act_out) as [BLOCK_M, BLOCK_N] tiles, for TMA
             # stores (bf16) or its strides (fp32); where not written, another output's descriptor
    c_ptr,  # out again (masked stores), bf16 or fp32; where not written, any pointer, never used
    g_desc,  # swiglu: gate_out g; dswiglu: dgate_out dg; [M_total, N] bf16 as c_desc's tiles; else c_desc again
    g_ptr,  # g_desc's tensor again (masked stores); where not written, any pointer
    u_desc,  # swiglu: up_out u; dswiglu: dup_out du; [M_total, N] bf16 as c_desc's tiles; else c_desc again
    u_ptr,  # u_desc's tensor again (masked stores); where not written, any pointer
    gin_desc,  # dswiglu: the saved g [M_total, N] bf16 as c_desc's tiles; else a_desc, never read
    uin_desc,  # dswiglu: the saved u [M_total, N] bf16 as c_desc's tiles; else a_desc, never read
    scale_ptr,  # row_scale, dswiglu: [M_total] fp32 or bf16, each row's routing weight w; else any pointer
    partial_ptr,  # dswiglu: topk_partial [⌈N / BLOCK_N⌉, M_total] fp32; else any pointer, never written
    offsets_ptr,  # [E + 1] int32: expert e's rows are offsets[e] ≤ r < offsets[e + 1]
    num_experts,  # E
    sigmoid_desc,  # dswiglu with SAVED: the saved σ(g) [M_total, N] bf16 as c_desc's tiles; else None
    silu_desc,  # dswiglu with SAVED: the saved silu(g) [M_total, N] bf16 as c_desc's tiles; else None
    a_src_ptr,  # GATHER_A: A's source [T, K] bf16 (a_desc is over it too, for the ring's tiles); else A again, unread
    a_stride,  # GATHER_A: the source's row stride (elements); else A's, unused
    index_ptr,  # GATHER_A: [M_total] int32, A's row r is the source's row index[r]; else offsets_ptr, unread
    B_TRANSPOSED: gl.constexpr,
    B_PAIR: gl.constexpr,  # 0: one B; 1: swiglu's pair (gate, up); 2: a pair along K (B₀, B₁)
    BUFFERS: gl.constexpr,  # buffers of the ring
    OUT_BUFS: gl.constexpr,  # bf16 output tiles in shared memory a consumer (0: C is fp32, stored from registers)
    GROUP_M: gl.constexpr,  # row tiles taken together in an expert's tile order
    EPILOGUE: gl.constexpr,  # 0 none, 1 row_scale, 2 swiglu, 3 dswiglu (EPILOGUES)
    WRITE_OUT: gl.constexpr,  # whether c is written (always with none and row_scale)
    WRITE_GATE: gl.constexpr,  # whether g is written (always with dswiglu)
    WRITE_UP: gl.constexpr,  # whether u is written (always with dswiglu)
    WRITE_PARTIAL: gl.constexpr,  # whether dswiglu's topk_partial is written
    SAVED: gl.constexpr,  # dswiglu: σ and silu read from sigmoid_desc and silu_desc, not computed from g
    PINGPONG: gl.constexpr,  # two one-warpgroup consumers on alternate tiles; else one of num_warps (8) warps
    CONSUMER_REGS: gl.constexpr,  # with PINGPONG: the second consumer's registers
    LOADER_REGS: gl.constexpr,  # the loading warp's registers
    GATHER_A: gl.constexpr,  # whether A's rows are read through index_ptr from a_src_ptr (cp.async), not by TMA
    LOADER_WARPS: gl.constexpr,  # warps of the loading partition: 1, or GATHER_WARPS with GATHER_A
    GATHER_PARTS: gl.constexpr,  # GATHER_A: the loading done by LOADER_WARPS one-warp partitions, not one partition
    RING_CHUNKS: gl.constexpr,  # dswiglu: its saved g and u through the ring, this many BLOCK_K-column chunks a tile
                                # (the output and saved descriptors' tiles then [BLOCK_M, BLOCK_K]); 0: whole tiles
    num_warps: gl.constexpr,  # of the default partition: the cooperative consumer, or ping-pong's first (4)
):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1] * (RING_CHUNKS if RING_CHUNKS > 0 else 1)
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    tiles_n = gl.cdiv(c_desc.shape[1], BLOCK_N)
    k_steps = gl.cdiv(a_desc.shape[1], BLOCK_K)
    CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    B_ROWS: gl.constexpr = b_desc.block_type.shape[0] * (2 if EPILOGUE == 2 else 1)  # swiglu: gate and up rows
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [BUFFERS, B_ROWS, b_desc.block_type.shape[1]], b_desc.layout)
    if RING_CHUNKS > 0 and WRITE_OUT:  # w·a's two staging chunks
        c_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, BLOCK_K], c_desc.layout)
    elif OUT_BUFS > 0:
        c_bufs = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS * OUT_BUFS, BLOCK_M, BLOCK_N], c_desc.layout)
    else:  # an fp32 C leaves from registers: no output tiles in shared memory (a_bufs stands in, never touched)
        c_bufs = a_bufs
    ready = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    saved = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # dswiglu's g, u a consumer
    # a step lands with TMA's bytes (one arrival, the expect) and, with GATHER_A, each loading thread's copies
    READY_COUNT: gl.constexpr = 1 + 32 * LOADER_WARPS if GATHER_A else 1
    for i in gl.static_range(BUFFERS):
        mbarrier.init(ready.index(i), count=READY_COUNT)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
        mbarrier.init(saved.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation is seen by the copy engine (the async proxy)
    outputs = (c_desc, c_ptr, g_desc, g_ptr, u_desc, u_ptr, gin_desc, uin_desc, scale_ptr, partial_ptr)
    if SAVED:  # the saved σ and silu after them (None, absent, would drop out of warp_specialize's arguments)
        outputs = outputs + (sigmoid_desc, silu_desc)
    # the constexprs written out in each call: a tuple held in a variable turns its constexprs into tensors
    if GATHER_PARTS and PINGPONG:
        gl.warp_specialize([
            (grouped_consumer_partition, (a_bufs, b_bufs, c_bufs, ready, empty, turns, saved, outputs, offsets_ptr,
                                          num_experts, tiles_n, k_steps, B_TRANSPOSED, GROUP_M, EPILOGUE, OUT_BUFS,
                                          WRITE_OUT, WRITE_GATE, WRITE_UP, WRITE_PARTIAL, SAVED, 0, 2, num_warps,
                                          GATHER_A, RING_CHUNKS)),
            (grouped_consumer_partition, (a_bufs, b_bufs, c_bufs, ready, empty, turns, saved, outputs, offsets_ptr,
                                          num_experts, tiles_n, k_steps, B_TRANSPOSED, GROUP_M, EPILOGUE, OUT_BUFS,
                                          WRITE_OUT, WRITE_GATE, WRITE_UP, WRITE_PARTIAL, SAVED, 1, 2, 4, GATHER_A,
                                          RING_CHUNKS)),
            (grouped_gather_part_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                             num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr,
                                             gin_desc, uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M,
                                             BLOCK_N, 0, 4, RING_CHUNKS)),
            (grouped_gather_part_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                             num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr,
                                             gin_desc, uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M,
                                             BLOCK_N, 1, 4, RING_CHUNKS)),
            (grouped_gather_part_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                             num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr,
                                             gin_desc, uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M,
                                             BLOCK_N, 2, 4, RING_CHUNKS)),
            (grouped_gather_part_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                             num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr,
                                             gin_desc, uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M,
                                             BLOCK_N, 3, 4, RING_CHUNKS)),
        ], [4, 1, 1, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS, LOADER_REGS, LOADER_REGS])
    elif GATHER_PARTS:
        gl.warp_specialize([
            (grouped_consumer_partition, (a_bufs, b_bufs, c_bufs, ready, empty, turns, saved, outputs, offsets_ptr,
                                          num_experts, tiles_n, k_steps, B_TRANSPOSED, GROUP_M, EPILOGUE, OUT_BUFS,
                                          WRITE_OUT, WRITE_GATE, WRITE_UP, WRITE_PARTIAL, SAVED, 0, 1, num_warps,
                                          GATHER_A, RING_CHUNKS)),
            (grouped_gather_part_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                             num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr,
                                             gin_desc, uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M,
                                             BLOCK_N, 0, 4, RING_CHUNKS)),
            (grouped_gather_part_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                             num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr,
                                             gin_desc, uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M,
                                             BLOCK_N, 1, 4, RING_CHUNKS)),
            (grouped_gather_part_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                             num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr,
                                             gin_desc, uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M,
                                             BLOCK_N, 2, 4, RING_CHUNKS)),
            (grouped_gather_part_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                             num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr,
                                             gin_desc, uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M,
                                             BLOCK_N, 3, 4, RING_CHUNKS)),
        ], [1, 1, 1, 1], [LOADER_REGS, LOADER_REGS, LOADER_REGS, LOADER_REGS])
    elif PINGPONG:
        gl.warp_specialize([
            (grouped_consumer_partition, (a_bufs, b_bufs, c_bufs, ready, empty, turns, saved, outputs, offsets_ptr,
                                          num_experts, tiles_n, k_steps, B_TRANSPOSED, GROUP_M, EPILOGUE, OUT_BUFS,
                                          WRITE_OUT, WRITE_GATE, WRITE_UP, WRITE_PARTIAL, SAVED, 0, 2, num_warps,
                                          GATHER_A, RING_CHUNKS)),
            (grouped_consumer_partition, (a_bufs, b_bufs, c_bufs, ready, empty, turns, saved, outputs, offsets_ptr,
                                          num_experts, tiles_n, k_steps, B_TRANSPOSED, GROUP_M, EPILOGUE, OUT_BUFS,
                                          WRITE_OUT, WRITE_GATE, WRITE_UP, WRITE_PARTIAL, SAVED, 1, 2, 4, GATHER_A,
                                          RING_CHUNKS)),
            (grouped_load_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                      num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr, gin_desc,
                                      uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M, BLOCK_N, GATHER_A,
                                      LOADER_WARPS, RING_CHUNKS)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (grouped_consumer_partition, (a_bufs, b_bufs, c_bufs, ready, empty, turns, saved, outputs, offsets_ptr,
                                          num_experts, tiles_n, k_steps, B_TRANSPOSED, GROUP_M, EPILOGUE, OUT_BUFS,
                                          WRITE_OUT, WRITE_GATE, WRITE_UP, WRITE_PARTIAL, SAVED, 0, 1, num_warps,
                                          GATHER_A, RING_CHUNKS)),
            (grouped_load_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, ready, empty, offsets_ptr,
                                      num_experts, tiles_n, k_steps, a_src_ptr, a_stride, index_ptr, gin_desc,
                                      uin_desc, B_TRANSPOSED, B_PAIR, GROUP_M, EPILOGUE, BLOCK_M, BLOCK_N, GATHER_A,
                                      LOADER_WARPS, RING_CHUNKS)),
        ], [LOADER_WARPS], [LOADER_REGS])


LAUNCHES = KernelLaunches(grouped_gemm_kernel)  # its compiled launches, kept per key (gluon_gemm.ENCODED_LAUNCHES)


# --- the host side ----------------------------------------------------------------------------------------------


def rows_of_one_matrix(w: torch.Tensor) -> bool:
    """Whether the weights ``w`` [E, ·, ·] are the rows of one 2-D matrix [E·rows, cols], rows of adjacent elements
    a multiple of 16 bytes apart (a column slice of a contiguous tensor is), as B's descriptor reads them."""
    return (w.stride(2) == 1 and w.stride(0) == w.shape[1] * w.stride(1)
            and (w.stride(1) * w.element_size()) % 16 == 0)


def weights_of(b) -> tuple:
    """B's weight tensors: (b,) for one, both of a pair (a tuple or list)."""
    return tuple(b) if isinstance(b, (tuple, list)) else (b,)


def pair_kind(b, epilogue: str) -> int:
    """The kernel's B_PAIR: 0 for one B; 1 for swiglu's pair (gate, up), each [E, N, K]; 2 for a pair along K
    (B₀, B₁), each [E, K_h, N] (the none and row_scale epilogues)."""
    if not isinstance(b, (tuple, list)):
        return 0
    return 1 if epilogue == "swiglu" else 2


def b_form(b: torch.Tensor, a: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether ``b`` [E, ·, ·] is held transposed ([E, N, K]: x·Wᵀ) rather than as it lies ([E, K, N]), read off
    which of its dimensions is A's K (where both are, off ``out``'s N); ValueError naming ``b`` where none fits."""
    K = a.shape[1]
    transposed_fits, as_is_fits = b.shape[2] == K, b.shape[1] == K
    if transposed_fits and as_is_fits:
        if out is None:
            raise ValueError(f"b: shape {tuple(b.shape)} is [E, N, K] and [E, K, N] alike (N == K): pass b_transposed")
        return out.shape[-1] == b.shape[1]
    if transposed_fits or as_is_fits:
        return transposed_fits
    raise ValueError(f"b: expected [E, N, K] or [E, K, N] with K = {K} (a's columns), got shape {tuple(b.shape)}")


def held_transposed(a, b, epilogue: str, b_transposed: bool | None, out) -> bool:
    """Whether B is held transposed, for arguments :func:`check_arguments` takes (which finds the same): always with
    swiglu, never for a pair along K, else ``b_transposed`` where given or read off the shapes (:func:`b_form`)."""
    if epilogue == "swiglu":
        return True
    if isinstance(b, (tuple, list)):
        return False
    return b_form(b, a, out) if b_transposed is None else b_transposed


def output_width(b, b_transposed: bool, epilogue: str) -> int:
    """The outputs' columns N: B's N, or half of the stacked [gate; up] rows with swiglu."""
    first = weights_of(b)[0]
    n = first.shape[1] if b_transposed else first.shape[2]
    return n // 2 if epilogue == "swiglu" and pair_kind(b, epilogue) == 0 else n


def roles(epilogue: str, tensors: dict) -> tuple:
    """The tensors behind the kernel's tile outputs c, g and u (None where not written): out, gate_out, up_out; with
    dswiglu scaled_act_out, dgate_out, dup_out."""
    if epilogue == "dswiglu":
        return tensors.get("scaled_act_out"), tensors.get("dgate_out"), tensors.get("dup_out")
    return tensors.get("out"), tensors.get("gate_out"), tensors.get("up_out")


def with_defaults(epilogue: str, tensors: dict, rows: int, n: int, like: torch.Tensor) -> dict:
    """``tensors`` with the outputs an epilogue always writes allocated where not given: out (none, row_scale; with
    swiglu where no output is given), dgate_out and dup_out (dswiglu); bf16 [rows, n]."""
    tensors = dict(tensors)
    missing = {"none": ("out",), "row_scale": ("out",), "dswiglu": ("dgate_out", "dup_out")}.get(epilogue, ())
    if epilogue == "swiglu" and all(tensors.get(name) is None for name in ("out", "gate_out", "up_out")):
        missing = ("out",)
    for name in missing:
        if tensors.get(name) is None:
            tensors[name] = torch.empty((rows, n), dtype=torch.bfloat16, device=like.device)
    return tensors


def tile_outputs(epilogue: str, tensors: dict) -> int:
    """bf16 outputs a tile writes through shared memory, the defaults :func:`with_defaults` allocates counted."""
    c, g, u = roles(epilogue, with_defaults(epilogue, tensors, 0, 0, torch.empty(0)))
    return sum(t is not None and t.dtype == torch.bfloat16 for t in (c, g, u))


NEEDED = {
    "scale": "a [M_total] tensor of row scales",
    "gate": "the saved gate pre-activations g [M_total, N]",
    "up": "the saved up pre-activations u [M_total, N]",
}


def check_rows(name: str, tensor: torch.Tensor, dtypes: tuple, shape: tuple) -> None:
    """An output or saved tile's tensor: its dtype and shape, rows of whole 16-byte pieces of adjacent elements, a
    row stride and start TMA takes (16-byte multiples); a strided view of a wider tensor passes."""
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name}: expected {' or '.join(map(str, dtypes))}, got {tensor.dtype}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(tensor.shape)}")
    if (shape[1] * tensor.element_size()) % 16:
        raise ValueError(f"{name}: its rows hold {shape[1]} elements, not a multiple of 16 bytes (the masked stores "
                         f"write whole 16-byte pieces)")
    if tensor.stride(1) != 1 or tensor.stride(0) < shape[1]:
        raise ValueError(f"{name}: expected rows of adjacent elements (strides (≥ {shape[1]}, 1)), got strides "
                         f"{tuple(tensor.stride())}")
    if (tensor.stride(0) * tensor.element_size()) % 16:
        raise ValueError(f"{name}: TMA needs rows a multiple of 16 bytes apart; its rows are {tensor.stride(0)} "
                         f"elements apart")
    if tensor.device.type != "meta" and not aligned(tensor):
        raise ValueError(f"{name}: TMA needs the tensor to start on a 16-byte boundary")


def check_arguments(a, b, offsets, *, out=None, scale=None, epilogue: str = "none", b_transposed: bool | None = None,
                    config: GemmConfig | None = None, gate=None, up=None, gate_out=None, up_out=None, dgate_out=None,
                    dup_out=None, scaled_act_out=None, topk_partial=None, gate_sigmoid=None, gate_silu=None) -> bool:
    """Raises TypeError/ValueError naming the argument where :func:`grouped_gemm` cannot take it, before any work;
    returns whether B is held transposed ([E, N, K]; always with swiglu, never for a pair along K). Offsets' values
    stay on the device and are not checked: they must rise from offsets[0] = 0 to offsets[E] = M_total."""
    saved = gate_sigmoid is not None or gate_silu is not None
    config = config or default_config(epilogue, saved)
    gathered = isinstance(a, Gathered)
    if gathered:  # A's rows read through the index: the source takes a's place in the checks of tensors below
        check_gathered("a", a)
        a_tensor = a.source
    else:
        a_tensor = a
    given = dict(out=out, scale=scale, gate=gate, up=up, gate_out=gate_out, up_out=up_out, dgate_out=dgate_out,
                 dup_out=dup_out, scaled_act_out=scaled_act_out, topk_partial=topk_partial, gate_sigmoid=gate_sigmoid,
                 gate_silu=gate_silu)
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue: expected one of {EPILOGUES}, got {epilogue!r}")
    pair = isinstance(b, (tuple, list)) and all(isinstance(w, torch.Tensor) for w in b)
    if pair and len(b) != 2:
        raise ValueError(f"b: a pair of weights is two tensors, got {len(b)}")
    weights = tuple(b) if pair else (b,)
    names = ("b[0]", "b[1]") if pair else ("b",)
    named = list(zip(names, weights, strict=True))  # each weight with the name its errors give
    for name, tensor in (("a", a_tensor), *named, ("offsets", offsets), *given.items()):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            pairs = " (or, for b, a pair of them)" if name == "b" else " (or, for a, a Gathered)" if name == "a" else ""
            raise TypeError(f"{name}: expected a torch.Tensor{pairs}, got {type(tensor).__name__}")
    for name, tensor in given.items():
        if tensor is not None and name not in TAKES[epilogue]:
            raise ValueError(f"{name}: given, but the {epilogue!r} epilogue takes none (it takes "
                             f"{', '.join(TAKES[epilogue])})")
    for name in NEEDS[epilogue]:
        if given[name] is None:
            raise ValueError(f"{name}: the {epilogue} epilogue needs {NEEDED[name]}")
    if saved and (gate_sigmoid is None or gate_silu is None):
        missing, other = SAVED_ACTIVATIONS if gate_sigmoid is None else SAVED_ACTIVATIONS[::-1]
        raise ValueError(f"{missing}: the dswiglu epilogue takes the saved σ and silu both or neither; {other} was "
                         f"given alone")
    if a_tensor.dim() != 2:
        raise ValueError(f"a: expected a 2-D tensor [M_total, K], got shape {tuple(a.shape)}")
    for name, w in named:
        if w.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor [E, N, K] or [E, K, N], got shape {tuple(w.shape)}")
    if a.dtype != torch.bfloat16:
        raise TypeError(f"a: expected torch.bfloat16, got {a.dtype}")
    for name, w in named:
        if w.dtype != a.dtype:
            raise TypeError(f"{name}: expected {a.dtype} like a, got {w.dtype}")
    if pair and weights[1].shape != weights[0].shape:
        raise ValueError(f"b[1]: expected the shape of b[0] {tuple(weights[0].shape)}, got {tuple(weights[1].shape)}")
    E = weights[0].shape[0]
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets: expected torch.int32, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] != E + 1:
        raise ValueError(f"offsets: expected shape ({E + 1},) (E + 1 for b's E = {E}), got {tuple(offsets.shape)}")
    for name, tensor in (*named, ("offsets", offsets), *given.items()):
        if tensor is not None and tensor.device != a.device:
            raise ValueError(f"{name}: expected the device of a ({a.device}), got {tensor.device}")
    M, K = a.shape
    if epilogue == "swiglu":
        if b_transposed is False:
            raise ValueError("b: the swiglu epilogue takes B held transposed, [E, 2N, K] (gate rows, then up rows) "
                             "or a pair (gate, up) of [E, N, K]")
        if not pair and b.shape[1] % 2:
            raise ValueError(f"b: the swiglu epilogue takes [E, 2N, K] (gate rows, then up rows), got an odd "
                             f"{b.shape[1]} rows")
        b_transposed = True
    elif pair:
        if epilogue == "dswiglu":
            raise ValueError("b: the dswiglu epilogue takes one weight (Wd [E, H, I] as it lies), not a pair")
        if b_transposed is True:
            raise ValueError("b: a pair along K takes its weights as they lie, [E, K/2, N] each")
        b_transposed = False
        if 2 * weights[0].shape[1] != K:
            raise ValueError(f"b: a pair along K takes [E, K/2, N] each with K = {K} (a's columns), got shape "
                             f"{tuple(weights[0].shape)} each")
        if weights[0].shape[1] % config.block_k:
            raise ValueError(f"b: a pair along K needs K/2 ({weights[0].shape[1]}) a multiple of block_k "
                             f"({config.block_k}): a K step would straddle the two weights")
    if b_transposed is None:
        b_transposed = b_form(b, a, out)
    N = output_width(b, b_transposed, epilogue)
    reduced = weights[0].shape[2] if b_transposed else weights[0].shape[1] * (2 if pair else 1)
    if reduced != K:
        raise ValueError(f"{names[0]}: expected {'[E, N, K]' if b_transposed else '[E, K, N]'} with K = {K} (a's "
                         f"columns), got shape {tuple(weights[0].shape)}")
    if epilogue == "dswiglu" and K == 0:
        raise ValueError("a: the dswiglu epilogue needs K ≥ 1 (a's columns)")
    c_dtypes = (torch.bfloat16, torch.float32) if epilogue in ("none", "row_scale") else (torch.bfloat16,)
    for name in ("out", "gate_out", "up_out", "dgate_out", "dup_out", "scaled_act_out", "gate", "up",
                 *SAVED_ACTIVATIONS):
        if given[name] is not None:
            check_rows(name, given[name], c_dtypes if name == "out" else (torch.bfloat16,), (M, N))
    if scale is not None:
        if scale.dtype not in SCALE_DTYPES:
            raise TypeError(f"scale: expected one of {SCALE_DTYPES}, got {scale.dtype}")
        if tuple(scale.shape) != (M,):
            raise ValueError(f"scale: expected shape ({M},), got {tuple(scale.shape)}")
    if topk_partial is not None:
        if topk_partial.dtype != torch.float32:
            raise TypeError(f"topk_partial: expected torch.float32, got {topk_partial.dtype}")
        if tuple(topk_partial.shape) != (partial_rows(N, config), M):
            raise ValueError(f"topk_partial: expected shape {(partial_rows(N, config), M)} (a row per "
                             f"{output_columns(config, epilogue)} columns of N = {N}), got "
                             f"{tuple(topk_partial.shape)}")
    for name, tensor in (("a", a_tensor), *named, ("offsets", offsets), ("scale", scale),
                         ("topk_partial", topk_partial)):
        if tensor is not None and not tensor.is_contiguous():
            if name == "a" and gathered:  # its rows are copied 16 bytes at a time: rows of adjacent elements
                if tensor.stride(1) != 1 or (tensor.stride(0) * tensor.element_size()) % 16:
                    raise ValueError(f"a.source: expected rows of adjacent elements a multiple of 16 bytes apart, "
                                     f"got strides {tuple(tensor.stride())}")
                continue
            if name.startswith("b") and rows_of_one_matrix(tensor):  # a column slice of [E, K, N]: TMA reads it so
                continue
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(tensor.stride())}")
    for name, tensor, row in (("a", a_tensor, K), *((name, w, w.shape[2]) for name, w in named)):
        if not rows_fit(row, element_bytes=ELEMENT_BYTES):
            raise ValueError(f"{name}: TMA needs rows of a multiple of 16 bytes; its rows hold {row} elements")
        if tensor.device.type != "meta" and not aligned(tensor):
            raise ValueError(f"{name}: TMA needs the tensor to start on a 16-byte boundary")
    if not b_transposed and not pair and K % config.block_k:
        raise ValueError(f"b: the [E, K, N] form needs K ({K}) a multiple of block_k ({config.block_k}): a K step "
                         f"past K would read the next expert's rows of b")
    if saved_through_ring(config, epilogue, saved):
        needed = ring_shared_bytes(config, scaled_act_out is not None)
        if needed > SHARED_MEMORY_LIMIT:
            raise ValueError(f"config: dswiglu through the ring needs {needed} bytes of shared memory (the ring and "
                             f"w·a's staging), more than the {SHARED_MEMORY_LIMIT} an sm_90 block may use (fewer "
                             f"stages fit)")
        return b_transposed
    tiles = tile_outputs(epilogue, given)
    least = least_buffers(epilogue, tiles, saved)
    if output_buffers(config, epilogue, tiles, saved) < least:
        what = " with the saved σ and silu" if saved else ""
        raise ValueError(f"config: the {epilogue} epilogue{what} needs {least} output tile(s) of "
                         f"{config.block_m}×{output_columns(config, epilogue)} a consumer in shared memory beside the "
                         f"ring; {shared_bytes(config, epilogue, least)} bytes in all, more than the "
                         f"{SHARED_MEMORY_LIMIT} an sm_90 block may use (fewer stages or a narrower tile fit)")
    return b_transposed


def launch_arguments(config: GemmConfig, a, b, offsets, epilogue: str, b_transposed: bool, **tensors):
    """(the kernel's run-time arguments by name, its compile-time arguments by name) for these tensors (``tensors``:
    :func:`grouped_gemm`'s keyword tensors, the defaults allocated): what :func:`grouped_gemm` launches and what
    ``scripts/p2/grouped_probe.py --compile-only`` compiles (meta tensors do; there the pointers are types)."""
    bm, bk = config.block_m, config.block_k
    bn = output_columns(config, epilogue)  # swiglu: a box of gate rows and one of up rows fill a BLOCK_N tile
    ring = saved_through_ring(config, epilogue, tensors.get("gate_sigmoid") is not None)
    box_n = bk if ring else bn  # through the ring, dswiglu's saved and output tiles move a BLOCK_K-column chunk a time
    weights = weights_of(b)
    E = weights[0].shape[0]
    b_descs = [descriptor(w.reshape(E * w.shape[1], w.shape[2]), (bn, bk) if b_transposed else (bk, bn))
               for w in weights]  # [E·N, K] or [E·K, N] (a pair: each [E·N, K] or [E·K_h, N])
    gathered = isinstance(a, Gathered)
    a_tensor = a.source if gathered else a  # gathered: the descriptor gives the ring's tiles and K, never loads
    a_desc = descriptor(a_tensor, (bm, bk))
    c, g, u = roles(epilogue, tensors)

    def tile_descriptor(tensor):
        if tensor.dtype == torch.float32:  # an fp32 C: TMA never stores it, its descriptor gives its strides
            return TensorDescriptor.from_tensor(tensor, [bm, bn], shared_layout((bm, bn), gl.float32))
        return descriptor(tensor, (bm, box_n))

    stand_in = c if c is not None else g if g is not None else u  # c not written: another output's descriptor
    c_desc = tile_descriptor(stand_in)
    saved = tensors.get("gate"), tensors.get("up")
    # one descriptor a tensor: an encoded launch encodes each once (g's or u's may be c_desc's, standing in for c)
    arguments = dict(
        a_desc=a_desc,
        b_desc=b_descs[0],
        b2_desc=b_descs[-1],
        c_desc=c_desc,
        c_ptr=c if c is not None else offsets,  # a None would drop out of warp_specialize's arguments
        g_desc=c_desc if g is None or g is stand_in else tile_descriptor(g),
        g_ptr=g if g is not None else offsets,
        u_desc=c_desc if u is None or u is stand_in else tile_descriptor(u),
        u_ptr=u if u is not None else offsets,
        gin_desc=descriptor(saved[0], (bm, box_n)) if saved[0] is not None else a_desc,
        uin_desc=descriptor(saved[1], (bm, box_n)) if saved[1] is not None else a_desc,
        scale_ptr=tensors.get("scale") if tensors.get("scale") is not None else offsets,
        partial_ptr=tensors.get("topk_partial") if tensors.get("topk_partial") is not None else offsets,
        offsets_ptr=offsets,
        num_experts=E,
        a_src_ptr=a_tensor,
        a_stride=a_tensor.stride(0),
        index_ptr=a.index if gathered else offsets,
    )
    tiles = sum(t is not None and t.dtype == torch.bfloat16 for t in (c, g, u))
    sigmoid, silu = (tensors.get(name) for name in SAVED_ACTIVATIONS)
    if ring:  # no output tiles: g and u land in the ring, w·a leaves through its two staging chunks
        tiles = 0
    saved_activations = dict(sigmoid_desc=descriptor(sigmoid, (bm, bn)) if sigmoid is not None else None,
                             silu_desc=descriptor(silu, (bm, bn)) if silu is not None else None)
    constexprs = dict(B_TRANSPOSED=b_transposed, B_PAIR=pair_kind(b, epilogue), BUFFERS=config.stages,
                      OUT_BUFS=output_buffers(config, epilogue, tiles, sigmoid is not None) if tiles else 0,
                      GROUP_M=config.group_m, EPILOGUE=EPILOGUES.index(epilogue), WRITE_OUT=c is not None,
                      WRITE_GATE=g is not None, WRITE_UP=u is not None,
                      WRITE_PARTIAL=tensors.get("topk_partial") is not None, SAVED=sigmoid is not None,
                      PINGPONG=config.pingpong, CONSUMER_REGS=CONSUMER_REGISTERS,
                      LOADER_REGS=GATHER_LOADER_REGISTERS[config.consumers] if gathered else LOADER_REGISTERS,
                      GATHER_A=gathered, LOADER_WARPS=GATHER_WARPS if gathered else 1,
                      GATHER_PARTS=gathered and GATHER_IN_PARTS,
                      RING_CHUNKS=ring_chunks(config, epilogue, sigmoid is not None), num_warps=config.warps)
    if sigmoid is not None:
        arguments.update(saved_activations)
    else:  # absent: None, a compile-time constant (the kernel without them has no such parameters)
        constexprs.update(saved_activations)
    return arguments, constexprs


def grouped_gemm(a: torch.Tensor | Gathered, b, offsets: torch.Tensor, *, out: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, epilogue: str = "none", b_transposed: bool | None = None,
                 config: GemmConfig | None = None, gate: torch.Tensor | None = None, up: torch.Tensor | None = None,
                 gate_out: torch.Tensor | None = None, up_out: torch.Tensor | None = None,
                 dgate_out: torch.Tensor | None = None, dup_out: torch.Tensor | None = None,
                 scaled_act_out: torch.Tensor | None = None, topk_partial: torch.Tensor | None = None,
                 gate_sigmoid: torch.Tensor | None = None, gate_silu: torch.Tensor | None = None, check: bool = True):
    """P[r] = A[r] · B_e for the rows offsets[e] ≤ r < offsets[e + 1] of each expert e, fp32-accumulated, through
    ``epilogue`` (the module's docstring gives each one's outputs):

    none, row_scale  ``out`` = P (times scale[r]): bf16, or fp32 where ``out`` is; returns out
    swiglu           B = [gate; up] stacked [E, 2N, K] or the pair ``(gate, up)`` [E, N, K] each, both held
                     transposed; ``out`` = silu(g)·u, ``gate_out`` = g, ``up_out`` = u, any of them (out where none
                     is given); returns out (None where not written)
    dswiglu          B = Wd [E, H, I] as it lies, A = dy (N = I); ``gate``, ``up`` the saved g, u, ``scale`` the
                     routing weights; writes ``dgate_out``, ``dup_out`` (allocated where None), ``scaled_act_out``
                     and ``topk_partial`` [partial_rows(N, config), M_total] fp32 where given; returns the four.
                     ``gate_sigmoid``, ``gate_silu`` (both or neither): the saved σ and silu, bf16 [M_total, N],
                     read in place of σ(g) and silu(g) (P1's definition: they need not be the forward's)
    a pair along K   ``b = (B₀, B₁)`` [E, K/2, N] each as they lie (none, row_scale): P = A[:, :K/2]·B₀ + A[:, K/2:]·B₁

    ``config``: the tiles, ring and consumers (:func:`default_config` where None; one that cannot hold the
    epilogue's output tiles beside its ring is refused). ``b``: [E, N, K] (each expert's B held transposed) or
    [E, K, N], read off the shapes (``b_transposed`` says which where N == K). ``offsets``: int32 [E + 1] on the
    device, rising from 0 to M_total (not checked: no host sync). Outputs and the saved g, u, σ, silu [M_total, N]
    may be strided views (rows 16-byte multiples apart, N a multiple of 16 bytes). Rows outside offsets[0] ≤ r <
    offsets[E] are left as they are. ``a`` may be a :class:`.gathered.Gathered` (source [T, K], index [M_total]):
    A's row r is then source[index[r]], read by the loads (the MoE layer's x_s and dy_s, never written out). On a
    Hopper GPU. ``check``: False for a trusted caller that has checked its arguments as :func:`check_arguments` does
    (the MoE layer, once a call), sparing those checks' host time."""
    tensors = dict(out=out, scale=scale, gate=gate, up=up, gate_out=gate_out, up_out=up_out, dgate_out=dgate_out,
                   dup_out=dup_out, scaled_act_out=scaled_act_out, topk_partial=topk_partial, gate_sigmoid=gate_sigmoid,
                   gate_silu=gate_silu)
    config = config or default_config(epilogue, gate_sigmoid is not None)
    if check:
        b_transposed = check_arguments(a, b, offsets, epilogue=epilogue, b_transposed=b_transposed, config=config,
                                       **tensors)
    else:
        b_transposed = held_transposed(a, b, epilogue, b_transposed, out)
    if a.device.type != "cuda":
        raise ValueError(f"a: the Gluon grouped GEMM runs on a CUDA (Hopper) GPU, got a tensor on {a.device}")
    M, K = a.shape
    E = weights_of(b)[0].shape[0]
    N = output_width(b, b_transposed, epilogue)
    tensors = with_defaults(epilogue, tensors, M, N, a)
    result = (tuple(tensors[name] for name in ("dgate_out", "dup_out", "scaled_act_out", "topk_partial"))
              if epilogue == "dswiglu" else tensors["out"])
    if M == 0 or N == 0 or E == 0:
        return result
    if K == 0:  # P = 0: so are C, g, u and silu(g)·u
        for name in ("out", "gate_out", "up_out"):
            if tensors[name] is not None:
                tensors[name].zero_()
        return result

    def make():
        arguments, constexprs = launch_arguments(config, a, b, offsets, epilogue, b_transposed, **tensors)
        return grid(M, E, N, config, sm_count(a.device), epilogue), arguments, constexprs

    # everything the launch is made of: a repeated call (the next training step's) skips building it
    call_key = (a.device, config, epilogue, b_transposed, signature((a, b, offsets)), signature(tuple(tensors.items())),
                switches())
    launch_memoised(LAUNCHES, call_key, make, maxnreg=config.maxnreg, device=a.device)
    return result
