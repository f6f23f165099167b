"""The P1 and P2 designs measured on the GPU, from the committed tuning runs: the tables and figures the lab notes'
numbers come from, and that ``tests/lab/test_measured_designs.py`` holds to what the notes and ``choose.MEASURED``
say. Notebook 04 teaches the designs the chooser takes today; how they came to be is the notes' (notes/index.md).

    P1, few tokens      :func:`p1_design_times`, :func:`p1_few_tokens_times`, :func:`p1_one_block_times`,
                        :func:`p1_phase2_tile_times`, :func:`few_tokens_figure`
    P1, any tuning run  :func:`p1_tune_times` (one run), :func:`p1_tune_runs` and :func:`p1_tune_runs_times` (several),
                        :func:`speedup_figure`, :func:`gains_of_variant`
    P1, the host's gap  :func:`p1_host_gap_times`, :func:`host_gap_figure`, :func:`p1_host_gap_runs`,
                        :func:`host_gap_steps_figure`
    P1, Gluon forms     :func:`p1_gluon_launch2_times`, :func:`launch2_figure`, :func:`fast_path_gluon_times`,
                        :func:`fast_path_gluon_large_times`, :func:`design20_times`, :func:`design21_times`,
                        :func:`design22_times`, :func:`programmatic_launch_gains`, :func:`saved_tiles_early_gains`,
                        :func:`split_tiles_slowdown`, :func:`runs_side_by_side`
    P2                  :func:`p2_kernel_times`, :func:`kernel_times_figure`

Which file each loader reads by default, the labels its tables give the candidates and what each run's "default"
ran at its commit are data: the index's entries (:mod:`.tuning_index`, ``data/results/H200/tuning/index.json``).
Every loader takes another file of the same script as ``path``.
"""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from . import tuning_index
from .results import load_result_file, ok_rows, pivot, resolve_path

P2_KERNEL_COLUMNS = ("A", "G", "Wgu", "Wd", "D", "C", "other")  # scripts/p2/p2_tune.py's per-kernel columns


def _read_json(path):
    return json.loads(resolve_path(path).read_text())


def p1_design_times(path=None) -> pd.DataFrame:
    """A ``scripts/p1/p1_tune.py`` run (the index's ``one_launch`` by default) as the best time (µs) per token count of
    each P1 design and the config that gave it, each candidate's design by the first prefix of its name the index
    lists: "one launch" (the ``one_*`` candidates: design 3, removed since, its code at commit 1051632) and "two
    launches" (the TileConfig ones). Only named candidates count: what "default" stood for depended on the code of
    the day."""
    index = tuning_index.run("one_launch")
    rows = pd.DataFrame([r for r in _read_json(path or index.path) if "error" not in r and r["config"] != "default"])
    rows = rows[rows["ok"]]
    prefixes = index.options["design_by_prefix"]
    rows["design"] = [
        next(design for prefix, design in prefixes if config.startswith(prefix)) for config in rows["config"]
    ]
    best = rows.loc[rows.groupby(["T", "design"])["median_us"].idxmin()]
    table = best.pivot(index="T", columns="design", values=["median_us", "config"])
    table.columns = [f"{design} µs" if what == "median_us" else f"{design}: config" for what, design in table.columns]
    table.index.name = "num_tokens"
    return table[sorted(table.columns, key=lambda c: ("config" in c, c))]


def p1_few_tokens_times(path=None, *, column: str = "graph_us"):
    """A ``scripts/p1/p1_few_tokens_check.py`` run (the index's ``few_tokens_check`` by default) as µs per (precision,
    num_tokens) and candidate (``column``: "graph_us" for graph replay, "official_us" for NVIDIA's method), the path
    that ran before the design ("default" then) under the index's label for it, first; a candidate that was wrong or
    failed is left empty. Returns (table, floor µs: a graph replay of one tiny kernel in the same run)."""
    index = tuning_index.run("few_tokens_check")
    run = _read_json(path or index.path)
    rows = pd.DataFrame([r for r in run["rows"] if r.get("ok") and column in r])
    rows["config"] = [index.label(r.config, r.precision, r.T) for r in rows.itertuples()]
    table = rows.pivot_table(index=["precision", "T"], columns="config", values=column, sort=False)
    table.index.names = ["precision", "num_tokens"]
    first = list(index.columns_first)
    return table[first + [c for c in rows["config"].unique() if c not in first]], run["floor_us"]


