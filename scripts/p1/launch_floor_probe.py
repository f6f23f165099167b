"""What a launch costs before it does any work, in the benchmark's timing method (CUDA-graph replay after the L2
flush that leaves dirty lines): the floor under P1's few-token cases.

    PYTHONPATH=. python scripts/p1/launch_floor_probe.py [--reps 50]

On a GPU, each probe captured alone in a graph and replayed after the benchmark's flush (``timing.L2Flusher``):
- ``empty``: a Triton kernel that does nothing, on 1 program, and on 96 programs of 8 warps;
- ``tile dot``: 96 programs of 8 warps that each load two small bf16 tiles, multiply them on the tensor cores
  and store the product, with 16 to 96 KB of shared memory (``TILE_SHAPES``) (the shared memory a launch asks for
  makes the SM set its L1 / shared-memory split; the flush's fill kernel asks for none);
- ``copy``: ``torch`` copying 9.4 MB into another buffer (P1's weights at H = 2048, I = 768), then 18.8 MB;
- ``stream``: 96 programs that each copy their 96 KB share of a 9.4 MB buffer (P1's weights) into another, as the
  few-token launch reads its weight tiles and writes their gradients: by pointer loads into registers (all three
  32 KB blocks asked for before the first store), and by TMA in Gluon (three bulk copies into shared memory on one
  barrier, one wait, three bulk stores): whether TMA streams a program's share faster than register loads;
- ``shared``: 96 programs of 8 warps that do the same tiny work (one 256-byte row through shared memory) while
  holding 1 to 128 KB of shared memory (``SHARED_KB``): what the shared memory a launch asks for costs by itself,
  apart from the loads and products that grow with it in the tile-dot probes;
- the few-token launch at 1 token (both paths), for comparison.
``--compile-only`` compiles the stream and shared-memory kernels for sm_90 on the CPU and prints their resources.
Prints one table (µs, the shared memory each launch used); with $OUT set, writes it as JSON there.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from moe_lib import problems
from moe_lib.bench import timing
from moe_lib.bench.tuning import write_out
from moe_lib.swiglu_down import swiglu_down_backward

WEIGHT_BYTES = 3 * 2048 * 768 * 2  # Wg, Wu, Wd in bf16 at H = 2048, I = 768
# (BLOCK_M, BLOCK_N, BLOCK_K) of the tile-dot probes: compiled for sm_90 on 8 warps they hold 16, 32, 48 and
# 96 KB of shared memory (the few-token launch: 72–76 KB)
TILE_SHAPES = ((64, 64, 64), (128, 128, 64), (128, 256, 64), (128, 256, 128))


@triton.jit
def empty_kernel(out_ptr):
    """Nothing: the launch alone (``out_ptr`` is never written)."""
    pass


@triton.jit
def tile_dot_kernel(
    a_ptr,
    b_ptr,
    c_ptr,  # a [BLOCK_M, BLOCK_K], b [BLOCK_K, BLOCK_N], c [BLOCK_M, BLOCK_N] per program
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c = a · b, every program on the same small tiles (L2 hits after the first): a launch that holds shared
    memory for its operands and does almost nothing with it."""
    rows_m, rows_k, cols_n = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_N)
    a = tl.load(a_ptr + rows_m[:, None] * BLOCK_K + rows_k[None, :])
    b = tl.load(b_ptr + rows_k[:, None] * BLOCK_N + cols_n[None, :])
    c = tl.dot(a, b).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + tl.program_id(0) * BLOCK_M * BLOCK_N + rows_m[:, None] * BLOCK_N + cols_n[None, :], c)


STREAM_BLOCK = (128, 128)  # rows × bf16 columns of one block of the stream probes: 32 KB, 256-byte rows
STREAM_BLOCKS = 3  # blocks per program: 96 KB, a few-token program's share of the weights


