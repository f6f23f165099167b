"""Notebook 04: the Triton kernels' launches as tables and diagrams, P1's choice of design, and the designs measured.

Every grid comes from the kernel family's own ``launch_plan()`` (:mod:`moe_lib.swiglu_down.designs.triton_launches`
for P1's portable launches, :mod:`moe_lib.moe_experts.launch` for P2), and every design named here from P1's chooser
(:func:`moe_lib.swiglu_down.choose.choose_design`) on a stated :class:`~moe_lib.swiglu_down.runtime.Device`; this
module only turns them into a table or a picture. Importing it imports triton: set ``TRITON_INTERPRET`` before, if
at all.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import re
import sys

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from matplotlib import patches

from .. import problems
from ..moe_experts import launch as p2_launch
from ..moe_experts.choose import launch_config as p2_launch_config
from ..moe_experts.config import KernelLaunch, LaunchConfig
from ..moe_experts.routing import route_by_expert
from ..swiglu_down.choose import choose_design
from ..swiglu_down.designs import DESIGNS
from ..swiglu_down.designs.gluon import FORMS, GluonLaunches
from ..swiglu_down.designs.library_gemms import LibraryGemmsConfig
from ..swiglu_down.designs.triton_launches import (
    INTERPRETER_TILES,
    TileConfig,
    TileKind,
    grid_sizes,
    launch_plan,
    tiles_for,
)
from ..swiglu_down.gluon_launch1 import GluonFirstLaunchConfig
from ..swiglu_down.runtime import Device
from ..tiling import cdiv
from .results import RESULTS_DIR, load_result_file, ok_rows, pivot, resolve_path

# the tuning scripts' committed outputs (scripts/p1/p1_tune.py, scripts/p2/p2_tune.py, ...)
TUNING_DIR = RESULTS_DIR / "H200" / "tuning"
P2_KERNEL_COLUMNS = ("A", "G", "Wgu", "Wd", "D", "C", "other")  # scripts/p2/p2_tune.py's per-kernel columns
KIND_COLORS = {"dWd": "tab:blue", "dA": "tab:orange", "dWg": "tab:green", "dWu": "tab:olive", "dx": "tab:red"}
# the GPU the tuning ran on as P1's chooser sees it (what runtime.device_of reads off an H200): the tables and figures
# of its choice are drawn for it, on any machine
H200 = Device("cuda", sms=132, shared_memory=232448, capability=(9, 0), name="NVIDIA H200")


def styled_plan(table: pd.DataFrame, caption: str):
    """A plan table (:func:`p1_plan_table`, :func:`p2_plan_table`) styled, text left-aligned."""
    text = [c for c in table.columns if not pd.api.types.is_numeric_dtype(table[c])]
    return table.style.set_properties(subset=text, **{"text-align": "left"}).set_caption(caption)


# ================================================================ P1: two launches of tile kinds


def p1_plan_table(plan: list[TileKind]) -> pd.DataFrame:
    """A plan of P1's portable launches (:func:`~moe_lib.swiglu_down.designs.triton_launches.launch_plan`) as one
    row per tile kind: launch,
    kind, what it computes, output [M, N], reduction, tile (BLOCK_M×BLOCK_N×BLOCK_K), split, tiles,
    programs and the first program id in its launch."""
    return pd.DataFrame([dict(launch=k.launch, kind=k.kind, computes=k.computes, output=f"[{k.M}, {k.N}]",
                              reduce=f"{k.reduce_name} = {k.reduce_length}",
                              tile=f"{k.block_m}×{k.block_n}×{k.block_k}", split=k.split, tiles=k.tiles,
                              programs=k.programs, first_program=k.first_program)
                         for k in plan])  # fmt: skip


def p1_grid_table(token_counts, hidden_size: int, intermediate_size: int, *, with_lo: bool = False,
                  interpreter: bool = False) -> pd.DataFrame:  # fmt: skip
    """Per token count: the tile shape and split of each kind and the programs of each launch of P1's portable
    launches, with the tiles they take on a GPU (:func:`~moe_lib.swiglu_down.designs.triton_launches.tiles_for`;
    ``with_lo``: the faithful path's) or under the interpreter (``INTERPRETER_TILES``)."""
    rows = {}
    for t in token_counts:
        config = INTERPRETER_TILES if interpreter else tiles_for(t, with_lo=with_lo)
        plan = launch_plan(t, hidden_size, intermediate_size, config)
        row = {f"{k.kind} tile (split)": f"{k.block_m}×{k.block_n}×{k.block_k} ({k.split})"
               for k in plan if k.kind != "dWu"}  # fmt: skip
        row.update({f"launch {n} programs": programs for n, programs in grid_sizes(plan).items()})
        rows[t] = row
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "num_tokens"
    return table


def rows_read(k_start: int, k_end: int, intermediate_size: int) -> str:
    """Which weight a dx program's reduction range [k_start, k_end) over the 2I rows of [Wg; Wu] reads."""
    if k_start >= k_end:
        return "empty"
    if k_end <= intermediate_size:
        return "Wg"
    return "Wu" if k_start >= intermediate_size else "Wg and Wu"


def _draw_tile_kind(ax, kind: TileKind, x0: float, y0: float, max_tiles: int = 4096) -> None:
    """One output matrix in element units (N across, M down) with its top-left corner at (x0, y0), its tile grid
    (hatched where split-K) and its caption above it."""
    color = KIND_COLORS.get(kind.kind, "tab:gray")
    M, N, bm, bn = kind.M, kind.N, kind.block_m, kind.block_n
    ax.add_patch(patches.Rectangle((x0, y0), N, M, facecolor=color, alpha=0.18, edgecolor=color, lw=1.5))
    if kind.tiles <= max_tiles:
        for i in range(0, M, bm):
            for j in range(0, N, bn):
                ax.add_patch(patches.Rectangle((x0 + j, y0 + i), min(bn, N - j), min(bm, M - i), fill=False,
                                               edgecolor=color, lw=0.5, hatch="///" if kind.split > 1 else None))
    ax.annotate(_caption(kind), (x0, y0), xytext=(0, 4), textcoords="offset points", fontsize=8, ha="left",
                va="bottom")


def _caption(kind: TileKind) -> str:
    reduce = f"{kind.reduce_name} = {kind.reduce_length}"
    split = f"split-K ×{kind.split} over {reduce}" if kind.split > 1 else f"reduces over {reduce}"
    return (f"{kind.computes}\n[{kind.M}, {kind.N}]: {kind.tiles} tiles of {kind.block_m}×{kind.block_n}\n{split}; "
            f"programs {kind.first_program}–{kind.first_program + kind.programs - 1}")


def p1_tiling_figure(num_tokens: int, hidden_size: int, intermediate_size: int, config: TileConfig):
    """P1's two portable launches under ``config``: each tile kind's output matrix with its tile grid (hatched where
    split-K), every matrix to the same scale (one element is as wide in each), and per launch a bar of its
    program ids coloured by kind (the order the kernel hands them out)."""
    plan = launch_plan(num_tokens, hidden_size, intermediate_size, config)
    totals = grid_sizes(plan)
    launches = {n: [k for k in plan if k.launch == n] for n in totals}
    figure_width_pt = 13 * 72
    width = max(sum(k.N for k in kinds) for kinds in launches.values())
    for _ in range(3):  # each matrix takes the room of its caption at least: the captions' size depends on the scale
        gap = 0.08 * width  # between matrices, and the room for each row's captions
        caption = 8 * 0.62 * width / figure_width_pt  # data units per character of an 8-point caption
        advance = {k.kind: max(k.N, caption * max(map(len, _caption(k).splitlines()))) + gap for k in plan}
        width = max(sum(advance[k.kind] for k in kinds) - gap for kinds in launches.values())
    heights = {n: max(k.M for k in kinds) for n, kinds in launches.items()}
    height = sum(heights.values()) + 2.6 * gap * len(heights)

    fig = plt.figure(figsize=(13, 1.6 + 12 * height / width), layout="constrained")
    grid = fig.add_gridspec(1 + len(launches), 1, height_ratios=[12 * height / width] + [0.35] * len(launches))
    ax = fig.add_subplot(grid[0])
    y = 0.0
    for n, kinds in launches.items():
        y += 1.5 * gap
        ax.text(0, y - 0.95 * gap, f"launch {n}: {totals[n]} programs", fontsize=11, weight="bold", va="bottom")
        x = 0.0
        for kind in kinds:
            _draw_tile_kind(ax, kind, x, y)
            x += advance[kind.kind]
        y += heights[n] + 1.1 * gap
    ax.set(xlim=(0, width), ylim=(y, 0))
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"T = {num_tokens}, H = {hidden_size}, I = {intermediate_size}: every matrix to the same scale",
                 fontsize=10, loc="left")  # fmt: skip
    for row, (n, kinds) in enumerate(launches.items(), 1):
        bar_ax = fig.add_subplot(grid[row])
        for kind in kinds:
            bar_ax.barh(0, kind.programs, left=kind.first_program, color=KIND_COLORS[kind.kind], alpha=0.7,
                        edgecolor="black", hatch="///" if kind.split > 1 else None)  # fmt: skip
            bar_ax.text(kind.first_program + kind.programs / 2, 0, f"{kind.kind}: {kind.programs}", ha="center",
                        va="center", fontsize=8)  # fmt: skip
        bar_ax.set(xlim=(0, totals[n]), yticks=[], xlabel=f"launch {n}: program id, tl.program_id(0)")
    return fig


