"""C = A · B on Hopper in Gluon: persistent programs, one TMA loading warp, wgmma consumers, a grouped tile order.

bf16 (or fp16) operands, fp32 accumulation, the output in the operands' dtype. One program per SM (at most one per
output tile), each a warp-specialised region:

    loading warp    for each of the program's tiles, for each K step: wait until the next ring buffer is empty
                    (its ``empty`` mbarrier), then TMA-copy A's and B's tiles into it; the copy engine completes
                    the buffer's ``ready`` mbarrier when the bytes have landed
    consumers       cooperative: one partition of two warpgroups (8 warps) on one BLOCK_M × BLOCK_N tile, each
                    warpgroup half of its rows; ping-pong: two one-warpgroup partitions taking the program's tiles
                    in turn, each a BLOCK_M × BLOCK_N tile of its own, an order barrier (``turns``) letting one run
                    its K loop at a time, so that one's epilogue overlaps the other's wgmma
    a K step        wait ``ready``, issue the wgmma asynchronously (a tile's first with use_acc=False, so that no
                    other instruction rewrites the accumulator, which would make ptxas serialise the wgmma), wait
                    for the step before and hand its buffer back (``empty``)
    epilogue        the tile in the output dtype into shared memory, out by TMA; its store drains while the next
                    tile's K loop runs

Tiles: program p takes tiles p, p + P, p + 2P, ... of the grouped order (GROUP_M row tiles together, column by
column: the programs running at once share A's and B's tiles in L2; :func:`moe_lib.tiling.grouped_tile` is the same
order on the host). The ring's steps run on from tile to tile (step i in buffer i mod BUFFERS, its phase
(i // BUFFERS) mod 2), so the loading warp fetches the next tile's first K steps while the last tile is finished.
Ping-pong's order barrier also keeps the phases sound: a partition that waited on a buffer more than one use ahead
could not tell the uses apart by the phase's parity (``notes/p1/design-13.md``).

Operand forms (P2's products need all three): A as it lies ([M, K] row-major) or transposed (held as Aᵀ, [K, M]
row-major: dgᵀ·x), B as it lies ([K, N]: dy·Wd) or transposed (held as Bᵀ, [N, K]: x·Wgᵀ). Transposed tiles are
loaded as they lie and read through a permuted view of the shared memory (wgmma takes 16-bit operands either way).
:func:`gemm` reads the form off the strides of the tensors it is given (``x @ w.t()`` is ``gemm(x, w.t())``).
TMA fills the rows and columns of a tile beyond the operands with zeros and clips the output tile's stores, so any
M, N, K whose rows TMA can address work.

The grouped kernels' launches (:func:`launch_kernel`): :data:`ENCODED_LAUNCHES` selects Triton's JIT path,
``kernel[grid](...)``, which binds and specialises every argument and encodes every host descriptor on each call
(P1's launch with 14 descriptors: 85-127 µs of host time, ``notes/p1/design-13.md``), or
:class:`moe_lib.encoded_launch.KernelLaunches`, which compiles through the JIT once per key, then per call encodes
each descriptor once (~2.4 µs each) and calls the compiled kernel's launcher (~10 µs); ``notes/p2/host-time.md`` says
which is the default and why.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..encoded_launch import KernelLaunches, descriptor
from ..tiling import cdiv
from ..tma import aligned, rows_fit

CONSUMER_MODES = ("cooperative", "pingpong")
SHARED_MEMORY_LIMIT = 232448  # bytes of shared memory one block may use on sm_90
LOADER_REGISTERS = 40  # the loading warp's registers after setmaxnreg (P1's launch 2: notes/p1/design-13.md)
CONSUMER_REGISTERS = 232  # ping-pong's second consumer partition (a worker: its registers are asked for)
ELEMENT_BYTES = 2
# the grouped kernels' launches through KernelLaunches (compiled once per key, then encoded) rather than the JIT's
ENCODED_LAUNCHES = True


@dataclass(frozen=True)
class GemmConfig:
    """Tiles, ring and consumers of :func:`gemm_kernel`."""

    block_m: int = 128  # rows of a consumer's tile (cooperative: 64 or 128 a warpgroup)
    block_n: int = 256
    block_k: int = 64
    stages: int = 3  # buffers of the ring, each one K step's A and B tiles
    consumers: str = "cooperative"  # or "pingpong" (CONSUMER_MODES)
    programs: int = 0  # 0: one per SM; else at most this many (never more than the output tiles)
    group_m: int = 8  # row tiles taken together in the tile order (L2 reuse)
    # registers a thread at launch: 12 warps (8 or 4 + 4 consumers, the loading warp's warpgroup) × 32 × 168 ≤ 64 K;
    # setmaxnreg then gives the loading warp LOADER_REGISTERS and the consumers the rest
    maxnreg: int = 168

    def __post_init__(self):
        if self.consumers not in CONSUMER_MODES:
            raise ValueError(f"config: consumers must be one of {CONSUMER_MODES}, got {self.consumers!r}")
        rows = (128, 256) if self.consumers == "cooperative" else (64, 128)
        if self.block_m not in rows:
            raise ValueError(f"config: block_m must be one of {rows} with {self.consumers} consumers, "
                             f"got {self.block_m}")
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"config: block_n must be 64, 128 or 256 (a wgmma's N), got {self.block_n}")
        if self.block_k not in (32, 64, 128):
            raise ValueError(f"config: block_k must be 32, 64 or 128, got {self.block_k}")
        if self.stages < 2:
            raise ValueError(f"config: stages must be at least 2 (one buffer filled while one is read), "
                             f"got {self.stages}")
        if self.programs < 0 or self.group_m < 1:
            raise ValueError(f"config: programs must be ≥ 0 and group_m ≥ 1, got {self.programs}, {self.group_m}")
        if self.ring_bytes > SHARED_MEMORY_LIMIT:  # each kernel checks its own buffers beside the ring
            raise ValueError(f"config: its ring alone takes {self.ring_bytes} bytes of shared memory, more than the "
                             f"{SHARED_MEMORY_LIMIT} an sm_90 block may use")

    @property
    def pingpong(self) -> bool:
        return self.consumers == "pingpong"

    @property
    def warps(self) -> int:
        """Warps of the default partition (the kernel's num_warps): cooperative's two warpgroups, or ping-pong's
        first consumer."""
        return 4 if self.pingpong else 8

    @property
    def output_tiles(self) -> int:
        """Output buffers in shared memory: one per consumer partition."""
        return 2 if self.pingpong else 1

    @property
    def ring_bytes(self) -> int:
        """Shared memory of the ring: a K step's A and B tiles a stage."""
        return self.stages * (self.block_m + self.block_n) * self.block_k * ELEMENT_BYTES

    @property
    def shared_bytes(self) -> int:
        """Shared memory of :func:`gemm_kernel`: the ring and the output buffers (the mbarriers' few bytes aside)."""
        return self.ring_bytes + self.output_tiles * self.block_m * self.block_n * ELEMENT_BYTES

    def tiles(self, M: int, N: int) -> int:
        """Output tiles of an M × N product."""
        return cdiv(M, self.block_m) * cdiv(N, self.block_n)

    def grid(self, M: int, N: int, sms: int) -> int:
        """Programs of a launch: one per SM, or ``programs``, and never more than the tiles."""
        return max(1, min(self.programs or sms, self.tiles(M, N)))

    def constexprs(self, a_transposed: bool, b_transposed: bool) -> dict:
        """The kernel's compile-time arguments by name (``num_warps`` included)."""
        return dict(A_TRANSPOSED=a_transposed, B_TRANSPOSED=b_transposed, BUFFERS=self.stages, GROUP_M=self.group_m,
                    PINGPONG=self.pingpong, CONSUMER_REGS=CONSUMER_REGISTERS, LOADER_REGS=LOADER_REGISTERS,
                    num_warps=self.warps)


@gluon.jit
def tile_origin(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(row, column) of output tile ``tile`` in the grouped order (``moe_lib.tiling.grouped_tile``)."""
    group_tiles = GROUP_M * tiles_n
    first_m = (tile // group_tiles) * GROUP_M
    group_rows = gl.minimum(tiles_m - first_m, GROUP_M)
    in_group = tile % group_tiles
    return (first_m + in_group % group_rows) * BLOCK_M, (in_group // group_rows) * BLOCK_N


@gluon.jit
def load_partition(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles_m, tiles_n, k_steps,
                   A_TRANSPOSED: gl.constexpr, B_TRANSPOSED: gl.constexpr, GROUP_M: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The loading warp: every K step of the program's tiles, in order, into the ring."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0] if A_TRANSPOSED else a_desc.block_type.shape[1]
    STEP_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    i = 0  # the ring's step, running on from tile to tile
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        off_m, off_n = tile_origin(tile, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        for step in range(k_steps):
            slot = i % BUFFERS
            mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)  # a fresh barrier counts as released
            bar = ready.index(slot)
            mbarrier.expect(bar, STEP_BYTES)  # TMA counts a tile's full bytes, zero-filled ones included
            k = step * BLOCK_K
            if A_TRANSPOSED:
                tma.async_copy_global_to_shared(a_desc, [k, off_m], bar, a_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(slot))
            if B_TRANSPOSED:
                tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_bufs.index(slot))
            i += 1


@gluon.jit
def tile_k_loop(a_bufs, b_bufs, ready, empty, acc, step0, k_steps, A_TRANSPOSED: gl.constexpr,
                B_TRANSPOSED: gl.constexpr, GENERIC_WRITES: gl.constexpr = False, ACCUMULATE: gl.constexpr = False):
    """acc = Σ A·B over the ring's steps step0 .. step0 + k_steps − 1 (the first overwriting acc), each step's
    buffer handed back once the step after it is issued; returns with the last step's wgmma still running. With
    GENERIC_WRITES (buffers filled by cp.async, not TMA) a proxy fence orders those writes before the wgmma's reads.
    ACCUMULATE: the loop goes on from an earlier one (acc += Σ A·B; the earlier loop's last buffer handed back once
    this loop's first step is issued)."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    for step in range(k_steps):
        i = step0 + step
        slot = i % BUFFERS
        mbarrier.wait(ready.index(slot), (i // BUFFERS) & 1)
        if GENERIC_WRITES:
            fence_async_shared()
        a = a_bufs.index(slot)
        if A_TRANSPOSED:
            a = a.permute((1, 0))
        b = b_bufs.index(slot)
        if B_TRANSPOSED:
            b = b.permute((1, 0))
        acc = warpgroup_mma(a, b, acc, use_acc=(step > 0) | ACCUMULATE, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # the step before is done
        mbarrier.arrive(empty.index((i + BUFFERS - 1) % BUFFERS), count=1, pred=(step > 0) | ACCUMULATE)
    return acc


@gluon.jit
def consumer_partition(a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs, tiles_m, tiles_n, k_steps,
                       A_TRANSPOSED: gl.constexpr, B_TRANSPOSED: gl.constexpr, GROUP_M: gl.constexpr,
                       ME: gl.constexpr, CONSUMERS: gl.constexpr, WARPS: gl.constexpr):
    """Consumer ME of CONSUMERS (WARPS warps): the program's tiles ME, ME + CONSUMERS, ... (its local count), each
    its K loop and its epilogue. With two consumers, each K loop waits for its turn and passes the turn on once
    its last wgmma is issued."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    c_smem = c_bufs.index(ME)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n = 0  # this consumer's tiles so far
    for tile in range(pid + ME * programs, tiles_m * tiles_n, CONSUMERS * programs):
        off_m, off_n = tile_origin(tile, tiles_m, tiles_n, GROUP_M, BLOCK_M, BLOCK_N)
        step0 = ((tile - pid) // programs) * k_steps  # the program's tiles before this one, k_steps each
        if CONSUMERS > 1:  # consumer 0's first turn is free (a fresh barrier), consumer 1's first waits for it
            mbarrier.wait(turns.index(ME), (n & 1) ^ (1 - ME))
        acc = tile_k_loop(a_bufs, b_bufs, ready, empty, acc, step0, k_steps, A_TRANSPOSED, B_TRANSPOSED)
        if CONSUMERS > 1:
            mbarrier.arrive(turns.index(1 - ME), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((step0 + k_steps - 1) % BUFFERS), count=1)
        tma.store_wait(pendings=0)  # the last tile's store has left c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        n += 1
    tma.store_wait(pendings=0)


@gluon.jit
def gemm_kernel(
    a_desc,  # A [M, K] as [BLOCK_M, BLOCK_K] tiles, or with A_TRANSPOSED Aᵀ [K, M] as [BLOCK_K, BLOCK_M] tiles
    b_desc,  # B [K, N] as [BLOCK_K, BLOCK_N] tiles, or with B_TRANSPOSED Bᵀ [N, K] as [BLOCK_N, BLOCK_K] tiles
    c_desc,  # out: C [M, N] as [BLOCK_M, BLOCK_N] tiles
    A_TRANSPOSED: gl.constexpr,
    B_TRANSPOSED: gl.constexpr,
    BUFFERS: gl.constexpr,  # buffers of the ring
    GROUP_M: gl.constexpr,  # row tiles taken together in the tile order
    PINGPONG: gl.constexpr,  # two one-warpgroup consumers on alternate tiles; else one of num_warps (8) warps
    CONSUMER_REGS: gl.constexpr,  # with PINGPONG: the second consumer's registers
    LOADER_REGS: gl.constexpr,  # the loading warp's registers
    num_warps: gl.constexpr,  # of the default partition: the cooperative consumer, or ping-pong's first (4)
):
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0] if A_TRANSPOSED else a_desc.block_type.shape[1]
    K = a_desc.shape[0] if A_TRANSPOSED else a_desc.shape[1]
    tiles_m = gl.cdiv(c_desc.shape[0], BLOCK_M)
    tiles_n = gl.cdiv(c_desc.shape[1], BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    CONSUMERS: gl.constexpr = 2 if PINGPONG else 1
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [BUFFERS] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [BUFFERS] + b_desc.block_type.shape, b_desc.layout)
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
    loader_args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tiles_m, tiles_n, k_steps, A_TRANSPOSED,
                   B_TRANSPOSED, GROUP_M, BLOCK_M, BLOCK_N)
    if PINGPONG:
        gl.warp_specialize([
            (consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs, tiles_m, tiles_n, k_steps,
                                  A_TRANSPOSED, B_TRANSPOSED, GROUP_M, 0, 2, num_warps)),
            (consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs, tiles_m, tiles_n, k_steps,
                                  A_TRANSPOSED, B_TRANSPOSED, GROUP_M, 1, 2, 4)),
            (load_partition, loader_args),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (consumer_partition, (a_bufs, b_bufs, ready, empty, turns, c_desc, c_bufs, tiles_m, tiles_n, k_steps,
                                  A_TRANSPOSED, B_TRANSPOSED, GROUP_M, 0, 1, num_warps)),
            (load_partition, loader_args),
        ], [1], [LOADER_REGS])


def operand_form(tensor: torch.Tensor, name: str) -> bool:
    """Whether a 2-D operand is held transposed (column-major: its transpose is contiguous); row-major is False.
    ValueError for any other layout."""
    if tensor.is_contiguous():
        return False
    if tensor.t().is_contiguous():
        return True
    raise ValueError(f"{name}: expected a row-major or a column-major (transposed) 2-D tensor, got strides "
                     f"{tuple(tensor.stride())}")


def check_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> None:
    """ValueError/TypeError naming the argument where :func:`gemm` cannot take it."""
    for name, tensor in (("a", a), ("b", b), ("out", out)):
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(tensor.shape)}")
        if tensor.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"{name}: expected bfloat16 or float16, got {tensor.dtype}")
        if tensor.dtype != a.dtype:
            raise ValueError(f"{name}: expected {a.dtype} like a, got {tensor.dtype}")
        if tensor.device != a.device:
            raise ValueError(f"{name}: expected the device of a ({a.device}), got {tensor.device}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b: expected {a.shape[1]} rows (a's columns), got shape {tuple(b.shape)}")
    if out is not None:
        if tuple(out.shape) != (a.shape[0], b.shape[1]):
            raise ValueError(f"out: expected shape {(a.shape[0], b.shape[1])}, got {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError("out: expected a contiguous (row-major) tensor")
    for name, tensor in (("a", a), ("b", b), ("out", out)):
        if tensor is None:
            continue
        held = tensor.t() if operand_form(tensor, name) else tensor
        if not rows_fit(held.shape[1], element_bytes=ELEMENT_BYTES):
            raise ValueError(f"{name}: TMA needs rows of a multiple of 16 bytes; its rows hold {held.shape[1]} "
                             f"elements")
        if tensor.device.type != "meta" and not aligned(tensor):
            raise ValueError(f"{name}: TMA needs the tensor to start on a 16-byte boundary")


def launch_arguments(config: GemmConfig, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> tuple[dict, dict]:
    """(the kernel's three TMA descriptors by argument name, its compile-time arguments by name) for these operands:
    what :func:`gemm` launches and what ``scripts/p2/gemm_probe.py --compile-only`` compiles (meta tensors do)."""
    a_transposed, b_transposed = operand_form(a, "a"), operand_form(b, "b")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    a_desc = descriptor(a.t(), (bk, bm)) if a_transposed else descriptor(a, (bm, bk))
    b_desc = descriptor(b.t(), (bn, bk)) if b_transposed else descriptor(b, (bk, bn))
    descriptors = dict(a_desc=a_desc, b_desc=b_desc, c_desc=descriptor(out, (bm, bn)))
    return descriptors, config.constexprs(a_transposed, b_transposed)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The GPU's streaming multiprocessors."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_kernel(launches: KernelLaunches, programs: int, arguments: dict, constexprs: dict, *, maxnreg: int,
                  device: torch.device) -> None:
    """``launches.kernel[(programs,)](**arguments, **constexprs, maxnreg=maxnreg)`` on ``device``'s current stream:
    through ``launches`` (compiled once per key, then encoded) where :data:`ENCODED_LAUNCHES` is set, else through
    Triton's JIT."""
    if ENCODED_LAUNCHES:
        launches(programs, arguments | constexprs, maxnreg=maxnreg, device=device)
    else:
        launches.kernel[(programs,)](**arguments, **constexprs, maxnreg=maxnreg)


def launch_memoised(launches: KernelLaunches, call_key, make, *, maxnreg: int, device: torch.device) -> None:
    """:func:`launch_kernel` of what ``make()`` builds, ``(programs, arguments, constexprs)``; where
    :data:`ENCODED_LAUNCHES` is set, a launch whose ``call_key`` was seen before reuses its encoded arguments
    (:meth:`~moe_lib.encoded_launch.KernelLaunches.memoised`: ``make`` is not called)."""
    if not ENCODED_LAUNCHES:
        programs, arguments, constexprs = make()
        launches.kernel[(programs,)](**arguments, **constexprs, maxnreg=maxnreg)
        return

    def by_name():
        programs, arguments, constexprs = make()
        return programs, arguments | constexprs

    launches.memoised(call_key, by_name, maxnreg=maxnreg, device=device)


def gemm(a: torch.Tensor, b: torch.Tensor, config: GemmConfig = GemmConfig(), out: torch.Tensor | None = None):
    """a · b ([M, K] · [K, N], each row-major or a transposed view of a row-major tensor) into ``out`` (a new
    [M, N] row-major tensor where None), fp32-accumulated, in the operands' dtype. On a Hopper GPU; rows TMA can
    address (16-byte multiples, 16-byte aligned starts)."""
    check_operands(a, b, out)
    if config.shared_bytes > SHARED_MEMORY_LIMIT:
        raise ValueError(f"config: {config.shared_bytes} bytes of shared memory (ring and output tiles), more than "
                         f"the {SHARED_MEMORY_LIMIT} an sm_90 block may use")
    if a.device.type != "cuda":
        raise ValueError(f"a: the Gluon GEMM runs on a CUDA (Hopper) GPU, got a tensor on {a.device}")
    M, K = a.shape
    N = b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    descriptors, constexprs = launch_arguments(config, a, b, out)
    gemm_kernel[(config.grid(M, N, sm_count(a.device)),)](**descriptors, **constexprs, maxnreg=config.maxnreg)
    return out
