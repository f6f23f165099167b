"""Notebook 05, "On the models' shapes": the model suite's runs read back, our speed-ups as tables and a figure.

The model suite (``python -m moe_lib.bench --models``, :mod:`moe_lib.bench.models`) writes one file per
problem, dtype and part of a split run, ``<date>-<problem>-<dtype>-models[-<suffix>].csv`` with the JSON
beside it. :func:`load_model_runs` reads every such file of a GPU into one tidy frame, keeping for each
(problem, model, token count, implementation) the row of the newest run: the parts of a split run combine,
and a rerun replaces what it measured again. :func:`speedup_table` compares, per model and token count, our
implementation with the PyTorch peers it must beat (:data:`COMPARISONS`), :func:`geomean_table` sums that up
per model, and :func:`speedup_figure` draws it.

A training-step run of the suite (``--models --mode forward_backward``: the layers' forward + backward at the
models' shapes) writes files of its own, ``<date>-<problem>-<dtype>-<mode>-models[-<suffix>].csv``;
:func:`load_model_runs` reads them only when asked for that ``mode`` (the function's runs, mode ``op``, are
never mixed with them), and the tables compare the layers as :data:`LAYER_COMPARISONS` says.

Times are in milliseconds (``*_ms``); a speed-up is the peer's time over ours (above 1: ours is faster).
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd

from .. import problems
from ..bench.models import MODEL_NAMES, SHAPE_AXES
from ..bench.modes import check_mode
from ..bench.results import MODEL_SUITE, geomean
from .results import (
    RESULTS_DIR,
    ResultFileError,
    optional_bool,
    read_run_csv,
    read_run_json,
    resolve_path,
    shown_path,
    styled,
)

# per op: our implementation, and the PyTorch peers whose time it is compared with
COMPARISONS = {
    "swiglu_down_backward": ("triton_fast", ("torch_eager", "torch_compile")),
    "moe_experts_backward": ("triton", ("grouped_mm",)),
}
LAYER_COMPARISONS = {  # the same in a training step of the layer: our layer, and the layers it is compared with
    "swiglu_down_backward": ("triton", ("torch_eager",)),
    "moe_experts_backward": ("triton_engine_saved", ("grouped_mm", "sonicmoe")),
}


def target_speedup(op: str) -> float | None:
    """The project's bar per model shape for ``op``: the ``at_least`` of the ``models_speedup`` target in the lab.json
    of a problem with that op (the targets are stated there only); None where none sets one."""
    for name in problems.PROBLEM_NAMES:
        definition = problems.load(name)
        if definition.op == op:
            for target in definition.targets:
                if target.get("kind") == "models_speedup":
                    return float(target["at_least"])
    return None


TARGET_SPEEDUP = target_speedup("swiglu_down_backward")  # P1's bar, for the colours of both tables
RUN_COLUMNS = [
    "problem",
    "dtype",
    "model",
    *SHAPE_AXES["moe_experts_backward"],
    "num_tokens",
    "impl",
    "median_ms",
    "status",
    "correct",
    "passes_element_rule",
    "rel_error",
    "file",
    "date_utc",
]
CSV_COLUMNS = ("model", "impl", "num_tokens", "status", "median_ms", "correct", "hidden_size", "intermediate_size")
LAYER_COLUMNS = ("mode", "peak_mem_gb", "flops")  # what a training-step run's rows add: its mode, memory and FLOPs


def run_columns(mode: str = "op") -> list[str]:
    """The columns of :func:`load_model_runs` in ``mode``: :data:`RUN_COLUMNS`, and in a training-step mode
    :data:`LAYER_COLUMNS` after ``median_ms``."""
    check_mode(mode)
    if mode == "op":
        return list(RUN_COLUMNS)
    after = RUN_COLUMNS.index("median_ms") + 1
    return [*RUN_COLUMNS[:after], *LAYER_COLUMNS, *RUN_COLUMNS[after:]]


def load_model_runs(
    results_dir=RESULTS_DIR, gpu_key: str = "H200", small: bool = False, mode: str = "op"
) -> pd.DataFrame:
    """Every model-suite run of ``mode`` in ``<results_dir>/<gpu_key>/`` (files whose JSON says ``"suite": "models"``
    and that mode: ``op``, the problems' functions, by default; ``forward`` or ``forward_backward``, a training
    step of their layers; with ``small``, the scaled-down runs of a machine without CUDA instead of full-size
    ones) as one frame of :func:`run_columns`: for each (problem, model, num_tokens, impl) the row of the newest
    run (by the JSON's ``date_utc``). ``median_ms`` (and ``peak_mem_gb``) is NaN where the row was not timed
    (``status`` says why); ``num_experts`` and ``top_k`` are NaN for P1. Rows by problem, model
    (:data:`~moe_lib.bench.models.MODEL_NAMES`' order), token count.

    ``attrs``: ``runs`` ({file name: its JSON}, of the files that gave a row), ``mode`` and ``note`` (a sentence
    when there is no run, else ""). A ValueError naming ``mode`` when it is not one of
    :data:`~moe_lib.bench.modes.MODES`; :class:`.results.ResultFileError` naming the file when one is malformed."""
    columns = run_columns(mode)
    folder = resolve_path(results_dir) / gpu_key
    frames, documents = [], {}
    for json_path in sorted(folder.glob("*.json")):
        csv_path = json_path.with_suffix(".csv")
        if not csv_path.is_file():
            continue
        meta = read_run_json(json_path)
        if meta.get("suite") != MODEL_SUITE or bool((meta.get("provenance") or {}).get("small")) != small:
            continue
        if meta.get("mode", "op") != mode:
            continue  # a training-step run of the suite is read only when its mode is asked for, and the reverse
        if meta.get("problem") not in problems.PROBLEM_NAMES:
            raise ResultFileError(
                f"{json_path}: problem: expected one of {problems.PROBLEM_NAMES}, got {meta.get('problem')!r}"
            )
        frame = read_run_csv(csv_path, CSV_COLUMNS if mode == "op" else (*CSV_COLUMNS, *LAYER_COLUMNS))
        try:
            frame["num_tokens"] = frame["num_tokens"].astype(int)
        except (TypeError, ValueError) as exc:
            raise ResultFileError(f"{csv_path}: column num_tokens: expected integers ({exc})") from exc
        date = (meta.get("provenance") or {}).get("date_utc") or json_path.stem[:10]
        frames.append(
            frame.assign(problem=meta["problem"], dtype=meta.get("dtype"), file=csv_path.name, date_utc=date).reindex(
                columns=columns
            )
        )
        documents[csv_path.name] = meta
    if not frames:
        runs = pd.DataFrame(columns=columns)
        kind = "scaled-down " if small else ""
        command = "python -m moe_lib.bench --models" + ("" if mode == "op" else f" --mode {mode}")
        runs.attrs.update(
            runs={},
            mode=mode,
            note=f"No {kind}model-suite run ({command}) is committed "
            f"in {shown_path(folder)} yet: the models' shapes have no measurement to show.",
        )
        return runs
    runs = pd.concat(frames, ignore_index=True).sort_values(["date_utc", "file"], kind="stable")
    runs = runs.drop_duplicates(["problem", "model", "num_tokens", "impl"], keep="last")
    for column in ("correct", "passes_element_rule"):
        runs[column] = runs[column].map(optional_bool).astype(object)
    runs.loc[runs["status"] != "ok", [c for c in ("median_ms", "peak_mem_gb") if c in columns]] = math.nan
    order = dict(problem=_order(problems.PROBLEM_NAMES), model=_order(MODEL_NAMES))
    runs = runs.sort_values(
        ["problem", "model", "num_tokens"], key=lambda c: c.map(order[c.name]) if c.name in order else c, kind="stable"
    ).reset_index(drop=True)
    runs.attrs.update(runs={name: documents[name] for name in dict.fromkeys(runs["file"])}, mode=mode, note="")
    return runs


def _order(names) -> dict:
    """{name: its place}, for sorting a column by a list's order (names not in it map to NaN: they sort last)."""
    return {name: index for index, name in enumerate(names)}


def problems_in(runs: pd.DataFrame) -> list[str]:
    """The problems of ``runs`` (:func:`load_model_runs`), in :data:`moe_lib.problems.PROBLEM_NAMES`' order."""
    return [name for name in problems.PROBLEM_NAMES if name in set(runs["problem"])]


def run_overview(runs: pd.DataFrame, problem: str) -> list[str]:
    """Which files ``problem``'s rows come from, one sentence each: its date, commit and GPU, and whether the
    run was cut short (its JSON's ``complete`` false: models after the last one it lists were not run)."""
    lines = []
    for name in dict.fromkeys(runs.loc[runs["problem"] == problem, "file"]):
        meta = runs.attrs["runs"][name]
        provenance = meta.get("provenance") or {}
        commit = (provenance.get("git_commit") or "unknown")[:10] + (" (dirty)" if provenance.get("git_dirty") else "")
        lines.append(
            f"{name}: {provenance.get('date_utc', '?')}, commit {commit}, "
            f"{provenance.get('gpu_name') or provenance.get('gpu_key', '?')}"
            + (" (cut short)" if meta.get("complete") is False else "")
        )
    return lines


def comparison(problem: str, mode: str = "op") -> tuple[str, tuple[str, ...]]:
    """(our implementation, the peers it is compared with) for ``problem`` in ``mode`` (:data:`COMPARISONS`, or
    :data:`LAYER_COMPARISONS` for a training step)."""
    check_mode(mode)
    return (COMPARISONS if mode == "op" else LAYER_COMPARISONS)[problems.load(problem).op]


def _issues(rows: pd.DataFrame) -> str:
    """What went wrong in one case's rows: each implementation not timed, with its status, and each that
    fails the element rule."""
    found = [f"{row.impl}: {row.status}" for row in rows.itertuples() if row.status != "ok"]
    found += [
        f"{row.impl} fails the element rule"
        for row in rows.itertuples()
        if row.status == "ok" and row.passes_element_rule is False
    ]
    return "; ".join(found)


def _correct(rows: pd.DataFrame):
    """True where every implementation that ran on the case was checked correct, False where one was not
    (wrong or failed), None where none ran (skipped for memory, or unavailable)."""
    ran = rows[~rows["status"].str.startswith(("skipped", "unavailable"))]
    if ran.empty:
        return None
    return bool(all(value is True for value in ran["correct"]))


def speedup_table(runs: pd.DataFrame, problem: str) -> pd.DataFrame:
    """Per (model, num_tokens) of ``problem``: our implementation's median and each peer's (``<impl> (ms)``),
    our speed-up over each peer (``vs <peer>``: the peer's time over ours, NaN where either was not timed),
    ``correct`` (:func:`_correct`) and ``issues`` (what was not timed and why, who fails the element rule). The
    implementations compared are those of :func:`comparison` in the runs' mode (``runs.attrs["mode"]``)."""
    ours, peers = comparison(problem, runs.attrs.get("mode", "op"))
    rows = runs[runs["problem"] == problem]
    table = {}
    for (model, num_tokens), case in rows.groupby(["model", "num_tokens"], sort=False):
        medians = case.set_index("impl")["median_ms"]
        entry = {f"{impl} (ms)": medians.get(impl, math.nan) for impl in (ours, *peers)}
        for peer in peers:
            entry[f"vs {peer}"] = entry[f"{peer} (ms)"] / entry[f"{ours} (ms)"]
        entry.update(correct=_correct(case), issues=_issues(case))
        table[(model, int(num_tokens))] = entry
    frame = pd.DataFrame.from_dict(table, orient="index")
    if table:
        frame.index = pd.MultiIndex.from_tuples(frame.index, names=["model", "num_tokens"])
        frame["correct"] = frame["correct"].astype(object)  # True, False or None, as _correct says
    frame.attrs.update(problem=problem, ours=ours, peers=peers, mode=runs.attrs.get("mode", "op"))
    return frame


def geomean_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per model of a :func:`speedup_table`: for each peer the geomean and the smallest of our speed-ups over
    the token counts where both were timed, how many those are, and whether every case was correct."""
    summary = {}
    for model, cases in table.groupby(level="model", sort=False):
        entry = {}
        for peer in table.attrs["peers"]:
            timed = cases[f"vs {peer}"].dropna()
            entry[f"geomean vs {peer}"] = geomean(timed)
            entry[f"min vs {peer}"] = timed.min() if len(timed) else math.nan
        entry["cases timed"] = (
            f"{int(cases[[f'vs {p}' for p in table.attrs['peers']]].notna().all(axis=1).sum())}/{len(cases)}"
        )
        entry["all correct"] = bool(all(value is not False for value in cases["correct"]))
        summary[model] = entry
    frame = pd.DataFrame.from_dict(summary, orient="index")
    frame.index.name = "model"
    frame.attrs.update(table.attrs)
    return frame


def styled_speedups(table: pd.DataFrame):
    """:func:`speedup_table` for display: times as ms, speed-ups below 1 in red and from 1.2 up in bold."""
    speedups = [column for column in table.columns if column.startswith("vs ")]
    formats = {column: "{:.3f}" for column in table.columns if column.endswith("(ms)")}
    formats.update({column: "{:.2f}×" for column in speedups})
    mode = table.attrs.get("mode", "op")
    caption = (
        f"{table.attrs['problem']}{'' if mode == 'op' else f' (layer {mode})'}: {table.attrs['ours']} against "
        f"{', '.join(table.attrs['peers'])} at the models' shapes (speed-up = peer's time / ours)"
    )
    return styled(table, formats, caption).map(_speedup_colour, subset=speedups)


def styled_geomeans(summary: pd.DataFrame):
    """:func:`geomean_table` for display, coloured as :func:`styled_speedups`."""
    speedups = [column for column in summary.columns if " vs " in column]
    caption = f"{summary.attrs['problem']}: {summary.attrs['ours']}'s speed-ups per model, over the token counts"
    return styled(summary, {column: "{:.2f}×" for column in speedups}, caption).map(_speedup_colour, subset=speedups)


def _speedup_colour(value) -> str:
    if value is None or pd.isna(value):
        return ""
    if value < 1:
        return "color: #b00020"
    return "font-weight: bold" if value >= TARGET_SPEEDUP else ""


def speedup_figure(table: pd.DataFrame):
    """Our speed-up over each peer (one panel each) against the token count, one line per model, with the lines
    of a tie (1.0) and of the project's bar (:func:`target_speedup`)."""
    peers = table.attrs["peers"]
    fig, axes = plt.subplots(1, len(peers), figsize=(6.5 * len(peers), 4.2), squeeze=False, layout="constrained")
    for ax, peer in zip(axes[0], peers, strict=True):
        for model, cases in table.groupby(level="model", sort=False):
            values = cases[f"vs {peer}"].droplevel("model")
            ax.plot(values.index, values.to_numpy(), marker="o", label=model)
        ax.axhline(1.0, color="black", linewidth=1)
        bar = target_speedup(table.attrs["problem"])
        if bar is not None:
            ax.axhline(bar, color="gray", linestyle="--", linewidth=1, label=f"the target, {bar}×")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens T")
        ax.set_ylabel(f"speed-up of {table.attrs['ours']} over {peer}")
        ax.set_title(f"{table.attrs['problem']}: {table.attrs['ours']} vs {peer}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    return fig