@triton.jit
def register_stream_kernel(
    source_ptr,
    target_ptr,  # [rows, BLOCK_COLS] each, contiguous
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """Three consecutive [BLOCK_ROWS, BLOCK_COLS] blocks of this program copied through registers, all three loads
    issued before the first store."""
    offsets = (tl.arange(0, BLOCK_ROWS)[:, None] * BLOCK_COLS + tl.arange(0, BLOCK_COLS)[None, :]).to(tl.int64)
    first = tl.program_id(0).to(tl.int64) * 3 * BLOCK_ROWS * BLOCK_COLS
    block_0 = tl.load(source_ptr + first + offsets)
    block_1 = tl.load(source_ptr + first + BLOCK_ROWS * BLOCK_COLS + offsets)
    block_2 = tl.load(source_ptr + first + 2 * BLOCK_ROWS * BLOCK_COLS + offsets)
    tl.store(target_ptr + first + offsets, block_0)
    tl.store(target_ptr + first + BLOCK_ROWS * BLOCK_COLS + offsets, block_1)
    tl.store(target_ptr + first + 2 * BLOCK_ROWS * BLOCK_COLS + offsets, block_2)


@gluon.jit
def tma_stream_kernel(
    source_desc,
    target_desc,  # TMA descriptors over [rows, cols], block [BLOCK_ROWS, cols]
    BLOCKS: gl.constexpr,
):
    """BLOCKS consecutive blocks of this program copied through shared memory: every TMA load issued at once onto
    one barrier, one wait, then every TMA store."""
    BLOCK_ROWS: gl.constexpr = source_desc.block_type.shape[0]
    buffers = gl.allocate_shared_memory(source_desc.dtype, [BLOCKS] + source_desc.block_type.shape, source_desc.layout)
    loaded = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(loaded, count=1)
    fence_async_shared()  # the barrier's initialisation before the TMA unit sees it
    first = gl.program_id(0) * BLOCKS * BLOCK_ROWS
    mbarrier.expect(loaded, BLOCKS * source_desc.block_type.nbytes)
    for block in gl.static_range(BLOCKS):
        tma.async_copy_global_to_shared(source_desc, [first + block * BLOCK_ROWS, 0], loaded, buffers.index(block))
    mbarrier.wait(loaded, 0)
    for block in gl.static_range(BLOCKS):
        tma.async_copy_shared_to_global(target_desc, [first + block * BLOCK_ROWS, 0], buffers.index(block))
    tma.store_wait(0)
    mbarrier.invalidate(loaded)


SHARED_KB = (1, 16, 32, 64, 128)  # shared memory held by the programs of the shared-memory probes (powers of two)
SHARED_ROW = 128  # bf16 elements per row of that shared memory: 256 bytes


@gluon.jit
def shared_memory_kernel(
    out_ptr,  # [programs, ROW] bf16, written
    ROWS: gl.constexpr,
    ROW: gl.constexpr,
):
    """One row of out through the last row of a [ROWS, ROW] bf16 buffer in shared memory: a launch whose only
    difference from its neighbours is the shared memory it holds."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0])
    shared_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    buffer = gl.allocate_shared_memory(gl.bfloat16, [ROWS, ROW], shared_layout)
    columns = gl.arange(0, ROW, layout=gl.SliceLayout(0, layout))
    row = gl.full([1, ROW], 1.0, gl.bfloat16, layout) + gl.program_id(0).to(gl.bfloat16)
    buffer.slice(ROWS - 1, 1).store(row)
    gl.thread_barrier()
    value = buffer.slice(ROWS - 1, 1).load(layout)
    gl.store(out_ptr + gl.program_id(0) * ROW + columns[None, :], value)


def shared_memory_rows(kilobytes: int) -> int:
    """Rows of SHARED_ROW bf16 in a buffer of ``kilobytes``."""
    return kilobytes * 1024 // (2 * SHARED_ROW)


def stream_descriptors(source: torch.Tensor, target: torch.Tensor) -> tuple:
    """TMA descriptors over the [rows, STREAM_BLOCK[1]] views of two bf16 buffers, one block per copy."""
    layout = gl.NVMMASharedLayout.get_default_for(list(STREAM_BLOCK), gl.bfloat16)
    return tuple(
        TensorDescriptor.from_tensor(t.view(-1, STREAM_BLOCK[1]), list(STREAM_BLOCK), layout) for t in (source, target)
    )


def stream_programs(source: torch.Tensor) -> int:
    rows = source.numel() // STREAM_BLOCK[1]
    if rows % (STREAM_BLOCKS * STREAM_BLOCK[0]):
        raise ValueError(f"stream probe: {rows} rows are not a whole number of {STREAM_BLOCKS}-block shares")
    return rows // (STREAM_BLOCKS * STREAM_BLOCK[0])


def compile_stream_kernels() -> None:
    """The stream and shared-memory kernels compiled for sm_90 without a GPU (registers, stack, shared memory,
    bulk copies)."""
    from moe_lib.bench.sm90 import compile_for_sm90, compile_gluon_for_sm90, resources

    compiled = compile_for_sm90(
        register_stream_kernel,
        {"source_ptr": "*bf16", "target_ptr": "*bf16"},
        {"BLOCK_ROWS": STREAM_BLOCK[0], "BLOCK_COLS": STREAM_BLOCK[1]},
        ["source_ptr", "target_ptr"],
        warps=8,
        stages=1,
    )
    print("register_stream_kernel", resources(compiled), compiled.asm["ptx"].count("ld.global"), "global loads")
    source = torch.empty(WEIGHT_BYTES // 2, dtype=torch.bfloat16)
    source_desc, target_desc = stream_descriptors(source, torch.empty_like(source))
    compiled = compile_gluon_for_sm90(
        tma_stream_kernel, dict(source_desc=source_desc, target_desc=target_desc), dict(BLOCKS=STREAM_BLOCKS), warps=4
    )
    ptx = compiled.asm["ptx"]
    print(
        "tma_stream_kernel",
        resources(compiled),
        ptx.count("cp.async.bulk.tensor"),
        "bulk copies,",
        ptx.count("mbarrier.try_wait"),
        "waits",
    )
    for kilobytes in SHARED_KB:
        constexprs = dict(ROWS=shared_memory_rows(kilobytes), ROW=SHARED_ROW)
        compiled = compile_gluon_for_sm90(shared_memory_kernel, dict(out_ptr="*bf16"), constexprs, warps=8)
        print(f"shared_memory_kernel, {kilobytes} KB asked:", resources(compiled))


def probes(programs: int) -> dict:
    """name -> (call, shared memory in KB or None)."""
    found = {}
    scratch = torch.zeros(1, device="cuda")
    found["empty, 1 program"] = (lambda: empty_kernel[(1,)](scratch), 0)
    found[f"empty, {programs} programs of 8 warps"] = (lambda: empty_kernel[(programs,)](scratch, num_warps=8), 0)
    for block_m, block_n, block_k in TILE_SHAPES:
        a = torch.randn(block_m, block_k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(block_k, block_n, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(programs, block_m, block_n, device="cuda", dtype=torch.bfloat16)
        kernel = tile_dot_kernel.warmup(a, b, c, block_m, block_n, block_k, grid=(programs,), num_warps=8, num_stages=1)
        shared_kb = kernel.metadata.shared // 1024
        found[f"tile dot, {programs} programs, {shared_kb} KB shared"] = (
            lambda a=a, b=b, c=c, shape=(block_m, block_n, block_k): tile_dot_kernel[(programs,)](
                a, b, c, *shape, num_warps=8, num_stages=1
            ),
            shared_kb,
        )
    for scale in (1, 2):
        source = torch.randn(scale * WEIGHT_BYTES // 2, device="cuda", dtype=torch.bfloat16)
        target = torch.empty_like(source)
        found[f"copy {scale * WEIGHT_BYTES / 1e6:.1f} MB"] = (lambda s=source, t=target: t.copy_(s), None)
    out = torch.empty(programs, SHARED_ROW, device="cuda", dtype=torch.bfloat16)
    for kilobytes in SHARED_KB:
        rows = shared_memory_rows(kilobytes)
        found[f"shared, {programs} programs of 8 warps holding {kilobytes} KB"] = (
            lambda rows=rows: shared_memory_kernel[(programs,)](out, rows, SHARED_ROW, num_warps=8),
            kilobytes,
        )
    source = torch.randn(WEIGHT_BYTES // 2, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)
    shares = stream_programs(source)
    found[f"stream {WEIGHT_BYTES / 1e6:.1f} MB, {shares} programs, registers"] = (
        lambda: register_stream_kernel[(shares,)](source, target, *STREAM_BLOCK, num_warps=8),
        None,
    )
    descriptors = stream_descriptors(source, target)
    found[f"stream {WEIGHT_BYTES / 1e6:.1f} MB, {shares} programs, TMA"] = (
        lambda: tma_stream_kernel[(shares,)](*descriptors, STREAM_BLOCKS, num_warps=4),
        None,
    )
    for precision in ("faithful", "fast"):
        inputs = problems.make_inputs("swiglu_down_backward", 1, seed=0, device="cuda", distribution="harness")
        found[f"few-token launch, 1 token, {precision}"] = (
            lambda i=inputs, p=precision: swiglu_down_backward(*i.values(), precision=p),
            None,
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--programs", type=int, default=96, help="programs of the empty and tile-dot launches")
    parser.add_argument("--compile-only", action="store_true", help="compile the stream kernels for sm_90 (CPU)")
    args = parser.parse_args()
    if args.compile_only:
        compile_stream_kernels()
        return
    if args.reps < 1 or args.programs < 1:
        raise SystemExit(f"--reps and --programs: expected positive integers, got {args.reps}, {args.programs}")
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    flush = timing.L2Flusher("cuda")
    rows = []
    for name, (call, shared_kb) in probes(args.programs).items():
        call()
        torch.cuda.synchronize()
        graph_us = timing.graph_median_ms(call, flush, reps=args.reps) * 1e3
        rows.append(dict(probe=name, shared_kb=shared_kb, graph_us=graph_us))
        print(f"{rows[-1]['graph_us']:8.2f} µs  {name}", flush=True)
    write_out("launch_floor_probe.json", dict(device=torch.cuda.get_device_name(), rows=rows))


if __name__ == "__main__":
    main()
