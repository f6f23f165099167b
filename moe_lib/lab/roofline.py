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
from matplotlib.lines import Line2D

from .. import problems, roofline
from .results import IMPL_STYLE, IMPLS, OURS, ResultFile, find, ok_rows, styled

PROBLEM_COLORS = ("tab:blue", "tab:orange", "tab:green")  # one per problem, in the order of PROBLEM_NAMES


def _spec(gpu) -> roofline.GPUSpec:
    """A GPUSpec from a key of :data:`moe_lib.roofline.GPUS` or a GPUSpec (a clear error otherwise)."""
    return roofline.gpu_spec(gpu)


def measured_specs(results: dict[str, ResultFile]) -> dict[str, roofline.GPUSpec]:
    """The ceilings each result file measured, as GPUSpecs keyed "<GPU> measured (<file key>)"."""
    return {f"{r.gpu_key} measured ({r.key})": r.measured_spec for r in results.values() if r.measured_spec}


def measured_ceilings(results: dict[str, ResultFile]) -> dict[str, roofline.GPUSpec]:
    """One GPUSpec per GPU key the result files ran on: the median of their measured ceilings (a device-to-device
    copy and an 8192³ bf16 matmul per run; the runs agree within a few per cent)."""
    by_gpu: dict[str, list] = {}
    for result in results.values():
        if result.measured_spec is not None:
            by_gpu.setdefault(result.gpu_key, []).append(result.measured_spec)
    return {
        gpu: roofline.GPUSpec.from_measured(
            float(np.median([s.dram_bandwidth for s in specs])),
            float(np.median([s.bf16_dense_flops for s in specs])),
            name=f"{gpu} measured (median of {len(specs)} runs)",
        )
        for gpu, specs in by_gpu.items()
    }


def ridge_point(gpu) -> float:
    """FLOP per byte where ``gpu`` turns compute-bound: bf16 dense rate / DRAM bandwidth."""
    spec = _spec(gpu)
    return spec.bf16_dense_flops / spec.dram_bandwidth


def attainable(gpu, intensity):
    """The roofline: attainable FLOP/s at ``intensity`` (FLOP/byte), min(peak, intensity · bandwidth)."""
    spec = _spec(gpu)
    return np.minimum(spec.bf16_dense_flops, np.asarray(intensity, dtype=float) * spec.dram_bandwidth)