def split_k_figure(split: int = 4):
    """How one tile's reduction is split over ``split`` programs and combined deterministically."""
    fig, ax = plt.subplots(figsize=(12, 4.2))
    ax.set(xlim=(0, 12), ylim=(0, 4.4))
    ax.axis("off")

    def box(x, y, w, h, text, color):
        ax.add_patch(patches.FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", facecolor=color, alpha=0.25,
                                            edgecolor=color))  # fmt: skip
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    def arrow(x0, y0, x1, y1):
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="->", color="black", lw=0.8))

    ax.text(0.1, 4.2, f"one output tile, its reduction over K split into {split} BLOCK_K-aligned ranges",
            fontsize=9, weight="bold")  # fmt: skip
    height = 3.4 / split
    for s in range(split):
        y = 3.6 - (s + 1) * height
        box(0.1, y + 0.05, 3.0, height - 0.15, f"program (tile, split {s})\nacc = Σ over K-range {s}", "tab:blue")
        box(4.0, y + 0.05, 2.2, height - 0.15, f"partials[tile, {s}] (fp32)", "tab:gray")
        arrow(3.15, y + height / 2, 3.95, y + height / 2)
        arrow(6.25, y + height / 2, 7.35, 1.9)
    box(4.0, 3.75, 2.2, 0.35, "counter[tile] += 1 (atomic)", "tab:purple")
    box(7.4, 1.2, 4.4, 1.4, "the program that counts in last:\n"
        + " + ".join(f"p{s}" for s in range(split)) + "  (in split order,\nwhoever arrived when)\n→ epilogue → store",
        "tab:red")  # fmt: skip
    ax.text(7.4, 0.5, "The sum's order is fixed, so the result is the same bit for bit on every run;\n"
            "the counters only grow (by SPLIT per call), so they never need a reset.", fontsize=8)  # fmt: skip
    return fig


# ================================================================ P2: routing, then kernels A, W, D, C


def _grid_text(launch: KernelLaunch) -> str:
    """A launch's grid as "4 × 2 × 1 (experts × I-tiles × row split)"; a persistent launch's as its programs
    and the tiles they loop over."""
    text = f"{' × '.join(map(str, launch.grid.values()))} ({' × '.join(launch.grid)})"
    if launch.tiles:
        text += f", looping over {' × '.join(map(str, launch.tiles.values()))} tiles ({' × '.join(launch.tiles)})"
    return text


def p2_plan_table(plan: dict[str, KernelLaunch]) -> pd.DataFrame:
    """A P2 launch plan (:func:`moe_lib.moe_experts.launch.launch_plan`) as one row per launch, in launch
    order: its grid, its programs (0 where it is not launched) and what one program does."""
    table = pd.DataFrame([dict(step=step, grid=_grid_text(launch), programs=launch.programs,
                               one_program=launch.one_program) for step, launch in plan.items()])  # fmt: skip
    return table.set_index("step")


def p2_grid_table(token_counts, problem: str, *, interpreter: bool = False, num_programs: int = 132) -> pd.DataFrame:
    """Per token count at ``problem``'s shape: the mean slots per expert, the row split R and the programs
    of each launch of :func:`moe_lib.moe_experts.launch.launch_plan` under the config
    :func:`~moe_lib.moe_experts.choose.launch_config` gives (GPU by default; its persistent launches with
    ``num_programs`` programs, the 132 SMs of an H100 or H200)."""
    definition = problems.load(problem)
    rows = {}
    for t in token_counts:
        s = definition.sizes(t)
        config = p2_launch_config(t * s["top_k"], s["num_experts"], input_bytes=definition.dtype.itemsize,
                                  interpreter=interpreter)  # fmt: skip
        plan = p2_launch.launch_plan(t, s["hidden_size"], s["intermediate_size"], s["num_experts"], s["top_k"], config,
                                     num_programs=num_programs, weight_bytes=definition.dtype.itemsize)  # fmt: skip
        rows[t] = {"slots per expert (mean)": t * s["top_k"] / s["num_experts"], "row split R": config.row_split,
                   **{f"kernel {step} programs": launch.programs for step, launch in plan.items()}}  # fmt: skip
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "num_tokens"
    return table


def _routing_panel(ax, topk_indices, routing, cmap) -> None:
    """The slots in token order and sorted by expert, each cell numbered with its expert, and expert_offsets."""
    T, K = topk_indices.shape
    offsets = routing.expert_offsets.tolist()
    experts_in_token_order = topk_indices.reshape(-1).tolist()
    experts_sorted = topk_indices.reshape(-1)[routing.sorted_slot.long()].tolist()
    for row_y, experts, title in ((1.2, experts_in_token_order, "slots s = t·K + k (token order)"),
                                  (0.0, experts_sorted, "sorted by expert (sorted_slot)")):  # fmt: skip
        for p, e in enumerate(experts):
            ax.add_patch(patches.Rectangle((p, row_y), 1, 0.8, facecolor=cmap(e % cmap.N), edgecolor="white"))
            ax.text(p + 0.5, row_y + 0.4, str(e), ha="center", va="center", fontsize=7 if T * K <= 48 else 5)
        ax.text(-0.5, row_y + 0.4, title, ha="right", va="center", fontsize=8)
    for e, start in enumerate(offsets):
        ax.axvline(start, ymin=0.0, ymax=0.4, color="black", lw=1.2)
        if e < len(offsets) - 1:
            ax.text(start, -0.35, f"off[{e}]={start}", fontsize=6, rotation=0, ha="left", va="top")
    ax.set(xlim=(-0.2 * T * K - 2, T * K + 0.5), ylim=(-0.8, 2.2))
    ax.axis("off")
    ax.set_title("routing metadata: the number in each cell is its expert", fontsize=10, loc="left")


def _row_blocks_panel(ax, counts: list[int], config: LaunchConfig) -> None:
    """Each expert's rows cut into row blocks, labelled with the row-split program r that takes them."""
    E, R = len(counts), config.row_split
    block_colors = plt.get_cmap("Set2")
    for e, count in enumerate(counts):
        if count == 0:
            ax.text(0.5, e, "no rows: W still writes zeros to dWg, dWu, dWd", va="center", fontsize=7)
        for b, start in enumerate(range(0, count, config.block_m)):
            rows = min(config.block_m, count - start)
            ax.barh(e, rows, left=start, color=block_colors(b % R), edgecolor="black", height=0.7)
            ax.text(start + rows / 2, e, f"r={b % R}", ha="center", va="center", fontsize=7)
    ax.set(yticks=range(E), yticklabels=[f"expert {e}" for e in range(E)], xlabel="rows of the expert (its slots)",
           title=f"row blocks of {config.block_m} rows: in kernel A (and the pointer-based kernel D), program "
                 f"r = block mod R takes them (R = {R})")  # fmt: skip
    ax.invert_yaxis()
    ax.title.set_fontsize(10)


