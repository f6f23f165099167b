"""Which outputs of P2's fp32 interface fall outside the element rule at a model's shape, on the CPU.

    PYTHONPATH=. python scripts/p2/fp32_precision_emulation.py [--model Mixtral-8x7B] [--tokens 4096] [--expert 0]
        [--seed 0]

One expert's slots of the model suite's fp32 inputs (``moe_lib.bench.models``), its outputs computed in float64 and
in the arithmetic of the fp32 path (``notes/p2/design-01.md``): g, u and Wdᵀ·dy exact (bf16×3 on the GPU), every
other product on operands rounded to bf16 (fp32 accumulation, whose error is far below the operands' rounding);
each output's share of elements within the problem's element rule (atol 0.11, rtol 1e-5), its RMS and relative
error. Then the weight gradients two other ways: operands rounded to TF32 (10 mantissa bits, as wgmma's tf32 form
takes them) and bf16×3 (hi·hi + hi·lo + lo·hi). grad_x is one slot's share (a token sums K of them). Needs memory
for the model's fp32 inputs (Mixtral: 5.6 GB) and about a minute on two cores.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from moe_lib import problems
from moe_lib.bench.models import MODEL_SHAPES

RULE = dict(atol=0.11, rtol=1e-5)  # data/problems/moe_experts_backward: the element rule
F64 = torch.float64


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(F64)


def tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to 10 explicit mantissa bits (half-way cases away from zero: an estimate, not the hardware's)."""
    bits = t.to(torch.float32).view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(F64)


def bf16x3(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ah, bh = bf16(a), bf16(b)
    return ah @ bh + ah @ bf16(b - bh) + bf16(a - ah) @ bh


def judged(out: torch.Tensor, exact: torch.Tensor) -> dict:
    passing = ((out - exact).abs() <= RULE["atol"] + RULE["rtol"] * exact.abs()).double().mean().item()
    rel = ((out - exact).norm() / exact.norm()).item()
    return dict(rms=exact.pow(2).mean().sqrt().item(), rel=rel, passing=passing)


def main(argv=None) -> int:
    names = [m.name for m in MODEL_SHAPES if m.num_experts]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Mixtral-8x7B", choices=names)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--expert", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = next(m for m in MODEL_SHAPES if m.name == args.model)
    if args.tokens < 1:
        parser.error(f"--tokens: expected a positive integer, got {args.tokens}")
    if not 0 <= args.expert < shape.num_experts:
        parser.error(f"--expert: expected 0 to {shape.num_experts - 1} for {shape.name}, got {args.expert}")

    start = time.perf_counter()
    inputs = problems.load("moe_experts_backward").make_inputs(
        args.tokens, seed=args.seed, **shape.axes("moe_experts_backward")
    )
    token, k = (inputs["topk_indices"] == args.expert).nonzero().unbind(1)
    x, dy = inputs["hidden_states"][token].to(F64), inputs["grad_output"][token].to(F64)
    w = inputs["topk_weights"][token, k].to(F64)[:, None]
    wg, wu, wd = (inputs[name][args.expert].to(F64) for name in ("gate_weights", "up_weights", "down_weights"))
    del inputs
    g, u = x @ wg.T, x @ wu.T
    s = torch.sigmoid(g)
    a = g * s * u
    d_a = (dy @ wd) * w
    dg, du = d_a * u * s * (1 + g * (1 - s)), d_a * g * s
    exact = dict(
        grad_down_weights=(w * dy).T @ a,
        grad_gate_weights=dg.T @ x,
        grad_up_weights=du.T @ x,
        grad_x_of_a_slot=dg @ wg + du @ wu,
    )
    ours = dict(
        grad_down_weights=bf16(w * dy).T @ bf16(a),
        grad_gate_weights=bf16(dg).T @ bf16(x),
        grad_up_weights=bf16(du).T @ bf16(x),
        grad_x_of_a_slot=bf16(dg) @ bf16(wg) + bf16(du) @ bf16(wu),
    )
    print(f"{shape.name}, {args.tokens} tokens, expert {args.expert}: {len(token)} slots; the rule {RULE}")
    print(f"{'output':20s} {'products':8s} {'rms':>9s} {'rel. error':>10s} {'passing':>9s}")
    for name in exact:
        rows = [("bf16", ours[name])]
        if name == "grad_down_weights":
            rows += [("tf32", tf32(w * dy).T @ tf32(a)), ("bf16×3", bf16x3((w * dy).T, a))]
        if name == "grad_gate_weights":
            rows += [("tf32", tf32(dg).T @ tf32(x)), ("bf16×3", bf16x3(dg.T, x))]
        for how, out in rows:
            j = judged(out, exact[name])
            print(f"{name:20s} {how:8s} {j['rms']:9.3f} {j['rel']:10.2e} {j['passing']:9.4%}")
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
