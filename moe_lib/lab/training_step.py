"""Notebook 05: a training step of each layer, its forward and its forward + backward.

The runs of ``python -m moe_lib.bench --mode forward|forward_backward``
(``<date>-<problem>-<dtype>-<mode>.csv``) read into one tidy frame (:func:`load_layer_runs`), shown as
tables and figures (:func:`layer_table`, :func:`layer_figure`), and what keeping the pre-activations
(``save_activations=True``) trades (:func:`saved_activations_table`). Times in milliseconds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch

from .. import problems
from ..bench.results import MODEL_SUITE
from .results import (
    IMPL_STYLE,
    RESULTS_DIR,
    ResultFileError,
    format_ms,
    read_run_csv,
    read_run_json,
    resolve_path,
    run_date,
    shown_path,
    styled,
)

LAYER_MODES = ("forward", "forward_backward")
LAYER_COLUMNS = [
    "problem",
    "dtype",
    "mode",
    "num_tokens",
    "impl",
    "median_ms",
    "peak_mem_gb",
    "timing",
    "status",
    "file",
]
LAYER_CSV_COLUMNS = ("impl", "num_tokens", "mode", "median_ms", "timing", "status")
LAYER_IMPLS = ("reference", "grouped_mm", "liger", "sonicmoe", "triton", "triton_saved")
LAYER_STYLE = {**IMPL_STYLE, "sonicmoe": ("tab:cyan", "h"), "triton_saved": ("tab:brown", "X")}


def load_layer_runs(results_dir=RESULTS_DIR, gpu_key: str = "H200", problem: str | None = None) -> pd.DataFrame:
    """The committed training-step runs (``python -m moe_lib.bench --mode forward|forward_backward``) in
    ``<results_dir>/<gpu_key>/``, the newest file of each kind (:func:`run_kind`; by its JSON's ``date_utc``), as
    one tidy frame: problem, dtype, mode, num_tokens, impl, median_ms (NaN where not timed), peak_mem_gb, timing
    (how it was timed: "graph" or "events"), status ("ok", or why not timed) and file; only ``problem``'s
    where given. Rows by file, then implementation (:data:`LAYER_IMPLS`' order), then token count.

    ``attrs``: ``runs`` ({file name: its JSON}) and ``note`` (a sentence when there is none, else "").
    Empty with a note when there is no such file or folder; :class:`.results.ResultFileError` naming the
    file when one is malformed."""
    folder = resolve_path(results_dir) / gpu_key
    newest: dict[str, tuple[Path, dict]] = {}
    for json_path in sorted(folder.glob("*.json")):  # named <date>-...: later dates sort later
        csv_path = json_path.with_suffix(".csv")
        if not csv_path.is_file():
            continue
        meta = read_run_json(json_path)
        if meta.get("mode") not in LAYER_MODES or meta.get("problem") not in problems.PROBLEM_NAMES:
            continue
        if meta.get("suite") == MODEL_SUITE:
            continue  # the model suite's steps (bench --models --mode) are at other shapes: lab.models reads them
        if problem is not None and meta["problem"] != problem:
            continue
        key = run_kind(json_path.stem)
        if key not in newest or run_date(meta) >= run_date(newest[key][1]):
            newest[key] = (csv_path, meta)
    frames = []
    for csv_path, meta in newest.values():
        frame = read_run_csv(csv_path, LAYER_CSV_COLUMNS)
        frame = frame.assign(problem=meta["problem"], dtype=meta.get("dtype"), file=csv_path.name)
        if "peak_mem_gb" not in frame:
            frame["peak_mem_gb"] = math.nan
        try:
            frame["num_tokens"] = frame["num_tokens"].astype(int)
        except (TypeError, ValueError) as exc:
            raise ResultFileError(f"{csv_path}: column num_tokens: expected integers ({exc})") from exc
        frame.loc[frame["status"] != "ok", ["median_ms", "peak_mem_gb"]] = math.nan
        frame["timing"] = frame["timing"].astype(object).where(frame["timing"].notna(), None)
        frames.append(frame[LAYER_COLUMNS])
    if frames:
        table = pd.concat(frames, ignore_index=True)
        table["order"] = table["impl"].map(_layer_order)
        table = table.sort_values(["file", "order", "num_tokens"], kind="stable").drop(columns="order")
        table = table.reset_index(drop=True)
    else:
        table = pd.DataFrame(columns=LAYER_COLUMNS)
    what = f"of {problem} " if problem else ""
    table.attrs.update(
        runs={csv_path.name: meta for csv_path, meta in newest.values()},
        note=""
        if frames
        else f"No training-step run {what}(bench --mode forward or "
        f"forward_backward) is committed in {shown_path(folder)}.",
    )
    return table


def run_kind(stem: str) -> str:
    """A result file's name without its date and without a ``-at-<commit>`` suffix: runs of one kind share it."""
    kind = stem[11:] if stem[:4].isdigit() else stem
    return re.sub(r"-at-[0-9a-f]{7,40}$", "", kind)


def _layer_order(impl: str) -> tuple[int, str]:
    return (LAYER_IMPLS.index(impl), "") if impl in LAYER_IMPLS else (len(LAYER_IMPLS), impl)


def layer_impls(layer: pd.DataFrame) -> dict[str, str]:
    """Every implementation the files hold, in :data:`LAYER_IMPLS`' order (others after them), with its
    status: "ok" where every row of it was timed, else the first reason it was not."""
    found = {}
    for impl in sorted(dict.fromkeys(layer["impl"]), key=_layer_order):
        statuses = layer.loc[layer["impl"] == impl, "status"]
        found[impl] = "ok" if (statuses == "ok").all() else next(s for s in statuses if s != "ok")
    return found


def layer_overview(layer: pd.DataFrame) -> list[str]:
    """What one problem's training-step runs (:func:`load_layer_runs`) hold, in sentences: the file of each
    mode (and a mode without one), the implementations in them, why any was not timed, and the layer
    implementations registered in :mod:`moe_lib.bench.peers` that the runs left out."""
    from ..bench.peers import layer_peers_for

    _one_problem(layer)
    problem = layer["problem"].iloc[0]
    lines = [
        f"{mode.replace('_', ' + ')}: " + ", ".join(layer.loc[layer["mode"] == mode, "file"].unique())
        if mode in set(layer["mode"])
        else f"{mode.replace('_', ' + ')}: no run committed"
        for mode in LAYER_MODES
    ]
    found = layer_impls(layer)
    lines.append("implementations in the runs: " + ", ".join(found))
    lines += [f"{impl} not timed: {status}" for impl, status in found.items() if status != "ok"]
    left_out = [label for label in layer_peers_for(problem) if label not in found]
    if left_out:
        lines.append("registered layer implementations the runs left out: " + ", ".join(left_out))
    return lines


def _one_problem(layer: pd.DataFrame) -> None:
    """ValueError unless ``layer`` holds one problem's runs (``load_layer_runs(problem=...)``) in which each
    implementation of a mode comes from one file (a peer may have a run of its own, e.g. a tagged file)."""
    files_per_impl = layer.groupby(["mode", "impl"])["file"].nunique()
    if layer["problem"].nunique() > 1 or (files_per_impl > 1).any():
        raise ValueError(
            f"layer: expected one problem's runs, each implementation of a mode from one file, got "
            f"{sorted(set(layer['file']))} (select one with load_layer_runs(problem=...))"
        )


def layer_table(layer: pd.DataFrame, column: str = "median_ms") -> pd.DataFrame:
    """``column`` of :func:`load_layer_runs` (one problem's) per mode and token count (rows: forward before
    forward + backward, tokens ascending) and implementation (columns, those with a value only)."""
    _one_problem(layer)
    rows = layer.dropna(subset=[column])
    table = rows.pivot_table(index=["mode", "num_tokens"], columns="impl", values=column, aggfunc="first")
    modes = [mode for mode in LAYER_MODES if mode in table.index.get_level_values("mode")]
    table = table.reindex(
        index=[(mode, t) for mode in modes for t in sorted(table.loc[mode].index)],
        columns=[impl for impl in layer_impls(layer) if impl in table.columns],
    )
    table.index.names, table.columns.name = ["mode", "num_tokens"], None
    return table


def styled_layer(layer: pd.DataFrame):
    """Times and peak memory of :func:`layer_table` side by side, the fastest of each row in bold."""
    times = layer_table(layer, "median_ms")
    memory = layer_table(layer, "peak_mem_gb")
    table = pd.concat({"median time": times, "peak memory (GB)": memory}, axis=1)
    formats = {column: (format_ms if column[0] == "median time" else "{:.2f}") for column in table.columns}
    files = ", ".join(dict.fromkeys(layer["file"]))
    return styled(table, formats, f"The layer's training step per mode and token count ({files})").highlight_min(
        subset=[c for c in table.columns if c[0] == "median time"], axis=1, props="font-weight: bold"
    )


def saved_activations_table(layer: pd.DataFrame, recompute: str = "triton", saved: str = "triton_saved"):
    """Per mode and token count where both were timed: our layer recomputing g and u in its backward
    (``recompute``) against keeping them from the forward (``saved``, ``save_activations=True``): both
    times, the time saving keeping them buys, both peak memories, the extra memory measured, and the
    memory the kept g and u take, 2·T·K·I values of the run's dtype (K and I from the run's axes).
    Empty where no case has both."""
    columns = [
        "recompute (ms)",
        "saved (ms)",
        "time saved (ms)",
        "recompute peak (GB)",
        "saved peak (GB)",
        "extra memory (GB)",
        "2·T·K·I values (GB)",
    ]
    rows = {}
    timed = layer[layer["impl"].isin([recompute, saved]) & (layer["status"] == "ok")]
    for (file, mode, tokens), group in timed.groupby(["file", "mode", "num_tokens"], sort=False):
        by_impl = group.set_index("impl")
        if not {recompute, saved} <= set(by_impl.index):
            continue
        meta = layer.attrs.get("runs", {}).get(file, {})
        sizes = problems.load(meta.get("problem") or by_impl["problem"].iloc[0]).sizes(tokens, **meta.get("axes", {}))
        itemsize = getattr(torch, by_impl["dtype"].iloc[0]).itemsize
        a, b = by_impl.loc[recompute], by_impl.loc[saved]
        rows[(mode, tokens)] = [
            a["median_ms"],
            b["median_ms"],
            a["median_ms"] - b["median_ms"],
            a["peak_mem_gb"],
            b["peak_mem_gb"],
            b["peak_mem_gb"] - a["peak_mem_gb"],
            2 * tokens * sizes["top_k"] * sizes["intermediate_size"] * itemsize / 1e9,
        ]
    table = pd.DataFrame.from_dict(rows, orient="index", columns=columns)
    table.index = pd.MultiIndex.from_tuples(table.index, names=["mode", "num_tokens"]) if rows else table.index
    return table


def saved_activations_reading(table: pd.DataFrame) -> list[str]:
    """:func:`saved_activations_table` in sentences, one per mode and token count."""
    lines = []
    for (mode, tokens), row in table.iterrows():
        change = row["saved (ms)"] / row["recompute (ms)"] - 1
        lines.append(
            f"{mode.replace('_', ' + ')}, T = {tokens}: keeping g and u takes the step from "
            f"{format_ms(row['recompute (ms)'])} to {format_ms(row['saved (ms)'])} ({change:+.0%}), "
            f"its peak memory {row['extra memory (GB)']:+.3f} GB; the kept g and u are "
            f"{row['2·T·K·I values (GB)']:.3f} GB"
        )
    return lines


def layer_figure(layer: pd.DataFrame):
    """Bars per token count and implementation: median time (left) and peak memory (right), one row of
    panels per mode the files hold (one problem's runs); an implementation not timed has no bar."""
    _one_problem(layer)
    modes = [mode for mode in LAYER_MODES if mode in set(layer["mode"])]
    impls = [impl for impl in layer_impls(layer) if layer.loc[layer["impl"] == impl, "median_ms"].notna().any()]
    fig, axes = plt.subplots(len(modes), 2, figsize=(12, 4.2 * len(modes)), squeeze=False, layout="constrained")
    width = 0.8 / max(len(impls), 1)
    for row, mode in zip(axes, modes, strict=True):
        mine = layer[layer["mode"] == mode]
        tokens = sorted(mine["num_tokens"].unique())
        for ax, column, label in zip(
            row, ("median_ms", "peak_mem_gb"), ("median time (ms)", "peak memory (GB)"), strict=True
        ):
            for i, impl in enumerate(impls):
                values = mine[mine["impl"] == impl].set_index("num_tokens")[column].reindex(tokens)
                bars = ax.bar(
                    [x + (i - (len(impls) - 1) / 2) * width for x in range(len(tokens))],
                    values,
                    width,
                    color=LAYER_STYLE.get(impl, ("black", "x"))[0],
                    label=impl,
                )
                ax.bar_label(bars, fmt="%.1f" if column == "median_ms" else "%.2f", fontsize=7)
            ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
            ax.set(xlabel="tokens T", ylabel=label, title=f"{mode.replace('_', ' + ')}: {label.split(' (')[0]}")
            ax.margins(y=0.15)
            ax.grid(alpha=0.3, axis="y")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=max(len(impls), 1), fontsize=9)
    return fig
