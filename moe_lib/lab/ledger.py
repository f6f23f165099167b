"""Notebook 04: P2's backward as a ledger — what each step of today's decomposition must move and compute.

The problem's floor (notebook 03) counts every input read once and every output written once. A
decomposition into kernels pays more: each kernel reads what it needs and writes what the next one reads.
Here each step of :func:`moe_lib.moe_experts.launch.moe_experts_backward_triton` is costed by the same
convention, applied per step: every tensor the step touches read once and every tensor it produces
written once (perfect reuse inside a step, none between steps), and its tensor-core work. A step's floor
is max(bytes / bandwidth, FLOPs / bf16 rate); the sum over the steps is the floor of the decomposition,
whatever its kernels' speed. Against the problem's floor it shows what the decomposition itself costs:
the weight-sized passes (kernel A reads Wg, Wu and Wd, kernel W writes three gradients, kernel D reads
Wg and Wu again: eight, where the problem has six), the workspaces' round trips and the fp32 splits.

Sizes in bytes, work in FLOPs, times in ms (``*_ms``), as the column names say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from .. import problems, roofline
from ..moe_experts.choose import choose
from ..moe_experts.runtime import Target
from .results import OURS, RESULTS_DIR, ResultFile, ok_rows, resolve_path

OPERAND_BYTES = 2  # the tensor-core operands and kernel A's workspaces: bf16 (or fp16)
ACCUMULATOR_BYTES = 4  # dX per slot and the routing-weight partials: fp32
STEP_COLORS = {
    "split x, dy": "tab:gray",
    "A": "tab:orange",
    "gather": "tab:brown",
    "W": "tab:green",
    "D": "tab:red",
    "C": "tab:purple",
}


@dataclass(frozen=True)
class Step:
    """One step of the backward: the bytes it must read and write and the tensor-core FLOPs it does."""

    name: str
    does: str
    read_bytes: float
    written_bytes: float
    flops: float
    weight_passes: int = 0  # weight-sized tensors ([E, I, H] in the interface dtype) read or written

    def floor_ms(self, spec: roofline.GPUSpec) -> float:
        return 1e3 * max(
            (self.read_bytes + self.written_bytes) / spec.dram_bandwidth, self.flops / spec.bf16_dense_flops
        )

    def bound(self, spec: roofline.GPUSpec) -> str:
        memory = (self.read_bytes + self.written_bytes) / spec.dram_bandwidth
        return "memory" if memory >= self.flops / spec.bf16_dense_flops else "tensor"


def p2_backward_steps(
    num_tokens: int, dtype: str = "float32", *, weights_shared_by_a_and_d: bool = False, **axes
) -> list[Step]:
    """The steps of P2's backward at ``num_tokens`` with ``dtype`` inputs ("float32", "bfloat16" or
    "float16"), at the problem's shape unless ``axes`` override it. ``weights_shared_by_a_and_d`` costs a
    design in which kernel D takes Wg and Wu from kernel A's read instead of reading them again."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype: expected 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if num_tokens < 1:
        raise ValueError(f"num_tokens: expected a positive count, got {num_tokens}")
    sizes = problems.load("moe_experts_backward").sizes(num_tokens, **axes)
    T, H, I = sizes["num_tokens"], sizes["hidden_size"], sizes["intermediate_size"]
    E, K = sizes["num_experts"], sizes["top_k"]
    S = T * K  # routed slots
    split = dtype == "float32"  # fp32 inputs: x and dy as bf16 hi + lo halves, g, u and Wdᵀdy as bf16×3
    wb = 4 if split else 2  # bytes of an input, output or weight element
    ob, fb = OPERAND_BYTES, ACCUMULATOR_BYTES
    weight = E * I * H  # elements of one weight tensor
    choice = choose(S, E, H, I, getattr(torch, dtype), Target(), top_k=K)  # on the GPU: Hopper
    config = choice.config
    w_halves = 2 if choice.weight_grad_products == "bf16x3" else 1  # kernel W's operands: hi (and lo) halves
    i_tiles = -(-I // config.block_i)  # kernel A's I-tiles: one routing-weight partial per slot each
    halves = 2 if split else 1  # operand copies of x and dy that kernel A multiplies
    gemm = 2 * S * H * I  # FLOPs of one of the eight per-slot GEMMs
    steps = []
    if split:
        steps.append(
            Step("split x, dy", "x and dy split into bf16 hi + lo halves", 2 * T * H * wb, 2 * 2 * T * H * ob, 0)
        )
    steps.append(
        Step(
            "A",
            "g, u, Wdᵀdy recomputed per slot; dSwiGLU and the routing-weight partials in the epilogue",
            3 * weight * wb + 2 * halves * T * H * ob + S * wb,
            3 * w_halves * S * I * ob + i_tiles * S * fb,
            3 * gemm * (3 if split else 1),
            weight_passes=3,
        )
    )
    gathered = choice.weight_grad.name == "tma"  # kernel W on rows gathered into expert order
    if gathered:
        steps.append(
            Step(
                "gather",
                "x and dy rows gathered into expert order for kernel W's TMA loads",
                2 * w_halves * T * H * ob,
                2 * w_halves * S * H * ob,
                0,
            )
        )
    steps.append(
        Step(
            "W",
            "dWg, dWu, dWd: each expert's rows reduced into its weight gradients",
            w_halves * (3 * S * I * ob + 2 * (S if gathered else T) * H * ob),
            3 * weight * wb,
            3 * gemm * (3 if w_halves == 2 else 1),  # bf16×3: three products each
            weight_passes=3,
        )
    )
    d_weights = 0 if weights_shared_by_a_and_d else 2 * weight * wb
    steps.append(
        Step(
            "D",
            "dX per slot = Wgᵀdg + Wuᵀdu",
            d_weights + 2 * S * I * ob,
            S * H * fb,
            2 * gemm,
            weight_passes=0 if weights_shared_by_a_and_d else 2,
        )
    )
    steps.append(
        Step(
            "C",
            "dX and the routing-weight gradient summed per token in a fixed order",
            S * H * fb + i_tiles * S * fb,
            T * H * wb + S * wb,
            0,
        )
    )
    return steps


def decomposition_floor_ms(problem: str, num_tokens: int, spec: roofline.GPUSpec) -> float | None:
    """The floor of today's decomposition (the sum of :func:`p2_backward_steps`' floors) for a P2 ``problem``
    at ``num_tokens`` on ``spec``, in its interface dtype; None for a problem of another op."""
    definition = problems.load(problem)
    if definition.op != "moe_experts_backward":
        return None
    steps = p2_backward_steps(num_tokens, problems.dtype_name(definition.dtype))
    return sum(step.floor_ms(spec) for step in steps)


def ledger_table(num_tokens: int, dtype: str, spec: roofline.GPUSpec, **axes) -> pd.DataFrame:
    """One row per step of :func:`p2_backward_steps`: GB read and written, TFLOP, weight passes, floor (ms)
    and what bounds it, with a total row."""
    steps = p2_backward_steps(num_tokens, dtype, **axes)
    rows = {
        s.name: {
            "does": s.does,
            "read (GB)": s.read_bytes / 1e9,
            "written (GB)": s.written_bytes / 1e9,
            "TFLOP": s.flops / 1e12,
            "weight passes": s.weight_passes,
            "floor (ms)": s.floor_ms(spec),
            "bound by": s.bound(spec),
        }
        for s in steps
    }
    table = pd.DataFrame.from_dict(rows, orient="index")
    total = table[["read (GB)", "written (GB)", "TFLOP", "weight passes", "floor (ms)"]].sum()
    table.loc["total"] = {**total.to_dict(), "does": "the decomposition's floor: the sum of the steps'", "bound by": ""}
    return table


def measured_ms(result: ResultFile | None, num_tokens: int, impl: str = OURS) -> float:
    """``impl``'s median ms at ``num_tokens`` in ``result`` (NaN where not measured)."""
    if result is None:
        return np.nan
    rows = ok_rows(result)
    rows = rows[(rows["impl"] == impl) & (rows["num_tokens"] == num_tokens)]
    return float(rows["median_ms"].iloc[0]) if len(rows) else np.nan


def case_target_ms(problem: str, num_tokens: int) -> float:
    """The time the problem's target at ``num_tokens`` asks for: a ``case_ms`` target's, or the time a
    ``case_tflops`` target's rate gives the problem's FLOPs (NaN where it sets neither)."""
    definition = problems.load(problem)
    for target in definition.targets:
        if target.get("num_tokens") != num_tokens:
            continue
        if target.get("kind") == "case_ms":
            return float(target["at_most"])
        if target.get("kind") == "case_tflops":
            return 1e3 * definition.flops(num_tokens) / (float(target["at_least"]) * 1e12)
    return np.nan


def summary_table(cases, spec: roofline.GPUSpec, results: dict[str, ResultFile | None]) -> pd.DataFrame:
    """Per (dtype, tokens) case: the problem's floor, the decomposition's floor (today's, and with D taking
    Wg, Wu from A's read), the target where one is set, and our measured time; ``results`` maps a dtype
    name to the result file that measured it (or None)."""
    rows = []
    for dtype, num_tokens in cases:
        problem = "moe_experts_backward" if dtype == "float32" else "moe_experts_backward_bf16"
        today = sum(s.floor_ms(spec) for s in p2_backward_steps(num_tokens, dtype))
        shared = sum(s.floor_ms(spec) for s in p2_backward_steps(num_tokens, dtype, weights_shared_by_a_and_d=True))
        rows.append(
            {
                "dtype": dtype,
                "tokens": num_tokens,
                "problem floor (ms)": 1e3 * roofline.sol_time(problem, num_tokens, spec, dtype),
                "decomposition floor (ms)": today,
                "… D sharing A's weight read (ms)": shared,
                "target (ms)": case_target_ms(problem, num_tokens),
                "measured (ms)": measured_ms(results.get(dtype), num_tokens),
            }
        )
    return pd.DataFrame(rows).set_index(["dtype", "tokens"])


def ledger_figure(cases, spec: roofline.GPUSpec, summary: pd.DataFrame):
    """Each case's steps as stacked bars of their floors, in multiples of the problem's floor, with the
    target and the measured time marked: what the decomposition costs before any kernel is slow."""
    fig, ax = plt.subplots(figsize=(11, 0.6 * len(cases) + 1.4))
    labels = [f"{dtype} · {tokens} tokens" for dtype, tokens in cases]
    seen = set()
    for y, (dtype, num_tokens) in enumerate(cases):
        unit = summary.loc[(dtype, num_tokens), "problem floor (ms)"]
        left = 0.0
        for step in p2_backward_steps(num_tokens, dtype):
            width = step.floor_ms(spec) / unit
            ax.barh(
                y,
                width,
                left=left,
                color=STEP_COLORS[step.name],
                edgecolor="white",
                label=None if step.name in seen else f"step {step.name}",
            )
            seen.add(step.name)
            left += width
        for column, marker, color, text in (
            ("target (ms)", "|", "black", "target"),
            ("measured (ms)", "x", "crimson", "measured (ours)"),
        ):
            value = summary.loc[(dtype, num_tokens), column]
            if np.isfinite(value):
                ax.scatter(
                    value / unit, y, marker=marker, s=220, color=color, zorder=3, label=None if text in seen else text
                )
                seen.add(text)
    ax.axvline(1.0, color="grey", ls=":", label="the problem's floor")
    ax.set_yticks(range(len(cases)), labels)
    ax.invert_yaxis()
    ax.set(
        xlabel="multiples of the problem's floor (each step at its own floor: bytes / bandwidth or FLOPs / rate)",
        title=f"P2's backward, step by step (ceilings: {spec.name})",
    )
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------------
# P1: the floor of each arithmetic, case by case

# GEMM work of P1's backward per arithmetic, in units of T·H·I FLOPs (bf16-rate equivalents): six products
# of 2·T·H·I each; the faithful path multiplies dGate, dUp twice (hi and lo) in dx, dWg and dWu (+8); with an
# fp8 lo half those second products run at twice the rate (+4)
P1_ARITHMETIC = {"fast (bf16 dGate, dUp)": 12, "faithful, bf16 hi + fp8 lo": 16, "faithful, bf16 hi/lo": 20}


def p1_floor_table(
    spec: roofline.GPUSpec, result: ResultFile | None = None, launch_floor_us: float = 0.0, tokens=None
) -> pd.DataFrame:
    """Per P1 case (the suite unless ``tokens``): its floor in µs under each of :data:`P1_ARITHMETIC` — max(bytes
    / bandwidth, work / bf16 rate) at ``spec``, plus ``launch_floor_us`` (what one launch costs in the timing
    method at hand) — and, from ``result``, the measured graph-replay µs of the fast (``triton_fast``) and
    faithful (``triton``) paths; a last row holds the geomeans."""
    problem = problems.load("swiglu_down_backward")
    rows = {}
    for num_tokens in sorted(tokens or problem.suite):
        s = problem.sizes(num_tokens)
        work = num_tokens * s["hidden_size"] * s["intermediate_size"]
        moved = roofline.minimal_bytes("swiglu_down_backward", num_tokens)
        row = {
            name: 1e6 * max(moved / spec.dram_bandwidth, units * work / spec.bf16_dense_flops) + launch_floor_us
            for name, units in P1_ARITHMETIC.items()
        }
        row["measured fast"] = 1e3 * measured_ms(result, num_tokens, "triton_fast")
        row["measured faithful"] = 1e3 * measured_ms(result, num_tokens, OURS)
        rows[num_tokens] = row
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "tokens"
    table.loc["geomean"] = np.exp(np.log(table).mean())  # NaN where a case was not measured
    return table


# cuBLAS's bf16 and fp8 products on the faithful path's lo half, by graph replay (scripts/p1/p1_fp8_lo_probe.py)
FP8_LO_PROBE = RESULTS_DIR / "H200" / "tuning" / "2026-12-03-p1-fp8-lo-probe.json"
FP8_BYTES = 1


def p1_fp8_lo_table(spec: roofline.GPUSpec, result: ResultFile | None, path=FP8_LO_PROBE) -> pd.DataFrame:
    """Per token count of the probe at ``path``: what an fp8 lo half would save the faithful path, at best.

    The lo half's two products (dx += lo·[Wg; Wu], dWg‖dWu += loᵀ·x) as cuBLAS runs them in bf16 and in fp8 (µs),
    against the copies fp8 operands would add each call, at ``spec``'s bandwidth: x as fp8 xᵀ (T·H read in bf16,
    written in fp8) and [Wg; Wu] as fp8 (2I·H the same way); the lo half itself is written in fp8 in the two layouts
    the products need, as many bytes as today's bf16 lo half. "net" is the change of the call (negative: faster);
    "share" that change against the faithful path measured in ``result`` (graph replay, NaN where not measured)."""
    runs = json.loads(resolve_path(path).read_text())["runs"]
    probe = pd.DataFrame([row for run in runs for row in run["rows"]])
    sizes = problems.load("swiglu_down_backward").sizes(0)
    H, I = sizes["hidden_size"], sizes["intermediate_size"]
    table = probe.groupby("T")[["bf16_us", "fp8_us"]].sum()
    table.index.name = "tokens"
    copied = (OPERAND_BYTES + FP8_BYTES) * (table.index.to_numpy() * H + 2 * I * H)
    table["copies_us"] = 1e6 * copied / spec.dram_bandwidth
    table["net_us"] = table["fp8_us"] + table["copies_us"] - table["bf16_us"]
    table["faithful_us"] = [1e3 * measured_ms(result, int(num_tokens)) for num_tokens in table.index]
    table["share"] = table["net_us"] / table["faithful_us"]
    return table


def geomean_change(shares: pd.Series, cases: int) -> float:
    """The relative change of a geomean over ``cases`` cases when the cases in ``shares`` change by their share
    (e.g. −0.08: 8% faster) and the others not at all; a case that would get slower counts as unchanged (the
    design would not be used there)."""
    kept = np.minimum(shares.to_numpy(dtype=float), 0.0)
    return float(np.expm1(np.log1p(kept).sum() / cases))
