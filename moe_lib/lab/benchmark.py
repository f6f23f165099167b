"""Notebook 05: the benchmark's results as tables and figures.

Per result file (:mod:`.results`): times, speed-ups over the best PyTorch peer, roofline fractions,
the benchmark's score, correctness; per-case figures over every file; and :func:`run_benchmark`, a
live run of ``python -m moe_lib.bench`` read back the same way. The project's targets are in
:mod:`.targets`.

Times are in milliseconds (``*_ms``) as the column names say.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib import ticker

from .. import roofline
from ..bench.results import geomean
from .results import (
    IMPL_STYLE,
    OURS,
    ROOT,
    ResultFile,
    format_ms,
    impl_columns,
    load_result_file,
    ok_rows,
    pivot,
    styled,
    times_table,
)


def baseline_labels() -> tuple[str, ...]:
    """The PyTorch peers the benchmark picks a score's baseline from (``moe_lib.bench.peers``)."""
    from ..bench.peers import BASELINE_LABELS

    return tuple(BASELINE_LABELS)


def provenance_table(results: dict[str, ResultFile]) -> pd.DataFrame:
    """Where, when and with what each result file was measured: one row per file."""
    rows = {}
    for result in results.values():
        p = result.provenance
        ceilings = p.get("ceilings") or {}
        suite = p.get("suite") or {}
        commit = (p.get("git_commit") or "unknown")[:10] + (" (dirty)" if p.get("git_dirty") else "")
        rows[result.csv.name] = {
            "problem": result.problem,
            "dtype": result.dtype,
            "GPU": p.get("gpu_name") or result.gpu_key,
            "driver": p.get("driver_version"),
            "torch": p.get("torch"),
            "triton": p.get("triton"),
            "liger-kernel": p.get("liger_kernel"),
            "CUDA": p.get("cuda"),
            "commit": commit,
            "date (UTC)": p.get("date_utc"),
            "cases": f"{len(result.tokens)} ({suite.get('provenance', '?')}: {suite.get('source', '?')})",
            "copy TB/s": ceilings.get("copy_bandwidth", math.nan) / 1e12,
            "bf16 TFLOP/s": ceilings.get("bf16_matmul_flops", math.nan) / 1e12,
            "warm-up / reps": f"{(p.get('timing') or {}).get('warmup')} / {(p.get('timing') or {}).get('reps')}",
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def run_benchmark(problem: str, tokens: str, out_dir) -> dict[str, ResultFile]:
    """Runs ``python -m moe_lib.bench --problem <problem> --tokens <tokens> --out <out_dir>`` (every
    implementation available on the device), prints its report, and returns the result files in
    ``<out_dir>/<gpu>/`` (give it a fresh folder) keyed as :func:`.results.load_results` keys them."""
    command = [sys.executable, "-m", "moe_lib.bench", "--problem", problem, "--tokens", tokens, "--out", str(out_dir)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print(done.stdout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[1:])} failed with exit code {done.returncode}:\n{done.stderr}")
    written = sorted(path for path in Path(out_dir).glob("*/*.csv") if path.with_suffix(".json").is_file())
    if not written:
        raise FileNotFoundError(f"out_dir: the benchmark wrote no result file under {out_dir}")
    return {result.key: result for result in map(load_result_file, written)}


# ================================================================ tables


def best_peer(result: ResultFile) -> pd.DataFrame:
    """Per case, the fastest correct PyTorch peer (:func:`baseline_labels`): impl, median_ms and whether it
    passes the element rule (None where the problem has none)."""
    rows = ok_rows(result)
    rows = rows[rows["impl"].isin(baseline_labels())]
    best = rows.loc[rows.groupby("num_tokens")["median_ms"].idxmin()].set_index("num_tokens")
    table = best[["impl", "median_ms", "passes_element_rule"]].reindex(result.tokens)
    table.index.name = "num_tokens"
    return table


def speedup_table(result: ResultFile) -> pd.DataFrame:
    """Per case: the best PyTorch peer's name and time, and every implementation's speed-up over it
    (best peer's time / its time: above 1 is faster)."""
    times = pivot(result, "median_ms", ok_rows(result))
    best = best_peer(result)
    table = times.rdiv(best["median_ms"], axis=0)
    table.insert(0, "best peer (ms)", best["median_ms"])
    names = [
        impl + (" ✗rule" if passes is False else "")
        for impl, passes in zip(best["impl"].fillna("–"), best["passes_element_rule"], strict=True)
    ]
    table.insert(0, "best peer", names)
    return table


def roofline_fraction_table(result: ResultFile) -> pd.DataFrame:
    """T_sol / T per case and implementation, T_sol from the run's measured ceilings (1 = at the roofline)."""
    return pivot(result, "roofline_fraction", ok_rows(result))


def impl_summary(result: ResultFile) -> pd.DataFrame:
    """Per implementation: geomean time over its correct cases, roofline fraction, the benchmark's
    score S = 1 / (1 + (T − T_sol)/(T_b − T_sol)) on geomeans (computed here with
    :func:`moe_lib.roofline.sol_score`, and as the file recorded it), correctness."""
    frame = result.frame
    sol_geomean = geomean(frame.drop_duplicates("num_tokens")["sol_ms"])
    rows = {}
    for impl in impl_columns(result):
        mine = frame[frame["impl"] == impl]
        ok = mine[mine["status"] == "ok"]
        rows[impl] = {
            "geomean_ms": geomean(ok["median_ms"]),
            "roofline_fraction": geomean(ok["sol_ms"] / ok["median_ms"]),
            "cases_correct": f"{len(ok)}/{len(mine)}",
            "all_correct": bool(len(mine) and len(ok) == len(mine)),
            "element_rule": _element_rule_verdict(ok),
            "worst_rel_error": ok["rel_error"].max() if len(ok) else math.nan,
        }
    # the score's baseline, as the benchmark harness picks it: the fastest PyTorch peer correct on every case
    candidates = {
        impl: row["geomean_ms"] for impl, row in rows.items() if impl in baseline_labels() and row["all_correct"]
    }
    baseline = min(candidates, key=candidates.get) if candidates else None
    baseline_ms = candidates[baseline] if baseline else math.nan
    summary = result.meta.get("summary", {})
    for impl, row in rows.items():
        usable = row["all_correct"] and baseline_ms > sol_geomean
        row["sol_score"] = roofline.sol_score(row["geomean_ms"], baseline_ms, sol_geomean) if usable else math.nan
        recorded = (summary.get(impl) or {}).get("sol_score")
        row["sol_score (file)"] = math.nan if recorded is None else recorded
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.attrs.update(baseline=baseline, baseline_ms=baseline_ms, sol_geomean_ms=sol_geomean)
    return table


def _element_rule_verdict(rows: pd.DataFrame) -> str:
    verdicts = [v for v in rows["passes_element_rule"] if v is not None]
    if not verdicts:
        return "no rule"
    failing = sum(not v for v in verdicts)
    return "passes" if not failing else f"FAILS on {failing}/{len(verdicts)} cases"


def correctness_table(result: ResultFile) -> pd.DataFrame:
    """Per implementation and case: status, worst relative error over the outputs, the element rule's
    pass fraction (worst output) and verdict; a ``flag`` for rows to read twice."""
    columns = ["impl", "num_tokens", "status", "rel_error", "element_pass_fraction", "passes_element_rule"]
    table = result.frame[columns].copy()
    flags = []
    for _, row in table.iterrows():
        if row["status"] != "ok":
            flags.append("not timed: " + row["status"].split(":")[0])
        elif row["passes_element_rule"] is False:
            flags.append("fails the element rule" + (" (ours: must pass)" if row["impl"] == OURS else " (peer)"))
        else:
            flags.append("")
    table["flag"] = flags
    order = {impl: i for i, impl in enumerate(impl_columns(result))}
    table = table.sort_values(["impl", "num_tokens"], key=lambda c: c.map(order) if c.name == "impl" else c)
    return table.set_index(["impl", "num_tokens"])


def flag_summary(result: ResultFile) -> str:
    """One line on :func:`correctness_table`'s flags: per flagged implementation, what and in how many cases."""
    table = correctness_table(result)
    flagged = table[table["flag"] != ""].reset_index()
    cases = table.index.get_level_values("num_tokens").nunique()
    if flagged.empty:
        return f"{result.title}: nothing flagged, every implementation correct on every case"
    groups = flagged.groupby(["impl", "flag"], sort=False)
    parts = [f"{impl} {flag} in {len(rows)} of {cases} cases" for (impl, flag), rows in groups]
    return f"{result.title}: " + "; ".join(parts)


def correctness_pivot(result: ResultFile) -> pd.DataFrame:
    """Per case (rows) and implementation: worst relative error, and the element rule's worst pass fraction."""
    errors = pivot(result, "rel_error").add_suffix(" · rel. error")
    fractions = pivot(result, "element_pass_fraction").add_suffix(" · elements passing")
    columns = [c for impl in impl_columns(result) for c in (f"{impl} · rel. error", f"{impl} · elements passing")]
    table = pd.concat([errors, fractions], axis=1)[columns]
    return table.dropna(axis=1, how="all")


def recorded_summary(result: ResultFile) -> dict:
    """{impl: {geomean_ms, all_correct}} as the result's JSON recorded them."""
    return {
        impl: {"geomean_ms": s.get("geomean_ms"), "all_correct": s.get("all_correct")}
        for impl, s in result.meta.get("summary", {}).items()
    }


# ================================================================ styled tables


def styled_times(result: ResultFile):
    """:func:`.results.times_table` as a styled table, the fastest implementation of each case in bold."""
    table = times_table(result)
    impls = [c for c in table.columns if not c.startswith("T_sol")]
    return styled(table, format_ms, f"{result.title}: median GPU time per case ({result.csv.name})").highlight_min(
        subset=impls, axis=1, props="font-weight: bold"
    )


def styled_speedups(result: ResultFile):
    """:func:`speedup_table` styled: speed-ups as "1.23×", green above 1, red below."""
    table = speedup_table(result)
    impls = [c for c in table.columns if not c.startswith("best peer")]

    def colour(value):
        if pd.isna(value) or value == 1:
            return ""
        return "color: #1a7f37" if value > 1 else "color: #cf222e"

    formats = {c: "{:.2f}×" for c in impls} | {"best peer (ms)": format_ms}
    return styled(
        table,
        formats,
        f"{result.title}: speed-up over the best PyTorch peer per case (✗rule: that peer fails the element rule)",
    ).map(colour, subset=impls)


def styled_fractions(result: ResultFile):
    """:func:`roofline_fraction_table` styled, shaded from 0 to 1."""
    table = roofline_fraction_table(result)
    return styled(
        table, "{:.3f}", f"{result.title}: roofline fraction T_sol / T (the run's measured ceilings)"
    ).background_gradient(cmap="Greens", vmin=0, vmax=1)


def styled_summary(result: ResultFile):
    """:func:`impl_summary` styled."""
    table = impl_summary(result)
    baseline = table.attrs["baseline"]
    caption = (
        f"{result.title}: geomeans over the correct cases; score baseline {baseline} "
        f"({format_ms(table.attrs['baseline_ms'])}), T_sol geomean {format_ms(table.attrs['sol_geomean_ms'])}"
    )
    formats = {
        "geomean_ms": format_ms,
        "roofline_fraction": "{:.3f}",
        "worst_rel_error": "{:.2e}",
        "sol_score": "{:.3f}",
        "sol_score (file)": "{:.3f}",
    }
    return styled(table, formats, caption)


def styled_correctness(result: ResultFile):
    """:func:`correctness_pivot` styled: pass fractions below the rule's required fraction in red."""
    table = correctness_pivot(result)
    rule = result.meta.get("element_rule") or {}
    required = rule.get("required_fraction", 0.0)
    passing = [c for c in table.columns if c.endswith("elements passing")]
    formats = {c: "{:.2e}" for c in table.columns if c.endswith("rel. error")} | {c: "{:.4f}" for c in passing}
    caption = f"{result.title}: correctness per case" + (
        f" (element rule: |out − ref| ≤ {rule['atol']} + {rule['rtol']}·|ref| on ≥ {required:.0%} of elements)"
        if rule
        else " (no element rule: judged by relative error)"
    )
    return styled(table, formats, caption).map(
        lambda v: "color: #cf222e; font-weight: bold" if not pd.isna(v) and v < required else "", subset=passing
    )


# ================================================================ figures


def per_case_figure(results: dict[str, ResultFile], kind: str):
    """One panel per result file against the token count: ``kind`` "time" (median per implementation,
    log scale, with T_sol), "speedup" (over the best PyTorch peer) or "fraction" (roofline fraction)."""
    tables = {"time": times_table, "speedup": speedup_table, "fraction": roofline_fraction_table}
    if kind not in tables:
        raise ValueError(f"kind: expected one of {sorted(tables)}, got {kind!r}")
    labels = {
        "time": "median GPU time (ms)",
        "speedup": "speed-up over the best PyTorch peer",
        "fraction": "roofline fraction T_sol / T",
    }
    if not results:  # a GPU's folder with layer or model-suite runs only: nothing per case to draw
        fig, ax = plt.subplots(figsize=(12, 1.2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no result file of a problem's function (mode op) in this folder", ha="center", va="center")
        return fig
    fig = plt.figure(figsize=(12, 4.8 if len(results) == 1 else 9.6), layout="constrained")
    grid = fig.add_gridspec(1 if len(results) == 1 else 2, max(len(results) - 1, 1))
    # the first file (P1 and its 16 cases) across the top, the others side by side below
    axes = [fig.add_subplot(grid[0, :])] + [fig.add_subplot(grid[1, i]) for i in range(len(results) - 1)]
    for ax, result in zip(axes, results.values(), strict=True):
        table = tables[kind](result)
        for impl in [c for c in table.columns if c in IMPL_STYLE or c in result.impls]:
            color, marker = IMPL_STYLE.get(impl, ("black", "x"))
            size = 9 if impl == OURS else 5
            ax.plot(table.index, table[impl], marker=marker, color=color, label=impl, markersize=size)
        if kind == "time":
            ax.plot(table.index, table["T_sol (measured)"], color="black", linestyle="--", label="T_sol (measured)")
            ax.set_yscale("log")
        elif kind == "speedup":
            ax.axhline(1.0, color="black", linewidth=1)
            ax.set_yscale("log")
        else:
            ax.axhline(1.0, color="black", linewidth=1)
            ax.set_ylim(0, 1.05)
        ax.set_xscale("log")
        if len(table.index) <= 6:  # few cases: tick exactly those
            ax.set_xticks(list(table.index), [str(t) for t in table.index])
            ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set(xlabel="tokens T", ylabel=labels[kind], title=f"{result.title} · {result.gpu_key} · {result.date}")
        ax.title.set_fontsize(10)
        if ax.get_yscale() == "log":  # plain numbers on the ticks (a short log axis would write 1.2×10⁰)
            low, high = ax.get_ylim()
            ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g") if high / low < 10 else ticker.NullFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: it covers no point
    return fig
