"""Which representations of dGate and dUp keep P1's dx, dWg and dWu within the benchmark's element rule?

    PYTHONPATH=. python scripts/p1_precision_simulation.py [--tokens 1087,8192] [--scales 1,8] [--seed 0]

A float64 simulation on the CPU, on the inputs NVIDIA's harness draws (std-1 activations, bf16): dGate and
dUp are computed exactly from the bf16 inputs, then represented one way or another; the products dx =
dGate·Wg + dUp·Wu, dWg = dGateᵀ·x and dWu = dUpᵀ·x are taken exactly (float64, a stand-in for the tensor
cores' fp32 accumulation, whose own error is far smaller than these roundings) from the represented
operands, rounded to bf16 like the outputs, and checked against the exact outputs with the element rule
|out − ref| ≤ 0.01 + 0.01·|ref| (the fraction of elements that pass; the benchmark needs ≥ 99%).

Representations (each costs tensor work in units of one bf16 product per GEMM):
  bf16           dG rounded to bf16 (the fast path, 1 unit)
  fp16           dG rounded to fp16 (the operands in fp16 too: bf16 → fp16 is exact at these scales; 1 unit)
  bf16 hi/lo     dG ≈ hi + lo, both bf16 (today's faithful path, 2 units)
  hi + fp8 lo    hi in bf16, lo = dG − hi in fp8 e4m3 scaled per column of the output (per I for dWg, dWu;
                 per token for dx), multiplied by an fp8 copy of x or of the weights scaled per output column:
                 1 unit + 1 fp8 product at twice the bf16 rate (1.5 units)
  hi + fp8 lo, bf16 operand   the same lo against the bf16 x or weights (what the lo rounding alone costs)
``--scales``: the activations (x, dy and the saved tensors) multiplied by each factor before rounding to bf16:
as the outputs grow, the rule's 0.01 absolute term covers less and it asks for relative accuracy alone.
Prints one table; with $OUT set, writes it as JSON there.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from moe_lib import problems
from moe_lib.bench.provenance import git_commit, git_dirty

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def fp8(v: torch.Tensor, dim: int | None) -> torch.Tensor:
    """v through fp8 e4m3 with one power-of-two scale per slice along ``dim`` (None: one for the whole
    tensor), back in float64: what an fp8 operand with its scale outside the product carries."""
    amax = v.abs().amax() if dim is None else v.abs().amax(dim=dim, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax.clamp_min(1e-300))))
    return (v * scale).to(torch.float8_e4m3fn).to(torch.float64) / scale


def bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).to(torch.float64)


def representations(dg: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """name -> (dx term dg·w, dW term dgᵀ·x) under each representation of dg ([T, I]); x [T, H], w [I, H]."""
    hi = bf16(dg)
    lo = dg - hi
    out = {
        "bf16": (hi @ w, hi.T @ x),
        "fp16": (dg.to(torch.float16).double() @ w.to(torch.float16).double(),
                 dg.to(torch.float16).double().T @ x.to(torch.float16).double()),  # fmt: skip
        "bf16 hi/lo": ((hi + bf16(lo)) @ w, (hi + bf16(lo)).T @ x),
    }
    # dx = dg · w reduces over I: scales per token (rows of dg) and per column of w (H); dW = dgᵀ · x reduces
    # over T: scales per I (columns of dg) and per H (columns of x)
    lo_dx, lo_dw = fp8(lo, dim=1), fp8(lo, dim=0)
    out["hi + fp8 lo"] = (hi @ w + lo_dx @ fp8(w, dim=0), hi.T @ x + lo_dw.T @ fp8(x, dim=0))
    out["hi + fp8 lo, bf16 operand"] = (hi @ w + lo_dx @ w, hi.T @ x + lo_dw.T @ x)
    return out


def simulate(num_tokens: int, scale: float, seed: int) -> list[dict]:
    problem = problems.load("swiglu_down_backward")
    inputs = problem.make_inputs(num_tokens, seed=seed, dtype=torch.float32, distribution="harness")
    weights = ("gate_weight", "up_weight", "down_weight")
    v = {name: bf16(t.double() * (1 if name in weights else scale)) for name, t in inputs.items()}
    d_a = v["grad_output"] @ v["down_weight"]  # [T, I]
    s = v["gate_sigmoid"]
    d_gate = d_a * s * (1 + v["gate"] * (1 - s)) * v["up"]
    d_up = d_a * v["gate_silu"]
    gate_terms = representations(d_gate, v["x"], v["gate_weight"])
    up_terms = representations(d_up, v["x"], v["up_weight"])
    exact = {"dx": d_gate @ v["gate_weight"] + d_up @ v["up_weight"], "dWg": d_gate.T @ v["x"],
             "dWu": d_up.T @ v["x"]}  # fmt: skip
    rule = problem.element_rule
    rows = []
    for name in gate_terms:
        got = {"dx": gate_terms[name][0] + up_terms[name][0], "dWg": gate_terms[name][1], "dWu": up_terms[name][1]}
        row = {"tokens": num_tokens, "scale": scale, "representation": name}
        for output, ref in exact.items():
            out = bf16(got[output])
            ok = (out - ref).abs() <= rule["atol"] + rule["rtol"] * ref.abs()
            row[f"{output} pass"] = ok.double().mean().item()
            row[f"{output} rel err"] = ((out - ref).norm() / ref.norm()).item()
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1087,8192", help="comma list of token counts")
    parser.add_argument("--scales", default="1", help="comma list of activation scales (1: the harness's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [row for t in args.tokens.split(",") for scale in args.scales.split(",")
            for row in simulate(int(t), float(scale), args.seed)]  # fmt: skip
    columns = [k for k in rows[0] if k.endswith("pass")]
    print(f"{'T':>6s} {'scale':>5s} {'representation':28s} " + " ".join(f"{k:>12s}" for k in columns))
    for row in rows:
        passes = " ".join(f"{row[k]:12.4%}" for k in columns)
        print(f"{row['tokens']:6d} {row['scale']:5g} {row['representation']:28s} {passes}")
    if os.environ.get("OUT"):
        provenance = dict(git_commit=git_commit(), git_dirty=git_dirty(), torch=torch.__version__,
                          command=f"scripts/p1_precision_simulation.py --tokens {args.tokens} --scales {args.scales} "
                                  f"--seed {args.seed}")  # fmt: skip
        with open(os.path.join(os.environ["OUT"], "p1_precision_simulation.json"), "w") as f:
            json.dump(dict(provenance=provenance, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
