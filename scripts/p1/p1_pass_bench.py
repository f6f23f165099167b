"""The fast path's dSwiGLU pass alone: our kernel's [tokens, I] blocks beside Inductor's fused kernel.

    PYTHONPATH=. python scripts/p1/p1_pass_bench.py [--tokens 128,512,1321,4093,8192] [--variants ...]

On a GPU, per token count, from P1's inputs and dA = dy · Wd (fp32, as the fast path keeps it below 1024 tokens,
or bf16 above): every variant writes [dGate | dUp] rows into memory poisoned with NaN, is checked against the
float64 pass (each element within one bf16 rounding of it), then timed by CUDA-graph replay after an L2 flush
(median of 50). ``inductor`` is ``torch.compile`` of the same pass in PyTorch (what ``torch_compile``'s call
runs between its GEMMs). Prints one table of µs; with $OUT set, writes it as JSON.
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from moe_lib import problems
from moe_lib.bench import timing
from moe_lib.bench.peers.swiglu_down import swiglu_grads_eager
from moe_lib.bench.provenance import recorded_commit
from moe_lib.bench.tuning import write_out
from moe_lib.swiglu_down import kernels
from moe_lib.swiglu_down.designs.library_gemms import D_A_16BIT_MIN_TOKENS
from moe_lib.tiling import cdiv

# name: ((BLOCK_T, BLOCK_I), warps) of swiglu_grads_kernel (LibraryGemmsConfig.grads_block, grads_warps). The pass by
# flat runs of elements measured here before (notes/p1/design-07.md) was removed: its code is at 1051632
VARIANTS = {
    "blocks16x128_w4": ((16, 128), 4),  # the default
    "blocks8x256_w4": ((8, 256), 4),
    "blocks32x256_w8": ((32, 256), 8),
    "blocks4x256_w2": ((4, 256), 2),
}


def run_variant(spec, d_a, saved, out):
    block, warps = spec
    T, I = d_a.shape
    grid = (cdiv(T, block[0]), cdiv(I, block[1]))
    kernels.swiglu_grads_kernel[grid](d_a, *saved, out, T, I, *block, False, num_warps=warps)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,512,1321,4093,8192")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="names from VARIANTS, comma-separated")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("p1_pass_bench.py: needs a CUDA GPU")
    problem = problems.load("swiglu_down_backward")
    flush = timing.L2Flusher("cuda")
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        inputs = problem.make_inputs(T, seed=T + 7, device="cuda")
        product = inputs["grad_output"].float() @ inputs["down_weight"].float()
        d_a = product if T < D_A_16BIT_MIN_TOKENS else product.to(torch.bfloat16)
        saved = [inputs[name] for name in ("gate", "gate_sigmoid", "gate_silu", "up")]
        exact = swiglu_grads_eager(d_a.double(), *(t.double() for t in saved))  # float64 throughout
        bound = exact.abs() * 2.0**-8 + exact.abs().max() * 2.0**-20  # one bf16 rounding, and fp32 cancellation
        torch._dynamo.reset()
        compiled = torch.compile(swiglu_grads_eager, dynamic=False)
        calls = {"inductor": lambda: compiled(d_a, *saved)}
        out = torch.empty((T, 2 * d_a.shape[1]), dtype=torch.bfloat16, device="cuda")
        for name in names:
            calls[name] = lambda spec=VARIANTS[name]: run_variant(spec, d_a, saved, out)
        for name, call in calls.items():
            out.fill_(float("nan"))  # poison: every element must be written
            result = call()
            torch.cuda.synchronize()
            error = (result.double() - exact).abs()
            ok = bool(torch.isfinite(result).all()) and bool((error <= bound).all())
            us = timing.graph_median_ms(call, flush, reps=50) * 1e3 if ok else float("nan")
            rows.append(dict(T=T, variant=name, us=round(us, 2), ok=ok, max_error=float(error.max())))
    table = pd.DataFrame(rows)
    print(table.pivot(index="T", columns="variant", values="us").to_string())
    if not table.ok.all():
        print("WRONG:", table[~table.ok].to_string())
    write_out(
        "p1_pass_bench.json",
        dict(
            what="P1 fast path's dSwiGLU pass alone (scripts/p1/p1_pass_bench.py)", commit=recorded_commit(), rows=rows
        ),
    )
    return 0 if table.ok.all() else 1


if __name__ == "__main__":
    raise SystemExit(main())
