"""What a launch costs before it does any work, in the benchmark's timing method (CUDA-graph replay after the L2
flush that leaves dirty lines): the floor under P1's few-token cases.

    PYTHONPATH=. python scripts/launch_floor_probe.py [--reps 50]

On a GPU, each probe captured alone in a graph and replayed after the benchmark's flush (``timing.L2Flusher``):
- ``empty``: a Triton kernel that does nothing, on 1 program, and on 96 programs of 8 warps;
- ``tile dot``: 96 programs of 8 warps that each load two small bf16 tiles, multiply them on the tensor cores
  and store the product, with 16 to 96 KB of shared memory (``TILE_SHAPES``) (the shared memory a launch asks for
  makes the SM set its L1 / shared-memory split; the flush's fill kernel asks for none);
- ``copy``: ``torch`` copying 9.4 MB into another buffer (P1's weights at H = 2048, I = 768), then 18.8 MB;
- the few-token launch at 1 token (both paths), for comparison.
Prints one table (µs, the shared memory each launch used); with $OUT set, writes it as JSON there.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from moe_lib import problems
from moe_lib.bench import timing
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
def tile_dot_kernel(a_ptr, b_ptr, c_ptr,  # a [BLOCK_M, BLOCK_K], b [BLOCK_K, BLOCK_N], c [BLOCK_M, BLOCK_N] per program
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """c = a · b, every program on the same small tiles (L2 hits after the first): a launch that holds shared
    memory for its operands and does almost nothing with it."""
    rows_m, rows_k, cols_n = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_N)
    a = tl.load(a_ptr + rows_m[:, None] * BLOCK_K + rows_k[None, :])
    b = tl.load(b_ptr + rows_k[:, None] * BLOCK_N + cols_n[None, :])
    c = tl.dot(a, b).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + tl.program_id(0) * BLOCK_M * BLOCK_N + rows_m[:, None] * BLOCK_N + cols_n[None, :], c)


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
        kernel = tile_dot_kernel.warmup(a, b, c, block_m, block_n, block_k, grid=(programs,), num_warps=8,
                                        num_stages=1)  # fmt: skip
        shared_kb = kernel.metadata.shared // 1024
        found[f"tile dot, {programs} programs, {shared_kb} KB shared"] = (
            lambda a=a, b=b, c=c, shape=(block_m, block_n, block_k): tile_dot_kernel[(programs,)](
                a, b, c, *shape, num_warps=8, num_stages=1),
            shared_kb,
        )  # fmt: skip
    for scale in (1, 2):
        source = torch.randn(scale * WEIGHT_BYTES // 2, device="cuda", dtype=torch.bfloat16)
        target = torch.empty_like(source)
        found[f"copy {scale * WEIGHT_BYTES / 1e6:.1f} MB"] = (lambda s=source, t=target: t.copy_(s), None)
    for precision in ("faithful", "fast"):
        inputs = problems.make_inputs("swiglu_down_backward", 1, seed=0, device="cuda", distribution="harness")
        found[f"few-token launch, 1 token, {precision}"] = (
            lambda i=inputs, p=precision: swiglu_down_backward(*i.values(), precision=p), None)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--programs", type=int, default=96, help="programs of the empty and tile-dot launches")
    args = parser.parse_args()
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
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "launch_floor_probe.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
