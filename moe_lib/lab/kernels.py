"""Notebook 04: the kernels' launches as tables and diagrams, and the split-K demonstration.

Every grid comes from the kernel family's own ``launch_plan()`` (:mod:`moe_lib.swiglu_down.designs.triton_launches`
for P1's portable launches, :mod:`moe_lib.moe_experts.launch` for P2); this module only turns them into a table or a
picture. Which design P1's chooser runs where is :mod:`.regimes`; the designs measured on the GPU are
:mod:`.design_runs`, :mod:`.traces` and :mod:`.schedules`. Importing it imports triton: set ``TRITON_INTERPRET``
before, if at all.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib import patches

from .. import problems
from ..moe_experts import launch as p2_launch
from ..moe_experts.choose import launch_config as p2_launch_config
from ..moe_experts.config import KernelLaunch, LaunchConfig
from ..moe_experts.routing import route_by_expert
from ..swiglu_down.designs.triton_launches import (
    INTERPRETER_TILES,
    TileConfig,
    TileKind,
    grid_sizes,
    launch_plan,
    tiles_for,
)

KIND_COLORS = {"dWd": "tab:blue", "dA": "tab:orange", "dWg": "tab:green", "dWu": "tab:olive", "dx": "tab:red"}


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
    return pd.DataFrame(
        [
            dict(
                launch=k.launch,
                kind=k.kind,
                computes=k.computes,
                output=f"[{k.M}, {k.N}]",
                reduce=f"{k.reduce_name} = {k.reduce_length}",
                tile=f"{k.block_m}×{k.block_n}×{k.block_k}",
                split=k.split,
                tiles=k.tiles,
                programs=k.programs,
                first_program=k.first_program,
            )
            for k in plan
        ]
    )


def p1_grid_table(
    token_counts, hidden_size: int, intermediate_size: int, *, with_lo: bool = False, interpreter: bool = False
) -> pd.DataFrame:
    """Per token count: the tile shape and split of each kind and the programs of each launch of P1's portable
    launches, with the tiles they take on a GPU (:func:`~moe_lib.swiglu_down.designs.triton_launches.tiles_for`;
    ``with_lo``: the faithful path's) or under the interpreter (``INTERPRETER_TILES``)."""
    rows = {}
    for t in token_counts:
        config = INTERPRETER_TILES if interpreter else tiles_for(t, with_lo=with_lo)
        plan = launch_plan(t, hidden_size, intermediate_size, config)
        row = {
            f"{k.kind} tile (split)": f"{k.block_m}×{k.block_n}×{k.block_k} ({k.split})"
            for k in plan
            if k.kind != "dWu"
        }
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
                ax.add_patch(
                    patches.Rectangle(
                        (x0 + j, y0 + i),
                        min(bn, N - j),
                        min(bm, M - i),
                        fill=False,
                        edgecolor=color,
                        lw=0.5,
                        hatch="///" if kind.split > 1 else None,
                    )
                )
    ax.annotate(_caption(kind), (x0, y0), xytext=(0, 4), textcoords="offset points", fontsize=8, ha="left", va="bottom")


def _caption(kind: TileKind) -> str:
    reduce = f"{kind.reduce_name} = {kind.reduce_length}"
    split = f"split-K ×{kind.split} over {reduce}" if kind.split > 1 else f"reduces over {reduce}"
    return (
        f"{kind.computes}\n[{kind.M}, {kind.N}]: {kind.tiles} tiles of {kind.block_m}×{kind.block_n}\n{split}; "
        f"programs {kind.first_program}–{kind.first_program + kind.programs - 1}"
    )


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
    ax.set_title(
        f"T = {num_tokens}, H = {hidden_size}, I = {intermediate_size}: every matrix to the same scale",
        fontsize=10,
        loc="left",
    )
    for row, (n, kinds) in enumerate(launches.items(), 1):
        bar_ax = fig.add_subplot(grid[row])
        for kind in kinds:
            bar_ax.barh(
                0,
                kind.programs,
                left=kind.first_program,
                color=KIND_COLORS[kind.kind],
                alpha=0.7,
                edgecolor="black",
                hatch="///" if kind.split > 1 else None,
            )
            bar_ax.text(
                kind.first_program + kind.programs / 2,
                0,
                f"{kind.kind}: {kind.programs}",
                ha="center",
                va="center",
                fontsize=8,
            )
        bar_ax.set(xlim=(0, totals[n]), yticks=[], xlabel=f"launch {n}: program id, tl.program_id(0)")
    return fig


def split_k_figure(split: int = 4):
    """How one tile's reduction is split over ``split`` programs and combined deterministically."""
    fig, ax = plt.subplots(figsize=(12, 4.2))
    ax.set(xlim=(0, 12), ylim=(0, 4.4))
    ax.axis("off")

    def box(x, y, w, h, text, color):
        ax.add_patch(
            patches.FancyBboxPatch(
                (x, y), w, h, boxstyle="round,pad=0.05", facecolor=color, alpha=0.25, edgecolor=color
            )
        )
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    def arrow(x0, y0, x1, y1):
        ax.annotate("", (x1, y1), (x0, y0), arrowprops=dict(arrowstyle="->", color="black", lw=0.8))

    ax.text(
        0.1,
        4.2,
        f"one output tile, its reduction over K split into {split} BLOCK_K-aligned ranges",
        fontsize=9,
        weight="bold",
    )
    height = 3.4 / split
    for s in range(split):
        y = 3.6 - (s + 1) * height
        box(0.1, y + 0.05, 3.0, height - 0.15, f"program (tile, split {s})\nacc = Σ over K-range {s}", "tab:blue")
        box(4.0, y + 0.05, 2.2, height - 0.15, f"partials[tile, {s}] (fp32)", "tab:gray")
        arrow(3.15, y + height / 2, 3.95, y + height / 2)
        arrow(6.25, y + height / 2, 7.35, 1.9)
    box(4.0, 3.75, 2.2, 0.35, "counter[tile] += 1 (atomic)", "tab:purple")
    box(
        7.4,
        1.2,
        4.4,
        1.4,
        "the program that counts in last:\n"
        + " + ".join(f"p{s}" for s in range(split))
        + "  (in split order,\nwhoever arrived when)\n→ epilogue → store",
        "tab:red",
    )
    ax.text(
        7.4,
        0.5,
        "The sum's order is fixed, so the result is the same bit for bit on every run;\n"
        "the counters only grow (by SPLIT per call), so they never need a reset.",
        fontsize=8,
    )
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
    table = pd.DataFrame(
        [
            dict(step=step, grid=_grid_text(launch), programs=launch.programs, one_program=launch.one_program)
            for step, launch in plan.items()
        ]
    )
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
        config = p2_launch_config(
            t * s["top_k"], s["num_experts"], input_bytes=definition.dtype.itemsize, interpreter=interpreter
        )
        plan = p2_launch.launch_plan(
            t,
            s["hidden_size"],
            s["intermediate_size"],
            s["num_experts"],
            s["top_k"],
            config,
            num_programs=num_programs,
            weight_bytes=definition.dtype.itemsize,
        )
        rows[t] = {
            "slots per expert (mean)": t * s["top_k"] / s["num_experts"],
            "row split R": config.row_split,
            **{f"kernel {step} programs": launch.programs for step, launch in plan.items()},
        }
    table = pd.DataFrame.from_dict(rows, orient="index")
    table.index.name = "num_tokens"
    return table


def _routing_panel(ax, topk_indices, routing, cmap) -> None:
    """The slots in token order and sorted by expert, each cell numbered with its expert, and expert_offsets."""
    T, K = topk_indices.shape
    offsets = routing.expert_offsets.tolist()
    experts_in_token_order = topk_indices.reshape(-1).tolist()
    experts_sorted = topk_indices.reshape(-1)[routing.sorted_slot.long()].tolist()
    for row_y, experts, title in (
        (1.2, experts_in_token_order, "slots s = t·K + k (token order)"),
        (0.0, experts_sorted, "sorted by expert (sorted_slot)"),
    ):
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
    ax.set(
        yticks=range(E),
        yticklabels=[f"expert {e}" for e in range(E)],
        xlabel="rows of the expert (its slots)",
        title=f"row blocks of {config.block_m} rows: in kernel A (and the pointer-based kernel D), program "
        f"r = block mod R takes them (R = {R})",
    )
    ax.invert_yaxis()
    ax.title.set_fontsize(10)


def _grid_panel(ax, title: str, rows: int, ticks: list, split: int, xlabel: str, ylabel: str, cmap) -> None:
    """A kernel's grid: ``rows`` × one column per (tick, hatch) of ``ticks``, each cell cut into ``split`` programs."""
    for i in range(rows):
        color = cmap(i % cmap.N) if ylabel == "expert" else "tab:gray"
        for j, (_, hatch) in enumerate(ticks):
            for r in range(split):
                ax.add_patch(
                    patches.Rectangle(
                        (j + r / split, i),
                        1 / split,
                        1,
                        facecolor=color,
                        hatch=hatch,
                        alpha=0.35 + 0.5 * r / split,
                        edgecolor="white",
                    )
                )
                if split > 1 and rows * len(ticks) * split <= 64:
                    ax.text(j + (r + 0.5) / split, i + 0.5, f"r{r}", ha="center", va="center", fontsize=7)
    step = max(1, rows // 16)
    ax.set_xticks([j + 0.5 for j in range(len(ticks))], [tick for tick, _ in ticks])
    ax.set_yticks([i + 0.5 for i in range(0, rows, step)], [str(i) for i in range(0, rows, step)])
    ax.tick_params(labelsize=7)
    ax.set(xlim=(0, len(ticks)), ylim=(rows, 0), xlabel=xlabel, ylabel=ylabel, title=title)
    ax.title.set_fontsize(9)


def p2_tiling_figure(topk_indices, num_experts: int, hidden_size: int, intermediate_size: int, config: LaunchConfig):
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
    w_ticks = [
        (f"{m}·{g}", hatch)
        for w, hatch in ((gate_up, None), (down, "////"))
        for m in range(w["M-tiles"])
        for g in range(w[n_key])
    ]
    d_tiles = plan["D"].tiles or plan["D"].grid
    d_split = 1 if plan["D"].tiles else R

    def count(step: str) -> str:
        launch = plan[step]
        if launch.tiles:
            return f"{launch.programs} persistent programs,\n{'×'.join(map(str, launch.tiles.values()))} tiles"
        return "×".join(map(str, launch.grid.values())) + " programs"

    panels = (  # title, rows, (tick, hatch) per column, programs per cell, x label, y label
        (
            f"kernel A\n{count('A')}",
            E,
            [(str(j), None) for j in range(plan["A"].grid["I-tiles"])],
            R,
            "I-tile (R programs each)",
            "expert",
        ),
        (f"kernel W: dWg·dWu, then dWd (hatched)\n{count('W_gate_up')}", E, w_ticks, 1, "tile", "expert"),
        (
            f"kernel D\n{count('D')}",
            E,
            [(str(j), None) for j in range(d_tiles["H-tiles"])],
            d_split,
            "H-tile" + ("" if plan["D"].tiles else " (R programs each)"),
            "expert",
        ),
        (
            f"kernel C\n{count('C')}",
            T,
            [(str(j), None) for j in range(plan["C"].grid["H-tiles"])],
            1,
            "H-tile",
            "token",
        ),
    )
    for column, panel in enumerate(panels):
        ax = fig.add_subplot(grid[2, column])
        _grid_panel(ax, *panel, cmap)
        if column == 1:  # kernel W: its dWg·dWu launch, then its dWd launch, one label each (the tiles are many)
            split = gate_up["M-tiles"] * gate_up[n_key]
            ax.axvline(split, color="black", lw=1.2)
            ax.set_xticks([split / 2, split + len(w_ticks[split:]) / 2], ["dWg·dWu", "dWd"])
    return fig


# ================================================================ split-K, deterministically (notebook 04)

SPLIT_DEMO_BLOCK_K = 16  # the demonstration's BLOCK_K: the smallest tl.dot takes


def split_demo_config(split: int) -> TileConfig:
    """Portable-design tiles for the split-K demonstration: dA's reduction over H and dx's over 2I split in ``split``
    (BLOCK_K = 16), the weight gradients (short reductions over T) unsplit, few programs for the interpreter."""
    reduction = (16, 64, SPLIT_DEMO_BLOCK_K, split)
    weight_grads = (32, 64, 16, 1)
    return TileConfig(
        d_intermediate=reduction,
        grad_down=weight_grads,
        grad_x=reduction,
        grad_gate_up=weight_grads,
        warps=(4, 4),
        stages=(2, 2),
        group_m=2,
    )


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
        rows[name] = {
            "relative difference": ((a - b).norm() / b.norm()).item(),
            "elements that differ": (a != b).double().mean().item(),
            "largest difference (fp32 eps)": ((a - b).abs() / spacing).max().item(),
        }
    return pd.DataFrame.from_dict(rows, orient="index")