def _grid_panel(ax, title: str, rows: int, ticks: list, split: int, xlabel: str, ylabel: str, cmap) -> None:
    """A kernel's grid: ``rows`` × one column per (tick, hatch) of ``ticks``, each cell cut into ``split`` programs."""
    for i in range(rows):
        color = cmap(i % cmap.N) if ylabel == "expert" else "tab:gray"
        for j, (_, hatch) in enumerate(ticks):
            for r in range(split):
                ax.add_patch(patches.Rectangle((j + r / split, i), 1 / split, 1, facecolor=color, hatch=hatch,
                                               alpha=0.35 + 0.5 * r / split, edgecolor="white"))  # fmt: skip
                if split > 1 and rows * len(ticks) * split <= 64:
                    ax.text(j + (r + 0.5) / split, i + 0.5, f"r{r}", ha="center", va="center", fontsize=7)
    step = max(1, rows // 16)
    ax.set_xticks([j + 0.5 for j in range(len(ticks))], [tick for tick, _ in ticks])
    ax.set_yticks([i + 0.5 for i in range(0, rows, step)], [str(i) for i in range(0, rows, step)])
    ax.tick_params(labelsize=7)
    ax.set(xlim=(0, len(ticks)), ylim=(rows, 0), xlabel=xlabel, ylabel=ylabel, title=title)
    ax.title.set_fontsize(9)


def p2_tiling_figure(topk_indices, num_experts: int, hidden_size: int, intermediate_size: int,
                     config: LaunchConfig):  # fmt: skip
    """P2's dataflow for one routing under ``config``: slots in token order and sorted by expert (with
    expert_offsets), the row blocks of each expert and which row-split program r of kernel A works on them,
    and the grids of kernels A, W (its two launches in one panel), D and C from the launch plan (the tiles
    of a persistent launch, which its programs loop over)."""
    T, K = topk_indices.shape
    E, R = num_experts, config.row_split
    plan = p2_launch.launch_plan(T, hidden_size, intermediate_size, E, K, config)
    routing = route_by_expert(topk_indices, E)
    cmap = plt.get_cmap("tab10" if E <= 10 else "tab20")
    fig = plt.figure(figsize=(13, 9.5))
    grid = fig.add_gridspec(3, 4, height_ratios=[1.1, 1.8, 2.2], hspace=0.75, wspace=0.4)
    _routing_panel(fig.add_subplot(grid[0, :]), topk_indices, routing, cmap)
    _row_blocks_panel(fig.add_subplot(grid[1, :]), routing.counts.tolist(), config)

    # a persistent launch (kernels W and D in their TMA-fed form) draws its tiles, which its programs loop over
    gate_up, down = (plan[step].tiles or plan[step].grid for step in ("W_gate_up", "W_down"))
    n_key = "N-tiles" if "N-tiles" in gate_up else "N-groups"
    w_ticks = [(f"{m}·{g}", hatch) for w, hatch in ((gate_up, None), (down, "////"))
               for m in range(w["M-tiles"]) for g in range(w[n_key])]  # fmt: skip
    d_tiles = plan["D"].tiles or plan["D"].grid
    d_split = 1 if plan["D"].tiles else R

    def count(step: str) -> str:
        launch = plan[step]
        if launch.tiles:
            return f"{launch.programs} persistent programs,\n{'×'.join(map(str, launch.tiles.values()))} tiles"
        return "×".join(map(str, launch.grid.values())) + " programs"

    panels = (  # title, rows, (tick, hatch) per column, programs per cell, x label, y label
        (f"kernel A\n{count('A')}", E, [(str(j), None) for j in range(plan["A"].grid["I-tiles"])], R,
         "I-tile (R programs each)", "expert"),
        (f"kernel W: dWg·dWu, then dWd (hatched)\n{count('W_gate_up')}", E, w_ticks, 1, "tile", "expert"),
        (f"kernel D\n{count('D')}", E, [(str(j), None) for j in range(d_tiles["H-tiles"])], d_split,
         "H-tile" + ("" if plan["D"].tiles else " (R programs each)"), "expert"),
        (f"kernel C\n{count('C')}", T, [(str(j), None) for j in range(plan["C"].grid["H-tiles"])], 1,
         "H-tile", "token"),
    )  # fmt: skip
    for column, panel in enumerate(panels):
        ax = fig.add_subplot(grid[2, column])
        _grid_panel(ax, *panel, cmap)
        if column == 1:  # kernel W: its dWg·dWu launch, then its dWd launch, one label each (the tiles are many)
            split = gate_up["M-tiles"] * gate_up[n_key]
            ax.axvline(split, color="black", lw=1.2)
            ax.set_xticks([split / 2, split + len(w_ticks[split:]) / 2], ["dWg·dWu", "dWd"])
    return fig


# ================================================================ kernel designs measured on the GPU


def _read_json(path) -> list[dict]:
    return json.loads(resolve_path(path).read_text())


def p1_design_times(path=TUNING_DIR / "2026-11-29-p1-tune-onelaunch.json") -> pd.DataFrame:
    """A ``scripts/p1/p1_tune.py`` run as the best time (µs) per token count of each P1 design and the config
    that gave it: "one launch" (the ``one_*`` candidates: design 3, removed since, its code at commit 1051632) and
    "two launches" (the TileConfig ones). Only named candidates count: what "default" stood for depended on the code
    of the day."""
    rows = pd.DataFrame([r for r in _read_json(path) if "error" not in r and r["config"] != "default"])
    rows = rows[rows["ok"]]
    rows["design"] = np.where(rows["config"].str.startswith("one_"), "one launch", "two launches")
    best = rows.loc[rows.groupby(["T", "design"])["median_us"].idxmin()]
    table = best.pivot(index="T", columns="design", values=["median_us", "config"])
    table.columns = [f"{design} µs" if what == "median_us" else f"{design}: config" for what, design in table.columns]
    table.index.name = "num_tokens"
    return table[sorted(table.columns, key=lambda c: ("config" in c, c))]


# what "default" ran in scripts/p1/p1_few_tokens_check.py's committed run: the paths before the few-token design
FEW_TOKENS_BEFORE = "before: one launch (faithful), two launches (fast)"


def p1_few_tokens_times(path=TUNING_DIR / "2026-11-30-p1-few-tokens-check.json", *, column: str = "graph_us"):
    """A ``scripts/p1/p1_few_tokens_check.py`` run as µs per (precision, num_tokens) and candidate (``column``:
    "graph_us" for graph replay, "official_us" for NVIDIA's method), the path that ran before the design as
    :data:`FEW_TOKENS_BEFORE`; a candidate that was wrong or failed is left empty. Returns (table, floor µs:
    a graph replay of one tiny kernel in the same run)."""
    run = json.loads(resolve_path(path).read_text())
    rows = pd.DataFrame([r for r in run["rows"] if r.get("ok") and column in r])
    rows["config"] = rows["config"].replace({"default": FEW_TOKENS_BEFORE})
    table = rows.pivot_table(index=["precision", "T"], columns="config", values=column, sort=False)
    table.index.names = ["precision", "num_tokens"]
    ordered = [FEW_TOKENS_BEFORE] + [c for c in rows["config"].unique() if c != FEW_TOKENS_BEFORE]
    return table[ordered], run["floor_us"]


# the series of p1_one_block_times: the default paths before, and the few-token launch with all tokens in one block
ONE_BLOCK_BEFORE = "before: one launch, chained launch (faithful); cuBLAS (fast)"
ONE_BLOCK_SAVED_FIRST = "one block, the saved tiles loaded at the start"
ONE_BLOCK_NOW = "one block, the default (the saved tiles after phase 1 from 33 tokens)"
ONE_BLOCK_FILES = (TUNING_DIR / "2026-12-01-p1-few-tokens-one-block.json",
                   TUNING_DIR / "2026-12-01-p1-few-tokens-to-128.json")  # fmt: skip
# commit → what its "default" ran beyond 32 tokens on the faithful path (at most 32 tokens every newer commit runs
# today's default; the fast path's default beyond 32 tokens is cuBLAS in every one of them)
ONE_BLOCK_COMMITS = {"aa4a161": ONE_BLOCK_BEFORE, "01719e9": ONE_BLOCK_SAVED_FIRST, "d72efcf": ONE_BLOCK_SAVED_FIRST,
                     "621fb5e": ONE_BLOCK_NOW}  # fmt: skip


def _one_block_series(commit: str, config: str, precision: str, tokens: int) -> str | None:
    """Which series of :func:`p1_one_block_times` a check row belongs to (None: none of them)."""
    ran = ONE_BLOCK_COMMITS.get(commit[:7])
    if config == "a_mv_t64" and 32 < tokens <= 64:  # the 64-token block, saved tiles at the start
        return ONE_BLOCK_SAVED_FIRST
    if config != "default" or ran is None:
        return None
    if ran == ONE_BLOCK_BEFORE:
        return ran
    if tokens <= 32:
        return ONE_BLOCK_NOW
    return ran if precision == "faithful" else None  # the fast path beyond 32 tokens: cuBLAS, as before


def p1_one_block_times(paths=ONE_BLOCK_FILES, *, column: str = "graph_us"):
    """The few-token launch with all tokens in one block (17–128 tokens) against the default paths before it, from
    the committed ``scripts/p1/p1_few_tokens_check.py`` runs of both trees: µs per (precision, num_tokens) and series
    (:data:`ONE_BLOCK_BEFORE`, :data:`ONE_BLOCK_SAVED_FIRST`, :data:`ONE_BLOCK_NOW`), the median over the runs that
    measured it (``column``: "graph_us" or "official_us"). Returns (table, the median floor of the runs, µs)."""
    rows, floors = [], []
    for path in paths:
        data = _read_json(path)
        provenance = data["provenance"]
        for run in data.get("rounds") or data["runs"]:
            commit = run.get("commit") or provenance[f"{run['tree']}_commit"]
            floors.append(run["floor_us"])
            for row in run["rows"]:
                series = _one_block_series(commit, row["config"], row["precision"], row["T"])
                if series is not None and row.get("ok") and column in row:
                    rows.append(dict(precision=row["precision"], num_tokens=row["T"], series=series, us=row[column]))
    table = pd.DataFrame(rows).pivot_table(index=["precision", "num_tokens"], columns="series", values="us",
                                           aggfunc="median")  # fmt: skip
    return table[[ONE_BLOCK_BEFORE, ONE_BLOCK_SAVED_FIRST, ONE_BLOCK_NOW]], float(np.median(floors))


PHASE2_TILES_BEFORE = "128 × 128 phase-2 tiles (before)"
PHASE2_TILES_NOW = "64 × 256 phase-2 tiles (the default now)"
PHASE2_TILES_CUBLAS = "the cuBLAS design (fast path)"
PHASE2_TILES_FILE = TUNING_DIR / "2026-12-01-p1-few-tokens-phase2-64x256.json"


def _phase2_tiles_series(round_number: int, config: str, precision: str, tokens: int) -> str | None:
    """The series of one row of :data:`PHASE2_TILES_FILE`: rounds 1–2 ran at the old default (128 × 128 tiles; the
    fast path on cuBLAS from 33 tokens) beside the new tiles as ``d_late_s8``; round 3 at the new default beside the
    old tiles as ``a_mv_s4`` (to 32 tokens) and ``a_mv_late_s4`` (above). The old tiles with the saved tiles placed
    otherwise than the old default: None (left out); other candidates keep their names."""
    few_token_default = precision == "faithful" or tokens <= 32  # the fast path's default above: cuBLAS
    if config == "default":
        if not few_token_default:
            return PHASE2_TILES_CUBLAS
        return PHASE2_TILES_NOW if round_number >= 3 else PHASE2_TILES_BEFORE
    if config == "d_late_s8" and round_number < 3:
        return PHASE2_TILES_NOW
    if round_number >= 3 and config == ("a_mv_s4" if tokens <= 32 else "a_mv_late_s4"):
        return PHASE2_TILES_BEFORE
    return None if config.startswith("a_mv") else config


def p1_phase2_tile_times(path=PHASE2_TILES_FILE, *, column: str = "graph_us"):
    """The one token block's phase-2 tiles, 128 × 128 against 64 × 256 (``few_tokens.ONE_BLOCK_PHASE2_TILE``), from
    the committed ``scripts/p1/p1_few_tokens_check.py`` runs: µs per (precision, num_tokens) and series, the median over
    the runs that measured it. Returns (table, the median floor of the runs, µs)."""
    data = _read_json(path)
    rows, floors = [], []
    for run in data["runs"]:
        floors.append(run["floor_us"])
        for row in run["rows"]:
            series = _phase2_tiles_series(run["round"], row["config"], row["precision"], row["T"])
            if series is not None and row.get("ok") and column in row:
                rows.append(dict(precision=row["precision"], num_tokens=row["T"], series=series, us=row[column]))
    table = pd.DataFrame(rows).pivot_table(index=["precision", "num_tokens"], columns="series", values="us",
                                           aggfunc="median")  # fmt: skip
    first = [PHASE2_TILES_BEFORE, PHASE2_TILES_NOW, PHASE2_TILES_CUBLAS]
    return table[first + sorted(c for c in table.columns if c not in first)], float(np.median(floors))


def few_tokens_figure(table: pd.DataFrame, floor_us: float, chosen: str, before: str = FEW_TOKENS_BEFORE, *,
                      xscale: str = "log", ticks=None):  # fmt: skip
    """One panel per precision: µs against token count for each candidate of :func:`p1_few_tokens_times` (or
    series of :func:`p1_one_block_times`), the path before it (``before``) dashed, ``chosen`` bold, and the floor
    of one tiny kernel dotted; a candidate not measured at some token counts is drawn where it was. ``ticks``: the
    token counts labelled (default: every one measured)."""
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


def few_tokens_traces(path=TUNING_DIR / "2026-12-01-p1-few-tokens-trace.json") -> pd.DataFrame:
    """The traced few-token launches of a ``scripts/p1/p1_few_tokens_trace.py`` file: one row per traced launch
    (label: candidate and L2 flush; tokens; the commit it ran at), the µs since the first program started at
    which the median program reached each step, the graph-replay time, and one replay's raw stamps."""
    rows = []
    for run in _read_json(path)["runs"]:
        for result in run["results"]:
            steps = {point: result["timeline"][point][0] for point in run["points"]}
            rows.append(dict(label=result["label"], num_tokens=result["T"], commit=run["commit"][:7], **steps,
                             graph_us=result["graph_us"], stamps=result["stamps_median_run"]))  # fmt: skip
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
        ax.set_title(f"{title[0] if title else label}, {tokens} token{'s' if tokens > 1 else ''} (commit {commit}): "
                     f"{row.graph_us:.1f} µs by graph replay", fontsize=9, loc="left")  # fmt: skip
    handles = [patches.Patch(color=color, label=name) for name, color in TRACE_STRETCHES.values()]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes[-1, 0].set_xlabel("µs since the first program started")
    fig.tight_layout()
    return fig


# ================================================================ P1: the design the chooser picks


PATHS = ("fast", "faithful")  # P1's paths, by the precision argument that picks them


def chosen_design(num_tokens: int, hidden_size: int, intermediate_size: int, precision: str, *, device: Device = H200):
    """The design ``swiglu_down_backward(..., precision=precision)`` runs on bf16 inputs of this shape on ``device``
    (:func:`~moe_lib.swiglu_down.choose.choose_design`, every operand aligned as the benchmark's are)."""
    return choose_design(num_tokens, hidden_size, intermediate_size, dtype=torch.bfloat16, precision=precision,
                         device=device)  # fmt: skip


def _without_chooser_changes(design: GluonLaunches) -> GluonLaunches:
    """A Gluon design with what the chooser changes of a form undone: dWd's tiles back in launch 1, dx unsplit and
    launch 2's weight-gradient tiles one program each (``choose.measured_form``, ``choose.fit_persistent_programs``)."""
    first = dataclasses.replace(design.first, grad_down_tiles=True)
    second = dataclasses.replace(design.second, grad_down_tiles=False, grad_x_splits=1, weight_grad_programs=0)
    return dataclasses.replace(design, first=first, second=second)


def gluon_form_of(design: GluonLaunches) -> tuple[str, bool, int]:
    """(its form's name in :data:`~moe_lib.swiglu_down.designs.gluon.FORMS`, dWd's tiles in launch 2, dx's splits) of
    a configured Gluon design: the form it equals once the chooser's changes are undone on both."""
    undone = _without_chooser_changes(design)
    names = [name for name, form in FORMS.items() if _without_chooser_changes(form) == undone]
    if not names:
        raise ValueError(f"design: not a form of designs.gluon.FORMS, even with dWd's tiles, dx's splits and the "
                         f"persistent programs set back: {design}")  # fmt: skip
    return names[0], design.second.grad_down_tiles, design.second.grad_x_splits


def design_label(design) -> str:
    """A configured P1 design as its registry name (``DESIGNS``), a Gluon design with its form's name and whether
    dWd's tiles moved to launch 2 (dx's splits left to :func:`gluon_forms_table`)."""
    if not isinstance(design, GluonLaunches):
        return design.name
    form, grad_down_second, _ = gluon_form_of(design)
    return f"{design.name}: {form}" + (", dWd in launch 2" if grad_down_second else "")


def p1_registry_table() -> pd.DataFrame:
    """P1's designs as the registry has them (:data:`~moe_lib.swiglu_down.designs.DESIGNS`): per name its config
    class, its module and the first line of the module's docstring (what the design is; Sphinx roles as plain
    names, a module as its file)."""

    def what(design) -> str:
        line = sys.modules[design.__module__].__doc__.strip().splitlines()[0]
        line = re.sub(r":mod:`~?\.*([^`]+)`", r"\1.py", line)  # a module by its file
        return re.sub(r":\w+:`~?\.*([^`]+)`", r"\1", line).replace("``", "")

    rows = {name: {"config": design.__name__, "module": design.__module__.removeprefix("moe_lib."),
                   "what it is": what(design)} for name, design in DESIGNS.items()}  # fmt: skip
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("design")


def p1_design_by_tokens(token_counts, hidden_size: int, intermediate_size: int, *, device: Device = H200):
    """Which design ``swiglu_down_backward`` runs on bf16 inputs on ``device``, per token count (rows) and path
    (columns), as :func:`design_label` names it."""
    rows = {T: {path: design_label(chosen_design(T, hidden_size, intermediate_size, path, device=device))
                for path in PATHS} for T in token_counts}  # fmt: skip
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("num_tokens")


def p1_design_table(token_counts, shapes, *, device: Device = H200) -> pd.DataFrame:
    """:func:`p1_design_by_tokens` for each (H, I) of ``shapes`` side by side: columns (shape, path)."""
    return pd.concat({f"H {H}, I {I}": p1_design_by_tokens(token_counts, H, I, device=device) for H, I in shapes},
                     axis=1, names=["shape", "path"])  # fmt: skip


def design_runs(names: list[str], first: int = 1) -> list[tuple[int, int, str]]:
    """Runs of equal names in a list indexed from ``first``: (start, stop, name), stop excluded."""
    runs = []
    for index, name in enumerate(names, start=first):
        if runs and runs[-1][2] == name:
            runs[-1] = (runs[-1][0], index + 1, name)
        else:
            runs.append((index, index + 1, name))
    return runs


def p1_design_map_figure(hidden_size: int, intermediate_size: int, *, max_tokens: int = 12288,
                         device: Device = H200, marks=(), marks_label: str = "the benchmark's token counts"):
    """Which design ``swiglu_down_backward`` runs at every token count from 1 to ``max_tokens`` on ``device``
    (:func:`chosen_design`, named by :func:`design_label`), one bar per path (to 1024 tokens on a log axis, beyond on
    a linear one), a colour per design; ``marks``: token counts drawn as dotted lines."""
    paths = {path: design_runs([design_label(chosen_design(T, hidden_size, intermediate_size, path, device=device))
                                for T in range(1, max_tokens + 1)])
             for path in PATHS}  # fmt: skip
    designs = list(dict.fromkeys(name for runs in paths.values() for _, _, name in runs))
    colors = dict(zip(designs, plt.get_cmap("tab10" if len(designs) <= 10 else "tab20").colors, strict=False))
    # few tokens on a log axis, the rest on a linear one, where the bands are
    split = min(1024, max_tokens)
    fig, axes = plt.subplots(1, 2, figsize=(11, 1.9 + 0.2 * len(designs)), sharey=True,
                             gridspec_kw=dict(width_ratios=(1, 2)))  # fmt: skip
    for ax, (low, high, scale) in zip(axes, ((1, split, "log"), (split, max_tokens + 1, "linear")), strict=True):
        for row, runs in enumerate(paths.values()):
            for start, stop, name in runs:
                ax.broken_barh([(start, stop - start)], (row - 0.35, 0.7), color=colors[name], edgecolor="black",
                               lw=0.3)  # fmt: skip
        for T in marks:
            ax.axvline(T, color="black", lw=0.6, ls=":")
        ax.set(xscale=scale, xlim=(low, high), xlabel="tokens")
    axes[0].set(yticks=range(len(paths)), yticklabels=list(paths))
    dotted = f"; dotted: {marks_label}" if marks else ""
    fig.suptitle(f"P1: the design swiglu_down_backward runs by token count (H = {hidden_size}, "
                 f"I = {intermediate_size}, {device.name or device.kind}, {device.sms} SMs{dotted})",
                 fontsize=9)  # fmt: skip
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[name]) for name in designs]
    fig.legend(handles, designs, fontsize=7, loc="lower center", ncol=2, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * len(designs) / 2, 1, 1))
    fig.paths = paths  # the runs drawn, per path: (first token count, last + 1, design)
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