def p1_one_block_times(paths=None, *, column: str = "graph_us"):
    """The few-token launch with all tokens in one block (17–128 tokens) against the default paths before it, from
    the committed ``scripts/p1/p1_few_tokens_check.py`` runs of both trees (the index's ``few_tokens_one_block`` by
    default): µs per (precision, num_tokens) and series (the index's ``columns_first``: the paths before, the one
    block with the saved tiles loaded at the start, the default now; what each commit's "default" ran is the index's
    ``default_by_run``), the median over the runs that measured it (``column``: "graph_us" or "official_us").
    Returns (table, the median floor of the runs, µs)."""
    index = tuning_index.run("few_tokens_one_block")
    rows, floors = [], []
    for path in paths or index.paths:
        data = _read_json(path)
        provenance = data["provenance"]
        for run in data.get("rounds") or data["runs"]:
            commit = run.get("commit") or provenance[f"{run['tree']}_commit"]
            floors.append(run["floor_us"])
            for row in run["rows"]:
                series = index.label(row["config"], row["precision"], row["T"], commit)
                if series is not None and row.get("ok") and column in row:
                    rows.append(dict(precision=row["precision"], num_tokens=row["T"], series=series, us=row[column]))
    table = pd.DataFrame(rows).pivot_table(
        index=["precision", "num_tokens"], columns="series", values="us", aggfunc="median"
    )
    return table[list(index.columns_first)], float(np.median(floors))


def p1_phase2_tile_times(path=None, *, column: str = "graph_us"):
    """The one token block's phase-2 tiles, 128 × 128 against 64 × 256 (``few_tokens.ONE_BLOCK_PHASE2_TILE``), from the
    committed ``scripts/p1/p1_few_tokens_check.py`` runs (the index's ``few_tokens_phase2_tiles`` by default): µs
    per (precision, num_tokens) and series, the median over the runs that measured it. Rounds 1–2 ran at the old
    default (128 × 128 tiles; the fast path on cuBLAS from 33 tokens) beside the new tiles as ``d_late_s8``; round 3
    at the new default beside the old tiles as ``a_mv_s4`` (to 32 tokens) and ``a_mv_late_s4`` (above): the index's
    bands; the old tiles with the saved tiles placed otherwise are left out, other candidates keep their names.
    Returns (table, the median floor of the runs, µs)."""
    index = tuning_index.run("few_tokens_phase2_tiles")
    data = _read_json(path or index.path)
    rows, floors = [], []
    for run in data["runs"]:
        floors.append(run["floor_us"])
        for row in run["rows"]:
            series = index.label(row["config"], row["precision"], row["T"], run["round"])
            if series is not None and row.get("ok") and column in row:
                rows.append(dict(precision=row["precision"], num_tokens=row["T"], series=series, us=row[column]))
    table = pd.DataFrame(rows).pivot_table(
        index=["precision", "num_tokens"], columns="series", values="us", aggfunc="median"
    )
    first = list(index.columns_first)
    return table[first + sorted(c for c in table.columns if c not in first)], float(np.median(floors))


