"""Notebook 04: what each rung of the lesson costs — bytes, FLOPs, the time the roofline predicts, the time measured.

The lesson climbs, for each problem, from a naive kernel to the Hopper-native ones. Each rung is costed the way
Triton's fused-softmax tutorial costs its kernels: count the bytes it moves and the FLOPs it does at the benchmark's
shape, predict its time as max(bytes / bandwidth, FLOPs / rate) with the ceilings the committed runs measured, then
set the committed measurements beside the prediction where there are any.

    P1   :func:`p1_rung_costs` (the teaching kernels' dA + dSwiGLU: naive, tiled, fused), :func:`p1_rungs_figure`
         (what one program of each touches), :func:`p1_launch2_ladder` (launch 2 in Triton, in Gluon and on cuBLAS,
         measured), :func:`p1_call_ladder` (the whole faithful call, Triton launches against Gluon launches)
    P2   :func:`p2_rung_costs` (the recomputed gate projection per expert from the host, or grouped in one launch),
         :func:`p2_tma_ladder` (kernels W and D pointer-based against TMA-fed, measured, beside their floors)
"""

from __future__ import annotations

import json
import math

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib import patches

from .. import problems, roofline
from . import tuning_index
from .ledger import p2_backward_steps
from .measured_designs import p1_gluon_launch2_times
from .results import ResultFile, ok_rows, resolve_path

LAUNCH_FLOOR_US = 3.2  # one tiny kernel by CUDA-graph replay on the H200 (notes/method.md)
BF16 = 2  # bytes of a bf16 element
FP32 = 4
# launch 2 of the faithful path in the Gluon probe's runs (notes/p1/design-13.md): the implementations compared, as the
# index labels them
LAUNCH2_LABELS = tuning_index.run("gluon_launch2_probe").labels


def _predict_us(traffic: float, flops: float, bandwidth: float, rate: float) -> float:
    return 1e6 * max(traffic / bandwidth, flops / rate)


# ================================================================ P1


def p1_rung_costs(
    num_tokens: int, spec: roofline.GPUSpec, cuda_core_flops: float, *, block: int = 128, **axes
) -> pd.DataFrame:
    """The teaching kernels' step, dA = dy·W_d then the dSwiGLU, at the benchmark's shape (bf16 operands) per rung:
    its FLOPs and where they run, the bytes its programs ask for and those that reach DRAM (W_d, 3 MB, stays in
    L2 for its re-reads), the part that is dA's round trip through memory, and the predicted time (``spec``'s
    bandwidth and bf16 rate; ``cuda_core_flops`` for the naive rung's FMAs), one launch after another.
    ``block``: the tiled rungs' tile edge, as the GPU's tiles would be."""
    if not isinstance(num_tokens, int) or num_tokens < 1 or block < 1:
        raise ValueError(f"num_tokens and block: expected positive integers, got {num_tokens!r} and {block!r}")
    sizes = problems.load("swiglu_down_backward").sizes(num_tokens, **axes)
    T, H, I = sizes["num_tokens"], sizes["hidden_size"], sizes["intermediate_size"]
    flops = 2 * T * H * I
    dy, w_down = T * H * BF16, H * I * BF16
    saved, grads = 4 * T * I * BF16, 2 * T * I * BF16  # gate, σ, silu, up in; dG, dU out
    round_trip = 2 * T * I * FP32  # dA written by the product, read back by the elementwise pass
    bw, tensor = spec.dram_bandwidth, spec.bf16_dense_flops
    pass_us = 1e6 * (round_trip / 2 + saved + grads) / bw  # the elementwise pass: dA and the saved tensors in
    rungs = {
        "1 · naive: a row a program, then a pass": dict(
            on="CUDA cores (fp32 FMA)",
            asked=T * (H * BF16 + w_down) + round_trip + saved + grads,
            dram=dy + w_down + round_trip + saved + grads,
            round_trip=round_trip,
            predicted=_predict_us(dy + w_down + round_trip / 2, flops, bw, cuda_core_flops) + pass_us,
        ),
        "2 · tiled: tl.dot tiles, then a pass": dict(
            on="tensor cores",
            asked=math.ceil(T / block) * w_down + math.ceil(I / block) * dy + round_trip + saved + grads,
            dram=dy + w_down + round_trip + saved + grads,
            round_trip=round_trip,
            predicted=_predict_us(dy + w_down + round_trip / 2, flops, bw, tensor) + pass_us,
        ),
        "3 · fused: the dSwiGLU in the epilogue": dict(
            on="tensor cores",
            asked=math.ceil(T / block) * w_down + math.ceil(I / block) * dy + saved + grads,
            dram=dy + w_down + saved + grads,
            round_trip=0.0,
            predicted=_predict_us(dy + w_down + saved + grads, flops, bw, tensor),
        ),
    }
    table = pd.DataFrame(
        {
            name: {
                "GFLOP": flops / 1e9,
                "on": rung["on"],
                "bytes asked (MB)": rung["asked"] / 1e6,
                "bytes from DRAM (MB)": rung["dram"] / 1e6,
                "dA round trip (MB)": rung["round_trip"] / 1e6,
                "launches": 1 if rung["round_trip"] == 0 else 2,
                "predicted (µs)": rung["predicted"],
            }
            for name, rung in rungs.items()
        }
    ).T
    table.attrs.update(num_tokens=T, hidden_size=H, intermediate_size=I, spec=spec.name)
    return table


