"""Where the time of one P1 call goes, from the committed traces: the few-token launch's programs step by step
(:func:`few_tokens_traces`), the kernels of a fast-path call (:func:`p1_call_kernels`), the Gluon launches' programs
(:func:`program_traces`) and launch 1's pingpong form (:func:`pingpong_epilogue_table`), each with its timeline.

The lab notes report these runs (notes/p1/design-05-traced.md, design-07.md, design-18.md, ...); which files they are
is data, the index's entries (:mod:`.tuning_index`).
"""

from __future__ import annotations

import dataclasses
import json

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib import patches

from .. import problems
from ..swiglu_down.designs.library_gemms import LibraryGemmsConfig
from . import tuning_index
from .results import resolve_path


def _read_json(path):
    return json.loads(resolve_path(path).read_text())


def few_tokens_traces(path=None) -> pd.DataFrame:
    """The traced few-token launches of a ``scripts/p1/p1_few_tokens_trace.py`` file (the index's ``few_tokens_traces``
    by default): one row per traced launch (label: candidate and L2 flush; tokens; the commit it ran at), the µs since
    the first program started at which the median program reached each step, the graph-replay time, and one replay's
    raw stamps."""
    rows = []
    for run in _read_json(path or tuning_index.run("few_tokens_traces").path)["runs"]:
        for result in run["results"]:
            steps = {point: result["timeline"][point][0] for point in run["points"]}
            rows.append(
                dict(
                    label=result["label"],
                    num_tokens=result["T"],
                    commit=run["commit"][:7],
                    **steps,
                    graph_us=result["graph_us"],
                    stamps=result["stamps_median_run"],
                )
            )
    return pd.DataFrame(rows)


# the stretch between two stamps of a traced few-token program, named by where it ends (few_tokens.TRACE_POINTS)
TRACE_STRETCHES = {
    "dA partial stored": ("phase 1: Wd tile → dA partial", "tab:blue"),
    "dWd stored": ("dWd tile", "tab:cyan"),
    "dA ready": ("wait for the I-block's partials", "lightgrey"),
    "dx partial stored": ("phase 2: dGate, dUp → dx partial", "tab:orange"),
    "dWg, dWu stored": ("dWg, dWu tiles", "tab:red"),
    "end": ("dx sum (the last program, or a slice each), stores visible", "tab:purple"),
}


def few_tokens_timeline_figure(traces: pd.DataFrame, labels: list[tuple]):
    """One panel per (label, tokens, commit[, title]) of :func:`few_tokens_traces`: each program of one replay as
    a row (sorted by its start), each stretch between its stamps as a bar coloured by :data:`TRACE_STRETCHES`, µs
    since the first program started; the title (else the label) and the launch's graph-replay time above it."""
    fig, axes = plt.subplots(len(labels), 1, figsize=(9, 2.6 * len(labels)), sharex=True, squeeze=False)
    points = list(TRACE_STRETCHES)
    for ax, (label, tokens, commit, *title) in zip(axes[:, 0], labels, strict=True):
        row = traces[(traces.label == label) & (traces.num_tokens == tokens) & (traces.commit == commit)].iloc[0]
        stamps = np.asarray(row.stamps, dtype=np.float64)[:, : len(points) + 1]  # start, then each point
        stamps = (stamps - stamps[:, 0].min()) / 1e3
        for y, program in enumerate(stamps[np.argsort(stamps[:, 0])]):
            for i, point in enumerate(points):
                ax.broken_barh([(program[i], program[i + 1] - program[i])], (y, 0.9), color=TRACE_STRETCHES[point][1])
        ax.set(ylabel="program", ylim=(0, len(stamps)))
        ax.set_title(
            f"{title[0] if title else label}, {tokens} token{'s' if tokens > 1 else ''} (commit {commit}): "
            f"{row.graph_us:.1f} µs by graph replay",
            fontsize=9,
            loc="left",
        )
    handles = [patches.Patch(color=color, label=name) for name, color in TRACE_STRETCHES.values()]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes[-1, 0].set_xlabel("µs since the first program started")
    fig.tight_layout()
    return fig


# what each kernel of a P1 fast-path call does, from its name (scripts/p1/p1_kernel_times.py), and its colour
CALL_KERNEL_KINDS = (
    ("nvjet", "cuBLAS GEMM", "tab:blue"),
    ("swiglu_grads", "dSwiGLU pass (ours)", "tab:orange"),
    ("triton_poi", "dSwiGLU pass (Inductor)", "gold"),
    ("CatArray", "copy of [Wg; Wu], kernel", "tab:red"),
    ("Memcpy", "copy of [Wg; Wu], copy engine", "tab:pink"),
)


