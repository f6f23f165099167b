"""Which outputs of P2's fp32 interface fall outside the element rule at a model's shape, on the CPU; and the sweep
behind kernel W's precision rule (``moe_lib.moe_experts.choose.weight_grad_products``).

    PYTHONPATH=. python scripts/p2/fp32_precision_emulation.py [--model Mixtral-8x7B] [--tokens 4096] [--expert 0]
        [--seed 0]
    PYTHONPATH=. python scripts/p2/fp32_precision_emulation.py --sweep [--sweep-tokens 512,2048,4096,8192,32768]
        [--columns 256] [--seed 0]

One expert (default). One expert's slots of the model suite's fp32 inputs (``moe_lib.bench.models``), its outputs
computed in float64 and in the arithmetic of the fp32 path (``notes/p2/design-01.md``): g, u and Wdᵀ·dy exact (bf16×3
on the GPU), every other product on operands rounded to bf16 (fp32 accumulation, whose error is far below the
operands' rounding); each output's share of elements within the problem's element rule (atol 0.11, rtol 1e-5), its
RMS and relative error. Then the weight gradients two other ways: operands rounded to TF32 (10 mantissa bits, as
wgmma's tf32 form takes them) and bf16×3 (hi·hi + hi·lo + lo·hi). grad_x is one slot's share (a token sums K of them).
Needs memory for the model's fp32 inputs (Mixtral: 5.6 GB) and about a minute on two cores.

Sweep (``--sweep``). Every model shape with experts, and the problem's own, at each token count: one expert's
T·K/E rows (the mean of the benchmark's uniform routing) drawn as the problem draws its inputs, the weight gradients
on ``--columns`` of I and of H (every row of the expert, so each element is exact; a share over 65536 elements at the
default), kernel W's plain bf16 products and its bf16×3 ones against float64. Per case the worst of the three
weight gradients: the rule's z and predicted share (``moe_lib.moe_experts.precision_rule``: from the shape alone),
the share the error model predicts from the drawn operands themselves (a Gaussian per element with the variance
2δ²·Σ_p a_pi²·b_pj²), the emulated shares, the emulated output RMS over the predicted one, and the rule's pick.
Seconds on two cores (notes/p2/fp32-precision-rule.md).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from moe_lib import problems
from moe_lib.bench.models import MODEL_SHAPES
from moe_lib.moe_experts.choose import weight_grad_products
from moe_lib.moe_experts.inputs import WEIGHT_STD
from moe_lib.moe_experts.precision_rule import BF16_ROUNDING, bf16_margin, operand_rms, predicted_pass_share
from moe_lib.precision import silu_grad

RULE = dict(atol=0.11, rtol=1e-5)  # data/problems/moe_experts_backward: the element rule
F64 = torch.float64
SWEEP_TOKENS = (512, 2048, 4096, 8192, 32768)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(F64)


def tf32(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to 10 explicit mantissa bits (half-way cases away from zero: an estimate, not the hardware's)."""
    bits = t.to(torch.float32).view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32).to(F64)


def bf16x3(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ah, bh = bf16(a), bf16(b)
    return ah @ bh + ah @ bf16(b - bh) + bf16(a - ah) @ bh


def passing_share(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out - exact).abs() <= RULE["atol"] + RULE["rtol"] * exact.abs()).double().mean().item()


def judged(out: torch.Tensor, exact: torch.Tensor) -> dict:
    rel = ((out - exact).norm() / exact.norm()).item()
    return dict(rms=exact.pow(2).mean().sqrt().item(), rel=rel, passing=passing_share(out, exact))


def one_expert(args, shape) -> None:
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
    rows = args.tokens * shape.top_k / shape.num_experts
    predicted = predicted_pass_share(rows, shape.hidden_size, shape.top_k)
    print(f"{shape.name}, {args.tokens} tokens, expert {args.expert}: {len(token)} slots; the rule {RULE}")
    print(
        f"precision rule at {rows:g} rows per expert: z = {bf16_margin(rows, shape.hidden_size, shape.top_k):.2f}, "
        f"kernel W multiplies {products_of(shape, args.tokens)}"
    )
    print(f"{'output':20s} {'products':8s} {'rms':>9s} {'rel. error':>10s} {'passing':>9s} {'rule predicts':>13s}")
    for name in exact:
        rows_out = [("bf16", ours[name])]
        if name == "grad_down_weights":
            rows_out += [("tf32", tf32(w * dy).T @ tf32(a)), ("bf16×3", bf16x3((w * dy).T, a))]
        if name == "grad_gate_weights":
            rows_out += [("tf32", tf32(dg).T @ tf32(x)), ("bf16×3", bf16x3(dg.T, x))]
        for how, out in rows_out:
            j = judged(out, exact[name])
            guess = f"{predicted[name]:13.4%}" if how == "bf16" and name in predicted else ""
            print(f"{name:20s} {how:8s} {j['rms']:9.3f} {j['rel']:10.2e} {j['passing']:9.4%} {guess}")
    print(f"({time.perf_counter() - start:.0f} s)")


def products_of(shape, tokens: int) -> str:
    slots = tokens * shape.top_k
    return weight_grad_products(slots, shape.num_experts, shape.hidden_size, torch.float32, top_k=shape.top_k)


