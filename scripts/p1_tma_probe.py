"""How fast can a Triton GEMM fed by TMA tensor descriptors run P1's four products on this GPU?

    PYTHONPATH=. python scripts/p1_tma_probe.py [--tokens 8192] [--compile-only]

P1's launches run pointer-based Triton GEMMs at 57–60% tensor-pipe activity where cuBLAS runs the
same shapes 1.4–1.5x faster (NOTES.md). This probe times one persistent GEMM kernel whose operands
arrive by TMA (``tl.make_tensor_descriptor``), with and without Triton's automatic warp
specialisation, against ``torch.mm`` on the four products of P1 at T tokens (H 2048, I 768):

    dA   = dy · Wd                M=T,  N=I,  K=H    A row-major
    dWd  = dyᵀ · intermediate     M=H,  N=I,  K=T    A stored transposed ([K, M])
    dx   = dGU · [Wg; Wu]         M=T,  N=H,  K=2I   A row-major
    dWgu = dGUᵀ · x               M=2I, N=H,  K=T    A stored transposed

Each result is checked against torch.mm in fp32 (relative Frobenius error) before it is timed the
benchmark's way (CUDA-graph replays, L2 flushed before each, median of 30). With --compile-only it
compiles every variant for sm_90 without a GPU and prints registers and shared memory.
"""

from __future__ import annotations

import argparse
import itertools

import pandas as pd
import torch
import triton
import triton.language as tl

from moe_lib import problems
from moe_lib.bench import timing
from moe_lib.bench.sm90 import compile_for_sm90, first_error_line, resources
from moe_lib.swiglu_down.kernels import grouped_tile

_SIZES = problems.load("swiglu_down_backward").sizes(0)
HIDDEN, INTERMEDIATE = _SIZES["hidden_size"], _SIZES["intermediate_size"]


@triton.jit
def _descriptor_gemm_kernel(
    a_ptr,  # A: [M, K] row-major, or [K, M] row-major when A_TRANSPOSED
    b_ptr,  # B: [K, N] row-major
    c_ptr,  # C = A · B: [M, N] row-major, written in c's dtype
    M, N, K,
    A_TRANSPOSED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    if A_TRANSPOSED:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[K, M], strides=[M, 1], block_shape=[BLOCK_K, BLOCK_M])
    else:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(k_steps):
            k = step * BLOCK_K
            if A_TRANSPOSED:
                a = a_desc.load([k, pid_m * BLOCK_M]).T
            else:
                a = a_desc.load([pid_m * BLOCK_M, k])
            b = b_desc.load([k, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c_desc.dtype))


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, warp_specialize)
# Triton's Hopper warp specialisation applies with num_warps=4: one producer warp group feeding
# two consumer warp groups (12 warps in all)
VARIANTS = [
    (128, 128, 64, 8, 4, False),
    (128, 256, 64, 8, 3, False),
    (128, 128, 64, 4, 3, True),
    (128, 128, 64, 4, 4, True),
    (128, 256, 64, 4, 3, True),
    (256, 128, 64, 4, 3, True),
]


def products(T: int, device) -> dict:
    """name -> (A storage, A_TRANSPOSED, B, M, N, K) for P1's four products, random bf16 operands."""

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16)

    dy, wd, x = rand(T, HIDDEN), rand(HIDDEN, INTERMEDIATE), rand(T, HIDDEN)
    inter, dgu, wgu = rand(T, INTERMEDIATE), rand(T, 2 * INTERMEDIATE), rand(2 * INTERMEDIATE, HIDDEN)
    return {
        "dA": (dy, False, wd, T, INTERMEDIATE, HIDDEN),
        "dWd": (dy, True, inter, HIDDEN, INTERMEDIATE, T),
        "dx": (dgu, False, wgu, T, HIDDEN, 2 * INTERMEDIATE),
        "dWgu": (dgu, True, x, 2 * INTERMEDIATE, HIDDEN, T),
    }


def launch(a, a_transposed, b, c, M, N, K, variant, num_programs):
    bm, bn, bk, warps, stages, ws = variant
    grid = (min(num_programs, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)
    _descriptor_gemm_kernel[grid](a, b, c, M, N, K, a_transposed, bm, bn, bk, 8, grid[0], ws,
                                  num_warps=warps, num_stages=stages)  # fmt: skip


def compile_only():
    types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
    for a_transposed, variant in itertools.product((False, True), VARIANTS):
        bm, bn, bk, warps, stages, ws = variant
        constexprs = dict(A_TRANSPOSED=a_transposed, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                          NUM_PROGRAMS=132, WARP_SPECIALIZE=ws)  # fmt: skip
        try:
            compiled = compile_for_sm90(_descriptor_gemm_kernel, types, constexprs, list(types), warps=warps,
                                        stages=stages)  # fmt: skip
        except Exception as exc:  # report and go on
            print(f"transposed={a_transposed} {variant}: FAIL {first_error_line(exc, 150)}")
            continue
        ptx = compiled.asm["ptx"]
        print(f"transposed={a_transposed} {variant}: {resources(compiled)} "
              f"tma={ptx.count('cp.async.bulk.tensor')} setmaxnreg={ptx.count('setmaxnreg')} "
              f"warps={compiled.metadata.num_warps}")  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192", help="comma-separated token counts")
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if args.compile_only:
        return compile_only()

    device = torch.device("cuda")
    flush = timing.L2Flusher(device)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=device))
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        for name, (a, a_transposed, b, M, N, K) in products(T, device).items():
            want = (a.float().T if a_transposed else a.float()) @ b.float()
            flops = 2 * M * N * K
            a_op = a.T if a_transposed else a
            ms = timing.graph_median_ms(lambda a_op=a_op, b=b: torch.mm(a_op, b), flush)
            rows.append(dict(T=T, product=name, impl="torch.mm", us=ms * 1e3, tflops=flops / ms / 1e9, err=0.0))
            for variant in VARIANTS:
                c = torch.full((M, N), float("nan"), device=device, dtype=torch.bfloat16)
                label = "{}x{}x{} w{} s{}{}".format(*variant[:5], " ws" if variant[5] else "")
                try:
                    launch(a, a_transposed, b, c, M, N, K, variant, num_sms)
                    torch.cuda.synchronize()
                except Exception as exc:  # report and go on with the other variants
                    rows.append(dict(T=T, product=name, impl=label, us=float("nan"), tflops=float("nan"),
                                     err=float("nan"), note=str(exc).strip().splitlines()[-1][:80]))  # fmt: skip
                    continue
                err = ((c.float() - want).norm() / want.norm()).item()
                ms = timing.graph_median_ms(
                    lambda a=a, t=a_transposed, b=b, c=c, M=M, N=N, K=K, v=variant: launch(a, t, b, c, M, N, K, v,
                                                                                           num_sms),
                    flush)  # fmt: skip
                rows.append(dict(T=T, product=name, impl=label, us=ms * 1e3, tflops=flops / ms / 1e9, err=err))
    table = pd.DataFrame(rows)
    pd.set_option("display.width", 200)
    print(table.round(4).to_string(index=False))


if __name__ == "__main__":
    main()