CALL_KERNEL_COLORS = {kind: color for _, kind, color in CALL_KERNEL_KINDS}


def call_kernel_kind(name: str) -> tuple[str, str]:
    """(what it does, colour) of a kernel of a P1 fast-path call, from its name; ("other", grey) if unknown."""
    for part, kind, color in CALL_KERNEL_KINDS:
        if part in name:
            return kind, color
    return "other", "tab:grey"


def cublas_candidates() -> dict[str, LibraryGemmsConfig]:
    """The candidates of the committed ``scripts/p1/p1_kernel_times.py`` run by their names there, and the cuBLAS design
    each stood for (the index's ``call_kernels``, notes/p1/design-07.md): dA in fp32 and [Wg; Wu] stacked by a copy
    kernel, or dA in bf16 and the copy by memcpys."""
    fields = tuning_index.run("call_kernels").options["cublas_candidates"]
    return {name: LibraryGemmsConfig(**config) for name, config in fields.items()}


def p1_call_kernels(path=None, labels: dict | None = None, *, defaults_only: bool = False) -> pd.DataFrame:
    """A ``scripts/p1/p1_kernel_times.py`` file (the index's ``call_kernels`` by default) as one row per kernel of a
    call: token count, implementation (renamed by ``labels``, others left out where given), what the kernel does
    (:func:`call_kernel_kind`), its stream, its median start (µs after the call's first kernel) and duration, and the
    call's median span. ``defaults_only``:
    per token count only ``torch_compile`` (named as the index labels it) and the candidate
    (:func:`cublas_candidates`) that is the fast path's design on cuBLAS GEMMs there today
    (``LibraryGemmsConfig.for_shape`` at the benchmark's shape, as the script ran: what the chooser takes wherever it
    takes cuBLAS's GEMMs on the fast path), named "ours"."""
    index = tuning_index.run("call_kernels")
    data = _read_json(path or index.path)
    candidates, shape = cublas_candidates(), problems.load("swiglu_down_backward")
    rows = []
    for run in data["rows"] if isinstance(data, dict) else data:
        impl = run["impl"]
        if defaults_only:
            # (the committed run predates dx in two products, which the form takes at H 2048, I 768 only below
            # 1536 tokens, where the chooser does not take cuBLAS's design anyway)
            today = LibraryGemmsConfig.for_shape(run["T"], shape.sizes(run["T"])["intermediate_size"])
            if impl in index.labels:
                impl = index.labels[impl]
            elif candidates.get(impl) == dataclasses.replace(today, dx_in_two=False):
                impl = "ours"
            else:
                continue
        elif labels is not None:
            if impl not in labels:
                continue
            impl = labels[impl]
        for kernel in run["kernels"]:
            rows.append(
                dict(
                    num_tokens=run["T"],
                    impl=impl,
                    kind=call_kernel_kind(kernel["name"])[0],
                    stream=kernel["stream"],
                    start_us=kernel["start_us"],
                    duration_us=kernel["duration_us"],
                    span_us=run["span_us"],
                )
            )
    return pd.DataFrame(rows)


def call_timeline_figure(table: pd.DataFrame, title: str):
    """A :func:`p1_call_kernels` table as one panel per token count: each implementation's call as a block of rows,
    one kernel per row in order of its start, a bar from its start for its duration coloured by what it does."""
    tokens = list(table.num_tokens.unique())
    fig, axes = plt.subplots(len(tokens), 1, figsize=(9, 2.4 * len(tokens)), squeeze=False)
    for ax, T in zip(axes[:, 0], tokens, strict=True):
        rows, names = 0, []
        for impl, call in table[table.num_tokens == T].groupby("impl", sort=False):
            for kernel in call.sort_values("start_us").itertuples():
                ax.broken_barh(
                    [(kernel.start_us, kernel.duration_us)],
                    (rows, 0.8),
                    color=CALL_KERNEL_COLORS.get(kernel.kind, "tab:grey"),
                )
                rows += 1
            names.append((rows - len(call) / 2, f"{impl}\n{call.span_us.iloc[0]:.1f} µs"))
            ax.axhline(rows - 0.1, color="lightgrey", lw=0.8)
        ax.set_yticks([y for y, _ in names], [name for _, name in names], fontsize=8)
        ax.set(ylim=(rows, 0), title=f"{title}: {T} tokens", xlabel="µs after the call's first kernel")
    handles = [patches.Patch(color=color, label=kind) for _, kind, color in CALL_KERNEL_KINDS]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


