"""Which representations of dGate and dUp keep P1's dx, dWg and dWu within the benchmark's element rule?

    PYTHONPATH=. python scripts/p1/p1_precision_simulation.py [--tokens 1087,8192] [--scales 1,4,16] [--seed 0]

A float64 simulation on the CPU (``moe_lib.lab.derivations.representation_pass_fractions``, which notebook 01
shows at one size): inputs as NVIDIA's harness draws them (std-1 activations, bf16), the activations multiplied
by each of ``--scales`` (as the outputs grow, the rule's 0.01 absolute term covers less and it asks for
relative accuracy alone); dGate and dUp exact, then represented as bf16, fp16, a bf16 hi/lo pair (today's
faithful path) or a bf16 hi with an fp8 e4m3 lo half; dx, dWg, dWu exact from the represented operands,
rounded to bf16, and the fraction of their elements within |out − ref| ≤ 0.01 + 0.01·|ref| (the benchmark
needs ≥ 99%). Prints one table; with $OUT set, writes it and its provenance as JSON there.
"""

from __future__ import annotations

import argparse

import torch

from moe_lib.bench.provenance import git_commit, git_dirty
from moe_lib.bench.tuning import write_out
from moe_lib.lab.derivations import representation_pass_fractions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1087,8192", help="comma list of token counts")
    parser.add_argument("--scales", default="1", help="comma list of activation scales (1: the harness's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    scales = [float(s) for s in args.scales.split(",")]
    rows = [row for t in args.tokens.split(",") for row in representation_pass_fractions(int(t), scales, args.seed)]
    columns = [k for k in rows[0] if k.endswith("pass")]
    print(f"{'T':>6s} {'scale':>5s} {'representation':16s} {'work':>4s} " + " ".join(f"{k:>10s}" for k in columns))
    for row in rows:
        passes = " ".join(f"{row[k]:10.4%}" for k in columns)
        print(f"{row['tokens']:6d} {row['scale']:5g} {row['representation']:16s} {row['tensor work']:4g} {passes}")
    provenance = dict(
        git_commit=git_commit(),
        git_dirty=git_dirty(),
        torch=torch.__version__,
        command=f"scripts/p1/p1_precision_simulation.py --tokens {args.tokens} --scales {args.scales} "
        f"--seed {args.seed}",
    )
    write_out("p1_precision_simulation.json", dict(provenance=provenance, rows=rows))


if __name__ == "__main__":
    main()
