"""What would an fp8 lo half save the faithful path? cuBLAS's own bf16 and fp8 rates on P1's lo products.

    PYTHONPATH=. python scripts/p1/p1_fp8_lo_probe.py [--tokens 1087,2447,4093,8192] [--out DIR]

The faithful path carries dGate, dUp as a bf16 hi half and a bf16 lo half (the rounding error of hi), so the dx and
dWg ‖ dWu products run twice (notes/p1/faithful-arithmetic.md). An fp8 e4m3 lo
half against fp8 copies of the other operand passed the benchmark's element rule in that simulation; on Hopper an
fp8 product runs at up to twice the bf16 rate, but wgmma takes fp8 operands only K-major, so the lo half would be
stored for each product in the layout it needs and x and [Wg; Wu] copied to fp8 transposed. This probe times, the
benchmark's way (CUDA-graph replay, L2 flushed before each), the lo half's two products at T tokens (H 2048,
I 768) both ways on cuBLAS:

    dx   += lo · [Wg; Wu]       M=T,  N=H, K=2I    bf16: torch.mm       fp8: torch._scaled_mm (rowwise scales)
    dWgu += loᵀ · x             M=2I, N=H, K=T     bf16: torch.mm       fp8: torch._scaled_mm (rowwise scales)

(the copies an fp8 lo half would add, x to fp8 as xᵀ [H, T] and [Wg; Wu] as [H, 2I], are bound by their bytes and
not timed here). Each fp8 product is checked against the same product in float64 first (relative Frobenius error, which
fp8's 3 mantissa bits put near 2⁻⁵). Prints one table; writes it as CSV under ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from moe_lib import problems
from moe_lib.bench import timing

_SIZES = problems.load("swiglu_down_backward").sizes(0)
HIDDEN, INTERMEDIATE = _SIZES["hidden_size"], _SIZES["intermediate_size"]
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def to_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` [R, C] as fp8 with one fp32 scale per row (t ≈ q · scale), the rows' largest magnitude at FP8_MAX."""
    scale = t.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-30) / FP8_MAX
    return (t.float() / scale).to(FP8).contiguous(), scale


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def probe(num_tokens: int, flush) -> list[dict]:
    T, H, I = num_tokens, HIDDEN, INTERMEDIATE
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(2 * I, H, device="cuda", generator=g) / H**0.5).bfloat16()  # [Wg; Wu]
    lo = (torch.randn(T, 2 * I, device="cuda", generator=g) * 2.0**-9).bfloat16()  # a lo half's scale
    # K = T padded with zeros to a multiple of 16 for both ways of dWgu (as a kernel's TMA would fill them): cuBLAS's
    # fp8 products need it, and its bf16 ones fall back to slow kernels on rows of an odd length
    pad = -T % 16
    lo_t = torch.nn.functional.pad(lo.t(), (0, pad)).contiguous()  # [2I, T + pad]: K-major for dWgu
    x_padded = torch.nn.functional.pad(x, (0, 0, 0, pad))  # [T + pad, H] row-major, zeros past T

    # fp8 operands, each K-major: A [M, K] row-major, B given as Bᵀ [N, K] row-major (column-major B)
    lo8, lo_scale = to_fp8_rows(lo)  # [T, 2I], a scale per token
    lo_t8, lo_t_scale = to_fp8_rows(lo_t)  # [2I, T + pad], a scale per column of dGate, dUp
    w_t8, w_t_scale = to_fp8_rows(w.t().contiguous())  # [H, 2I], a scale per row of H
    x_t8, x_t_scale = to_fp8_rows(x_padded.t())  # [H, T + pad]

    products = {
        "dx lo (M=T, N=H, K=2I)": (
            lambda: torch.mm(lo, w),
            lambda: torch._scaled_mm(
                lo8, w_t8.t(), scale_a=lo_scale, scale_b=w_t_scale.t().contiguous(), out_dtype=torch.bfloat16
            ),
            lo.double() @ w.double(),
        ),
        "dWgu lo (M=2I, N=H, K=T)": (
            lambda: torch.mm(lo_t, x_padded),
            lambda: torch._scaled_mm(
                lo_t8, x_t8.t(), scale_a=lo_t_scale, scale_b=x_t_scale.t().contiguous(), out_dtype=torch.bfloat16
            ),
            lo_t.double() @ x_padded.double(),
        ),
    }
    rows = []
    for name, (bf16_call, fp8_call, want) in products.items():
        row = dict(
            T=T, product=name, bf16_error=relative_error(bf16_call(), want), fp8_error=relative_error(fp8_call(), want)
        )
        if not row["fp8_error"] < 0.1:
            raise AssertionError(f"{name} at T={T}: fp8 product off by {row['fp8_error']:.3g} (relative)")
        row["bf16_us"] = 1e3 * timing.graph_median_ms(bf16_call, flush)
        row["fp8_us"] = 1e3 * timing.graph_median_ms(fp8_call, flush)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1087,2447,4093,8192", help="comma-separated token counts")
    parser.add_argument("--out", type=Path, default=None, help="folder for p1_fp8_lo_probe.csv")
    args = parser.parse_args()
    if not all(t.strip().isdigit() and int(t) > 0 for t in args.tokens.split(",")):
        raise SystemExit(f"--tokens: expected a comma list of positive integers, got {args.tokens!r}")
    if not torch.cuda.is_available():
        raise SystemExit("p1_fp8_lo_probe: needs a CUDA GPU with fp8 products (Hopper or later)")
    tokens = [int(t) for t in args.tokens.split(",")]
    flush = timing.L2Flusher("cuda")
    table = pd.DataFrame([row for T in tokens for row in probe(T, flush)])
    table["fp8/bf16"] = table["fp8_us"] / table["bf16_us"]
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(table.round(4).to_string(index=False))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out / "p1_fp8_lo_probe.csv", index=False)


if __name__ == "__main__":
    main()