TRACE_TILE_COLORS = {"dWd": "tab:blue", "dA": "tab:orange", "dWg, dWu": "tab:green", "dx": "tab:red"}


def program_traces(path=None) -> pd.DataFrame:
    """A committed file of program traces of the faithful path's two Gluon launches (``scripts/p1/p1_program_trace.py``
    under ``designs.gluon.traced_programs()``; the index's ``program_traces`` by default): per program its run
    (commit, config), token count T, launch, program id, SM, tile kind, start, end of its wait for launch 1 (proceed)
    and end in µs from launch 1's first program's start, its run and wait."""
    return pd.read_csv(resolve_path(path or tuning_index.run("program_traces").path))


def program_trace_summary(rows: pd.DataFrame, sms: int = 132) -> pd.DataFrame:
    """Per token count, launch and tile kind: programs, first start, median start and last end, median and longest
    run, median wait, and how busy the ``sms`` SMs are over the launch's span (Σ runs / (span × SMs))."""
    table = rows.groupby(["T", "launch", "tiles"], sort=False).agg(
        programs=("program", "size"),
        first_start=("start_us", "min"),
        median_start=("start_us", "median"),
        last_end=("end_us", "max"),
        median_run=("run_us", "median"),
        longest_run=("run_us", "max"),
        median_wait=("wait_us", "median"),
    )
    spans = rows.groupby(["T", "launch"]).agg(
        span_start=("start_us", "min"), span_end=("end_us", "max"), busy=("run_us", "sum")
    )
    spans["sm_busy"] = spans.busy / ((spans.span_end - spans.span_start) * sms)
    return table.join(spans[["sm_busy"]], on=["T", "launch"]).round(2)


def program_timeline_figure(panels: dict):
    """One panel per entry of ``panels`` (title → one call's trace rows): a line per program from its start to its
    end at its SM (launch 2's a little above launch 1's), coloured by tile kind, grey while launch 2's program waits
    for launch 1."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False, sharex=True)
    for ax, (title, rows) in zip(axes[:, 0], panels.items(), strict=True):
        for tiles, part in rows.groupby("tiles"):
            ax.hlines(
                part.sm + (part.launch == "launch 2") * 0.4,
                part.start_us,
                part.end_us,
                colors=TRACE_TILE_COLORS[tiles],
                label=tiles,
                linewidth=1.2,
            )
            waited = part[part.wait_us > 0.5]
            ax.hlines(waited.sm + 0.4, waited.start_us, waited.proceed_us, colors="lightgrey", linewidth=1.2)
        ax.axvline(rows.end_us.max(), color="black", lw=0.8, ls=":")
        ax.set(title=f"{title}: last program ends at {rows.end_us.max():.1f} µs", ylabel="SM")
    axes[-1, 0].set_xlabel("µs from launch 1's first program's start")
    axes[0, 0].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    return fig


def pingpong_epilogue_table(num_tokens: int = 2447, paths=None):
    """Per traced pingpong config at ``num_tokens``: the median program's first main loop end and launch 1's end (µs
    from its start), and their difference, the epilogue of the program's first tile (at 2447 tokens each program has
    one tile, so that is all the program does after its main loop). The traces of launch 1's pingpong form (removed
    since), the index's ``pingpong_traces`` by default: a program's "proceed" is the end of its first tile's main
    loop; rows of a file without a config column are the index's ``config``."""
    index = tuning_index.run("pingpong_traces")
    traces = pd.concat([pd.read_csv(resolve_path(path)) for path in paths or index.paths], ignore_index=True)
    unnamed = index.options["config"]
    traces["config"] = traces["config"].fillna(unnamed) if "config" in traces else unnamed
    rows = traces[(traces["launch"] == "launch 1") & (traces["T"] == num_tokens)]
    table = rows.groupby("config", sort=False).agg(
        main_loop_end_us=("proceed_us", "median"), launch_end_us=("end_us", "median")
    )
    table["epilogue_us"] = table["launch_end_us"] - table["main_loop_end_us"]
    return table