def chained_schedule(num_tokens: int, hidden_size: int, intermediate_size: int, tiles: TileConfig, *,
                     programs_at_once: int = 132, with_lo: bool = True,
                     grad_down_last: bool = False) -> pd.DataFrame:  # fmt: skip
    """A model of the chained launch's tickets (:mod:`moe_lib.swiglu_down.designs.chained`), one program per SM: the
    tickets go out in the launch's order (dA tiles, dWd tiles, then launch 2's in ``launch_plan``'s order; with
    ``grad_down_last`` the dWd tiles after launch 2's); an SM that is free
    takes the next one; a tile takes as long as its multiply-adds (launch 2's twice over with ``with_lo``: the hi/lo
    halves), and launch 2's tiles start no sooner than the last dA tile ends. Returns one row per program: kind, sm,
    start and end in MFLOP of one SM's work. A model: it knows nothing of a tile's efficiency (wider tiles do more per
    cycle) or of what a split costs beyond its products."""
    plan = launch_plan(num_tokens, hidden_size, intermediate_size, tiles)
    grad_down, second = [k for k in plan if k.kind == "dWd"], [k for k in plan if k.launch == 2]
    order = [k for k in plan if k.kind == "dA"] + (second + grad_down if grad_down_last else grad_down + second)
    free = [(0.0, sm) for sm in range(programs_at_once)]
    heapq.heapify(free)
    d_a_done, rows = 0.0, []
    for kind in order:
        work = 2 * kind.block_m * kind.block_n * kind.reduce_length / kind.split / 1e6
        work *= 2 if with_lo and kind.launch == 2 else 1
        for _ in range(kind.programs):
            start, sm = heapq.heappop(free)
            if kind.launch == 2:
                start = max(start, d_a_done)
            end = start + work
            if kind.kind == "dA":
                d_a_done = max(d_a_done, end)
            rows.append(dict(kind=kind.kind, sm=sm, start=start, end=end))
            heapq.heappush(free, (end, sm))
    return pd.DataFrame(rows)