def gpu_table(measured: dict[str, roofline.GPUSpec] | None = None) -> pd.DataFrame:
    """One row per GPU of :data:`moe_lib.roofline.GPUS`: its datasheet's bf16 dense rate, DRAM bandwidth and ridge
    point, and beside them the ceilings a run measured on it (``measured``: {GPU key: GPUSpec}, e.g.
    :func:`measured_ceilings`; NaN where none was), its SMs and the datasheet's source."""
    measured = measured or {}
    rows = {}
    for key, spec in roofline.GPUS.items():
        mine = measured.get(key)
        rows[key] = {
            "bf16 dense (TFLOP/s)": spec.bf16_dense_flops / 1e12,
            "DRAM (TB/s)": spec.dram_bandwidth / 1e12,
            "ridge (FLOP/B)": ridge_point(spec),
            "measured bf16 (TFLOP/s)": mine.bf16_dense_flops / 1e12 if mine else math.nan,
            "measured DRAM (TB/s)": mine.dram_bandwidth / 1e12 if mine else math.nan,
            "measured ridge (FLOP/B)": ridge_point(mine) if mine else math.nan,
            "SMs": spec.sms,
            "source": spec.source,
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def styled_gpu_table(table: pd.DataFrame, highlight: str):
    """:func:`gpu_table` styled, the row ``highlight`` shaded."""
    formats = {
        "bf16 dense (TFLOP/s)": "{:.0f}",
        "DRAM (TB/s)": "{:.2f}",
        "ridge (FLOP/B)": "{:.0f}",
        "SMs": "{:.0f}",
        "measured bf16 (TFLOP/s)": "{:.0f}",
        "measured DRAM (TB/s)": "{:.2f}",
        "measured ridge (FLOP/B)": "{:.0f}",
    }
    return styled(
        table, formats, f"Ceilings and ridge points, datasheet and measured ({highlight} highlighted; –: not measured)"
    ).apply(lambda row: ["background: #ddf4ff" if row.name == highlight else "" for _ in row], axis=1)


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
        rows.append(
            dict(
                num_tokens=t,
                flops=work,
                bytes=traffic,
                intensity=work / traffic if traffic else math.nan,
                t_memory_us=t_memory,
                t_compute_us=t_compute,
                t_sol_us=max(t_memory, t_compute),
                bound="compute" if t_compute >= t_memory else "memory",
            )
        )
    return pd.DataFrame(rows).set_index("num_tokens")


def styled_cost_table(table: pd.DataFrame, caption: str):
    """:func:`cost_table` styled: GFLOP, MB, FLOP/B and µs, the bound coloured."""
    shown = table.assign(flops=table["flops"] / 1e9, bytes=table["bytes"] / 1e6).rename(
        columns={
            "flops": "GFLOP",
            "bytes": "MB",
            "intensity": "FLOP/B",
            "t_memory_us": "t_memory (µs)",
            "t_compute_us": "t_compute (µs)",
            "t_sol_us": "T_sol (µs)",
        }
    )
    formats = {
        "GFLOP": "{:.3f}",
        "MB": "{:.1f}",
        "FLOP/B": "{:.1f}",
        "t_memory (µs)": "{:.1f}",
        "t_compute (µs)": "{:.1f}",
        "T_sol (µs)": "{:.1f}",
    }
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


def crossing_table(
    gpus, measured: dict[str, roofline.GPUSpec] | None = None, problem_names=problems.PROBLEM_NAMES
) -> pd.DataFrame:
    """Per problem and GPU (``gpus``: keys of :data:`moe_lib.roofline.GPUS`, each once): the datasheet's ridge, the
    crossing T*, the first compute-bound token count ⌈T*⌉, the same from the ceilings measured on that GPU where
    ``measured`` has them ({GPU key: GPUSpec}), and the intensity the problem tends to at large T (a / b)."""
    measured = measured or {}
    rows = []
    for problem in problem_names:
        a, b, _ = cost_coefficients(problem)
        for gpu in dict.fromkeys(gpus):
            crossing = ridge_crossing(problem, gpu)
            mine = measured.get(gpu)
            rows.append(
                dict(
                    problem=problem,
                    gpu=gpu,
                    ridge=ridge_point(gpu),
                    crossing_tokens=crossing,
                    first_compute_bound=math.ceil(crossing) if math.isfinite(crossing) else None,
                    measured_ridge=ridge_point(mine) if mine else math.nan,
                    measured_crossing_tokens=ridge_crossing(problem, mine) if mine else math.nan,
                    intensity_limit=a / b,
                )
            )
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
        rows.append(
            dict(
                problem=problem,
                num_tokens=t,
                bound=row["bound"],
                t_memory_us=row["t_memory_us"],
                t_compute_us=row["t_compute_us"],
                weight_bytes_share=c / (b * t + c),
            )
        )
    return pd.DataFrame(rows).set_index(["problem", "num_tokens"])


# ================================================================ measured points


def measured_points(results: dict[str, ResultFile]) -> pd.DataFrame:
    """Every timed (ok) row as a point of the roofline plot: intensity and achieved FLOP/s, and the GPU it ran on."""
    frames = []
    for result in results.values():
        ok = ok_rows(result)
        frames.append(
            pd.DataFrame(
                {
                    "problem": result.problem,
                    "impl": ok["impl"],
                    "num_tokens": ok["num_tokens"],
                    "gpu": result.gpu_key,
                    "flops": ok["flops"],
                    "bytes": ok["bytes"],
                    "intensity": ok["flops"] / ok["bytes"],
                    "median_ms": ok["median_ms"],
                    "flop_rate": ok["flops"] / (ok["median_ms"] * 1e-3),
                    "file": result.csv.name,
                }
            )
        )
    columns = ["problem", "impl", "num_tokens", "gpu", "flops", "bytes", "intensity", "median_ms", "flop_rate", "file"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


# below this roofline time a kernel's time is its latencies: a launch and a chain of dependent round trips
# (5–15 µs measured at P1's few tokens, notes/p1/design-05-traced.md)
LATENCY_BOUND_US = 10.0


def roof_time_s(gpu, flops, traffic):
    """The roofline's time for ``flops`` and ``traffic`` bytes on ``gpu``: max(bytes / bandwidth, FLOPs / rate)."""
    spec = _spec(gpu)
    return np.maximum(
        np.asarray(traffic, dtype=float) / spec.dram_bandwidth, np.asarray(flops, dtype=float) / spec.bf16_dense_flops
    )


def project_points(points: pd.DataFrame, to_gpu: str, latency_bound_us: float = LATENCY_BOUND_US) -> pd.DataFrame:
    """The points with ``projected_rate`` and ``projected_ms`` on ``to_gpu`` and how each was projected
    (``projection``). Two models, by the point's roofline time T_roof on its own GPU (datasheet ceilings):

    - from ``latency_bound_us`` up, the roof is what bounds it: it **keeps its fraction** of the roofline, its rate
      scaled by roof(to_gpu, AI) / roof(its GPU, AI) — the ratio of the bandwidths where both GPUs are memory-bound
      at its intensity AI, of the bf16 rates where both are compute-bound;
    - below, its time is latencies (a launch, chains of dependent loads) that a faster roof does not shorten: the
      **latency model** keeps the time beyond the roof, t − T_roof(its GPU), and adds the new GPU's T_roof to it.

    Points measured on ``to_gpu`` keep their rate ("measured"); points from a GPU not in
    :data:`moe_lib.roofline.GPUS` get NaN ("not projected")."""
    projected = points.copy()
    scales, methods = [], []
    for gpu, intensity, flops, traffic, ms in zip(
        points["gpu"], points["intensity"], points["flops"], points["bytes"], points["median_ms"], strict=True
    ):
        if gpu == to_gpu:
            scales.append(1.0)
            methods.append("measured")
        elif gpu not in roofline.GPUS:
            scales.append(math.nan)
            methods.append("not projected")
        elif float(roof_time_s(gpu, flops, traffic)) * 1e6 >= latency_bound_us:
            scales.append(float(attainable(to_gpu, intensity) / attainable(gpu, intensity)))
            methods.append("keeps its fraction")
        else:
            seconds = ms * 1e-3 - float(roof_time_s(gpu, flops, traffic)) + float(roof_time_s(to_gpu, flops, traffic))
            scales.append(ms * 1e-3 / seconds)
            methods.append("latency model")
    projected["scale"] = scales
    projected["projection"] = methods
    projected["projected_rate"] = projected["flop_rate"] * projected["scale"]
    projected["projected_ms"] = projected["median_ms"] / projected["scale"]
    projected["projected"] = projected["gpu"] != to_gpu
    return projected


def points_table(points: pd.DataFrame, gpu: str, impl: str = OURS) -> pd.DataFrame:
    """``impl``'s points (from :func:`project_points`) with the fraction of ``gpu``'s roofline they reach."""
    mine = points[points["impl"] == impl].copy()
    mine["roofline fraction"] = mine["projected_rate"] / attainable(gpu, mine["intensity"])
    mine = mine.sort_values(["problem", "num_tokens"]).set_index(["problem", "num_tokens"])
    return mine[["gpu", "projection", "intensity", "flop_rate", "projected_rate", "roofline fraction"]].rename(
        columns={"gpu": "measured on", "flop_rate": "measured FLOP/s", "projected_rate": f"FLOP/s on {gpu}"}
    )


# ================================================================ figures


def _label_roofs(ax, spec: roofline.GPUSpec, x_min: float, color: str) -> None:
    ridge = spec.bf16_dense_flops / spec.dram_bandwidth
    ax.annotate(
        f"DRAM {spec.dram_bandwidth / 1e12:.2f} TB/s",
        (x_min * 1.5, x_min * 1.5 * spec.dram_bandwidth),
        rotation=33,
        color=color,
        fontsize=8,
        va="bottom",
    )
    ax.annotate(
        f"bf16 dense {spec.bf16_dense_flops / 1e12:.0f} TFLOP/s",
        (ridge * 1.15, spec.bf16_dense_flops),
        color=color,
        fontsize=8,
        va="bottom",
    )


def plot_roofline(ax, gpu: str, *, x_range=(0.5, 5000.0), measured: roofline.GPUSpec | None = None) -> None:
    """The two ceilings of ``gpu`` (log-log: attainable FLOP/s against FLOP/byte), its ridge, and
    optionally a run's measured ceilings (dashed)."""
    spec = _spec(gpu)
    x = np.logspace(math.log10(x_range[0]), math.log10(x_range[1]), 400)
    ax.loglog(x, attainable(spec, x), color="black", linewidth=2, label=f"{gpu} roofline (datasheet)")
    ridge = ridge_point(spec)
    ax.axvline(ridge, color="black", linestyle=":", linewidth=1)
    ax.annotate(
        f"ridge {ridge:.0f} FLOP/B",
        (ridge, 0.03),
        xycoords=ax.get_xaxis_transform(),
        rotation=90,
        fontsize=8,
        ha="right",
        va="bottom",
    )
    _label_roofs(ax, spec, x_range[0], "black")
    if measured is not None:
        ax.loglog(
            x,
            attainable(measured, x),
            color="tab:gray",
            linestyle="--",
            linewidth=1.2,
            label=f"{measured.name}: {measured.dram_bandwidth / 1e12:.2f} TB/s, "
            f"{measured.bf16_dense_flops / 1e12:.0f} TFLOP/s",
        )
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
        ax.annotate(
            f"T={row['num_tokens']}",
            (row["intensity"], row["projected_rate"]),
            xytext=(row["intensity"], y),
            fontsize=8,
            color=color,
            ha="center",
            va="top",
            arrowprops=dict(arrowstyle="-", color=color, lw=0.6, alpha=0.6, shrinkA=1, shrinkB=5),
        )


PROJECTION_STYLE = {
    "measured": ("solid", True),
    "keeps its fraction": ("solid", False),
    "latency model": ("dashed", False),
}  # (edge line style, filled) of a point by its projection


def roofline_figure(
    gpu: str,
    points: pd.DataFrame,
    results: dict[str, ResultFile] | None = None,
    *,
    latency_bound_us: float = LATENCY_BOUND_US,
):
    """One roofline panel per problem with points (a row each): measured ones filled where they ran on ``gpu``,
    projected ones hollow where they ran elsewhere (:func:`project_points`; those projected by the latency model
    with a dashed edge), the legend beside the axes. Returns the figure."""
    projected = project_points(points, gpu, latency_bound_us)
    names = [p for p in problems.PROBLEM_NAMES if p in set(points["problem"])] or list(problems.PROBLEM_NAMES)
    fig, axes = plt.subplots(len(names), 1, figsize=(12.5, 5.2 * len(names)), sharex=True, squeeze=False)
    y_min = max(1e9, projected["projected_rate"].min() / 8) if len(projected) else 1e10  # room for the T labels
    for ax, problem in zip(axes[:, 0], names, strict=True):
        result = find(results, problem) if results else None
        same_gpu = result is not None and result.gpu_key == gpu
        plot_roofline(ax, gpu, measured=result.measured_spec if same_gpu else None)
        mine = projected[projected["problem"] == problem]
        handles = [ax.get_lines()[0]]  # the roofline
        for impl in [i for i in IMPLS if i in set(mine["impl"])] + sorted(set(mine["impl"]) - set(IMPLS)):
            rows = mine[mine["impl"] == impl]
            color, marker = IMPL_STYLE.get(impl, ("black", "x"))
            handles.append(Line2D([], [], color=color, marker=marker, ls="none", label=impl))
            for method, group in rows.groupby("projection", sort=False):
                if method not in PROJECTION_STYLE:
                    continue
                edge, filled = PROJECTION_STYLE[method]
                ax.scatter(
                    group["intensity"],
                    group["projected_rate"],
                    color=color if filled else "none",
                    edgecolors=color,
                    marker=marker,
                    s=70 if impl == OURS else 38,
                    linewidths=1.2,
                    linestyles=edge,
                    zorder=3,
                )
        sources = ", ".join(sorted(set(mine["gpu"]) - {gpu}))
        for method in [m for m in PROJECTION_STYLE if m in set(mine["projection"])]:
            edge, filled = PROJECTION_STYLE[method]
            what = f"measured on {gpu}" if method == "measured" else f"from {sources}: {method}"
            handles.append(
                Line2D(
                    [],
                    [],
                    color="black",
                    marker="o",
                    ls="none",
                    markerfacecolor="black" if filled else "none",
                    markeredgewidth=1.2,
                    label=what,
                )
            )
            if edge == "dashed":
                handles[-1].set_label(f"{what} (dashed edge)")
        _label_token_counts(ax, mine)
        ax.set_ylim(y_min, _spec(gpu).bf16_dense_flops * 4)
        ax.set_title(f"{problems.load(problem).title} on {gpu}", fontsize=11)
        handles += [line for line in ax.get_lines()[1:] if not line.get_label().startswith("_")]  # measured ceilings
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # covers nothing
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
            ax.annotate(
                f"T* = {crossing:.0f}",
                (crossing, 0.03),
                xycoords=ax.get_xaxis_transform(),
                rotation=90,
                color=color,
                fontsize=8,
                ha="right",
                va="bottom",
            )
    for (label, spec), style in zip(ridges.items(), ("--", "-."), strict=False):
        ax.axhline(
            ridge_point(spec),
            color="black",
            linestyle=style,
            linewidth=1,
            label=f"{label}: {ridge_point(spec):.0f} FLOP/B",
        )
    ax.set_ylim(bottom=0.5)
    ax.set(
        xlabel="tokens T",
        ylabel="arithmetic intensity (FLOP / byte)",
        title=f"Where each problem turns compute-bound on {gpu}",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: it covers no curve
    return fig


# ================================================================ granularity and sparsity (SonicMoE's view)


def expert_gemm_intensity(
    num_tokens, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, element_bytes: int = 2
):
    """The arithmetic intensity of one expert's up-projection, [m, H] × [H, 2I] with m = T·K/E rows (the mean under
    uniform routing), each operand read and the output written once: 2·m·H·2I FLOPs over
    b·(m·H + 2·H·I + m·2I) bytes, i.e. AI = 4 / b · 1 / (1/I + 2/m + 2/H) with b = ``element_bytes``. In SonicMoE's
    terms (granularity G = H/I, sparsity ρ = K/E): AI = 4 / b · 1 / ((G + 2)/H + 2/(T·ρ))."""
    for name, value in (
        ("hidden_size", hidden_size),
        ("intermediate_size", intermediate_size),
        ("num_experts", num_experts),
        ("top_k", top_k),
        ("element_bytes", element_bytes),
    ):
        if not value > 0:
            raise ValueError(f"{name}: expected a positive number, got {value!r}")
    rows = np.asarray(num_tokens, dtype=float) * top_k / num_experts
    H, I = hidden_size, intermediate_size
    return 4 / element_bytes / (1 / I + 2 / rows + 2 / H)


def granularity_table(shapes, num_tokens: int, gpu) -> pd.DataFrame:
    """Per model shape (``shapes``: objects with name, hidden_size, intermediate_size, num_experts and top_k, e.g.
    :data:`moe_lib.bench.models.MODEL_SHAPES`): its granularity G = H/I, sparsity ρ = K/E, rows per expert at
    ``num_tokens`` and the intensity of :func:`expert_gemm_intensity` beside ``gpu``'s ridge."""
    ridge = ridge_point(gpu)
    rows = {}
    for shape in shapes:
        if shape.num_experts is None:
            continue
        ai = float(
            expert_gemm_intensity(
                num_tokens, shape.hidden_size, shape.intermediate_size, shape.num_experts, shape.top_k
            )
        )
        rows[shape.name] = {
            "H": shape.hidden_size,
            "I": shape.intermediate_size,
            "E": shape.num_experts,
            "K": shape.top_k,
            "G = H/I": shape.hidden_size / shape.intermediate_size,
            "ρ = K/E": shape.top_k / shape.num_experts,
            "rows per expert": num_tokens * shape.top_k / shape.num_experts,
            "AI (FLOP/B)": ai,
            "bound": "compute" if ai >= ridge else "memory",
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def granularity_figure(gpu, shapes, num_tokens: int, hidden_size: int = 4096):
    """SonicMoE's view of arithmetic intensity: AI of one expert's up-projection against the rows per expert
    m = T·ρ, one curve per granularity G at ``hidden_size``, ``gpu``'s ridge dashed, and the model ``shapes`` at
    ``num_tokens`` tokens marked at their own G, ρ and H. Returns the figure."""
    fig, ax = plt.subplots(figsize=(10, 4.6), layout="constrained")
    rows = np.logspace(0.5, 4.5, 300)
    for granularity in (0.5, 1, 2, 4, 8):
        ax.loglog(
            rows,
            expert_gemm_intensity(rows, hidden_size, hidden_size / granularity, 1, 1),
            lw=1.2,
            label=f"G = H/I = {granularity:g} (H = {hidden_size})",
        )
    ax.axhline(ridge_point(gpu), color="black", ls="--", lw=1, label=f"{gpu} ridge {ridge_point(gpu):.0f} FLOP/B")
    table = granularity_table(shapes, num_tokens, gpu)
    ax.scatter(table["rows per expert"], table["AI (FLOP/B)"], color="black", zorder=3, s=22)
    ordered = table.sort_values(["rows per expert", "AI (FLOP/B)"])
    for index, (name, row) in enumerate(ordered.iterrows()):  # labels alternately above and below: none overlap
        above = index % 2 == 1
        offset = (-6, 16) if above else (6, -16)
        ax.annotate(
            name,
            (row["rows per expert"], row["AI (FLOP/B)"]),
            xytext=offset,
            textcoords="offset points",
            fontsize=7,
            ha="right" if above else "left",
            va="bottom" if above else "top",
            arrowprops=dict(arrowstyle="-", lw=0.5, color="gray"),
        )
    ax.set(
        xlabel="rows per expert m = T·K/E",
        ylabel="arithmetic intensity (FLOP / byte)",
        title=f"One expert's up-projection [m, H] × [H, 2I] in bf16; the models at T = {num_tokens}",
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