def _matrix(ax, x, y, width, height, label, shade=None, colour="tab:blue"):
    """A matrix outline at (x, y) with a label above it, and ``shade`` [(x0, y0, w, h) relative to it] filled."""
    ax.add_patch(patches.Rectangle((x, y), width, height, fill=False, lw=1.2))
    ax.text(x + width / 2, y + height + 0.15, label, ha="center", va="bottom", fontsize=8)
    for x0, y0, w, h in shade or ():
        ax.add_patch(patches.Rectangle((x + x0, y + y0), w, h, color=colour, alpha=0.55, lw=0))


def p1_rungs_figure():
    """What one program of each teaching rung touches: dy [T, H], W_d [H, I] and its output [T, I] (top of each
    matrix is its first row), the program's reads and writes shaded, and where dA goes. Returns the figure."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    t, h, i = 3.0, 4.0, 2.6  # drawn sizes of T, H, I
    notes = (
        "row t of dy and all of W_d per program: W_d is read T times;\nno tensor cores (a row is one token); "
        "dA goes to memory,\na second launch reads it back for the dSwiGLU",
        "a BLOCK_M × H strip of dy and an H × BLOCK_N strip of W_d\nper tile, multiplied by tl.dot over K steps: "
        "W_d read\n⌈T / BLOCK_M⌉ times; dA still goes to memory and back",
        "the same tiles; the dSwiGLU runs on the accumulator\n(the epilogue) with the saved tiles loaded there: "
        "dA never\nleaves the chip, one launch writes dG and dU",
    )
    titles = ("1 · naive", "2 · tiled", "3 · fused")
    for ax, title, note, rung in zip(axes, titles, notes, range(3), strict=True):
        row = [(0, t - 0.25, h, 0.25)] if rung == 0 else [(0, t - 0.9, h, 0.9)]
        column = [(0, 0, i, h)] if rung == 0 else [(0.8, 0, 0.7, h)]
        out = [(0, t - 0.25, i, 0.25)] if rung == 0 else [(0.8, t - 0.9, 0.7, 0.9)]
        _matrix(ax, 0, 0.5, h, t, "dy [T, H]", row)
        _matrix(ax, h + 0.6, 0.5 - (h - t), i, h, "W_d [H, I]", column, "tab:orange")
        _matrix(ax, h + i + 1.2, 0.5, i, t, "dG, dU [T, I]" if rung == 2 else "dA [T, I]", out, "tab:green")
        ax.text(h + 0.3, 0.5 + t / 2, "·", fontsize=16, ha="center", va="center")
        ax.text(h + i + 0.9, 0.5 + t / 2, "=", fontsize=12, ha="center", va="center")
        ax.text(0, -1.1 - (h - t), note, fontsize=7.5, va="top")
        ax.set(xlim=(-0.2, h + 2 * i + 1.5), ylim=(-3.2 - (h - t), t + 1.3), title=title)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.tight_layout()
    return fig


def p1_launch2_bytes_flops(num_tokens: int, **axes) -> tuple[float, float]:
    """(bytes, FLOPs) of the faithful path's launch 2: dG, dU as hi and lo halves and x, Wg, Wu in; dx, dWg, dWu out;
    dx = [dG | dU]·[Wg; Wu] and dWg, dWu = [dG | dU]ᵀ·x, every product taken with both halves (16·T·H·I)."""
    sizes = problems.load("swiglu_down_backward").sizes(num_tokens, **axes)
    T, H, I = sizes["num_tokens"], sizes["hidden_size"], sizes["intermediate_size"]
    traffic = (4 * T * I + T * H + 2 * I * H + T * H + 2 * I * H) * BF16
    return traffic, 16 * T * H * I


def p1_launch2_ladder(spec: roofline.GPUSpec, path=None) -> pd.DataFrame:
    """Launch 2 of the faithful path on the H200 (the Gluon probe, notes/p1/design-13.md; µs by graph replay): the
    Triton launch (every warp loads and multiplies), the library's Gluon launch (a TMA warp, two wgmma warpgroups) and
    cuBLAS running the same arithmetic, beside the roofline's prediction at ``spec``'s ceilings (the index's
    ``gluon_launch2_probe`` by default)."""
    measured = p1_gluon_launch2_times(path, labels=LAUNCH2_LABELS)
    predicted = [
        _predict_us(*p1_launch2_bytes_flops(t), spec.dram_bandwidth, spec.bf16_dense_flops) for t in measured.index
    ]
    table = measured.assign(**{"predicted (µs)": predicted})
    for column in LAUNCH2_LABELS.values():
        table[f"{column}: of the prediction"] = table["predicted (µs)"] / table[column]
    return table


def p1_call_ladder(spec: roofline.GPUSpec, result: ResultFile, path=None) -> pd.DataFrame:
    """The whole faithful call by token count: the portable Triton launches as tuned on the H200 before the Gluon
    launches existed (their "default" of that run, the index's ``triton_launches_faithful`` by default), the Gluon
    launches the chooser takes today (``result``'s ``triton``), and the floor of the faithful arithmetic,
    max(bytes / bandwidth, 20·T·H·I / rate) at ``spec``'s ceilings (µs)."""
    path = path or tuning_index.run("triton_launches_faithful").path
    runs = json.loads(resolve_path(path).read_text())
    triton = {r["T"]: r["median_us"] for r in runs if r.get("config") == "default" and r.get("ok")}
    ours = ok_rows(result)
    ours = ours[ours["impl"] == "triton"].set_index("num_tokens")["median_ms"] * 1e3
    rows = {}
    for t in sorted(set(triton) & set(ours.index)):
        sizes = problems.load("swiglu_down_backward").sizes(t)
        _, traffic = roofline.cost("swiglu_down_backward", t)
        floor = _predict_us(
            traffic,
            20 * t * sizes["hidden_size"] * sizes["intermediate_size"],
            spec.dram_bandwidth,
            spec.bf16_dense_flops,
        )
        rows[t] = {
            "Triton launches (µs)": triton[t],
            "Gluon launches (µs)": ours[t],
            "floor (µs)": floor,
            "Gluon over Triton": triton[t] / ours[t],
            "floor over Gluon": floor / ours[t],
        }
    table = pd.DataFrame.from_dict(rows, orient="index").rename_axis("num_tokens")
    table.attrs.update(triton_file=resolve_path(path).name, gluon_file=result.csv.name)
    return table


def ladder_figure(table: pd.DataFrame, columns, title: str, predicted: str | None = None):
    """Bars of ``columns`` of a ladder table per token count, the prediction (``predicted``) as a black mark on
    each group; the legend beside the axes. Returns the figure."""
    fig, ax = plt.subplots(figsize=(10, 3.8), layout="constrained")
    width = 0.8 / len(columns)
    for n, column in enumerate(columns):
        ax.bar([k + n * width for k in range(len(table))], table[column], width, label=column)
    if predicted:
        for k, value in enumerate(table[predicted]):
            ax.plot(
                [k - width / 2, k + (len(columns) - 0.5) * width],
                [value, value],
                color="black",
                lw=2,
                label=predicted if k == 0 else None,
            )
    ax.set_xticks([k + (len(columns) - 1) * width / 2 for k in range(len(table))], [str(t) for t in table.index])
    ax.set(xlabel="tokens", ylabel="µs", title=title)
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


# ================================================================ P2


def p2_rung_costs(
    num_tokens: int,
    spec: roofline.GPUSpec,
    problem: str = "moe_experts_backward_bf16",
    launch_us: float = LAUNCH_FLOOR_US,
) -> pd.DataFrame:
    """The teaching kernels' P2 step, the recomputed gate projection g_s = W_g,e x_t(s) of every slot, at
    ``problem``'s shape: per expert from the host (the row counts read back, a gathered copy of each expert's rows,
    one launch per expert with rows) or grouped (one launch, the rows gathered inside its loads). Its predicted time
    adds ``launch_us`` per launch (the floor of one launch, ``notes/method.md``) to the roofline's."""
    if not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens: expected a positive integer, got {num_tokens!r}")
    sizes = problems.load(problem).sizes(num_tokens)
    T, H, I, E, K = (sizes[k] for k in ("num_tokens", "hidden_size", "intermediate_size", "num_experts", "top_k"))
    item = problems.load(problem).dtype.itemsize
    slots = T * K
    flops = 2 * slots * H * I
    core = slots * H * item + E * I * H * item + slots * I * item  # rows in, W_g in, g out
    busy = E * (1 - (1 - K / E) ** T)  # the experts with rows, in expectation
    copy = 2 * slots * H * item  # the gathered rows written, then read by the launches (on top of x read once)
    rows = {
        "1 · per expert, from the host": dict(launches=round(busy), syncs=1, traffic=core + copy),
        "2 · grouped, rows gathered in the loads": dict(launches=1, syncs=0, traffic=core),
    }
    table = pd.DataFrame(
        {
            name: {
                "launches": r["launches"],
                "host syncs": r["syncs"],
                "GFLOP": flops / 1e9,
                "bytes (MB)": r["traffic"] / 1e6,
                "predicted (µs)": _predict_us(r["traffic"], flops, spec.dram_bandwidth, spec.bf16_dense_flops)
                + r["launches"] * launch_us,
            }
            for name, r in rows.items()
        }
    ).T
    table.attrs.update(num_tokens=T, problem=problem)
    return table


def _tuning_rows(path) -> list[dict]:
    return json.loads(resolve_path(path).read_text())


def p2_tma_ladder(spec: roofline.GPUSpec) -> pd.DataFrame:
    """Kernels W and D on the H200 (``scripts/p2/p2_tma_bench.py``, ms by graph replay, uniform routing): pointer-based
    (rows gathered inside the loads) against fed by TMA (that run's default, and its fastest correct variant), each
    beside its floor at ``spec``'s ceilings (:func:`.ledger.p2_backward_steps`; W with the gather into expert order
    it needs). Triton's automatic warp specialisation of W ran faster still but left tiles unwritten: not a
    candidate (``notes/p2/design-04-w.md``). The runs are the index's ``p2_tma_weight_grad`` and
    ``p2_tma_slot_projection``, each with its pointer-based candidate's name."""
    weight_run, slot_run = tuning_index.run("p2_tma_weight_grad"), tuning_index.run("p2_tma_slot_projection")
    weight = _tuning_rows(weight_run.path)
    slot = [r for r in _tuning_rows(slot_run.path) if r.get("use") == "backward" and r.get("routing") == "uniform"]
    rows = {}
    for case in dict.fromkeys(r["case"] for r in weight):
        dtype, tokens = case.split(":")
        steps = {s.name: s for s in p2_backward_steps(int(tokens), "float32" if dtype == "fp32" else "bfloat16")}
        row = {"W floor (ms)": steps["W"].floor_ms(spec) + (steps["gather"].floor_ms(spec) if "gather" in steps else 0)}
        pointers = (("W", weight, weight_run.options["pointer"]), ("D", slot, slot_run.options["pointer"]))
        for kernel, runs, pointer in pointers:
            mine = [r for r in runs if r["case"] == case]
            by_config = {r["config"]: r["ms"] for r in mine if r.get("ms")}
            correct = {r["config"]: r["ms"] for r in mine if r.get("ok") and r.get("ms")}
            row[f"{kernel} pointer-based (ms)"] = by_config.get(pointer, math.nan)
            row[f"{kernel} TMA, default (ms)"] = correct.get("default", math.nan)
            row[f"{kernel} TMA, fastest (ms)"] = min(correct.values()) if correct else math.nan
            if kernel == "D":
                row["D floor (ms)"] = steps["D"].floor_ms(spec)
        rows[case] = row
    columns = [
        "W floor (ms)",
        "W pointer-based (ms)",
        "W TMA, default (ms)",
        "W TMA, fastest (ms)",
        "D floor (ms)",
        "D pointer-based (ms)",
        "D TMA, default (ms)",
        "D TMA, fastest (ms)",
    ]
    order = sorted(rows, key=lambda case: (case.split(":")[0] != "bf16", int(case.split(":")[1])))
    return pd.DataFrame.from_dict(rows, orient="index").loc[order, columns].rename_axis("case")