def gluon_launch_schedule(num_tokens: int, hidden_size: int, intermediate_size: int, form, *,
                          programs_at_once: int = 132, with_lo: bool = True) -> pd.DataFrame:  # fmt: skip
    """A model of one Gluon launch of the faithful path (``form``: a :class:`~moe_lib.swiglu_down.gluon_launch1.
    GluonFirstLaunchConfig` or :class:`~moe_lib.swiglu_down.gluon_launch2.GluonSecondLaunchConfig`), one program per
    tile handed out in program-id order to whichever SM is free first: launch 1's dWd tiles (K = T) then its dA tiles
    (K = H), or the dA tiles first with ``d_a_first``; launch 2's dWg, dWu tiles (K = T) then its dx tiles (K = 2I),
    or dx first with ``grad_x_first``; with ``grad_down_tiles`` (launch 2's) dWd's tiles go first in launch 2 (after
    dWg's and dWu's with ``grad_down_after_weight_grad``) and none in launch 1; a tile takes as long as its
    multiply-adds (launch 2's twice over with ``with_lo``). Rows as :func:`chained_schedule`'s (kind, sm, start, end
    in MFLOP of one SM's work), for :func:`schedule_figure`. A model: every tile at one rate, whatever its height (a
    64-row tile runs on one warpgroup, a 128-row one on two) and whatever runs beside it."""
    T, H, I = num_tokens, hidden_size, intermediate_size
    bm = form.block_m
    if isinstance(form, GluonFirstLaunchConfig):
        grad_down = ("dWd", cdiv(H, bm) * cdiv(I, form.grad_down_block_n), bm * form.grad_down_block_n * T)
        d_a = ("dA", cdiv(T, bm) * cdiv(I, form.d_a_block_n), bm * form.d_a_block_n * H)
        order = [d_a, grad_down] if form.d_a_first else [grad_down, d_a]
        if not form.grad_down_tiles:  # launch 2 takes them
            order = [d_a]
    else:
        halves = 2 if with_lo else 1
        weight_tiles = cdiv(I, bm) * cdiv(H, form.weight_block_n)
        weight = bm * form.weight_block_n * T * halves
        grad_x = ("dx", cdiv(T, bm) * cdiv(H, form.block_n), bm * form.block_n * 2 * I * halves)
        order = [("dWg", weight_tiles, weight), ("dWu", weight_tiles, weight)]
        order = [grad_x] + order if form.grad_x_first else order + [grad_x]
        if form.grad_down_tiles:  # dWd's tiles first (or after dWg's and dWu's), no lo halves, their own width
            width = form.grad_down_width
            grad_down = ("dWd", cdiv(H, bm) * cdiv(I, width), bm * width * T)
            order = order[:2] + [grad_down] + order[2:] if form.grad_down_after_weight_grad else [grad_down] + order
    free = [(0.0, sm) for sm in range(programs_at_once)]
    heapq.heapify(free)
    rows = []
    for kind, tiles, multiply_adds in order:
        for _ in range(tiles):
            start, sm = heapq.heappop(free)
            end = start + 2 * multiply_adds / 1e6
            rows.append(dict(kind=kind, sm=sm, start=start, end=end))
            heapq.heappush(free, (end, sm))
    return pd.DataFrame(rows)


def schedule_figure(schedules: dict[str, pd.DataFrame]):
    """One panel per :func:`chained_schedule` (by title): each SM a row, each tile a bar coloured by its kind; the
    makespan against the mean work per SM (the makespan of a perfect balance) in the title."""
    fig, axes = plt.subplots(len(schedules), 1, figsize=(9, 2.4 * len(schedules)), sharex=True, squeeze=False)
    for ax, (title, schedule) in zip(axes[:, 0], schedules.items(), strict=True):
        for kind, rows in schedule.groupby("kind"):
            for row in rows.itertuples():
                ax.broken_barh([(row.start, row.end - row.start)], (row.sm, 0.9), color=KIND_COLORS[kind])
        makespan = schedule.end.max()
        balance = (schedule.end - schedule.start).sum() / (schedule.sm.max() + 1)
        ax.set(ylabel="SM", ylim=(0, schedule.sm.max() + 1))
        ax.set_title(f"{title}: last tile ends at {makespan:.0f}, a perfect balance at {balance:.0f} "
                     f"({balance / makespan:.0%})", fontsize=9, loc="left")  # fmt: skip
    handles = [patches.Patch(color=color, label=kind) for kind, color in KIND_COLORS.items()]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes[-1, 0].set_xlabel("MFLOP of one SM's work since the launch started (the model's time)")
    fig.tight_layout()
    return fig