def few_tokens_figure(
    table: pd.DataFrame, floor_us: float, chosen: str, before: str | None = None, *, xscale: str = "log", ticks=None
):
    """One panel per precision: µs against token count for each candidate of :func:`p1_few_tokens_times` (or
    series of :func:`p1_one_block_times`), the path before it (``before``; by default the label of the few-token
    check's "default") dashed, ``chosen`` bold, and the floor of one tiny kernel dotted; a candidate not measured at
    some token counts is drawn where it was. ``ticks``: the token counts labelled (default: every one measured)."""
    before = tuning_index.run("few_tokens_check").default if before is None else before
    precisions = list(dict.fromkeys(table.index.get_level_values("precision")))
    fig, axes = plt.subplots(1, len(precisions), figsize=(5.5 * len(precisions), 3.8), sharey=True, squeeze=False)
    for ax, precision in zip(axes[0], precisions, strict=True):
        part = table.loc[precision]
        for config in part.columns:
            style = dict(lw=1, alpha=0.6, marker=".")
            if config == before:
                style = dict(lw=2, ls="--", color="black", marker="o")
            elif config == chosen:
                style = dict(lw=2.5, color="tab:red", marker="o")
            measured = part[config].dropna()
            ax.plot(measured.index, measured, label=config, **style)
        ax.axhline(floor_us, ls=":", color="grey", label="one tiny kernel (floor of the method)")
        ax.set(xscale=xscale, xlabel="tokens", title=f"{precision} path", ylim=(0, None))
        ax.minorticks_off()
        labelled = list(part.index) if ticks is None else list(ticks)
        ax.set_xticks(labelled, [str(t) for t in labelled])
    axes[0][0].set_ylabel("µs (graph replay, L2 flushed)")
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def p1_tune_times(path, *, default_label: str) -> pd.DataFrame:
    """A ``scripts/p1/p1_tune.py`` run as µs per token count (rows) and candidate (columns), the run's "default"
    renamed ``default_label`` (what it stood for depended on the code of the day); failed or wrong candidates
    left out."""
    rows = pd.DataFrame([r for r in _read_json(path) if "error" not in r and r.get("ok")])
    rows["config"] = rows["config"].replace({"default": default_label})
    table = rows.pivot(index="T", columns="config", values="median_us").rename_axis("num_tokens")
    return table[[default_label] + [c for c in table.columns if c != default_label]]


