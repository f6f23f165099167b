"""A probe for launch 2's products in Gluon: warp-specialised TMA loads and warpgroup MMAs, with the hi/lo halves.

    PYTHONPATH=. python scripts/p1_gluon_probe.py --compile-only      # sm_90 on the CPU: registers, shared memory
    PYTHONPATH=. python scripts/p1_gluon_probe.py [--tokens 2447,8192] # on a GPU: check, then time beside cuBLAS

The faithful path's launch 2 runs two products with both halves of dGate, dUp (``data/results/NOTES.md``, design 4):

    [dWg; dWu] = Σ_t [dG | dU]_hi[t]ᵀ x[t] + [dG | dU]_lo[t]ᵀ x[t]      M = 2I, N = H, K = T   (A read transposed)
    dx         = [dG | dU]_hi · [Wg; Wu] + [dG | dU]_lo · [Wg; Wu]       M = T,  N = H, K = 2I

ncu put the Triton version (cp.async pipeline, every warp loading and multiplying) at 72–74% tensor-pipe activity,
with 29–31% of its stalls on the pipeline's CTA barrier. Here one warp only issues TMA loads into a ring of shared
memory buffers (``ready``/``empty`` mbarriers per buffer), and two warpgroups only issue wgmma: per K step
``acc += A_hi·B`` and ``acc += A_lo·B`` on the same B tile, then wait until the step before is done and hand its
buffer back. One output tile per program, stored by TMA. Each product is checked against float64 of (hi + lo)·B
and timed by CUDA-graph replay after an L2 flush, beside cuBLAS running the same arithmetic as one bf16 GEMM
([hi | lo] against [B; B]) and the hi half alone. Prints one table; with $OUT set, writes it as JSON there.
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
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

H, I = 2048, 768
# name -> (BLOCK_M, BLOCK_N, BLOCK_K, buffers, warps of the MMA partition, maxnreg)
VARIANTS = {
    "m128n256k64b2": (128, 256, 64, 2, 8, 168),
    "m128n256k32b4": (128, 256, 32, 4, 8, 168),
    "m128n128k64b4": (128, 128, 64, 4, 8, 168),
    "m128n128k64b4w4": (128, 128, 64, 4, 4, 232),
}


@gluon.jit
def load_partition(a_desc, a_lo_desc, b_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, k_steps,
                   A_K_MAJOR: gl.constexpr, WITH_LO: gl.constexpr):  # fmt: skip
    """One warp: for each K step, wait until the ring's next buffer is free, then load A (and A_lo) and B into it."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_K: gl.constexpr = b_desc.block_type.shape[0]
    STEP_BYTES: gl.constexpr = b_desc.block_type.nbytes + a_desc.block_type.nbytes * (1 + WITH_LO)
    for i in range(k_steps):
        slot = i % BUFFERS
        mbarrier.wait(empty.index(slot), ((i // BUFFERS) & 1) ^ 1)  # a fresh barrier counts as released
        bar = ready.index(slot)
        mbarrier.expect(bar, STEP_BYTES)
        k = i * BLOCK_K
        if A_K_MAJOR:  # A [M, K] row-major: tile [BLOCK_M, BLOCK_K]
            tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(slot))
            if WITH_LO:
                tma.async_copy_global_to_shared(a_lo_desc, [off_m, k], bar, a_lo_bufs.index(slot))
        else:  # A given as Aᵀ [K, M] row-major: tile [BLOCK_K, BLOCK_M], multiplied through a transposed view
            tma.async_copy_global_to_shared(a_desc, [k, off_m], bar, a_bufs.index(slot))
            if WITH_LO:
                tma.async_copy_global_to_shared(a_lo_desc, [k, off_m], bar, a_lo_bufs.index(slot))
        tma.async_copy_global_to_shared(b_desc, [k, off_n], bar, b_bufs.index(slot))


@gluon.jit
def mma_partition(a_bufs, a_lo_bufs, b_bufs, ready, empty, c_desc, c_smem, off_m, off_n, k_steps,
                  A_K_MAJOR: gl.constexpr, WITH_LO: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    """The warpgroups: per K step acc += A·B (and A_lo·B), keep one step's MMAs in flight, free the step before."""
    BUFFERS: gl.constexpr = a_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
    for i in range(k_steps):
        slot = i % BUFFERS
        mbarrier.wait(ready.index(slot), (i // BUFFERS) & 1)
        if A_K_MAJOR:
            acc = warpgroup_mma(a_bufs.index(slot), b_bufs.index(slot), acc, is_async=True)
            if WITH_LO:
                acc = warpgroup_mma(a_lo_bufs.index(slot), b_bufs.index(slot), acc, is_async=True)
        else:
            acc = warpgroup_mma(a_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc, is_async=True)
            if WITH_LO:
                acc = warpgroup_mma(a_lo_bufs.index(slot).permute((1, 0)), b_bufs.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1 + WITH_LO, deps=(acc,))  # this step's MMAs may still run
        mbarrier.arrive(empty.index((i + BUFFERS - 1) % BUFFERS), count=1, pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def hilo_gemm_kernel(a_desc, a_lo_desc, b_desc, c_desc, K, A_K_MAJOR: gl.constexpr, WITH_LO: gl.constexpr,
                     BUFFERS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
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
    ready = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    k_steps = gl.cdiv(K, BLOCK_K)
    gl.warp_specialize([
        (mma_partition, (a_bufs, a_lo_bufs, b_bufs, ready, empty, c_desc, c_smem, off_m, off_n, k_steps, A_K_MAJOR,
                         WITH_LO, num_warps)),
        (load_partition, (a_desc, a_lo_desc, b_desc, a_bufs, a_lo_bufs, b_bufs, ready, empty, off_m, off_n, k_steps,
                          A_K_MAJOR, WITH_LO)),
    ], [1], [40])  # fmt: skip


def descriptors(a, a_lo, b, c, a_k_major: bool, block):
    block_m, block_n, block_k = block
    a_block = [block_m, block_k] if a_k_major else [block_k, block_m]

    def desc(tensor, shape):
        return TensorDescriptor.from_tensor(tensor, shape, gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16))

    return desc(a, a_block), desc(a_lo if a_lo is not None else a, a_block), desc(b, [block_k, block_n]), \
        desc(c, [block_m, block_n])  # fmt: skip


def hilo_gemm(a, a_lo, b, c, *, a_k_major: bool, variant: str):
    """c = a·b (+ a_lo·b); ``a`` [M, K] when ``a_k_major``, else given as aᵀ [K, M]; all bf16, row-major."""
    block_m, block_n, block_k, buffers, warps, maxnreg = VARIANTS[variant]
    a_desc, a_lo_desc, b_desc, c_desc = descriptors(a, a_lo, b, c, a_k_major, (block_m, block_n, block_k))
    K = a.shape[1] if a_k_major else a.shape[0]
    grid = (triton.cdiv(c.shape[0], block_m) * triton.cdiv(c.shape[1], block_n),)
    hilo_gemm_kernel[grid](a_desc, a_lo_desc, b_desc, c_desc, K, a_k_major, int(a_lo is not None), buffers,
                           num_warps=warps, maxnreg=maxnreg)  # fmt: skip
    return c


def products(T: int):
    """The two products' shapes: name -> (M, N, K, A K-major)."""
    return {"dWgu": (2 * I, H, T, False), "dx": (T, H, 2 * I, True)}


def compile_only() -> None:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon._runtime import GluonASTSource

    from moe_lib.bench.sm90 import HOPPER, resources, sass_counts

    T = 256
    print(f"{'variant':18s} {'product':5s} {'lo':3s} resources")
    for variant, (block_m, block_n, block_k, buffers, warps, maxnreg) in VARIANTS.items():
        for product, (M, N, K, a_k_major) in products(T).items():
            a = torch.empty((M, K) if a_k_major else (K, M), dtype=torch.bfloat16)
            b = torch.empty((K, N), dtype=torch.bfloat16)
            c = torch.empty((M, N), dtype=torch.bfloat16)
            descs = descriptors(a, a, b, c, a_k_major, (block_m, block_n, block_k))
            for with_lo in (1, 0):
                names = ["a_desc", "a_lo_desc", "b_desc", "c_desc"]
                signature = {n: native_specialize_impl(BaseBackend, d, False, True, True)[0]
                             for n, d in zip(names, descs, strict=True)}  # fmt: skip
                signature.update(K="i32", A_K_MAJOR="constexpr", WITH_LO="constexpr", BUFFERS="constexpr",
                                 num_warps="constexpr")  # fmt: skip
                constexprs = {"A_K_MAJOR": a_k_major, "WITH_LO": with_lo, "BUFFERS": buffers, "num_warps": warps}
                source = GluonASTSource(hilo_gemm_kernel, signature, constexprs)
                try:
                    compiled = triton.compile(source, target=HOPPER,
                                              options=dict(num_warps=warps, maxnreg=maxnreg))  # fmt: skip
                    sass = sass_counts(compiled, ["HGMMA", "UTMALDG", "UTMASTG", "SYNCS"])
                    report = f"{resources(compiled)} HGMMA={sass['HGMMA']} UTMALDG={sass['UTMALDG']}"
                except Exception as exc:  # report and go on
                    lines = [line for line in str(exc).splitlines() if line.strip()]
                    report = "FAIL " + (lines[-1] if lines else type(exc).__name__)[:300]
                print(f"{variant:18s} {product:5s} {with_lo:3d} {report}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--tokens", default="2447,8192")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    if args.compile_only:
        return compile_only()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --compile-only)")
    from moe_lib.bench import timing

    flush = timing.L2Flusher("cuda")
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
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
            for variant in args.variants.split(","):
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
