"""C = A · B_e per expert on Hopper in Gluon: the grouped (varlen-M) form of :mod:`.gluon_gemm`'s persistent kernel.

    A [M_total, K]          rows sorted by expert: expert e owns rows offsets[e] ≤ r < offsets[e + 1]
    B [E, N, K] or [E, K, N]  one matrix per expert (held transposed, as x·Wᵀ needs, or as it lies, as dy·Wd does)
    C [M_total, N]          C[r] = (A[r] · B_e) · scale[r] (the scale with the ``row_scale`` epilogue), bf16;
                            with ``swiglu``, B_e = [gate; up] ([2N, K]) and C[r] = silu(A[r]·gateᵀ) · (A[r]·upᵀ)

Tiles: expert e has ⌈n_e / BLOCK_M⌉ · ⌈N / BLOCK_N⌉ output tiles (none for an expert without rows), its row tiles
anchored at its first row offsets[e] (so no tile spans two experts' rows of C), in :mod:`.gluon_gemm`'s grouped
order inside the expert; the experts' tiles are numbered one after the other, expert by expert. Program p of P
takes tiles p, p + P, p + 2P, ... (:func:`schedule` lists them on the host). Each partition finds a tile's expert by
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

SwiGLU: a tile of BLOCK_N / 2 output columns j loads, each K step, a box of B's gate rows j and one of its up rows
N + j into the two halves of its B buffer, so the accumulator's halves are gate and up of the same columns (a gate
box past N reads up rows, an up box past 2N the next expert's: both feed only columns ≥ N, never stored). The
reshape, permute and split into the halves need no shared memory: each thread holds both halves of its columns.

Epilogue: the accumulator (times the row's scale with ``row_scale``, silu(gate)·up with ``swiglu``) in bf16 into
shared memory; a tile whose rows all belong to its expert (or end at the tensor's edge, where TMA clips) goes out by
TMA store; a tile at an expert's end by masked stores from shared memory, row chunk by row chunk, so that it never
writes the next expert's rows.
Every element of C for rows offsets[0] ≤ r < offsets[E] is written once: deterministic, no atomics.

The same schedule in plain Triton, for the interpreter and for reading: :mod:`.grouped_tl`.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma_wait

from ..encoded_launch import descriptor
from ..tiling import cdiv, grouped_tile
from ..tma import aligned, rows_fit
from .gluon_gemm import (
    CONSUMER_REGISTERS,
    ELEMENT_BYTES,
    LOADER_REGISTERS,
    GemmConfig,
    sm_count,
    tile_k_loop,
    tile_origin,
)

EPILOGUES = ("none", "row_scale", "swiglu")  # the kernel's EPILOGUE is the index
SCALE_DTYPES = (torch.float32, torch.bfloat16)
DEFAULT_CONFIG = GemmConfig()  # cooperative, 128 × 256 × 64 tiles, 3 stages: the dense probe's best at large M


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
def grouped_load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, num_experts, tiles_n, k_steps,
                           B_TRANSPOSED: gl.constexpr, GROUP_M: gl.constexpr, EPILOGUE: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The loading warp: every K step of the program's tiles (BLOCK_N output columns each), in order, into the ring;
    B's tile from the expert's slice of the stacked weights."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    B_BYTES: gl.constexpr = b_desc.block_type.nbytes
    STEP_BYTES: gl.constexpr = a_desc.block_type.nbytes + (2 * B_BYTES if EPILOGUE == 2 else B_BYTES)  # swiglu: 2 boxes
    HALF: gl.constexpr = b_desc.block_type.shape[0]
    K = a_desc.shape[1]
    N = b_desc.shape[1] if not B_TRANSPOSED else b_desc.shape[0] // num_experts
    tile = gl.program_id(0)
    expert, first, last = expert_of(offsets_ptr, num_experts, tile, gl.to_tensor(-1), gl.to_tensor(0),
                                     gl.to_tensor(0), tiles_n, BLOCK_M)
    i = 0  # the ring's step, running on from tile to tile
    while expert < num_experts:
        off_m, off_n, _ = tile_place(offsets_ptr, tile, expert, first, last, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        for step in range(k_steps):
            slot = i % BUFFERS
            mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)  # a fresh barrier counts as released
            bar = ready.index(slot)
            mbarrier.expect(bar, STEP_BYTES)  # TMA counts a tile's full bytes, zero-filled ones included
            k = step * BLOCK_K
            tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(slot))
            if EPILOGUE == 2:  # gate rows j and up rows N/2 + j of the tile's output columns, half a buffer each
                row = expert * N + off_n
                tma.async_copy_global_to_shared(b_desc, [row, k], bar, b_bufs.index(slot).slice(0, HALF))
                tma.async_copy_global_to_shared(b_desc, [row + N // 2, k], bar, b_bufs.index(slot).slice(HALF, HALF))
            elif B_TRANSPOSED:
                tma.async_copy_global_to_shared(b_desc, [expert * N + off_n, k], bar, b_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(b_desc, [expert * K + k, off_n], bar, b_bufs.index(slot))
            i += 1
        tile += gl.num_programs(0)
        expert, first, last = expert_of(offsets_ptr, num_experts, tile, expert, first, last, tiles_n, BLOCK_M)


@gluon.jit
def store_rows(c_smem, c_ptr, off_m, off_n, row_end, n_cols, WARPS: gl.constexpr):
    """The tile in ``c_smem`` to C's rows off_m ≤ r < row_end (columns < n_cols) by masked stores, a chunk of rows
    at a time (16 elements a thread): a TMA store would also write the rows past row_end, the next expert's."""
    BLOCK_M: gl.constexpr = c_smem.type.shape[0]
    BLOCK_N: gl.constexpr = c_smem.type.shape[1]
    COLUMN_THREADS: gl.constexpr = 32 if BLOCK_N >= 256 else BLOCK_N // 8  # 8 elements (16 bytes) a thread
    CHUNK: gl.constexpr = 2 * (32 // COLUMN_THREADS) * WARPS
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // COLUMN_THREADS, COLUMN_THREADS], [WARPS, 1], [1, 0])
    rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    col_ok = gl.expand_dims(cols < n_cols, 0)
    for r in gl.static_range(0, BLOCK_M, CHUNK):
        values = c_smem.slice(r, CHUNK, dim=0).load(layout)
        row = off_m + r + rows
        mask = gl.expand_dims(row < row_end, 1) & col_ok
        offsets = gl.expand_dims(row.to(gl.int64) * n_cols, 1) + gl.expand_dims(cols, 0)
        gl.store(c_ptr + offsets, values, mask=mask)


@gluon.jit
def grouped_consumer_partition(a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs, c_ptr, scale_ptr, offsets_ptr,
                               num_experts, tiles_n, k_steps, B_TRANSPOSED: gl.constexpr, GROUP_M: gl.constexpr,
                               EPILOGUE: gl.constexpr, ME: gl.constexpr, CONSUMERS: gl.constexpr,
                               WARPS: gl.constexpr):
    """Consumer ME of CONSUMERS (WARPS warps): the program's tiles ME, ME + CONSUMERS, ... of its own (the ring's
    steps counted over all the program's tiles), each its K loop, its epilogue and its store. With two consumers
    each K loop waits for its turn and passes it on once its last wgmma is issued (as :mod:`.gluon_gemm`)."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]  # output columns a tile
    ACC_N: gl.constexpr = 2 * BLOCK_N if EPILOGUE == 2 else BLOCK_N  # the product's columns: swiglu's gate, up
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, ACC_N, 16])
    M_total = c_desc.shape[0]
    N = c_desc.shape[1]
    acc = gl.zeros((BLOCK_M, ACC_N), dtype=gl.float32, layout=layout)
    c_smem = c_bufs.index(ME)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    tile = pid + ME * programs
    expert, first, last = expert_of(offsets_ptr, num_experts, tile, gl.to_tensor(-1), gl.to_tensor(0),
                                     gl.to_tensor(0), tiles_n, BLOCK_M)
    n = 0  # this consumer's tiles so far
    while expert < num_experts:
        off_m, off_n, row_end = tile_place(offsets_ptr, tile, expert, first, last, tiles_n, GROUP_M, BLOCK_M,
                                           BLOCK_N)
        step0 = ((tile - pid) // programs) * k_steps  # the program's tiles before this one, k_steps each
        if CONSUMERS > 1:  # consumer 0's first turn is free (a fresh barrier), consumer 1's first waits for it
            mbarrier.wait(turns.index(ME), (n & 1) ^ (1 - ME))
        acc = tile_k_loop(a_bufs, b_bufs, ready, empty, acc, step0, k_steps, False, B_TRANSPOSED)
        if CONSUMERS > 1:
            mbarrier.arrive(turns.index(1 - ME), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step0 + k_steps - 1) % BUFFERS), count=1)
        out = acc
        if EPILOGUE == 1:  # row_scale: the routing weight of each row, before the rounding to bf16
            rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
            scale = gl.load(scale_ptr + rows, mask=rows < row_end, other=0.0).to(gl.float32)
            out = acc * gl.expand_dims(scale, 1)
        if EPILOGUE == 2:  # swiglu: the accumulator's halves are gate and up of the same columns
            gate, up = gl.split(gl.permute(gl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
            out = gate / (1.0 + gl.exp(-gate)) * up
        tma.store_wait(pendings=0)  # the last tile's store has left c_smem
        c_smem.store(out.to(c_desc.dtype))
        fence_async_shared()
        if (off_m + BLOCK_M <= row_end) | (row_end >= M_total):  # no row of another expert (TMA clips at M_total)
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        else:
            store_rows(c_smem, c_ptr, off_m, off_n, row_end, N, WARPS)
        n += 1
        tile += CONSUMERS * programs
        expert, first, last = expert_of(offsets_ptr, num_experts, tile, expert, first, last, tiles_n, BLOCK_M)
    tma.store_wait(pendings=0)


@gluon.jit
def grouped_gemm_kernel(
    a_desc,  # A [M_total, K], rows sorted by expert, as [BLOCK_M, BLOCK_K] tiles
    b_desc,  # B_TRANSPOSED: the experts' Bᵀ stacked, [E·N, K], as [BLOCK_N, BLOCK_K] tiles; else B [E·K, N] as
             # [BLOCK_K, BLOCK_N] tiles. swiglu: [E·2N, K] (gate rows, then up rows), as [BLOCK_N, BLOCK_K] tiles
    c_desc,  # out: C [M_total, N] as [BLOCK_M, BLOCK_N] tiles (TMA stores of tiles inside one expert's rows)
    c_ptr,  # out: C [M_total, N] again (masked stores of tiles at an expert's end)
    scale_ptr,  # EPILOGUE 1 (row_scale): [M_total] fp32 or bf16, each row's scale; else any pointer, never read
    offsets_ptr,  # [E + 1] int32: expert e's rows are offsets[e] ≤ r < offsets[e + 1]
    num_experts,  # E
    B_TRANSPOSED: gl.constexpr,
    BUFFERS: gl.constexpr,  # buffers of the ring
    GROUP_M: gl.constexpr,  # row tiles taken together in an expert's tile order
    EPILOGUE: gl.constexpr,  # 0 none, 1 row_scale, 2 swiglu (EPILOGUES)
    PINGPONG: gl.constexpr,  # two one-warpgroup consumers on alternate tiles; else one of num_warps (8) warps
    CONSUMER_REGS: gl.constexpr,  # with PINGPONG: the second consumer's registers
    LOADER_REGS: gl.constexpr,  # the loading warp's registers
    num_warps: gl.constexpr,  # of the default partition: the cooperative consumer, or ping-pong's first (4)
):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    tiles_n = gl.cdiv(c_desc.shape[1], BLOCK_N)
    k_steps = gl.cdiv(a_desc.shape[1], BLOCK_K)
    CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    B_ROWS: gl.constexpr = b_desc.block_type.shape[0] * (2 if EPILOGUE == 2 else 1)  # swiglu: gate and up rows
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [BUFFERS, B_ROWS, b_desc.block_type.shape[1]], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turns.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation is seen by the copy engine (the async proxy)
    # the argument tuples written out in each call: a tuple held in a variable turns its constexprs into tensors
    if PINGPONG:
        gl.warp_specialize([
            (grouped_consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs, c_ptr, scale_ptr,
                                          offsets_ptr, num_experts, tiles_n, k_steps, B_TRANSPOSED, GROUP_M,
                                          EPILOGUE, 0, 2, num_warps)),
            (grouped_consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs, c_ptr, scale_ptr,
                                          offsets_ptr, num_experts, tiles_n, k_steps, B_TRANSPOSED, GROUP_M,
                                          EPILOGUE, 1, 2, 4)),
            (grouped_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, num_experts, tiles_n,
                                      k_steps, B_TRANSPOSED, GROUP_M, EPILOGUE, BLOCK_M, BLOCK_N)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (grouped_consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs, c_ptr, scale_ptr,
                                          offsets_ptr, num_experts, tiles_n, k_steps, B_TRANSPOSED, GROUP_M,
                                          EPILOGUE, 0, 1, num_warps)),
            (grouped_load_partition, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, num_experts, tiles_n,
                                      k_steps, B_TRANSPOSED, GROUP_M, EPILOGUE, BLOCK_M, BLOCK_N)),
        ], [1], [LOADER_REGS])


# --- the host side ----------------------------------------------------------------------------------------------


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


def output_width(b: torch.Tensor, b_transposed: bool, epilogue: str) -> int:
    """C's columns: B's N, or half of B's rows with swiglu ([gate; up] → silu(gate)·up)."""
    n = b.shape[1] if b_transposed else b.shape[2]
    return n // 2 if epilogue == "swiglu" else n


def check_arguments(a, b, offsets, *, out=None, scale=None, epilogue: str = "none", b_transposed: bool | None = None,
                    config: GemmConfig | None = None) -> bool:
    """Raises TypeError/ValueError naming the argument where :func:`grouped_gemm` cannot take it, before any work;
    returns whether B is held transposed ([E, N, K]; always with swiglu). Offsets' values stay on the device and are
    not checked: they must rise from offsets[0] = 0 to offsets[E] = M_total."""
    config = config or DEFAULT_CONFIG
    for name, tensor in (("a", a), ("b", b), ("offsets", offsets), ("out", out), ("scale", scale)):
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue: expected one of {EPILOGUES}, got {epilogue!r}")
    if a.dim() != 2:
        raise ValueError(f"a: expected a 2-D tensor [M_total, K], got shape {tuple(a.shape)}")
    if b.dim() != 3:
        raise ValueError(f"b: expected a 3-D tensor [E, N, K] or [E, K, N], got shape {tuple(b.shape)}")
    if a.dtype != torch.bfloat16:
        raise TypeError(f"a: expected torch.bfloat16, got {a.dtype}")
    if b.dtype != a.dtype:
        raise TypeError(f"b: expected {a.dtype} like a, got {b.dtype}")
    if offsets.dtype != torch.int32:
        raise TypeError(f"offsets: expected torch.int32, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] != b.shape[0] + 1:
        raise ValueError(f"offsets: expected shape ({b.shape[0] + 1},) (E + 1 for b's E = {b.shape[0]}), "
                         f"got {tuple(offsets.shape)}")
    for name, tensor in (("b", b), ("offsets", offsets), ("out", out), ("scale", scale)):
        if tensor is not None and tensor.device != a.device:
            raise ValueError(f"{name}: expected the device of a ({a.device}), got {tensor.device}")
    if epilogue == "swiglu":
        if b_transposed is False:
            raise ValueError("b: the swiglu epilogue takes B held transposed, [E, 2N, K] (gate rows, then up rows)")
        if b.shape[1] % 2:
            raise ValueError(f"b: the swiglu epilogue takes [E, 2N, K] (gate rows, then up rows), got an odd "
                             f"{b.shape[1]} rows")
        b_transposed = True
    if b_transposed is None:
        b_transposed = b_form(b, a, out)
    K = a.shape[1]
    N = output_width(b, b_transposed, epilogue)
    if (b.shape[2] if b_transposed else b.shape[1]) != K:
        raise ValueError(f"b: expected {'[E, N, K]' if b_transposed else '[E, K, N]'} with K = {K} (a's columns), "
                         f"got shape {tuple(b.shape)}")
    if out is not None:
        if out.dtype != a.dtype:
            raise TypeError(f"out: expected {a.dtype} like a, got {out.dtype}")
        if tuple(out.shape) != (a.shape[0], N):
            raise ValueError(f"out: expected shape {(a.shape[0], N)}, got {tuple(out.shape)}")
    if epilogue == "row_scale":
        if scale is None:
            raise ValueError("scale: the row_scale epilogue needs a [M_total] tensor of row scales")
        if scale.dtype not in SCALE_DTYPES:
            raise TypeError(f"scale: expected one of {SCALE_DTYPES}, got {scale.dtype}")
        if tuple(scale.shape) != (a.shape[0],):
            raise ValueError(f"scale: expected shape ({a.shape[0]},), got {tuple(scale.shape)}")
    elif scale is not None:
        raise ValueError(f"scale: given, but the {epilogue!r} epilogue takes none")
    for name, tensor in (("a", a), ("b", b), ("offsets", offsets), ("out", out), ("scale", scale)):
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(tensor.stride())}")
    for name, tensor, row in (("a", a, K), ("b", b, b.shape[2]), ("out", out, N)):
        if not rows_fit(row, element_bytes=ELEMENT_BYTES):
            raise ValueError(f"{name}: TMA needs rows of a multiple of 16 bytes; its rows hold {row} elements")
        if tensor is not None and tensor.device.type != "meta" and not aligned(tensor):
            raise ValueError(f"{name}: TMA needs the tensor to start on a 16-byte boundary")
    if not b_transposed and K % config.block_k:
        raise ValueError(f"b: the [E, K, N] form needs K ({K}) a multiple of block_k ({config.block_k}): a K step "
                         f"past K would read the next expert's rows of b")
    return b_transposed


def launch_arguments(config: GemmConfig, a, b, out, offsets, scale, epilogue: str, b_transposed: bool):
    """(the kernel's run-time arguments by name, its compile-time arguments by name) for these tensors: what
    :func:`grouped_gemm` launches and what ``scripts/p2/grouped_probe.py --compile-only`` compiles (meta tensors
    do; there the pointers are types)."""
    bm, bk = config.block_m, config.block_k
    bn = output_columns(config, epilogue)  # swiglu: a box of gate rows and one of up rows fill a BLOCK_N tile
    E = b.shape[0]
    stacked = b.reshape(E * b.shape[1], b.shape[2])  # [E·N, K] or [E·K, N]
    arguments = dict(
        a_desc=descriptor(a, (bm, bk)),
        b_desc=descriptor(stacked, (bn, bk) if b_transposed else (bk, bn)),
        c_desc=descriptor(out, (bm, bn)),
        c_ptr=out,
        scale_ptr=scale if scale is not None else offsets,  # a None would drop out of warp_specialize's arguments
        offsets_ptr=offsets,
        num_experts=E,
    )
    constexprs = dict(B_TRANSPOSED=b_transposed, BUFFERS=config.stages, GROUP_M=config.group_m,
                      EPILOGUE=EPILOGUES.index(epilogue), PINGPONG=config.pingpong, CONSUMER_REGS=CONSUMER_REGISTERS,
                      LOADER_REGS=LOADER_REGISTERS, num_warps=config.warps)
    return arguments, constexprs


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, *, out: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, epilogue: str = "none", b_transposed: bool | None = None,
                 config: GemmConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """C[r] = A[r] · B_e for the rows offsets[e] ≤ r < offsets[e + 1] of each expert e (times scale[r] with
    ``epilogue="row_scale"``), into ``out`` (a new [M_total, N] bf16 tensor where None), fp32-accumulated. With
    ``epilogue="swiglu"``, B_e is [gate; up] ([2N, K], held transposed) and C[r] = silu(A[r]·gateᵀ) · (A[r]·upᵀ).

    ``b``: [E, N, K] (each expert's B held transposed) or [E, K, N], read off the shapes (``b_transposed`` says
    which where N == K). ``offsets``: int32 [E + 1] on the device, rising from 0 to M_total (not checked: no host
    sync). Rows of ``out`` outside offsets[0] ≤ r < offsets[E] are left as they are. On a Hopper GPU."""
    b_transposed = check_arguments(a, b, offsets, out=out, scale=scale, epilogue=epilogue, b_transposed=b_transposed,
                                   config=config)
    if a.device.type != "cuda":
        raise ValueError(f"a: the Gluon grouped GEMM runs on a CUDA (Hopper) GPU, got a tensor on {a.device}")
    M, K = a.shape
    E = b.shape[0]
    N = output_width(b, b_transposed, epilogue)
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0 or E == 0:
        return out
    if K == 0:
        return out.zero_()
    arguments, constexprs = launch_arguments(config, a, b, out, offsets, scale, epilogue, b_transposed)
    programs = grid(M, E, N, config, sm_count(a.device), epilogue)
    grouped_gemm_kernel[(programs,)](**arguments, **constexprs, maxnreg=config.maxnreg)
    return out