def emulate_expert(rows: int, hidden: int, inter: int, top_k: int, columns: int, generator) -> dict:
    """One expert of ``rows`` rows drawn as the problem draws its inputs; per weight gradient on ``columns`` of I and
    H: (exact, plain bf16 products as kernel W makes them, bf16×3, the error model's per-element variance)."""

    def draw(*size, std=1.0):  # fp32 values, as the inputs are
        return (torch.randn(size, generator=generator, dtype=torch.float32) * std).to(F64)

    i_cols, h_cols = min(inter, columns), min(hidden, columns)
    x, dy = draw(rows, hidden), draw(rows, hidden)
    w = torch.softmax(draw(rows, top_k), dim=1)[:, :1]
    wg, wu = draw(i_cols, hidden, std=WEIGHT_STD), draw(i_cols, hidden, std=WEIGHT_STD)
    wd = draw(hidden, i_cols, std=WEIGHT_STD)
    g, u, dap = x @ wg.T, x @ wu.T, dy @ wd
    silu = g * torch.sigmoid(g)
    dg, du = w * dap * u * silu_grad(g), w * dap * silu
    aw = w * silu * u
    x_cols, dy_cols = x[:, :h_cols], dy[:, :h_cols]
    out = {}
    for name, a, b in (
        ("grad_gate_weights", dg, x_cols),
        ("grad_up_weights", du, x_cols),
        ("grad_down_weights", dy_cols, aw),
    ):
        variance = 2 * BF16_ROUNDING**2 * (a.square().T @ b.square())  # both operands' roundings, per element
        out[name] = (a.T @ b, bf16(a).T @ bf16(b), bf16x3(a.T, b), variance)
    return out


def sweep(args) -> None:
    start = time.perf_counter()
    sizes = problems.load("moe_experts_backward").sizes(1)
    shapes = [
        (m.name, m.hidden_size, m.intermediate_size, m.num_experts, m.top_k) for m in MODEL_SHAPES if m.num_experts
    ]
    shapes.append(
        ("P2 (the problem)", sizes["hidden_size"], sizes["intermediate_size"], sizes["num_experts"], sizes["top_k"])
    )
    generator = torch.Generator().manual_seed(args.seed)
    print(
        f"one expert per case, {args.columns} columns of I and of H; worst weight gradient; rule {RULE}; "
        f"δ = {BF16_ROUNDING:.3e}"
    )
    print(
        f"{'shape':17s} {'T':>6s} {'rows':>5s} {'z':>6s} {'rule pred.':>10s} {'model':>9s} {'bf16':>9s} "
        f"{'bf16×3':>8s} {'rms/pred':>8s} {'rule picks':>10s}"
    )
    for name, H, I, E, K in shapes:
        for tokens in args.sweep_tokens:
            rows = max(1, round(tokens * K / E))
            emulated = emulate_expert(rows, H, I, K, args.columns, generator)
            model, plain, split, ratio = [], [], [], []
            for output, (exact, bf, x3, variance) in emulated.items():
                plain.append(passing_share(bf, exact))
                split.append(passing_share(x3, exact))
                model.append(torch.erf(RULE["atol"] / (2 * variance).sqrt()).mean().item())
                ratio.append(exact.square().mean().sqrt().item() / (math.sqrt(rows) * operand_rms(H, K)[output]))
            z = bf16_margin(rows, H, K)
            predicted = min(predicted_pass_share(rows, H, K).values())
            picks = weight_grad_products(tokens * K, E, H, torch.float32, top_k=K)
            print(
                f"{name:17s} {tokens:6d} {rows:5d} {z:6.2f} {predicted:10.4%} {min(model):9.4%} {min(plain):9.4%} "
                f"{min(split):8.3%} {min(ratio):4.2f}-{max(ratio):4.2f} {picks:>10s}",
                flush=True,
            )
    print(f"({time.perf_counter() - start:.0f} s)")


def main(argv=None) -> int:
    names = [m.name for m in MODEL_SHAPES if m.num_experts]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="Mixtral-8x7B", choices=names)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--expert", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="every model shape and token count, one expert each")
    parser.add_argument("--sweep-tokens", default=",".join(map(str, SWEEP_TOKENS)), help="token counts of --sweep")
    parser.add_argument("--columns", type=int, default=256, help="columns of I and of H per case of --sweep")
    args = parser.parse_args(argv)
    shape = next(m for m in MODEL_SHAPES if m.name == args.model)
    if args.tokens < 1:
        parser.error(f"--tokens: expected a positive integer, got {args.tokens}")
    if not 0 <= args.expert < shape.num_experts:
        parser.error(f"--expert: expected 0 to {shape.num_experts - 1} for {shape.name}, got {args.expert}")
    text = args.sweep_tokens
    args.sweep_tokens = [int(t) for t in text.split(",") if t.strip().isdigit()]
    if len(args.sweep_tokens) != len(text.split(",")) or min(args.sweep_tokens) < 1:
        parser.error(f"--sweep-tokens: expected a comma list of positive integers, got {text!r}")
    if args.columns < 1:
        parser.error(f"--columns: expected a positive integer, got {args.columns}")
    if args.sweep:
        sweep(args)
    else:
        one_expert(args, shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
