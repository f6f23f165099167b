"""Notebook 05, "The grouped engine": the committed runs that timed P2's layer on the grouped engine.

The bench's peers ``triton_engine`` (the op, and the layer recomputing g and u) and ``triton_engine_saved`` (the
layer keeping them) ask for the engine's structure (:mod:`moe_lib.bench.peers.moe_experts`). :func:`load_engine_runs`
reads every committed run holding one of them, in ``<results_dir>/<gpu_key>/`` and its ``runs/`` folder, into one
tidy frame with each row's file and the commit and date its JSON records; :func:`engine_table` sets the engine beside
kernels A-W-D-C (``triton``, ``triton_saved``) and ``grouped_mm`` of the same run, :func:`sonicmoe_beside` beside
SonicMoE from the newest run that timed it (another run: both files and commits are named), :func:`models_table` at
the model suite's shapes, and :func:`engine_figure` draws the first two. :func:`same_run_sonicmoe` reads, on every
GPU, the newest runs that timed our layer and SonicMoE together, time and peak memory, and
:func:`same_run_figure` draws it. :func:`quack_probe` reads the grouped probe's runs with QuACK's GEMM beside the
engine (``scripts/p2/grouped_probe.py``), and :func:`quack_probe_table` sets each column's rate against
``torch._grouped_mm``'s. Times in milliseconds.
"""

from __future__ import annotations

import json
import math

import matplotlib.pyplot as plt
import pandas as pd

from ..bench.results import MODEL_SUITE, geomean
from .results import RESULTS_DIR, ResultFileError, read_run_csv, read_run_json, resolve_path, run_date, shown_path
from .training_step import load_layer_runs

# each engine implementation and the kernels A-W-D-C implementation timed beside it
ENGINE_IMPLS = {"triton_engine": "triton", "triton_engine_saved": "triton_saved"}
PEER = "grouped_mm"
SONIC = "sonicmoe"  # set beside the engine where the same run timed it
RUN_COLUMNS = ["file", "commit", "date", "problem", "mode", "suite", "model", "num_tokens", "impl", "median_ms",
               "peak_mem_gb", "status"]  # fmt: skip


def load_engine_runs(results_dir=RESULTS_DIR, gpu_key: str = "H200") -> pd.DataFrame:
    """Every committed run in ``<results_dir>/<gpu_key>/`` and ``<...>/runs/`` whose JSON lists an implementation of
    :data:`ENGINE_IMPLS`, as one frame of :data:`RUN_COLUMNS` (every implementation of those runs; ``file`` relative
    to the repository root, ``commit`` and ``date`` from the JSON's provenance, ``suite`` "models" for the model
    suite's runs, else "problem"; ``median_ms`` NaN where not timed). Empty where there is none;
    :class:`.results.ResultFileError` naming the file when one is malformed."""
    folder = resolve_path(results_dir) / gpu_key
    if not folder.is_dir():
        raise FileNotFoundError(f"results_dir, gpu_key: no results folder {folder}")
    frames = []
    for json_path in sorted(folder.glob("*.json")) + sorted((folder / "runs").glob("*.json")):
        csv_path = json_path.with_suffix(".csv")
        if not csv_path.is_file():
            continue
        meta = read_run_json(json_path)
        if not set(meta.get("impls") or ()) & set(ENGINE_IMPLS):
            continue
        frame = read_run_csv(csv_path, ("impl", "num_tokens", "median_ms", "status"))
        provenance = meta.get("provenance", {})
        try:
            frame["num_tokens"] = frame["num_tokens"].astype(int)
        except (TypeError, ValueError) as exc:
            raise ResultFileError(f"{csv_path}: column num_tokens: expected integers ({exc})") from exc
        frame = frame.assign(
            file=shown_path(csv_path),
            commit=provenance.get("git_commit", "–"),
            date=(provenance.get("date_utc") or json_path.stem)[:10],
            problem=meta.get("problem"),
            mode=meta.get("mode", "op"),
            suite="models" if meta.get("suite") == MODEL_SUITE else "problem",
        )
        for column in ("model", "peak_mem_gb"):
            if column not in frame:
                frame[column] = "" if column == "model" else math.nan
        frame.loc[frame["status"] != "ok", "median_ms"] = math.nan
        frames.append(frame[RUN_COLUMNS])
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=RUN_COLUMNS)


