"""Notebook 05: two rulers of the same calls, graph replay and NVIDIA's harness.

NVIDIA's harness (``python -m moe_lib.bench.official``, ``<date>-<problem>-official-<impl>.json``) times
eager calls on fresh inputs with CUPTI, from a call's first kernel start to its last kernel end; our
harness replays a CUDA graph of the call (GPU time alone). :func:`ruler_table` joins each workload's
latency there with the same implementation's graph-replay median from the newest result file
(:func:`load_official_runs`, :func:`ruler_bands`, :func:`ruler_reading`, :func:`ruler_figure`).
Times are in microseconds (``*_us``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from .results import (
    IMPL_STYLE,
    IMPLS,
    RESULTS_DIR,
    ResultFileError,
    find,
    load_results,
    ok_rows,
    read_run_json,
    resolve_path,
    shown_path,
    styled,
)

RULER_COLUMNS = ["num_tokens", "impl", "graph_us", "official_us", "gap_us", "status"]
OFFICIAL_KEYS = ("problem", "impl", "workloads")
PASSED = "PASSED"  # NVIDIA's harness's status of a workload that passed its check and was timed
BANDS = ((1, 16), (17, 511), (512, math.inf))  # token ranges of :func:`ruler_bands`, inclusive


@dataclass(frozen=True)
class OfficialRun:
    """One run of NVIDIA's harness as committed: ``<date>-<problem>-official-<impl>.json`` (provenance and,
    per workload, the harness's status, latency and errors) beside the harness's own traces (``.jsonl``)."""

    path: Path
    meta: dict = field(repr=False)

    @property
    def problem(self) -> str:
        return self.meta["problem"]

    @property
    def impl(self) -> str:
        return self.meta["impl"]

    @property
    def date(self) -> str:
        return self.path.stem[:10]

    @property
    def commit(self) -> str:
        """The commit of the code the harness ran (10 characters, "(dirty)" after it where it had edits)."""
        return _run_commit(self.meta.get("provenance") or {})

    @property
    def workloads(self) -> pd.DataFrame:
        """One row per workload: num_tokens, status, latency_ms, reference_latency_ms, speedup, max errors."""
        return pd.DataFrame(self.meta["workloads"])


def _run_commit(provenance: dict) -> str:
    return (provenance.get("git_commit") or "unknown")[:10] + (" (dirty)" if provenance.get("git_dirty") else "")


def load_official_runs(problem: str, results_dir=RESULTS_DIR, gpu_key: str = "H200") -> dict[str, OfficialRun]:
    """The committed runs of NVIDIA's harness for ``problem`` in ``<results_dir>/<gpu_key>/``: the newest
    of each implementation, keyed by its label in the order of :data:`.results.IMPLS` (others after them).
    Empty when there is no such run or no such folder; :class:`.results.ResultFileError` naming the file
    when one is malformed."""
    folder = resolve_path(results_dir) / gpu_key
    newest: dict[str, OfficialRun] = {}
    for path in sorted(folder.glob(f"*-{problem}-official-*.json")):  # named <date>-...: later dates sort later
        meta = read_run_json(path, OFFICIAL_KEYS)
        if meta["problem"] != problem or meta.get("timing", "official") != "official":
            continue
        workloads = meta["workloads"]
        if not isinstance(workloads, list) or not all(isinstance(w, dict) and "num_tokens" in w for w in workloads):
            raise ResultFileError(f"{path}: workloads: expected a list of objects with num_tokens")
        newest[meta["impl"]] = OfficialRun(path, meta)
    return dict(sorted(newest.items(), key=lambda item: _impl_order(item[0])))


def _impl_order(impl: str) -> tuple[int, str]:
    return (IMPLS.index(impl), "") if impl in IMPLS else (len(IMPLS), impl)


def ruler_table(problem: str, results_dir=RESULTS_DIR, gpu_key: str = "H200") -> pd.DataFrame:
    """Every workload of the committed runs of NVIDIA's harness for ``problem`` (:func:`load_official_runs`),
    each beside the same implementation's graph-replay median from the newest result file of the GPU
    (:func:`.results.load_results`): columns num_tokens, impl, graph_us, official_us (the harness's latency;
    NaN where the workload failed there), gap_us (official − graph) and status (the harness's), rows by
    implementation then token count.

    ``attrs``: ``graph`` (file, commit, date of the graph-replay file, or None), ``official`` ({impl: file,
    commit, date, passed}), ``note`` (a sentence when there is nothing, or nothing to join, else "")."""
    table = pd.DataFrame(columns=RULER_COLUMNS)
    folder = resolve_path(results_dir) / gpu_key
    runs = load_official_runs(problem, results_dir, gpu_key)
    table.attrs.update(graph=None, official={}, note="")
    if not runs:
        table.attrs["note"] = (
            f"No run of NVIDIA's harness for {problem} is committed in {shown_path(folder)} "
            f"(python -m moe_lib.bench.official run --problem {problem} makes one)."
        )
        return table
    try:
        graph = find(load_results(results_dir, gpu_key), problem)
    except FileNotFoundError:
        graph = None
    rows = []
    for impl, run in runs.items():
        medians = {}
        if graph is not None:
            mine = ok_rows(graph)
            medians = mine[mine["impl"] == impl].set_index("num_tokens")["median_ms"].to_dict()
        for workload in sorted(run.meta["workloads"], key=lambda w: w["num_tokens"]):
            tokens = int(workload["num_tokens"])
            latency = workload.get("latency_ms")
            official_us = math.nan if latency is None else latency * 1e3
            graph_us = medians.get(tokens, math.nan) * 1e3
            rows.append(
                dict(
                    num_tokens=tokens,
                    impl=impl,
                    graph_us=graph_us,
                    official_us=official_us,
                    gap_us=official_us - graph_us,
                    status=workload.get("status"),
                )
            )
        passed = sum(w.get("status") == PASSED for w in run.meta["workloads"])
        table.attrs["official"][impl] = dict(
            file=run.path.name, commit=run.commit, date=run.date, passed=f"{passed}/{len(run.meta['workloads'])}"
        )
    attrs = table.attrs
    table = pd.DataFrame(rows, columns=RULER_COLUMNS)
    table.attrs.update(attrs)
    if graph is None:
        where = shown_path(folder)
        table.attrs["note"] = f"No graph-replay result file of {problem} in {where}: no graph_us, no gap_us."
    else:
        table.attrs["graph"] = dict(file=graph.csv.name, commit=_run_commit(graph.provenance), date=graph.date)
        if table["graph_us"].isna().all():
            table.attrs["note"] = f"{graph.csv.name} times none of {', '.join(runs)}: graph_us and gap_us are empty."
    return table


def ruler_provenance(table: pd.DataFrame) -> list[str]:
    """One line per file :func:`ruler_table` joined: which run, of which commit; and a warning where the
    commits differ (the two rulers then timed the code of different commits)."""
    lines = []
    graph = table.attrs.get("graph")
    if graph:
        lines.append(f"graph replay: {graph['file']} (commit {graph['commit']}, {graph['date']})")
    for impl, run in table.attrs.get("official", {}).items():
        lines.append(
            f"NVIDIA's harness, {impl}: {run['file']} (commit {run['commit']}, {run['date']}; "
            f"{run['passed']} workloads passed)"
        )
    commits = {run["commit"] for run in table.attrs.get("official", {}).values()}
    if graph:
        commits.add(graph["commit"])
    if len(commits) > 1:
        lines.append(
            "The runs come from different commits: where the code changed between them, the two rulers "
            "timed different code (notes/p1/nvidia-harness.md says what changed when)."
        )
    return lines


def _band_name(low, high) -> str:
    return f"T ≥ {low}" if high == math.inf else f"{low} ≤ T ≤ {high}"


def ruler_bands(table: pd.DataFrame, bands=BANDS) -> pd.DataFrame:
    """Per implementation and range of token counts (``bands``, inclusive; ranges without a workload left
    out): workloads, how many passed NVIDIA's harness, and the smallest, median and largest gap (µs,
    official − graph) over the passing workloads timed by both rulers."""
    rows = []
    for impl in dict.fromkeys(table["impl"]):
        mine = table[table["impl"] == impl]
        for low, high in bands:
            band = mine[(mine["num_tokens"] >= low) & (mine["num_tokens"] <= high)]
            if band.empty:
                continue
            gaps = band.loc[band["status"] == PASSED, "gap_us"].dropna()
            rows.append(
                {
                    "impl": impl,
                    "tokens": _band_name(low, high),
                    "workloads": len(band),
                    "passed": int((band["status"] == PASSED).sum()),
                    "gap min (µs)": gaps.min() if len(gaps) else math.nan,
                    "gap median (µs)": gaps.median() if len(gaps) else math.nan,
                    "gap max (µs)": gaps.max() if len(gaps) else math.nan,
                }
            )
    columns = ["impl", "tokens", "workloads", "passed", "gap min (µs)", "gap median (µs)", "gap max (µs)"]
    return pd.DataFrame(rows, columns=columns).set_index(["impl", "tokens"])


def ruler_reading(table: pd.DataFrame) -> list[str]:
    """:func:`ruler_bands` in sentences, one per implementation: how many workloads pass NVIDIA's harness,
    and per range of token counts the gap official − graph over the passing ones."""
    bands = ruler_bands(table)
    lines = []
    for impl in dict.fromkeys(bands.index.get_level_values("impl")):
        mine = bands.loc[impl]
        parts = []
        for name, row in mine.iterrows():
            if math.isnan(row["gap median (µs)"]):
                parts.append(f"{name}: no workload passed and timed by both")
            else:
                parts.append(
                    f"{name}: {row['gap min (µs)']:+.1f} to {row['gap max (µs)']:+.1f} µs "
                    f"(median {row['gap median (µs)']:+.1f}) over {int(row['passed'])} passing"
                )
        passed, workloads = int(mine["passed"].sum()), int(mine["workloads"].sum())
        lines.append(
            f"{impl}: {passed}/{workloads} workloads pass NVIDIA's harness; official − graph, " + "; ".join(parts)
        )
    return lines


def styled_rulers(table: pd.DataFrame):
    """:func:`ruler_table` styled: times in µs, the statuses other than PASSED in red."""
    formats = {"graph_us": "{:.1f}", "official_us": "{:.1f}", "gap_us": "{:+.1f}"}
    caption = "Per workload: graph-replay median and NVIDIA's harness latency (µs); gap = official − graph"
    return styled(table.set_index(["impl", "num_tokens"]), formats, caption).map(
        lambda v: "" if v == PASSED else "color: #cf222e; font-weight: bold", subset=["status"]
    )


def ruler_figure(table: pd.DataFrame):
    """Time against token count, log-log, one panel per implementation: the graph-replay median (solid)
    and NVIDIA's harness latency (dashed); a workload that failed there drawn as a red × at its
    graph-replay time (the harness times no failed workload)."""
    impls = list(dict.fromkeys(table["impl"]))
    if not impls:
        raise ValueError("table: no workload to draw (ruler_table found no run of NVIDIA's harness)")
    fig, axes = plt.subplots(
        1, len(impls), figsize=(6 * len(impls), 4.6), sharey=True, squeeze=False, layout="constrained"
    )
    for ax, impl in zip(axes[0], impls, strict=True):
        mine = table[table["impl"] == impl].sort_values("num_tokens")
        color, marker = IMPL_STYLE.get(impl, ("black", "x"))
        ax.plot(mine["num_tokens"], mine["graph_us"], color=color, marker=marker, label="graph replay (GPU time)")
        passed = mine[mine["status"] == PASSED]
        ax.plot(
            passed["num_tokens"],
            passed["official_us"],
            color=color,
            marker="o",
            markerfacecolor="white",
            linestyle="--",
            label="NVIDIA's harness (CUPTI, eager)",
        )
        failed = mine[mine["status"] != PASSED]
        if len(failed):
            y = failed["graph_us"].where(failed["graph_us"].notna(), mine["graph_us"].min())
            ax.scatter(
                failed["num_tokens"],
                y,
                marker="x",
                s=90,
                color="#cf222e",
                zorder=3,
                linewidths=2,
                label=f"failed in NVIDIA's harness ({len(failed)}; at its graph time)",
            )
        ax.set(xscale="log", yscale="log", xlabel="tokens T", title=impl)
        ax.yaxis.set_major_locator(plt.LogLocator(subs=(1, 2, 5)))  # 10, 20, 50, 100, ... µs
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(plt.NullFormatter())
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("time per call (µs)")
    return fig