def p1_tune_runs(path) -> pd.DataFrame:
    """A committed tuning file of ``scripts/p1/p1_tune.py`` runs (``{"runs": [{"round": …, "rows": […]}]}``) as µs per
    token count (rows) and (candidate, round) (columns); failed or wrong candidates left out."""
    rows = [dict(row, round=run["round"]) for run in _read_json(path)["runs"] for row in run["rows"]
            if "error" not in row and row.get("ok")]  # fmt: skip
    return pd.DataFrame(rows).pivot_table(index="T", columns=["config", "round"], values="median_us").rename_axis(
        "num_tokens")


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
    table = rows.rename(columns={"T": "num_tokens", "config": "design", "graph_us": "graph",
                                 "official_us": "official"})  # fmt: skip
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
            ax.bar(offsets, values, width, color=colors(d), hatch=hatch, alpha=0.55 if hatch else 0.9,
                   edgecolor="black", lw=0.4, label=f"{design}, {name}")  # fmt: skip
    ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
    ax.set(xlabel="tokens", ylabel="µs per call", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


GLUON_HOST_GAP_FILE = TUNING_DIR / "2026-12-01-p1-gluon-launch2-host-gap.json"
ONE_GRAPH_HOST_GAP_FILE = TUNING_DIR / "2026-12-02-p1-host-gap-one-graph.json"
# its designs: the few-token launch's band before (to 128 tokens), and the Gluon launches issued either way
ONE_GRAPH_LABELS = {"default": "few-token launch to 128, then two launches",
                    "gluon12_m64_lf_pdl_sif": "two launches, one after the other",
                    "gluon12_m64_lf_pdl_sif_graph": "two launches as one CUDA graph"}


def p1_host_gap_runs(path=GLUON_HOST_GAP_FILE, config: str = "gluon2", labels: dict | None = None) -> pd.DataFrame:
    """One design's host gap in NVIDIA's method (its official span minus graph replay, µs) per token count (rows)
    in each run of a file of ``scripts/p1/p1_host_gap.py`` runs (columns: the run numbers, or ``labels[run]``)."""
    rows = [dict(num_tokens=row["T"], run=(labels or {}).get(run["run"], run["run"]), gap=row["gap_us"])
            for run in _read_json(path)["runs"] for row in run["rows"]
            if row["config"] == config and "gap_us" in row]  # fmt: skip
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


GLUON_PROBE_FILE = TUNING_DIR / "2026-12-01-p1-gluon-launch2-probe.json"


def p1_gluon_launch2_times(path=GLUON_PROBE_FILE, labels: dict | None = None) -> pd.DataFrame:
    """Launch 2 of the faithful path (dx, dWg, dWu with the hi/lo halves) per implementation of the committed
    ``scripts/p1_gluon_probe.py --launch2`` runs (the script removed at 1051632: ``notes/p1/removed.md``): µs by
    graph replay per num_tokens (rows) and implementation (columns, renamed by ``labels`` where given; the others
    left out when ``labels`` is given), the median over the runs that measured it."""
    rows = [dict(num_tokens=row["T"], impl=row["impl"], us=row["us"])
            for run in _read_json(path)["runs"] for row in run["rows"]
            if row.get("product") == "launch 2" and "us" in row]  # fmt: skip
    table = pd.DataFrame(rows).pivot_table(index="num_tokens", columns="impl", values="us", aggfunc="median")
    if labels:
        table = table[[impl for impl in labels if impl in table.columns]].rename(columns=labels)
    return table


GLUON_LAUNCH1_FILE = TUNING_DIR / "2026-12-01-p1-gluon-launch1.json"
GLUON_FORMS_FILE = TUNING_DIR / "2026-12-02-p1-gluon-forms.json"
# the candidates of GLUON_FORMS_FILE that became Gluon forms (designs.gluon.FORMS) or led to them, by what they change
GLUON_FORM_LABELS = {"gluon12_b6": "128 rows", "gluon12_b6_l2m64b6": "launch 2 at 64 rows",
                     "gluon12_l2m64_daf": "launch 2 at 64 rows, dA tiles first",
                     "gluon12_m64_l1b8": "both at 64 rows", "gluon12_m64_lf": "both at 64 rows, long tiles first"}


PROGRAMMATIC_LAUNCH_FILE = TUNING_DIR / "2026-12-02-p1-programmatic-launch.json"

# dx split over programs in the Gluon launches, and the fast path on them (its Gluon bands in choose.MEASURED)
SPLIT_DX_FILE = TUNING_DIR / "2026-12-02-p1-split-dx.json"
FAST_PATH_GLUON_LABELS = {"gluon12_m64_lf_pdl_sif_graph_early": "Gluon launches, dx unsplit",
                          "gluon12_m64_early_dx4": "Gluon launches, dx in 4",
                          "lib_s3": "cuBLAS, copy kernel", "lib_bs3_mc": "cuBLAS, memcpys"}  # fmt: skip


def fast_path_gluon_times(path=SPLIT_DX_FILE) -> pd.DataFrame:
    """The fast path's designs by graph replay (µs per token count, median over the runs that measured each): the
    Gluon launches without the lo halves, dx unsplit (its design at 65-959 tokens on Hopper) or split in 4, and its
    design on cuBLAS GEMMs (the [Wg; Wu] copy by a kernel, or by the copy engines with dA in bf16), plus "cuBLAS", the
    faster of the two where both ran."""
    table = p1_tune_runs_times(path, precision="fast", labels=FAST_PATH_GLUON_LABELS)
    table["cuBLAS"] = table[["cuBLAS, copy kernel", "cuBLAS, memcpys"]].min(axis=1, skipna=False)
    return table


FAST_GLUON_LARGE_FILE = TUNING_DIR / "2026-12-02-p1-fast-gluon-large.json"
FAST_GLUON_LARGE_LABELS = {"lib_bs3_mc": "cuBLAS",
                           "gluon12_l2m64_lf_pdl_sif_graph_early": "Gluon, the 1100-1399 form",
                           "gluon12_l2m64_daf_pdl_sif_graph_early": "Gluon, the 1400-2299 form",
                           "gluon12_b6_pdl_sif_graph_early": "Gluon, the 2300-3299 form",
                           "gluon12_b6_l2m64b6_pdl_sif_graph_early": "Gluon, the 3300-4599 form"}  # fmt: skip


def fast_path_gluon_large_times(path=FAST_GLUON_LARGE_FILE) -> pd.DataFrame:
    """The fast path beyond 959 tokens by graph replay (µs per token count, median over the runs that measured each):
    its design on cuBLAS GEMMs and each band's Gluon form of then without the lo halves."""
    return p1_tune_runs_times(path, precision="fast", labels=FAST_GLUON_LARGE_LABELS)


# Design 20 (notes/p1/design-20.md): launch 1's dA tiles 64 wide to 256 tokens, dWd's tiles in launch 2 at
# 513-1099 and 3600-5199, and the fast path on those forms. In the runs at f60a2bd "default" was the forms before;
# in the fast path's run at c69b21c beyond 959 tokens, its cuBLAS design (the later runs' "default" is design 20's
# own choice: left out)
DESIGN20_FILE = TUNING_DIR / "2026-12-02-p1-narrow-da-grad-down-in-launch2.json"
DESIGN20_DEFAULTS = {"f60a2bd69c996e378063ecac7301131e0c75ba69": "forms before",
                     "c69b21cd1dddad02f942e8e2327dab51d1b1237b": "cuBLAS"}  # fmt: skip
DESIGN20_LABELS = {
    "faithful": {"gluon12_m64_early_dx4_wp68_ibw": "dx in 4 (before)",
                 "gluon12_m64_early_dx2_wp68_ibw": "dx in 2 (before)",
                 "gluon12_m64_early_dx4_wp68_ibw_n64": "dA 64 wide, dx in 4",
                 "gluon12_m64_early_dx2_wp68_ibw_n64": "dA 64 wide, dx in 2",
                 "gluon12_m64_early_dx4_wp68_ibw_n64d64": "dA and dWd 64 wide, dx in 4",
                 "gluon_dwd2_from513": "dWd in launch 2, 64-row launch 2",
                 "gluon_dwd2_from4600": "dWd in launch 2, 128-row launch 2",
                 "gluon_dwd2_from4600_a256": "dWd in launch 2, 128-row launch 2, dA 256 wide"},
    "fast": {"lib_bs3_mc": "cuBLAS", "gluon12_m64_early_dx1_wp68_ibw": "forms before",
             "gluon12_m64_early_dx1_wp68_ibw_n64": "dA 64 wide",
             "gluon_dwd2_from513": "dWd in launch 2, 64-row launch 2",
             "gluon_dwd2_from4600": "dWd in launch 2, 128-row launch 2",
             "gluon_dwd2_from4600_a256": "dWd in launch 2, 128-row launch 2, dA 256 wide"},
}


def design20_times(precision: str = "faithful", path=DESIGN20_FILE) -> pd.DataFrame:
    """Design 20's runs by graph replay (µs per token count and form, the median over the runs that measured it):
    the forms before it, launch 1's 64-wide dA tiles and dWd's tiles in launch 2 (``DESIGN20_LABELS``), and on the
    fast path its cuBLAS design; "default" rows only where they name a form (``DESIGN20_DEFAULTS``)."""
    labels = DESIGN20_LABELS[precision]
    rows = []
    for run in _read_json(path)["runs"]:
        if run["precision"] != precision:
            continue
        for row in run["rows"]:
            config = row["config"]
            label = DESIGN20_DEFAULTS.get(run["commit"]) if config == "default" else labels.get(config)
            if row.get("ok") and label is not None:
                rows.append(dict(num_tokens=row["T"], form=label, us=row["median_us"]))
    table = pd.DataFrame(rows).pivot_table(index="num_tokens", columns="form", values="us", aggfunc="median")
    order = ["forms before", "cuBLAS"] + [label for label in labels.values() if label not in ("forms before", "cuBLAS")]
    return table[[label for label in dict.fromkeys(order) if label in table.columns]]


DESIGN21_FILE = TUNING_DIR / "2026-12-02-p1-fast-own-forms.json"
# the candidates behind the fast path's forms of its own (its entries of choose.MEASURED), the faithful path's 1500
# form and those they were measured against, by precision (gluon_dwd2_from2300 and gluon_dwd2_from4600
# are the same form: the 2300 and 4600 bands' forms were equal)
DESIGN21_LABELS = {
    "fast": {"lib_bs3_mc": "cuBLAS", "gluon_dwd2_from1400": "1400 form, dWd in launch 2",
             "gluon_dwd2_from2300": "2300 form, dWd in launch 2", "gluon_dwd2_from4600": "2300 form, dWd in launch 2",
             "gluon_dwd2_from2300_n64": "2300 form, dWd in launch 2, dA 64 wide",
             "gluon_dwd2_from4600_a256": "3600 form"},
    "faithful": {"gluon_dwd2_from1100": "1100 form, dWd in launch 2",
                 "gluon_dwd2_from1400": "1400 form, dWd in launch 2",
                 "gluon_dwd2_from1100_n64": "1100 form, dWd in launch 2, dA 64 wide",
                 "gluon_dwd2_from1400_n64": "1400 form, dWd in launch 2, dA 64 wide"},
}
# what "default" ran in those runs, by precision and commit, as a label of the table by token count (None: a form
# not in the table): at b8c31d3 the fast path's cuBLAS design below 2300 tokens ("default then" above: the faithful
# path's form or cuBLAS); at 6e47ee6 its own forms of then (the 1400 and 2300 bands' with dWd in launch 2 at 1300-1499
# and 1500-2299, the 3600 form at 2300-2599), and the faithful path's forms before its 1500 form


def _fast_forms_then(num_tokens: int):
    bands = ((1100, None), (1300, "cuBLAS"), (1500, "1400 form, dWd in launch 2"),
             (2300, "2300 form, dWd in launch 2"), (2600, "3600 form"))  # fmt: skip
    return next((label for stop, label in bands if num_tokens < stop), "default then")


DESIGN21_DEFAULTS = {
    ("fast", "b8c31d3d5527ddfbff905d58e82b5e636a51a07a"): lambda tokens: "cuBLAS" if tokens < 2300 else "default then",
    ("fast", "6e47ee6cc5a18184860b07aaebbb2503e996d081"): _fast_forms_then,
    ("faithful", "6e47ee6cc5a18184860b07aaebbb2503e996d081"): lambda num_tokens: "forms before",
}


def design21_times(precision: str = "fast", path=DESIGN21_FILE) -> pd.DataFrame:
    """Design 21's runs by graph replay, µs per token count and form (the median over the runs and the candidates
    that measured it, ``DESIGN21_LABELS``): on the fast path its forms of its own at 1087-5000 tokens against its
    cuBLAS design ("default then" for the default of the first runs from 2300 tokens: the faithful path's form at
    2300-3299 and 3600-4299, cuBLAS elsewhere); on the faithful path the 1100 and 1400 bands' forms with dWd's tiles
    in launch 2 against the forms before ("forms before")."""
    labels = DESIGN21_LABELS[precision]

    def label(run, config, num_tokens):
        if config != "default":
            return labels.get(config)
        default = DESIGN21_DEFAULTS.get((precision, run["commit"]))
        return default and default(num_tokens)

    rows = [dict(num_tokens=row["T"], form=label(run, row["config"], row["T"]), us=row["median_us"])
            for run in _read_json(path)["runs"] if run["precision"] == precision for row in run["rows"]
            if row.get("ok")]  # fmt: skip
    table = pd.DataFrame([row for row in rows if row["form"] is not None])
    table = table.pivot_table(index="num_tokens", columns="form", values="us", aggfunc="median")
    order = ["default then", "forms before", *labels.values()]
    return table[[label for label in dict.fromkeys(order) if label in table.columns]]


DESIGN22_FILE = TUNING_DIR / "2026-12-02-p1-dwd2-to-512.json"
# the candidates of design 22's runs, by precision: the forms to 512 tokens before it and with dWd's tiles in launch 2
# (choose.MEASURED at 65-512 tokens on the fast path, at 129-256 on the faithful one), and the fast path's 64-wide dA
# form at 1100-1249 against cuBLAS
DESIGN22_LABELS = {
    "fast": {"gluon12_m64_early_dx1_wp68_ibw_n64": "dA 64 wide (before, to 256)",
             "gluon12_m64_early_dx1_wp68_ibw": "257 form (before, 257-512)",
             "gluon12_m64_early_dx4_wp68_ibw_n64_dwd2": "dA 64 wide, dWd in launch 2, dx in 4",
             "gluon12_m64_early_dx2_wp68_ibw_n64_dwd2": "dA 64 wide, dWd in launch 2, dx in 2",
             "gluon12_m64_early_dx1_wp68_ibw_n64_dwd2": "dA 64 wide, dWd in launch 2",
             "gluon12_m64_early_dx1_wp68_ibw_dwd2": "257 form, dWd in launch 2",
             "lib_bs3_mc": "cuBLAS", "gluon_dwd2_from2300_n64": "2300 form, dWd in launch 2, dA 64 wide"},
    "faithful": {"gluon12_m64_early_dx4_wp68_ibw_n64": "dx in 4 (before)",
                 "gluon12_m64_early_dx2_wp68_ibw_n64": "dx in 2 (before)",
                 "gluon12_m64_early_dx4_wp68_ibw_n64_dwd2": "dx in 4, dWd in launch 2",
                 "gluon12_m64_early_dx2_wp68_ibw_n64_dwd2": "dx in 2, dWd in launch 2",
                 "gluon12_m64_early_dx1_wp68_ibw_dwd2": "257 form, dWd in launch 2"},
}


def design22_times(precision: str = "fast", path=DESIGN22_FILE) -> pd.DataFrame:
    """Design 22's runs by graph replay: µs per token count and form (``DESIGN22_LABELS``), the median over the runs
    that measured it; "default" (which changed between the runs) left out."""
    return p1_tune_runs_times(path, precision, DESIGN22_LABELS[precision])


# the committed benchmark runs before and after a captured graph kept an eager call's zeroed counters instead of zeroing
# its own in a memset node (notes/p1/design-23.md)
GRAPH_COUNTERS_RUNS = (RESULTS_DIR / "H200" / "2026-12-02-swiglu_down_backward-bfloat16.csv",
                       RESULTS_DIR / "H200" / "2026-12-03-swiglu_down_backward-bfloat16.csv")  # fmt: skip


def runs_side_by_side(before, after, impls=("triton", "triton_fast", "torch_compile"),
                      max_tokens: int = 128) -> pd.DataFrame:  # fmt: skip
    """µs by graph replay per num_tokens (to ``max_tokens``: rows) of each of ``impls`` in two committed benchmark
    runs (CSV paths), columns (impl, "before" / "after"), and the change after − before ("Δ")."""
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


def programmatic_launch_gains(path=PROGRAMMATIC_LAUNCH_FILE) -> pd.DataFrame:
    """What issuing launch 2 by programmatic dependent launch saves each Gluon form: per num_tokens (rows) and form
    (columns), the form's µs by graph replay plainly issued minus its ``_pdl`` candidate's (launch 1 letting launch 2
    start as each of its programs starts), from the committed ``scripts/p1/p1_tune.py`` runs; forms measured only one
    way left out."""
    return gains_of_variant(path, "_pdl")


def gains_of_variant(path, suffix: str) -> pd.DataFrame:
    """Per num_tokens (rows) and form (columns), the form's µs by graph replay minus its variant's (the candidate named
    as the form with ``suffix``), the median over a file's ``scripts/p1/p1_tune.py`` runs; forms measured only one way
    left out."""
    times = p1_tune_runs_times(path)
    forms = [name for name in times.columns if f"{name}{suffix}" in times.columns]
    return pd.DataFrame({name: times[name] - times[f"{name}{suffix}"] for name in forms}).dropna(how="all")


SAVED_TILES_EARLY_FILE = TUNING_DIR / "2026-12-02-p1-saved-tiles-early.json"
SPLIT_TILES_FILE = TUNING_DIR / "2026-12-02-p1-split-tiles.json"


def saved_tiles_early_gains(path=SAVED_TILES_EARLY_FILE) -> pd.DataFrame:
    """What asking for launch 1's saved tiles from the loading warp, as the main loop frees their buffers, saves each
    Gluon form: per num_tokens (rows) and form (columns), the form's µs by graph replay minus its ``_early``
    candidate's (the median over the committed runs); forms measured only one way left out."""
    return gains_of_variant(path, "_early")


def split_tiles_slowdown(path=SPLIT_TILES_FILE) -> pd.DataFrame:
    """dA's and dx's reductions split over programs, against the 65-1099 band's form unsplit: per num_tokens (rows)
    and split candidate (columns, ``gluon12_m64_daA_dxX`` on 64-row tiles, ``gluon12_m128_*`` on 128-row tiles), the
    candidate's µs by graph replay over the unsplit form's (above 1: slower)."""
    times = p1_tune_runs_times(path)
    base = times["gluon12_m64_lf_pdl_sif_graph"]
    splits = [name for name in times.columns if "_da" in name]
    return times[splits].div(base, axis=0)


def gluon_forms_table(token_counts, hidden_size: int, intermediate_size: int, *, precision: str = "faithful",
                      device: Device = H200) -> pd.DataFrame:  # fmt: skip
    """The Gluon launches as the chooser configures them on ``device`` per token count where it takes them
    (:func:`chosen_design`; other designs' token counts are left out): the form's name in
    :data:`~moe_lib.swiglu_down.designs.gluon.FORMS`, each launch's tile height, ring depth, and whether its tiles of
    fixed length (dA's, dx's) take the first program ids, whether launch 2 is issued by programmatic dependent launch
    (its programs started on the SMs launch 1's last wave frees, waiting there for launch 1's end), whether launch 1's
    saved tiles are asked for early, whether dWd's tiles are in launch 2, and over how many programs a dx tile's
    reduction is split."""
    rows = {}
    for T in token_counts:
        design = chosen_design(T, hidden_size, intermediate_size, precision, device=device)
        if not isinstance(design, GluonLaunches):
            continue
        first, second = design.first, design.second
        rows[T] = {"form": gluon_form_of(design)[0], "launch 1 rows": first.block_m, "launch 1 ring": first.buffers,
                   "dA tiles first": first.d_a_first, "launch 2 rows": second.block_m, "launch 2 ring": second.buffers,
                   "dx tiles first": second.grad_x_first, "launch 2 early": second.programmatic,
                   "saved tiles early": first.saved_tiles_early, "dWd in launch 2": second.grad_down_tiles,
                   "dx splits": second.grad_x_splits}  # fmt: skip
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("num_tokens")


def p1_tune_runs_times(path=GLUON_LAUNCH1_FILE, precision: str = "faithful", labels: dict | None = None,
                       runs: tuple[int, ...] | None = None):  # fmt: skip
    """Whole calls by graph replay from a file of several ``scripts/p1/p1_tune.py`` runs (as :func:`p1_tune_times` for
    one): µs per num_tokens (rows) and candidate (columns, renamed by ``labels`` where given and the others left
    out), the median over the runs of ``precision`` that measured it (runs without a "precision" field count as
    faithful), or over the runs numbered in ``runs``; failed or wrong candidates left out, and "default" (which
    changed between runs) unless ``runs`` names the runs of one code."""
    rows = [dict(num_tokens=row["T"], config=row["config"], us=row["median_us"])
            for run in _read_json(path)["runs"]
            if run.get("precision", "faithful") == precision and (runs is None or run["run"] in runs)
            for row in run["rows"] if row.get("ok") and (row["config"] != "default" or runs is not None)]  # fmt: skip
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


# the candidates of the committed scripts/p1/p1_kernel_times.py runs by their names there, and the cuBLAS design each
# stood for (notes/p1/design-07.md): dA in fp32 and [Wg; Wu] stacked by a copy kernel, or dA in bf16 and the copy
# by memcpys
CUBLAS_CANDIDATES = {"lib_s3": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True),
                     "lib_bs3_mc": LibraryGemmsConfig(d_a_fp32=False, streams=True, stack_aside=True,
                                                      stack_by_memcpy=True)}  # fmt: skip