def provenance_table(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per file of :func:`load_engine_runs`: its commit, date, problem, mode, suite, implementations and
    token counts."""
    rows = {}
    for file, group in runs.groupby("file", sort=False):
        first = group.iloc[0]
        rows[file] = {
            "commit": first["commit"],
            "date": first["date"],
            "problem": first["problem"],
            "mode": first["mode"],
            "suite": first["suite"],
            "implementations": ", ".join(dict.fromkeys(group["impl"])),
            "tokens": ", ".join(str(t) for t in sorted(set(group["num_tokens"]))),
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def _compare(group: pd.DataFrame, index) -> pd.DataFrame:
    """Engine against kernels A-W-D-C and grouped_mm per ``index`` (columns of ``group``), from one run."""
    times = group.pivot_table(index=index, columns="impl", values="median_ms", aggfunc="first")
    engine = next(impl for impl in ENGINE_IMPLS if impl in times)
    kernels = ENGINE_IMPLS[engine]
    table = pd.DataFrame(index=times.index)
    table["engine"] = engine
    table["engine (ms)"] = times[engine]
    table["kernels A-W-D-C (ms)"] = times.get(kernels, math.nan)
    table[f"{PEER} (ms)"] = times.get(PEER, math.nan)
    table["over kernels A-W-D-C"] = table["kernels A-W-D-C (ms)"] / table["engine (ms)"]
    table[f"over {PEER}"] = table[f"{PEER} (ms)"] / table["engine (ms)"]
    if SONIC in times:  # timed in the same run
        table[f"{SONIC} (ms)"] = times[SONIC]
        table[f"over {SONIC}"] = times[SONIC] / table["engine (ms)"]
    return table


def engine_table(runs: pd.DataFrame) -> pd.DataFrame:
    """The problem-shape runs of :func:`load_engine_runs` (not the model suite's): per file, mode and token count the
    engine's time beside kernels A-W-D-C and grouped_mm of the same run, and their times over the engine's (above 1:
    the engine is faster). ``attrs["files"]``: {file: commit}."""
    runs = runs[runs["suite"] == "problem"]
    if runs.empty:
        return pd.DataFrame()
    parts = [_compare(group, ["file", "mode", "num_tokens"]) for _, group in runs.groupby("file", sort=False)]
    table = pd.concat(parts)
    table.attrs["files"] = dict(zip(runs["file"], runs["commit"], strict=True))
    return table


def sonicmoe_beside(runs: pd.DataFrame, results_dir=RESULTS_DIR, gpu_key: str = "H200") -> pd.DataFrame:
    """Per token count of the engine's layer runs (forward + backward): its time beside SonicMoE's in the newest
    committed training-step run that timed SonicMoE (:func:`.training_step.load_layer_runs`), and their ratio (above
    1: the engine slower). Two runs, on different dates and commits: ``attrs`` names both files and commits. Empty
    where either is missing."""
    layer = runs[(runs["mode"] == "forward_backward") & runs["impl"].isin(list(ENGINE_IMPLS))].dropna(
        subset=["median_ms"]
    )
    if layer.empty:
        return pd.DataFrame()
    problem = layer["problem"].iloc[0]
    peers = load_layer_runs(results_dir, gpu_key, problem=problem)
    sonic = peers[(peers["mode"] == "forward_backward") & (peers["impl"] == "sonicmoe")].dropna(subset=["median_ms"])
    if sonic.empty:
        return pd.DataFrame()
    sonic_file = sonic["file"].iloc[-1]
    sonic = sonic[sonic["file"] == sonic_file].set_index("num_tokens")["median_ms"]
    sonic_meta = peers.attrs["runs"][sonic_file].get("provenance", {})
    rows = {}
    for row in layer.itertuples():
        if row.num_tokens in sonic.index:
            rows[(row.impl, row.num_tokens)] = {
                "engine (ms)": row.median_ms,
                "sonicmoe (ms)": sonic[row.num_tokens],
                "engine / sonicmoe": row.median_ms / sonic[row.num_tokens],
            }
    table = pd.DataFrame.from_dict(rows, orient="index")
    if rows:
        table.index = pd.MultiIndex.from_tuples(table.index, names=["impl", "num_tokens"])
    table.attrs.update(
        engine_files={f: c for f, c in zip(layer["file"], layer["commit"], strict=True)},
        sonicmoe_file=shown_path(resolve_path(results_dir) / gpu_key / sonic_file),
        sonicmoe_commit=str(sonic_meta.get("git_commit", "–"))[:7],
        sonicmoe_date=str(sonic_meta.get("date_utc", sonic_file))[:10],
    )
    return table


def models_table(runs: pd.DataFrame) -> pd.DataFrame:
    """The model suite's runs of :func:`load_engine_runs`: per file, model and token count the engine beside kernels
    A-W-D-C and grouped_mm of the same run (and SonicMoE where that run timed it), as :func:`engine_table`.
    ``attrs["files"]``: {file: commit}."""
    runs = runs[runs["suite"] == "models"]
    if runs.empty:
        return pd.DataFrame()
    table = pd.concat(_compare(group, ["file", "model", "num_tokens"]) for _, group in runs.groupby("file", sort=False))
    table.attrs["files"] = dict(zip(runs["file"], runs["commit"], strict=True))
    return table


def reading(table: pd.DataFrame, sonic: pd.DataFrame, models: pd.DataFrame) -> list[str]:
    """The three tables in sentences: how many cases the engine leads in, by how much, and where it trails."""
    lines = []
    groups = table.groupby(level=["file", "mode"], sort=False) if not table.empty else []  # no engine run: none
    for (file, mode), group in groups:
        speedups = group["over kernels A-W-D-C"].dropna()
        lines.append(
            f"{mode.replace('_', ' + ')} ({file}, commit {table.attrs['files'][file]}): the engine ahead of kernels "
            f"A-W-D-C in {(speedups > 1).sum()} of {len(speedups)} cases ({speedups.min():.2f}-{speedups.max():.2f}×), "
            f"of {PEER} by {group[f'over {PEER}'].min():.2f}-{group[f'over {PEER}'].max():.2f}×"
        )
    if not sonic.empty:
        ratios = sonic["engine / sonicmoe"]
        lines.append(
            f"beside SonicMoE ({sonic.attrs['sonicmoe_file']}, commit {sonic.attrs['sonicmoe_commit']}, "
            f"{sonic.attrs['sonicmoe_date']}; another run): engine / SonicMoE {ratios.min():.2f}-{ratios.max():.2f}"
        )
    if not models.empty:
        over = models["over kernels A-W-D-C"].dropna()
        line = (
            f"model suite ({', '.join(models.attrs['files'])}): ahead of kernels A-W-D-C in {(over > 1).sum()} of "
            f"{len(over)} cases, behind in {(over < 1).sum()}; ahead of {PEER} in "
            f"{(models[f'over {PEER}'] > 1).sum()} of {models[f'over {PEER}'].notna().sum()}"
        )
        sonic = models.get(f"over {SONIC}", pd.Series(dtype=float)).dropna()
        if len(sonic):
            line += f"; ahead of {SONIC} (same run) in {(sonic > 1).sum()} of {len(sonic)}"
        lines.append(line)
    return lines


def engine_figure(table: pd.DataFrame, sonic: pd.DataFrame):
    """One panel per (file, mode) of :func:`engine_table`: bars per token count for the engine, kernels A-W-D-C and
    grouped_mm, with SonicMoE's bar hatched beside the layer's (from its own run, :func:`sonicmoe_beside`). Returns the
    figure."""
    groups = list(table.groupby(level=["file", "mode"], sort=False))
    fig, axes = plt.subplots(1, len(groups), figsize=(6.2 * len(groups), 4.2), squeeze=False, layout="constrained")
    columns = {"engine (ms)": "tab:red", "kernels A-W-D-C (ms)": "tab:brown", f"{PEER} (ms)": "tab:orange"}
    for ax, ((file, mode), group) in zip(axes[0], groups, strict=True):
        tokens = list(group.index.get_level_values("num_tokens"))
        bars = dict(columns)
        if mode == "forward_backward" and not sonic.empty:
            bars["sonicmoe (ms)"] = "tab:cyan"
        width = 0.8 / len(bars)
        for i, (column, color) in enumerate(bars.items()):
            if column == "sonicmoe (ms)":
                values = [sonic["sonicmoe (ms)"].xs(t, level="num_tokens").iloc[0]
                          if t in sonic.index.get_level_values("num_tokens") else math.nan for t in tokens]  # fmt: skip
                label = f"sonicmoe ({sonic.attrs['sonicmoe_date']}, another run)"
            else:
                values, label = list(group[column]), column.removesuffix(" (ms)")
            drawn = ax.bar([x + (i - (len(bars) - 1) / 2) * width for x in range(len(tokens))], values, width,
                           color=color, label=label, hatch="//" if column == "sonicmoe (ms)" else None)  # fmt: skip
            ax.bar_label(drawn, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set(xlabel="tokens T", ylabel="median time (ms)")
        ax.set_title(f"{mode.replace('_', ' + ')}: {file.rsplit('/', 1)[-1]}\n(commit {table.attrs['files'][file]})",
                     fontsize=8)  # fmt: skip
        ax.margins(y=0.15)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    return fig


# our layer keeping g and u: the engine asked for, or the default dispatch (the engine at these shapes)
OURS_SAVED = ("triton_engine_saved", "triton_saved")
SAME_RUN_COLUMNS = ["gpu", "file", "commit", "date", "model", "num_tokens", "ours (ms)", f"{SONIC} (ms)", "time ratio",
                    "ours (GB)", f"{SONIC} (GB)", "peak ratio"]  # fmt: skip


def same_run_sonicmoe(results_dir=RESULTS_DIR) -> pd.DataFrame:
    """On every GPU folder of ``results_dir``, the newest committed training-step run (forward + backward, by the
    ``date_utc`` of its JSON) that timed our layer keeping g and u (:data:`OURS_SAVED`) and SonicMoE together, one
    at P2's shape (``model`` "P2") and one of the model suite: per case both times and both peaks of memory, and
    ours over SonicMoE's (below 1: ours faster, or smaller). Columns :data:`SAME_RUN_COLUMNS`; empty where no such
    run is committed."""
    newest: dict[tuple[str, str], tuple[str, dict]] = {}
    for folder in sorted(p for p in resolve_path(results_dir).iterdir() if p.is_dir()):
        for json_path in sorted(folder.glob("*.json")):
            meta = read_run_json(json_path)
            impls = set(meta.get("impls") or ())
            if meta.get("mode") != "forward_backward" or SONIC not in impls or not impls & set(OURS_SAVED):
                continue
            suite = "models" if meta.get("suite") == MODEL_SUITE else "problem"
            date = run_date(meta)
            if (folder.name, suite) not in newest or date >= newest[(folder.name, suite)][0]:
                newest[(folder.name, suite)] = (date, {"path": json_path.with_suffix(".csv"), "meta": meta})
    rows = []
    for (gpu, _), (date, run) in newest.items():
        frame = read_run_csv(run["path"], ("impl", "num_tokens", "median_ms", "peak_mem_gb", "status"))
        frame = frame[frame["status"] == "ok"]
        if "model" not in frame:
            frame = frame.assign(model="P2")
        ours = next((impl for impl in OURS_SAVED if impl in set(frame["impl"])), None)
        if ours is None:  # listed, but no row timed
            continue
        both = frame.pivot_table(index=["model", "num_tokens"], columns="impl", values=["median_ms", "peak_mem_gb"],
                                 aggfunc="first").dropna()  # fmt: skip
        for (model, tokens), row in both.iterrows():
            if (("median_ms", ours) not in row) or (("median_ms", SONIC) not in row):
                continue
            rows.append({
                "gpu": gpu, "file": shown_path(run["path"]),
                "commit": str(run["meta"].get("provenance", {}).get("git_commit", "–"))[:7], "date": date[:10],
                "model": model, "num_tokens": int(tokens),
                "ours (ms)": row[("median_ms", ours)], f"{SONIC} (ms)": row[("median_ms", SONIC)],
                "ours (GB)": row[("peak_mem_gb", ours)], f"{SONIC} (GB)": row[("peak_mem_gb", SONIC)],
            })  # fmt: skip
    table = pd.DataFrame(rows, columns=SAME_RUN_COLUMNS)
    table["time ratio"] = table["ours (ms)"] / table[f"{SONIC} (ms)"]
    table["peak ratio"] = table["ours (GB)"] / table[f"{SONIC} (GB)"]
    return table


def same_run_reading(table: pd.DataFrame) -> list[str]:
    """:func:`same_run_sonicmoe` in a sentence a GPU: in how many cases ours is faster, and its peak no larger."""
    lines = []
    for gpu, group in table.groupby("gpu", sort=False):
        files = ", ".join(
            f"{f} (commit {c})" for f, c in dict(zip(group["file"], group["commit"], strict=True)).items()
        )
        lines.append(
            f"{gpu}: ours faster than SonicMoE in {(group['time ratio'] < 1).sum()} of {len(group)} cases "
            f"({group['time ratio'].min():.2f}-{group['time ratio'].max():.2f} of its time), its peak memory no "
            f"larger in {(group['peak ratio'] <= 1).sum()} ({group['peak ratio'].min():.2f}-"
            f"{group['peak ratio'].max():.2f} of its); from {files}"
        )
    return lines


def same_run_figure(table: pd.DataFrame):
    """Per GPU, ours over SonicMoE in time and in peak memory at each case (1: level; below: ours faster, or
    smaller), from :func:`same_run_sonicmoe`. Returns the figure."""
    gpus = list(table.groupby("gpu", sort=False))
    fig, axes = plt.subplots(1, len(gpus), figsize=(6.5 * len(gpus), 3.8), squeeze=False, layout="constrained")
    for ax, (gpu, group) in zip(axes[0], gpus, strict=True):
        labels = [f"{m}\n{t}" for m, t in zip(group["model"], group["num_tokens"], strict=True)]
        x = range(len(group))
        for offset, column, color in ((-0.2, "time ratio", "tab:red"), (0.2, "peak ratio", "tab:purple")):
            drawn = ax.bar([i + offset for i in x], group[column], 0.4, color=color, label=column)
            ax.bar_label(drawn, fmt="%.2f", fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set(ylabel="ours / SonicMoE", title=f"{gpu}: the layer's forward + backward, same run")
        ax.margins(y=0.15)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    return fig


# the grouped probe's runs with QuACK's columns (scripts/p2/grouped_probe.py, its JSON committed under tuning/)
QUACK_PROBE_GLOB = "*/tuning/*quack*grouped-probe*.json"
PROBE_BASELINE = "grouped_mm"
QUACK_PROBE_COLUMNS = ["gpu", "file", "seed", "shape", "column", "tflops", "of grouped_mm"]
# the probe's config names as the table shows them
PROBE_LABELS = {"coop_m128n256k64_s3": "engine 128 × 256", "quack_default": "QuACK default",
                "quack_coop_m128n256": "QuACK 128 × 256", "quack_tuned": "QuACK autotuned"}  # fmt: skip


def quack_probe(results_dir=RESULTS_DIR) -> pd.DataFrame:
    """Every committed grouped-probe run holding QuACK's columns (:data:`QUACK_PROBE_GLOB`), one row a shape and
    column that checked ok: its TFLOP/s and that over ``torch._grouped_mm``'s in the same run (columns
    :data:`QUACK_PROBE_COLUMNS`). Empty where there is none; :class:`.results.ResultFileError` naming a malformed
    file."""
    rows = []
    for path in sorted(resolve_path(results_dir).glob(QUACK_PROBE_GLOB)):
        try:
            record = json.loads(path.read_text())
            runs, seed = record["runs"], record["seed"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ResultFileError(f"{shown_path(path)}: not a grouped-probe record ({exc})") from exc
        baseline = runs.get(PROBE_BASELINE, {}).get("results", {})
        for column, run in runs.items():
            for shape, row in run.get("results", {}).items():
                base = baseline.get(shape, {})
                if row.get("check") != "ok" or base.get("check") != "ok":
                    continue
                rows.append({"gpu": path.parent.parent.name, "file": shown_path(path), "seed": seed, "shape": shape,
                             "column": column, "tflops": row["tflops"],
                             "of grouped_mm": row["tflops"] / base["tflops"]})  # fmt: skip
    return pd.DataFrame(rows, columns=QUACK_PROBE_COLUMNS)


def quack_probe_table(probe: pd.DataFrame) -> pd.DataFrame:
    """:func:`quack_probe` as a table: a row a run's shape, a column a config (its rate over grouped_mm's), and a
    row of each run's geometric mean over the shapes every column of it ran."""
    tables = []
    for (gpu, file), run in probe.groupby(["gpu", "file"], sort=False):
        wide = run.pivot_table(index="shape", columns="column", values="of grouped_mm", sort=False)
        wide = wide.drop(columns=PROBE_BASELINE, errors="ignore").dropna().rename(columns=PROBE_LABELS)
        wide.loc["geomean"] = wide.apply(geomean)
        wide.index = pd.MultiIndex.from_product([[f"{gpu}: {file.rsplit('/', 1)[-1]}"], wide.index])
        tables.append(wide)
    return pd.concat(tables) if tables else pd.DataFrame()


def quack_probe_figure(table: pd.DataFrame):
    """Each run of :func:`quack_probe_table`: a bar a shape and config, its rate over grouped_mm's (1: level).
    Returns the figure."""
    runs = list(table.groupby(level=0, sort=False))
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 3.2 * len(runs)), squeeze=False, layout="constrained")
    for ax, (run, wide) in zip(axes[:, 0], runs, strict=True):
        wide = wide.droplevel(0).dropna(axis=1, how="all")
        wide.plot.bar(ax=ax, width=0.8, rot=30, fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set(ylabel="over grouped_mm", xlabel="", title=run, ylim=(0.7, None))
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7, ncols=4)
    return fig