def speedup_figure(table: pd.DataFrame, baseline: str, title: str, *, switch: int | None = None):
    """Each column of a :func:`p1_tune_times` (or :func:`p1_tune_runs_times`) table as the speed-up over ``baseline``
    (its time / theirs) against the token count; 1 dotted; ``switch``: the token count from which the default
    changes, dashed."""
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for config in table.columns:
        if config != baseline:
            speedup = (table[baseline] / table[config]).dropna()  # a line through the counts both measured
            ax.plot(speedup.index, speedup, marker=".", label=config)
    ax.axhline(1.0, ls=":", color="grey")
    if switch is not None:
        ax.axvline(switch, ls="--", color="black", lw=1, label=f"the default switches ({switch} tokens)")
    ax.set(xscale="log", xlabel="tokens", ylabel=f"speed-up over {baseline}", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def p1_tune_runs(path) -> pd.DataFrame:
    """A committed tuning file of ``scripts/p1/p1_tune.py`` runs (``{"runs": [{"round": …, "rows": […]}]}``) as µs per
    token count (rows) and (candidate, round) (columns); failed or wrong candidates left out."""
    rows = [
        dict(row, round=run["round"])
        for run in _read_json(path)["runs"]
        for row in run["rows"]
        if "error" not in row and row.get("ok")
    ]
    return (
        pd.DataFrame(rows)
        .pivot_table(index="T", columns=["config", "round"], values="median_us")
        .rename_axis("num_tokens")
    )


def p1_host_gap_times(path, labels: dict | None = None) -> pd.DataFrame:
    """A ``scripts/p1/p1_host_gap.py`` run as one row per (token count, design): µs by graph replay ("graph") and in
    NVIDIA's method ("official": eager calls, first kernel start to last kernel end), and the host's share between
    them ("gap"); designs renamed by ``labels`` (its run's "default" stood for the code of the day) and kept in
    that order, the others left out."""
    data = _read_json(path)  # one run's rows, or {"runs": [{"rows": [...]}, ...]}
    rows = pd.DataFrame(data if isinstance(data, list) else [row for run in data["runs"] for row in run["rows"]])
    if labels is not None:
        rows = rows[rows["config"].isin(labels)]
        rows = rows.assign(config=pd.Categorical(rows["config"].map(labels), categories=list(labels.values())))
    table = rows.rename(columns={"T": "num_tokens", "config": "design", "graph_us": "graph", "official_us": "official"})
    table["gap"] = table["official"] - table["graph"]
    return table.set_index(["num_tokens", "design"])[["graph", "official", "gap"]].sort_index()


def host_gap_figure(table: pd.DataFrame, title: str):
    """A :func:`p1_host_gap_times` table as bars per token count: each design by graph replay (hatched) and in
    NVIDIA's method (solid) side by side."""
    designs = list(table.index.get_level_values("design").unique())
    tokens = list(table.index.get_level_values("num_tokens").unique())
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / (2 * len(designs))
    colors = plt.get_cmap("tab10")
    methods = (("graph", "//", "graph replay"), ("official", None, "NVIDIA's method"))
    for d, design in enumerate(designs):
        for m, (method, hatch, name) in enumerate(methods):
            values = [table.loc[(t, design), method] if (t, design) in table.index else float("nan") for t in tokens]
            offsets = [i + (2 * d + m - len(designs) + 0.5) * width for i in range(len(tokens))]
            ax.bar(
                offsets,
                values,
                width,
                color=colors(d),
                hatch=hatch,
                alpha=0.55 if hatch else 0.9,
                edgecolor="black",
                lw=0.4,
                label=f"{design}, {name}",
            )
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set(xlabel="tokens", ylabel="µs per call", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def p1_host_gap_runs(path=None, config: str | None = None, labels: dict | None = None) -> pd.DataFrame:
    """One design's host gap in NVIDIA's method (its official span minus graph replay, µs) per token count (rows)
    in each run of a file of ``scripts/p1/p1_host_gap.py`` runs (columns: the run numbers, or ``labels[run]``); by
    default the index's ``gluon_launch2_host_gap`` and its ``config``, launch 2 in Gluon."""
    index = tuning_index.run("gluon_launch2_host_gap")
    config = index.options["config"] if config is None else config
    rows = [
        dict(num_tokens=row["T"], run=(labels or {}).get(run["run"], run["run"]), gap=row["gap_us"])
        for run in _read_json(path or index.path)["runs"]
        for row in run["rows"]
        if row["config"] == config and "gap_us" in row
    ]
    table = pd.DataFrame(rows).pivot_table(index="num_tokens", columns="run", values="gap")
    return table[list(dict.fromkeys(r["run"] for r in rows))]  # the runs in their order


def host_gap_steps_figure(table: pd.DataFrame, title: str):
    """A :func:`p1_host_gap_runs` table as one line per token count across the runs (the steps taken)."""
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for tokens, gaps in table.iterrows():
        ax.plot(range(len(gaps)), gaps.to_numpy(), marker="o", label=f"{tokens} tokens")
    ax.set_xticks(range(len(table.columns)), [str(c) for c in table.columns], fontsize=7)
    ax.axhline(0, color="black", lw=0.8, ls=":")
    ax.set(ylabel="NVIDIA's span − graph replay (µs)", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def p1_gluon_launch2_times(path=None, labels: dict | None = None) -> pd.DataFrame:
    """Launch 2 of the faithful path (dx, dWg, dWu with the hi/lo halves) per implementation of the committed
    ``scripts/p1_gluon_probe.py --launch2`` runs (the script removed at 1051632: ``notes/p1/removed.md``; the
    index's ``gluon_launch2_probe`` by default): µs by graph replay per num_tokens (rows) and implementation
    (columns, renamed by ``labels`` where given; the others left out when ``labels`` is given), the median over the
    runs that measured it."""
    rows = [
        dict(num_tokens=row["T"], impl=row["impl"], us=row["us"])
        for run in _read_json(path or tuning_index.run("gluon_launch2_probe").path)["runs"]
        for row in run["rows"]
        if row.get("product") == "launch 2" and "us" in row
    ]
    table = pd.DataFrame(rows).pivot_table(index="num_tokens", columns="impl", values="us", aggfunc="median")
    if labels:
        table = table[[impl for impl in labels if impl in table.columns]].rename(columns=labels)
    return table


def fast_path_gluon_times(path=None) -> pd.DataFrame:
    """The fast path's designs by graph replay (the index's ``split_dx``: dx split over programs in the Gluon
    launches, and the fast path on them; µs per token count, median over the runs that measured each): the
    Gluon launches without the lo halves, dx unsplit (its design at 65-959 tokens on Hopper) or split in 4, and its
    design on cuBLAS GEMMs (the [Wg; Wu] copy by a kernel, or by the copy engines with dA in bf16), plus "cuBLAS", the
    faster of the two where both ran."""
    index = tuning_index.run("split_dx")
    table = p1_tune_runs_times(path or index.path, precision="fast", labels=index.labels)
    table["cuBLAS"] = table[["cuBLAS, copy kernel", "cuBLAS, memcpys"]].min(axis=1, skipna=False)
    return table


def fast_path_gluon_large_times(path=None) -> pd.DataFrame:
    """The fast path beyond 959 tokens by graph replay (the index's ``fast_gluon_large``; µs per token count, median
    over the runs that measured each): its design on cuBLAS GEMMs and each band's Gluon form of then without the lo
    halves."""
    index = tuning_index.run("fast_gluon_large")
    return p1_tune_runs_times(path or index.path, precision="fast", labels=index.labels)


def design20_times(precision: str = "faithful", path=None) -> pd.DataFrame:
    """Design 20's runs by graph replay (the index's ``design20``: launch 1's dA tiles 64 wide to 256 tokens, dWd's
    tiles in launch 2 at 513-1099 and 3600-5199, and the fast path on those forms; µs per token count and form, the
    median over the runs that measured it): the forms before it, the candidates the index labels, and on the fast
    path its cuBLAS design; "default" rows only where the index names what they ran (the forms before at f60a2bd,
    the fast path's cuBLAS design at c69b21c; the later runs' "default" is design 20's own choice: left out)."""
    return _labelled_times("design20", precision, path)


def design21_times(precision: str = "fast", path=None) -> pd.DataFrame:
    """Design 21's runs by graph replay (the index's ``design21``), µs per token count and form (the median over the
    runs and the candidates that measured it; gluon_dwd2_from2300 and gluon_dwd2_from4600 are the same form): on the
    fast path its forms of its own at 1087-5000 tokens against its cuBLAS design ("default then" for the default of
    the first runs from 2300 tokens: the faithful path's form at 2300-3299 and 3600-4299, cuBLAS elsewhere; at
    6e47ee6 its own forms of then, by the index's bands); on the faithful path the 1100 and 1400 bands' forms with
    dWd's tiles in launch 2 against the forms before ("forms before")."""
    return _labelled_times("design21", precision, path)


def _labelled_times(key: str, precision: str, path=None) -> pd.DataFrame:
    """µs by graph replay per token count and label of the index's run ``key`` on ``precision``'s path: each ok row
    of its ``scripts/p1/p1_tune.py`` runs under the label the index gives it (its "default" by commit and token count;
    rows it labels None left out), the median over the rows of a label; the index's ``columns_first``, then its
    labels in their order, where measured."""
    index = tuning_index.run(key)
    rows = [
        dict(
            num_tokens=row["T"],
            form=index.label(row["config"], precision, row["T"], run["commit"]),
            us=row["median_us"],
        )
        for run in _read_json(path or index.path)["runs"]
        if run["precision"] == precision
        for row in run["rows"]
        if row.get("ok")
    ]
    table = pd.DataFrame([row for row in rows if row["form"] is not None])
    table = table.pivot_table(index="num_tokens", columns="form", values="us", aggfunc="median")
    order = [*index.columns_first, *index.labels_for(precision).values()]
    return table[[label for label in dict.fromkeys(order) if label in table.columns]]


def design22_times(precision: str = "fast", path=None) -> pd.DataFrame:
    """Design 22's runs by graph replay (the index's ``design22``: the forms to 512 tokens before it and with dWd's
    tiles in launch 2, and the fast path's 64-wide dA form at 1100-1249 against cuBLAS): µs per token count and form
    (the index's labels of ``precision``), the median over the runs that measured it; "default" (which changed
    between the runs) left out."""
    index = tuning_index.run("design22")
    return p1_tune_runs_times(path or index.path, precision, index.labels_for(precision))


def runs_side_by_side(
    before=None, after=None, impls=("triton", "triton_fast", "torch_compile"), max_tokens: int = 128
) -> pd.DataFrame:
    """µs by graph replay per num_tokens (to ``max_tokens``: rows) of each of ``impls`` in two committed benchmark
    runs (CSV paths; by default the index's ``graph_counters``: before and after a captured graph kept an eager
    call's zeroed counters instead of zeroing its own in a memset node), columns (impl, "before" / "after"), and the
    change after − before ("Δ")."""
    if before is None and after is None:
        before, after = tuning_index.run("graph_counters").paths
    times = {}
    for label, path in (("before", before), ("after", after)):
        result = load_result_file(resolve_path(path))
        table = pivot(result, "median_ms", ok_rows(result))
        times[label] = table.loc[table.index <= max_tokens, list(impls)] * 1000
    columns = {}
    for impl in impls:
        columns[(impl, "before")] = times["before"][impl]
        columns[(impl, "after")] = times["after"][impl]
        columns[(impl, "Δ")] = times["after"][impl] - times["before"][impl]
    return pd.DataFrame(columns).rename_axis(columns=["impl", "run"])


def programmatic_launch_gains(path=None) -> pd.DataFrame:
    """What issuing launch 2 by programmatic dependent launch saves each Gluon form: per num_tokens (rows) and form
    (columns), the form's µs by graph replay plainly issued minus its ``_pdl`` candidate's (the index's
    ``variant_suffix``; launch 1 letting launch 2 start as each of its programs starts), from the committed
    ``scripts/p1/p1_tune.py`` runs (the index's ``programmatic_launch``); forms measured only one way left out."""
    index = tuning_index.run("programmatic_launch")
    return gains_of_variant(path or index.path, index.options["variant_suffix"])


def gains_of_variant(path, suffix: str) -> pd.DataFrame:
    """Per num_tokens (rows) and form (columns), the form's µs by graph replay minus its variant's (the candidate named
    as the form with ``suffix``), the median over a file's ``scripts/p1/p1_tune.py`` runs; forms measured only one way
    left out."""
    times = p1_tune_runs_times(path)
    forms = [name for name in times.columns if f"{name}{suffix}" in times.columns]
    return pd.DataFrame({name: times[name] - times[f"{name}{suffix}"] for name in forms}).dropna(how="all")


def saved_tiles_early_gains(path=None) -> pd.DataFrame:
    """What asking for launch 1's saved tiles from the loading warp, as the main loop frees their buffers, saves each
    Gluon form: per num_tokens (rows) and form (columns), the form's µs by graph replay minus its ``_early``
    candidate's (the index's ``saved_tiles_early`` and its ``variant_suffix``; the median over the committed runs);
    forms measured only one way left out."""
    index = tuning_index.run("saved_tiles_early")
    return gains_of_variant(path or index.path, index.options["variant_suffix"])


def split_tiles_slowdown(path=None) -> pd.DataFrame:
    """dA's and dx's reductions split over programs, against the 65-1099 band's form unsplit (the index's
    ``split_tiles``, its ``base`` candidate): per num_tokens (rows) and split candidate (columns, those whose name
    holds the index's ``split_marker``: ``gluon12_m64_daA_dxX`` on 64-row tiles, ``gluon12_m128_*`` on 128-row tiles),
    the candidate's µs by graph replay over the unsplit form's (above 1: slower)."""
    index = tuning_index.run("split_tiles")
    times = p1_tune_runs_times(path or index.path)
    base = times[index.options["base"]]
    splits = [name for name in times.columns if index.options["split_marker"] in name]
    return times[splits].div(base, axis=0)


def p1_tune_runs_times(
    path=None, precision: str = "faithful", labels: dict | None = None, runs: tuple[int, ...] | None = None
):
    """Whole calls by graph replay from a file of several ``scripts/p1/p1_tune.py`` runs (as :func:`p1_tune_times` for
    one; the index's ``gluon_launch1`` by default): µs per num_tokens (rows) and candidate (columns, renamed by
    ``labels`` where given and the others left out), the median over the runs of ``precision`` that measured it (runs
    without a "precision" field count as faithful), or over the runs numbered in ``runs``; failed or wrong candidates
    left out, and "default" (which changed between runs) unless ``runs`` names the runs of one code."""
    rows = [
        dict(num_tokens=row["T"], config=row["config"], us=row["median_us"])
        for run in _read_json(path or tuning_index.run("gluon_launch1").path)["runs"]
        if run.get("precision", "faithful") == precision and (runs is None or run["run"] in runs)
        for row in run["rows"]
        if row.get("ok") and (row["config"] != "default" or runs is not None)
    ]
    table = pd.DataFrame(rows).pivot_table(index="num_tokens", columns="config", values="us", aggfunc="median")
    if labels:
        table = table[[config for config in labels if config in table.columns]].rename(columns=labels)
    return table


def launch2_figure(table: pd.DataFrame, title: str):
    """A :func:`p1_gluon_launch2_times` table as bars per token count, each implementation's µs relative to the
    first column's (the first column at 1)."""
    relative = table.div(table.iloc[:, 0], axis=0)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    relative.plot.bar(ax=ax, rot=0, width=0.8, edgecolor="black", lw=0.4)
    ax.axhline(1, color="black", lw=0.8, ls=":")
    ax.set(xlabel="tokens", ylabel=f"time / {table.columns[0]}", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def p2_kernel_times(path, labels: dict | None = None) -> pd.DataFrame:
    """A ``scripts/p2/p2_tune.py`` run as one row per (case, config): each kernel's median ms (0 where it
    did not run), the whole call from a CUDA graph, and the worst element-rule pass fraction, in the
    run's order. With ``labels`` (config name -> label) only those configs, named by their labels."""
    rows = []
    for r in _read_json(path):
        if "error" in r or (labels is not None and r["config"] not in labels):
            continue
        row = {"case": r["case"], "config": labels[r["config"]] if labels else r["config"]}
        row.update({k: r["kernels"].get(k, 0.0) for k in P2_KERNEL_COLUMNS})
        row.update(graph_ms=r["graph_ms"], element_rule=r["element_rule"])
        rows.append(row)
    return pd.DataFrame(rows).set_index(["case", "config"])


def kernel_times_figure(table: pd.DataFrame, title: str):
    """Stacked horizontal bars of :func:`p2_kernel_times`: where each (case, config)'s time goes."""
    kernels = [k for k in P2_KERNEL_COLUMNS if table[k].any()]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(table) + 1.2))
    labels = [f"{case}  {config}" for case, config in table.index]
    left = np.zeros(len(table))
    for i, kernel in enumerate(kernels):
        ax.barh(labels, table[kernel], left=left, color=plt.cm.tab10(i), label=kernel)
        left += table[kernel].to_numpy()
    ax.scatter(table["graph_ms"], labels, marker="|", s=200, color="black", label="whole call (graph)", zorder=3)
    ax.invert_yaxis()
    ax.set(xlabel="ms (median per kernel)", title=title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig
