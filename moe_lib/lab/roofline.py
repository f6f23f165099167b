"""Notebook 03: the roofline model of the problems, with the measured points of the committed results.

Ridge points, per-case cost tables (from :func:`moe_lib.roofline.cost`), where a problem crosses the
ridge, the measured points and their projection to another GPU, and the plots.

Rates are in FLOP/s, bandwidths in B/s, intensities in FLOP per byte, times in µs (``*_us``) or ms
(``*_ms``) as the column names say.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from .. import problems, roofline
from .results import IMPL_STYLE, IMPLS, OURS, ResultFile, find, ok_rows, styled

PROBLEM_COLORS = ("tab:blue", "tab:orange", "tab:green")  # one per problem, in the order of PROBLEM_NAMES


def _spec(gpu) -> roofline.GPUSpec:
    """A GPUSpec from a key of :data:`moe_lib.roofline.GPUS` or a GPUSpec (a clear error otherwise)."""
    return roofline.gpu_spec(gpu)


def measured_specs(results: dict[str, ResultFile]) -> dict[str, roofline.GPUSpec]:
    """The ceilings each result file measured, as GPUSpecs keyed "<GPU> measured (<file key>)"."""
    return {f"{r.gpu_key} measured ({r.key})": r.measured_spec for r in results.values() if r.measured_spec}


def ridge_point(gpu) -> float:
    """FLOP per byte where ``gpu`` turns compute-bound: bf16 dense rate / DRAM bandwidth."""
    spec = _spec(gpu)
    return spec.bf16_dense_flops / spec.dram_bandwidth


def attainable(gpu, intensity):
    """The roofline: attainable FLOP/s at ``intensity`` (FLOP/byte), min(peak, intensity · bandwidth)."""
    spec = _spec(gpu)
    return np.minimum(spec.bf16_dense_flops, np.asarray(intensity, dtype=float) * spec.dram_bandwidth)


def gpu_table(measured: dict[str, roofline.GPUSpec] | None = None) -> pd.DataFrame:
    """Every GPU of :data:`moe_lib.roofline.GPUS` (datasheet figures), then the ``measured`` ceilings:
    bf16 dense rate, DRAM bandwidth, ridge point, SMs and source."""
    specs = {**roofline.GPUS, **(measured or {})}
    rows = {label: {"bf16 dense (TFLOP/s)": s.bf16_dense_flops / 1e12, "DRAM (TB/s)": s.dram_bandwidth / 1e12,
                    "ridge (FLOP/B)": ridge_point(s), "SMs": s.sms, "source": s.source}
            for label, s in specs.items()}  # fmt: skip
    return pd.DataFrame.from_dict(rows, orient="index")


def styled_gpu_table(table: pd.DataFrame, highlight: str):
    """:func:`gpu_table` styled, the row ``highlight`` shaded."""
    formats = {"bf16 dense (TFLOP/s)": "{:.0f}", "DRAM (TB/s)": "{:.2f}", "ridge (FLOP/B)": "{:.0f}", "SMs": "{:.0f}"}
    return (styled(table, formats, f"Ceilings and ridge points ({highlight} highlighted)")
            .apply(lambda row: ["background: #ddf4ff" if row.name == highlight else "" for _ in row], axis=1))


# ================================================================ cost per case and the ridge crossing


def cost_table(problem: str, gpu, tokens=None, **axes) -> pd.DataFrame:
    """FLOPs, bytes, arithmetic intensity and roofline times of ``problem`` per case on ``gpu``.

    ``tokens``: the token counts (default: the problem's suite), shown ascending. Times in µs:
    t_memory = bytes / bandwidth, t_compute = FLOPs / bf16 rate, T_sol the larger; ``bound`` names it.
    """
    spec = _spec(gpu)
    tokens = sorted(problems.load(problem).suite if tokens is None else tokens)
    rows = []
    for t in tokens:
        work, traffic = roofline.cost(problem, t, **axes)
        t_memory, t_compute = traffic / spec.dram_bandwidth * 1e6, work / spec.bf16_dense_flops * 1e6
        rows.append(dict(num_tokens=t, flops=work, bytes=traffic, intensity=work / traffic if traffic else math.nan,
                         t_memory_us=t_memory, t_compute_us=t_compute, t_sol_us=max(t_memory, t_compute),
                         bound="compute" if t_compute >= t_memory else "memory"))  # fmt: skip
    return pd.DataFrame(rows).set_index("num_tokens")


def styled_cost_table(table: pd.DataFrame, caption: str):
    """:func:`cost_table` styled: GFLOP, MB, FLOP/B and µs, the bound coloured."""
    shown = table.assign(flops=table["flops"] / 1e9, bytes=table["bytes"] / 1e6).rename(
        columns={"flops": "GFLOP", "bytes": "MB", "intensity": "FLOP/B", "t_memory_us": "t_memory (µs)",
                 "t_compute_us": "t_compute (µs)", "t_sol_us": "T_sol (µs)"})  # fmt: skip
    formats = {"GFLOP": "{:.3f}", "MB": "{:.1f}", "FLOP/B": "{:.1f}", "t_memory (µs)": "{:.1f}",
               "t_compute (µs)": "{:.1f}", "T_sol (µs)": "{:.1f}"}  # fmt: skip
    colours = {"memory": "color: #0969da", "compute": "color: #cf222e; font-weight: bold"}
    return styled(shown, formats, caption).map(lambda v: colours.get(v, ""), subset=["bound"])


def cost_coefficients(problem: str, **axes) -> tuple[int, int, int]:
    """(FLOPs per token a, bytes per token b, fixed bytes c): FLOPs = a·T and bytes = b·T + c.

    Read off :func:`moe_lib.roofline.cost` at 0, 1 and 2 tokens (and checked to be affine)."""
    (f0, b0), (f1, b1), (f2, b2) = (roofline.cost(problem, t, **axes) for t in (0, 1, 2))
    if f0 != 0 or f2 - f1 != f1 - f0 or b2 - b1 != b1 - b0:
        raise ValueError(f"{problem}: FLOPs and bytes are not affine in the token count")
    return f1, b1 - b0, b0


def ridge_crossing(problem: str, gpu, **axes) -> float:
    """The token count T* where ``problem``'s intensity a·T / (b·T + c) reaches ``gpu``'s ridge R:
    T* = R·c / (a − R·b); inf when the intensity never gets there (a ≤ R·b)."""
    a, b, c = cost_coefficients(problem, **axes)
    ridge = ridge_point(gpu)
    return ridge * c / (a - ridge * b) if a > ridge * b else math.inf


def crossing_table(gpus: dict, problem_names=problems.PROBLEM_NAMES) -> pd.DataFrame:
    """Per problem and GPU (``{label: key or GPUSpec}``): the ridge, the crossing T*, the first
    compute-bound token count ⌈T*⌉ and the intensity the problem tends to at large T (a / b)."""
    rows = []
    for problem in problem_names:
        a, b, _ = cost_coefficients(problem)
        for label, gpu in gpus.items():
            crossing = ridge_crossing(problem, gpu)
            rows.append(dict(problem=problem, gpu=label, ridge=ridge_point(gpu), crossing_tokens=crossing,
                             first_compute_bound=math.ceil(crossing) if math.isfinite(crossing) else None,
                             intensity_limit=a / b))  # fmt: skip
    return pd.DataFrame(rows).set_index(["problem", "gpu"])


def regime_table(cases, gpu) -> pd.DataFrame:
    """For ``cases`` [(problem, num_tokens), ...] on ``gpu``: memory and compute time, the bound, and the
    share of the bytes that are the weights and their gradients (the fixed bytes c of
    :func:`cost_coefficients`, read whatever T is)."""
    spec = _spec(gpu)
    rows = []
    for problem, t in cases:
        _, b, c = cost_coefficients(problem)
        row = cost_table(problem, spec, [t]).iloc[0]
        rows.append(dict(problem=problem, num_tokens=t, bound=row["bound"], t_memory_us=row["t_memory_us"],
                         t_compute_us=row["t_compute_us"], weight_bytes_share=c / (b * t + c)))  # fmt: skip
    return pd.DataFrame(rows).set_index(["problem", "num_tokens"])


# ================================================================ measured points


def measured_points(results: dict[str, ResultFile]) -> pd.DataFrame:
    """Every timed (ok) row as a point of the roofline plot: intensity and achieved FLOP/s, and the GPU it ran on."""
    frames = []
    for result in results.values():
        ok = ok_rows(result)
        frames.append(pd.DataFrame({
            "problem": result.problem, "impl": ok["impl"], "num_tokens": ok["num_tokens"], "gpu": result.gpu_key,
            "flops": ok["flops"], "bytes": ok["bytes"], "intensity": ok["flops"] / ok["bytes"],
            "median_ms": ok["median_ms"], "flop_rate": ok["flops"] / (ok["median_ms"] * 1e-3),
            "file": result.csv.name,
        }))  # fmt: skip
    columns = ["problem", "impl", "num_tokens", "gpu", "flops", "bytes", "intensity", "median_ms", "flop_rate", "file"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


def project_points(points: pd.DataFrame, to_gpu: str) -> pd.DataFrame:
    """The points with ``projected_rate`` and ``projected_ms`` on ``to_gpu``: each keeps its fraction of the
    roofline, i.e. its rate is scaled by roof(to_gpu, I) / roof(its GPU, I) at its intensity I. Where both
    GPUs are memory-bound at I that is the ratio of the bandwidths, where both are compute-bound the ratio
    of the bf16 rates. Points measured on ``to_gpu`` itself keep their rate; points from a GPU not in
    :data:`moe_lib.roofline.GPUS` get NaN."""
    projected = points.copy()
    ratios = []
    for gpu, intensity in zip(points["gpu"], points["intensity"], strict=True):
        if gpu == to_gpu:
            ratios.append(1.0)
        elif gpu in roofline.GPUS:
            ratios.append(float(attainable(to_gpu, intensity) / attainable(gpu, intensity)))
        else:
            ratios.append(math.nan)
    projected["scale"] = ratios
    projected["projected_rate"] = projected["flop_rate"] * projected["scale"]
    projected["projected_ms"] = projected["median_ms"] / projected["scale"]
    projected["projected"] = projected["gpu"] != to_gpu
    return projected


def points_table(points: pd.DataFrame, gpu: str, impl: str = OURS) -> pd.DataFrame:
    """``impl``'s points (from :func:`project_points`) with the fraction of ``gpu``'s roofline they reach."""
    mine = points[points["impl"] == impl].copy()
    mine["roofline fraction"] = mine["projected_rate"] / attainable(gpu, mine["intensity"])
    mine = mine.sort_values(["problem", "num_tokens"]).set_index(["problem", "num_tokens"])
    return mine[["gpu", "intensity", "flop_rate", "projected_rate", "roofline fraction"]].rename(
        columns={"gpu": "measured on", "flop_rate": "measured FLOP/s", "projected_rate": f"FLOP/s on {gpu}"})


# ================================================================ figures


def _label_roofs(ax, spec: roofline.GPUSpec, x_min: float, color: str) -> None:
    ridge = spec.bf16_dense_flops / spec.dram_bandwidth
    ax.annotate(f"DRAM {spec.dram_bandwidth / 1e12:.2f} TB/s", (x_min * 1.5, x_min * 1.5 * spec.dram_bandwidth),
                rotation=33, color=color, fontsize=8, va="bottom")  # fmt: skip
    ax.annotate(f"bf16 dense {spec.bf16_dense_flops / 1e12:.0f} TFLOP/s", (ridge * 1.15, spec.bf16_dense_flops),
                color=color, fontsize=8, va="bottom")  # fmt: skip


def plot_roofline(ax, gpu: str, *, x_range=(0.5, 5000.0), measured: roofline.GPUSpec | None = None) -> None:
    """The two ceilings of ``gpu`` (log-log: attainable FLOP/s against FLOP/byte), its ridge, and
    optionally a run's measured ceilings (dashed)."""
    spec = _spec(gpu)
    x = np.logspace(math.log10(x_range[0]), math.log10(x_range[1]), 400)
    ax.loglog(x, attainable(spec, x), color="black", linewidth=2, label=f"{gpu} roofline (datasheet)")
    ridge = ridge_point(spec)
    ax.axvline(ridge, color="black", linestyle=":", linewidth=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, 0.03), xycoords=ax.get_xaxis_transform(), rotation=90,
                fontsize=8, ha="right", va="bottom")  # fmt: skip
    _label_roofs(ax, spec, x_range[0], "black")
    if measured is not None:
        ax.loglog(x, attainable(measured, x), color="tab:gray", linestyle="--", linewidth=1.2,
                  label=f"{measured.name}: {measured.dram_bandwidth / 1e12:.2f} TB/s, "
                        f"{measured.bf16_dense_flops / 1e12:.0f} TFLOP/s")  # fmt: skip
    ax.set(xlim=x_range, xlabel="arithmetic intensity (FLOP / byte)", ylabel="FLOP/s")
    ax.grid(alpha=0.3, which="both")


def labelled_points(ours: pd.DataFrame, max_labels: int = 4, min_decades: float = 0.35) -> pd.DataFrame:
    """The points of ``ours`` to label with their token count: the first and the last, then others from the middle
    outwards, each at least ``min_decades`` of intensity (log10) from every label already taken, so that no two
    labels collide."""
    ours = ours.sort_values("num_tokens")
    if ours.empty:
        return ours
    n = len(ours)
    middle_out = sorted(range(1, n - 1), key=lambda i: abs(i - (n - 1) / 2))
    taken = []
    for i in [0, n - 1, *middle_out]:
        x = math.log10(ours["intensity"].iloc[i])
        if i not in taken and all(abs(x - math.log10(ours["intensity"].iloc[j])) >= min_decades for j in taken):
            taken.append(i)
        if len(taken) == max_labels:
            break
    return ours.iloc[sorted(taken)]


def _label_token_counts(ax, points: pd.DataFrame) -> None:
    """Our points' token counts (:func:`labelled_points`), each written below every marker near its intensity and
    joined to its point by a thin line, so that no label covers a marker."""
    color = IMPL_STYLE[OURS][0]
    for _, row in labelled_points(points[points["impl"] == OURS]).iterrows():
        near = points[(np.log10(points["intensity"]) - math.log10(row["intensity"])).abs() < 0.2]
        y = near["projected_rate"].min() / 2.5
        ax.annotate(f"T={row['num_tokens']}", (row["intensity"], row["projected_rate"]), xytext=(row["intensity"], y),
                    fontsize=8, color=color, ha="center", va="top",
                    arrowprops=dict(arrowstyle="-", color=color, lw=0.6, alpha=0.6, shrinkA=1, shrinkB=5))  # fmt: skip


def roofline_figure(gpu: str, points: pd.DataFrame, results: dict[str, ResultFile] | None = None):
    """One roofline panel per problem with points: measured ones (filled) where they ran on ``gpu``,
    projected ones (hollow, labelled so) where they ran elsewhere. Returns the figure."""
    projected = project_points(points, gpu)
    names = [p for p in problems.PROBLEM_NAMES if p in set(points["problem"])] or list(problems.PROBLEM_NAMES)
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 5.6 * len(names)), sharex=True, squeeze=False)
    y_min = max(1e9, projected["projected_rate"].min() / 8) if len(projected) else 1e10  # room for the T labels
    for ax, problem in zip(axes[:, 0], names, strict=True):
        result = find(results, problem) if results else None
        same_gpu = result is not None and result.gpu_key == gpu
        plot_roofline(ax, gpu, measured=result.measured_spec if same_gpu else None)
        mine = projected[projected["problem"] == problem]
        for impl in [i for i in IMPLS if i in set(mine["impl"])] + sorted(set(mine["impl"]) - set(IMPLS)):
            rows = mine[mine["impl"] == impl]
            color, marker = IMPL_STYLE.get(impl, ("black", "x"))
            for was_projected, group in rows.groupby("projected"):
                source = ", ".join(sorted(set(group["gpu"])))
                label = f"{impl} (projected from {source})" if was_projected else f"{impl} (measured, {source})"
                ax.scatter(group["intensity"], group["projected_rate"], color=color if not was_projected else "none",
                           edgecolors=color, marker=marker, s=70 if impl == OURS else 38, linewidths=1.2,
                           label=label, zorder=3)  # fmt: skip
        _label_token_counts(ax, mine)
        ax.set_ylim(y_min, _spec(gpu).bf16_dense_flops * 4)
        ax.set_title(f"{problems.load(problem).title} on {gpu}", fontsize=11)
        ax.legend(fontsize=8, loc="lower right")
        ax.xaxis.set_tick_params(labelbottom=True)
    fig.tight_layout()
    return fig


def intensity_figure(gpu: str, problem_names=problems.PROBLEM_NAMES, measured: dict | None = None):
    """Arithmetic intensity against token count for each problem, its suite cases marked, with the ridge
    of ``gpu`` (and of ``measured``: {label: GPUSpec}) and where each problem crosses it."""
    fig, ax = plt.subplots(figsize=(12, 5), layout="constrained")
    colors = dict(zip(problems.PROBLEM_NAMES, PROBLEM_COLORS, strict=True))
    t = np.unique(np.logspace(0, math.log10(65536), 300).astype(int))
    ridges = {f"{gpu} ridge (datasheet)": _spec(gpu), **(measured or {})}
    for name in problem_names:
        problem = problems.load(name)
        a, b, c = cost_coefficients(name)
        suite = np.array(problem.suite)
        color = colors.get(name, "black")
        ax.loglog(t, a * t / (b * t + c), color=color, label=problem.title)
        label = "suite cases" + (" (assumed)" if problem.suite_provenance == "assumed" else "")
        ax.scatter(suite, a * suite / (b * suite + c), color=color, s=18, zorder=3, label=f"  {label}")
        crossing = ridge_crossing(name, gpu)
        if math.isfinite(crossing):
            ax.axvline(crossing, color=color, linestyle=":", linewidth=1)
            ax.annotate(f"T* = {crossing:.0f}", (crossing, 0.03), xycoords=ax.get_xaxis_transform(), rotation=90,
                        color=color, fontsize=8, ha="right", va="bottom")  # fmt: skip
    for (label, spec), style in zip(ridges.items(), ("--", "-."), strict=False):
        ax.axhline(ridge_point(spec), color="black", linestyle=style, linewidth=1,
                   label=f"{label}: {ridge_point(spec):.0f} FLOP/B")  # fmt: skip
    ax.set_ylim(bottom=0.5)
    ax.set(xlabel="tokens T", ylabel="arithmetic intensity (FLOP / byte)",
           title=f"Where each problem turns compute-bound on {gpu}")  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: it covers no curve
    return fig