def p1_call_kernels(path=TUNING_DIR / "2026-12-01-p1-kernel-times-defaults.json", labels: dict | None = None, *,
                    defaults_only: bool = False) -> pd.DataFrame:  # fmt: skip
    """A ``scripts/p1/p1_kernel_times.py`` file as one row per kernel of a call: token count, implementation (renamed
    by ``labels``, others left out where given), what the kernel does (:func:`call_kernel_kind`), its stream, its
    median start (µs after the call's first kernel) and duration, and the call's median span. ``defaults_only``:
    per token count only ``torch_compile`` and the candidate (:data:`CUBLAS_CANDIDATES`) that is the fast path's
    design on cuBLAS GEMMs there today (``LibraryGemmsConfig.for_shape``: what the chooser takes wherever it takes
    cuBLAS's GEMMs on the fast path), named "ours"."""
    data = _read_json(path)
    rows = []
    for run in data["rows"] if isinstance(data, dict) else data:
        impl = run["impl"]
        if defaults_only:
            if impl == "torch_compile":
                impl = "torch.compile"
            # (the committed run predates dx in two products, which the form takes at H 2048, I 768 only below
            # 1536 tokens, where the chooser does not take cuBLAS's design anyway)
            elif CUBLAS_CANDIDATES.get(impl) == dataclasses.replace(LibraryGemmsConfig.for_shape(run["T"], 768),
                                                                    dx_in_two=False):  # fmt: skip
                impl = "ours"
            else:
                continue
        elif labels is not None:
            if impl not in labels:
                continue
            impl = labels[impl]
        for kernel in run["kernels"]:
            rows.append(dict(num_tokens=run["T"], impl=impl,
                             kind=call_kernel_kind(kernel["name"])[0], stream=kernel["stream"],
                             start_us=kernel["start_us"], duration_us=kernel["duration_us"],
                             span_us=run["span_us"]))  # fmt: skip
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
                ax.broken_barh([(kernel.start_us, kernel.duration_us)], (rows, 0.8),
                               color=CALL_KERNEL_COLORS.get(kernel.kind, "tab:grey"))  # fmt: skip
                rows += 1
            names.append((rows - len(call) / 2, f"{impl}\n{call.span_us.iloc[0]:.1f} µs"))
            ax.axhline(rows - 0.1, color="lightgrey", lw=0.8)
        ax.set_yticks([y for y, _ in names], [name for _, name in names], fontsize=8)
        ax.set(ylim=(rows, 0), title=f"{title}: {T} tokens", xlabel="µs after the call's first kernel")
    handles = [patches.Patch(color=color, label=kind) for _, kind, color in CALL_KERNEL_KINDS]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


# Program traces of the faithful path's two Gluon launches (scripts/p1/p1_program_trace.py under
# designs.gluon.traced_programs()):
# one row per program, times in µs from launch 1's first program's start, each run's commit and config beside it
PROGRAM_TRACES_FILE = TUNING_DIR / "2026-12-02-p1-program-traces.csv"
TRACE_TILE_COLORS = {"dWd": "tab:blue", "dA": "tab:orange", "dWg, dWu": "tab:green", "dx": "tab:red"}


def program_traces(path=PROGRAM_TRACES_FILE) -> pd.DataFrame:
    """A committed file of program traces: per program its run (commit, config), token count T, launch, program id,
    SM, tile kind, start, end of its wait for launch 1 (proceed) and end in µs, its run and wait."""
    return pd.read_csv(resolve_path(path))


def program_trace_summary(rows: pd.DataFrame, sms: int = 132) -> pd.DataFrame:
    """Per token count, launch and tile kind: programs, first start, median start and last end, median and longest
    run, median wait, and how busy the ``sms`` SMs are over the launch's span (Σ runs / (span × SMs))."""
    table = rows.groupby(["T", "launch", "tiles"], sort=False).agg(
        programs=("program", "size"), first_start=("start_us", "min"), median_start=("start_us", "median"),
        last_end=("end_us", "max"), median_run=("run_us", "median"), longest_run=("run_us", "max"),
        median_wait=("wait_us", "median"))  # fmt: skip
    spans = rows.groupby(["T", "launch"]).agg(span_start=("start_us", "min"), span_end=("end_us", "max"),
                                              busy=("run_us", "sum"))  # fmt: skip
    spans["sm_busy"] = spans.busy / ((spans.span_end - spans.span_start) * sms)
    return table.join(spans[["sm_busy"]], on=["T", "launch"]).round(2)


def program_timeline_figure(panels: dict):
    """One panel per entry of ``panels`` (title → one call's trace rows): a line per program from its start to its
    end at its SM (launch 2's a little above launch 1's), coloured by tile kind, grey while launch 2's program waits
    for launch 1."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False, sharex=True)
    for ax, (title, rows) in zip(axes[:, 0], panels.items(), strict=True):
        for tiles, part in rows.groupby("tiles"):
            ax.hlines(part.sm + (part.launch == "launch 2") * 0.4, part.start_us, part.end_us,
                      colors=TRACE_TILE_COLORS[tiles], label=tiles, linewidth=1.2)  # fmt: skip
            waited = part[part.wait_us > 0.5]
            ax.hlines(waited.sm + 0.4, waited.start_us, waited.proceed_us, colors="lightgrey", linewidth=1.2)
        ax.axvline(rows.end_us.max(), color="black", lw=0.8, ls=":")
        ax.set(title=f"{title}: last program ends at {rows.end_us.max():.1f} µs", ylabel="SM")
    axes[-1, 0].set_xlabel("µs from launch 1's first program's start")
    axes[0, 0].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    return fig


# Launch 1's pingpong form traced (`GluonFirstLaunchConfig.pingpong_programs`, removed since: its code is at commit
# 1051632; a program's "proceed" is the end of its first tile's main loop): the form with its saved tiles loaded by
# 4-byte loads (one config, no commit column), and the later forms (saved tiles by 16-byte loads, by TMA through the
# ring, with the stores through the ring too)
PINGPONG_TRACE_FILE = TUNING_DIR / "2026-12-03-p1-pingpong-trace.csv"
PINGPONG_TRACE_CONFIG = "gluon_pingpong_from2300_b6_f2"
PINGPONG_RING_TRACE_FILE = TUNING_DIR / "2026-12-03-p1-pingpong-ring-trace.csv"
# the fast path's first half on cuBLAS, its second on the Gluon launch 2 (run 1), against each whole design
# (notes/p1/design-25.md): the labels of that run's candidates
HALVES_FILE = TUNING_DIR / "2026-12-03-p1-library-then-gluon-launch2.json"
HALVES_LABELS = {"default": "default",  # the Gluon launches; at 8192 tokens cuBLAS's design
                 "lib_bs3_mc": "cuBLAS's design", "lib_gluon2": "cuBLAS's dA, dWd, pass; Gluon launch 2",
                 "lib_gluon2_dwd": "cuBLAS's dA, pass; Gluon launch 2 with dWd"}  # fmt: skip


def pingpong_epilogue_table(num_tokens: int = 2447, paths=(PINGPONG_TRACE_FILE, PINGPONG_RING_TRACE_FILE)):
    """Per traced pingpong config at ``num_tokens``: the median program's first main loop end and launch 1's end (µs
    from its start), and their difference, the epilogue of the program's first tile (at 2447 tokens each program has
    one tile, so that is all the program does after its main loop)."""
    traces = pd.concat([pd.read_csv(resolve_path(path)) for path in paths], ignore_index=True)
    traces["config"] = traces["config"].fillna(PINGPONG_TRACE_CONFIG) if "config" in traces else PINGPONG_TRACE_CONFIG
    rows = traces[(traces["launch"] == "launch 1") & (traces["T"] == num_tokens)]
    table = rows.groupby("config", sort=False).agg(main_loop_end_us=("proceed_us", "median"),
                                                    launch_end_us=("end_us", "median"))  # fmt: skip
    table["epilogue_us"] = table["launch_end_us"] - table["main_loop_end_us"]
    return table


# ================================================================ split-K, deterministically (notebook 04)

SPLIT_DEMO_BLOCK_K = 16  # the demonstration's BLOCK_K: the smallest tl.dot takes


def split_demo_config(split: int) -> TileConfig:
    """Portable-design tiles for the split-K demonstration: dA's reduction over H and dx's over 2I split in ``split``
    (BLOCK_K = 16), the weight gradients (short reductions over T) unsplit, few programs for the interpreter."""
    reduction = (16, 64, SPLIT_DEMO_BLOCK_K, split)
    weight_grads = (32, 64, 16, 1)
    return TileConfig(d_intermediate=reduction, grad_down=weight_grads, grad_x=reduction, grad_gate_up=weight_grads,
                      warps=(4, 4), stages=(2, 2), group_m=2)  # fmt: skip


def split_demo_size(split: int, steps_per_split: int) -> int:
    """H (and I) of the demonstration: each split's piece of dA's reduction ``steps_per_split`` BLOCK_K steps long, so
    that the split and the unsplit sums group the steps differently (one step a split would add them in the same
    order)."""
    return split * steps_per_split * SPLIT_DEMO_BLOCK_K


def split_differences(split_outputs, unsplit_outputs, names) -> pd.DataFrame:
    """Per output: the relative difference split against unsplit, the share of elements that differ and the largest
    elementwise difference relative to the unsplit value, in units of fp32's machine epsilon (about one unit in the
    last place)."""
    rows = {}
    for name, a, b in zip(names, split_outputs, unsplit_outputs, strict=True):
        a, b = a.float(), b.float()
        spacing = torch.finfo(torch.float32).eps * b.abs().clamp_min(torch.finfo(torch.float32).tiny)
        rows[name] = {"relative difference": ((a - b).norm() / b.norm()).item(),
                      "elements that differ": (a != b).double().mean().item(),
                      "largest difference (fp32 eps)": ((a - b).abs() / spacing).max().item()}  # fmt: skip
    return pd.DataFrame.from_dict(rows, orient="index")
