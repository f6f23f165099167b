"""Notebook 04, "The grouped engine": P2's layer on :mod:`moe_lib.engine`, drawn, scheduled and run on the CPU.

    pipeline_figure       a program of the Gluon kernels: the loading warp, the ring of stages with their ready and
                          empty barriers, the consumer warpgroups (cooperative or ping-pong), the epilogue, the stores
    ring_steps_frame      dswiglu's ring step by step over a program's first tiles: each tile's K steps (A and B
                          tiles), then, through the ring, its saved u and g a chunk a step; ring_steps_figure draws it
    schedule_frame        the persistent tile schedule of the varlen-M kernel (:func:`.grouped_gemm.schedule`) as one
                          row per tile; schedule_figure draws it over the experts' rows
    wgrad_schedule_frame  the same for the varlen-K kernel (:func:`.grouped_wgrad.schedule`); wgrad_schedule_figure
    twin_errors           the plain-Triton twins (``grouped_tl.py``, ``grouped_wgrad_tl.py``) on a tiny ragged shape
                          against float64, every output NaN-filled first
    layer_launches        the launches one call of the engine's layer makes (recorded, not listed by hand), beside
                          :data:`LAUNCHES`, what each computes
    backward_memory_frame what the layer's backward holds at each of its three widest launches (g and u saved and
                          spent), x_s whole and in column slices: where its peak is; backward_memory_figure draws it

Everything here runs on the CPU; the twins need ``TRITON_INTERPRET=1`` there (set it before triton is imported).
"""

from __future__ import annotations

import contextlib

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib import patches

from ..engine import grouped_gemm, grouped_wgrad
from ..engine.gathered import Gathered
from ..engine.gluon_gemm import GemmConfig
from ..tiling import cdiv
from .derivations import relative_error

# what each launch of the layer computes, in launch order: (pass, kernel, epilogue, computes, weights)
LAUNCHES = {
    "forward": (
        ("grouped_gemm", "swiglu", "g, u = x_s·Wg_eᵀ, x_s·Wu_eᵀ; a = silu(g)·u", "reads Wg, Wu"),
        ("grouped_gemm", "row_scale", "y_s = w_s · (a·Wd_eᵀ)", "reads Wd"),
    ),
    "backward": (
        ("grouped_gemm", "swiglu", "g, u again, stored only (where the forward did not keep them)", "reads Wg, Wu"),
        (
            "grouped_gemm",
            "dswiglu",
            "dAp = dy_s·Wd_e; dg, du, aw = w_s·a and the routing weight's row sums",
            "reads Wd",
        ),
        ("grouped_gemm", "none", "dX_s = [dg | du]·[Wg_e; Wu_e] (a pair along K = 2I)", "reads Wg, Wu"),
        (
            "grouped_wgrad",
            "",
            "[dWg_e | dWu_e]ᵀ = x_s,eᵀ [dg | du]_e, x's rows gathered (where x_s is written: dg_eᵀ x_s,e, du_eᵀ x_s,e)",
            "writes dWg, dWu",
        ),
        ("grouped_wgrad", "", "dWd_e = dy_s,eᵀ aw_e (dy's rows gathered through the routing)", "writes dWd"),
    ),
}


def check_offsets(offsets) -> list[int]:
    """``offsets`` as a list of ints: 0 first, never decreasing (expert e's rows offsets[e] ≤ r < offsets[e + 1])."""
    offsets = [int(v) for v in offsets]
    if len(offsets) < 2 or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
        raise ValueError(f"offsets: expected [0, ...] never decreasing, at least two entries, got {offsets}")
    return offsets


def offsets_of(counts) -> list[int]:
    """The offsets [E + 1] of experts with ``counts`` rows each."""
    counts = [int(c) for c in counts]
    if not counts or min(counts) < 0:
        raise ValueError(f"counts: expected one non-negative row count per expert, got {counts}")
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def _check_programs(programs: int) -> None:
    if not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs: expected a positive int, got {programs!r}")


# ================================================================ the pipeline of one program


def _box(ax, x, y, w, h, text, face, edge, size=8):
    ax.add_patch(patches.FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.04", fc=face, ec=edge))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size)


def _arrow(ax, start, end, color="black", text="", text_at=None, rad=0.0):
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops=dict(arrowstyle="->", lw=1.3, color=color, connectionstyle=f"arc3,rad={rad}"),
    )
    if text:
        x, y = text_at or ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.12)
        ax.text(x, y, text, ha="center", va="bottom", fontsize=7, color=color)


def _pipeline_panel(ax, consumers: str, stages: int) -> None:
    _box(
        ax,
        0,
        1.2,
        1.9,
        1.6,
        "loading warp\n(1 warp)\nTMA: A rows of the\nexpert, B_e's box\nper K step",
        "#ddf4ff",
        "#0969da",
    )
    width = 3.0 / stages
    for s in range(stages):
        x = 2.5 + s * width
        ax.add_patch(patches.Rectangle((x, 1.3), width * 0.88, 1.4, fc="#f6f8fa", ec="black"))
        ax.text(x + width * 0.44, 2.05, f"stage {s}\nA | B", ha="center", va="center", fontsize=7)
        ax.add_patch(patches.Circle((x + width * 0.25, 1.45), 0.07, color="#1a7f37"))
        ax.add_patch(patches.Circle((x + width * 0.63, 1.45), 0.07, color="#cf222e"))
    _arrow(ax, (1.95, 2.45), (2.5, 2.45), "#0969da", "expect, copy")
    if consumers == "cooperative":
        _box(
            ax,
            6.1,
            1.2,
            2.3,
            1.6,
            "consumer partition\n2 warpgroups, one tile:\neach wgmma's half of\nBLOCK_M rows, fp32 acc",
            "#fff1e5",
            "#bc4c00",
        )
        consumer_ys = [2.0]
    else:
        _box(
            ax,
            6.1,
            2.1,
            2.3,
            0.95,
            "consumer 0 (1 warpgroup)\ntiles 0, 2, 4, … of the program",
            "#fff1e5",
            "#bc4c00",
            7,
        )
        _box(ax, 6.1, 0.95, 2.3, 0.95, "consumer 1 (1 warpgroup)\ntiles 1, 3, 5, …", "#fff1e5", "#bc4c00", 7)
        _arrow(ax, (8.45, 2.3), (8.45, 1.75), "#8250df", "", rad=-0.6)
        _arrow(ax, (6.05, 1.75), (6.05, 2.3), "#8250df", "", rad=-0.6)
        ax.text(
            7.25,
            3.12,
            "turn barriers: one K loop at a time, the other's epilogue meanwhile",
            ha="center",
            fontsize=7,
            color="#8250df",
        )
        consumer_ys = [2.55, 1.4]
    for y in consumer_ys:
        _arrow(ax, (5.55, 2.0), (6.05, y), "#1a7f37", "")
    ax.text(5.8, 2.25, "wait\nready,\nwgmma", ha="center", fontsize=6, color="#1a7f37")
    _arrow(
        ax,
        (6.1, 1.0 if consumers == "cooperative" else 0.85),
        (1.0, 1.1),
        "#cf222e",
        "arrive empty once the step's wgmma is done: the stage may be refilled",
        (3.6, 0.55),
        rad=-0.15,
    )
    _box(ax, 8.9, 1.2, 1.9, 1.6, "epilogue\n(registers)\nnone · row_scale\nswiglu · dswiglu", "#fbefff", "#8250df")
    _arrow(ax, (8.45, 2.0), (8.9, 2.0))
    _box(ax, 11.3, 2.1, 2.2, 0.8, "TMA store\n(tile inside its expert)", "#dafbe1", "#1a7f37", 7)
    _box(ax, 11.3, 1.1, 2.2, 0.8, "masked stores\n(at the expert's end)", "#fff8c5", "#9a6700", 7)
    _arrow(ax, (10.85, 2.1), (11.3, 2.5))
    _arrow(ax, (10.85, 1.9), (11.3, 1.5))
    title = (
        "cooperative: both warpgroups on one tile"
        if consumers == "cooperative"
        else "ping-pong: two consumers take the program's tiles in turn"
    )
    ax.set_title(
        f"{title}; ● ready (the copy engine's bytes landed)  ● empty (the products are done)", fontsize=9, loc="left"
    )
    ax.set(xlim=(-0.2, 13.7), ylim=(0.3, 3.3))
    ax.axis("off")


def pipeline_figure(stages: int = 4):
    """A persistent program of the engine's Gluon kernels, cooperative (top) and ping-pong (bottom): the loading warp
    fills stage i mod ``stages`` of the ring and the copy engine completes its ready barrier; the consumers wait on
    it, multiply (wgmma) and arrive on its empty barrier; the epilogue runs on the accumulator, and the tile leaves
    by TMA where its rows are all its expert's, by masked stores at an expert's end. Returns the figure."""
    if not isinstance(stages, int) or stages < 2:
        raise ValueError(f"stages: expected an int ≥ 2 (one stage filled while one is read), got {stages!r}")
    fig, axes = plt.subplots(2, 1, figsize=(12, 5.6))
    for ax, consumers in zip(axes, ("cooperative", "pingpong"), strict=True):
        _pipeline_panel(ax, consumers, stages)
    fig.tight_layout()
    return fig


# ================================================================ dswiglu's saved tiles through the ring


def ring_steps_frame(k: int, config: GemmConfig, tiles: int = 2, epilogue: str = "dswiglu") -> pd.DataFrame:
    """One program's ring, step by step, over its first ``tiles`` tiles of a varlen-M launch with K = ``k``: a row a
    step with the step's number (counted on from tile to tile, as the kernel does), its stage (step mod stages) and
    the parity of the stage's use that its barriers wait for, the tile, what the step is (a K step, or with dswiglu
    through the ring a chunk of the tile's saved u and g: :func:`.grouped_gemm.ring_chunks`), its index among the
    tile's steps of that kind, and what lands in the stage's A and B buffers."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an int ≥ 1 (A's columns), got {k!r}")
    if not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"tiles: expected an int ≥ 1, got {tiles!r}")
    if epilogue not in grouped_gemm.EPILOGUES:
        raise ValueError(f"epilogue: expected one of {grouped_gemm.EPILOGUES}, got {epilogue!r}")
    bk, stages = config.block_k, config.stages
    k_steps, chunks = cdiv(k, bk), grouped_gemm.ring_chunks(config, epilogue)
    rows = []
    for tile in range(tiles):
        for j in range(k_steps + chunks):
            step = tile * (k_steps + chunks) + j
            if j < k_steps:  # A's tile rows, K columns j·BK on; B_e's K rows j·BK on (dswiglu's Wd as it lies)
                ks = f"{j * bk}:{(j + 1) * bk}"
                kind, a_buffer, b_buffer = "K step", f"A[:, {ks}]", f"B_e[{ks}, :]"
            else:  # the tile's rows, its columns (from its first) chunk by chunk
                cols = f"{(j - k_steps) * bk}:{(j - k_steps + 1) * bk}"
                kind, a_buffer, b_buffer = "saved chunk", f"u[:, {cols}]", f"g[:, {cols}]"
            index = j if j < k_steps else j - k_steps
            rows.append(dict(step=step, stage=step % stages, parity=(step // stages) & 1, tile=tile, kind=kind,
                             index=index, a_buffer=a_buffer, b_buffer=b_buffer))  # fmt: skip
    return pd.DataFrame(rows)


def ring_steps_figure(frame: pd.DataFrame, config: GemmConfig):
    """:func:`ring_steps_frame` drawn: a column a step, a row a stage, each step's cell coloured by its kind and
    labelled with what its A and B buffers hold; the consumer's epilogue reads a tile's chunks as they land, and
    each stage goes back to the loaders once the step's reads (or a chunk's stores) are done. Returns the figure."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.62 * len(frame)), 0.8 + 0.55 * config.stages))
    colors = {"K step": "#ddf4ff", "saved chunk": "#fbefff"}
    for row in frame.itertuples():
        ax.add_patch(patches.Rectangle((row.step, row.stage), 0.92, 0.9, fc=colors[row.kind], ec="black", lw=0.6))
        label = f"K{row.index}\nA | B_e" if row.kind == "K step" else f"chunk {row.index}\nu | g"
        ax.text(row.step + 0.46, row.stage + 0.45, label, ha="center", va="center", fontsize=6)
    for tile, steps in frame.groupby("tile")["step"]:
        ax.axvline(steps.min(), color="black", lw=1.0)
        ax.text(steps.min() + 0.05, -0.35, f"tile {tile}", fontsize=7, va="center")
    ax.set(xlim=(0, len(frame)), ylim=(config.stages, -0.6), xlabel="ring step (counted on from tile to tile)",
           ylabel="stage")  # fmt: skip
    ax.set_yticks([s + 0.45 for s in range(config.stages)], [str(s) for s in range(config.stages)])
    ax.set_xticks([])
    handles = [patches.Patch(fc=color, ec="black", label=label) for label, color in colors.items()]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=2, bbox_to_anchor=(1.0, 1.18))
    tiles = f"{config.block_m}×{config.block_n}×{config.block_k} tiles, {config.stages} stages"
    title = f"{tiles}: A|B = what the stage's A and B buffers hold (A's rows and B_e's box; u's and g's chunks)"
    ax.set_title(title, fontsize=8, loc="left")
    fig.tight_layout()
    return fig


# ================================================================ the tile schedules


def schedule_frame(offsets, n: int, config: GemmConfig, programs: int, epilogue: str = "none") -> pd.DataFrame:
    """:func:`.grouped_gemm.schedule` as one row per tile: program, turn (its place in the program's order),
    consumer (ping-pong: turn mod 2), expert, row0, col0, rows (the expert's rows in the tile: the rest are masked)
    and cols (output columns inside N)."""
    offsets = check_offsets(offsets)
    _check_programs(programs)
    if n < 1:
        raise ValueError(f"n: expected at least one output column, got {n}")
    columns = grouped_gemm.output_columns(config, epilogue)
    rows = []
    for program, tiles in enumerate(grouped_gemm.schedule(offsets, n, config, programs, epilogue)):
        for turn, (expert, row0, col0) in enumerate(tiles):
            rows.append(
                dict(
                    program=program,
                    turn=turn,
                    consumer=turn % 2 if config.pingpong else 0,
                    expert=expert,
                    row0=row0,
                    col0=col0,
                    rows=min(config.block_m, offsets[expert + 1] - row0),
                    cols=min(columns, n - col0),
                )
            )
    return pd.DataFrame(rows, columns=["program", "turn", "consumer", "expert", "row0", "col0", "rows", "cols"])


def _program_colors(programs: int):
    cmap = plt.get_cmap("tab10" if programs <= 10 else "tab20")
    return [cmap(p % cmap.N) for p in range(programs)]


def schedule_figure(frame: pd.DataFrame, offsets, n: int, config: GemmConfig, programs: int, epilogue: str = "none"):
    """The output [M_total, N] of a varlen-M launch: the experts' row bands, each tile coloured by the program that
    takes it and labelled p.turn, its rows past the expert's end (loaded, never stored) dashed. Returns the figure."""
    offsets = check_offsets(offsets)
    colors = _program_colors(programs)
    fig, ax = plt.subplots(figsize=(9, 0.9 + 4.2 * max(offsets[-1], 1) / max(offsets[-1], n, 1)))
    for e, (begin, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        ax.axhspan(begin, end, color="#eaeef2" if e % 2 else "#f6f8fa", zorder=0)
        ax.text(n * 1.01, (begin + end) / 2, f"expert {e}: {end - begin} rows", va="center", fontsize=7)
    for tile in frame.itertuples():
        ax.add_patch(
            patches.Rectangle(
                (tile.col0, tile.row0), tile.cols, tile.rows, fc=colors[tile.program], ec="black", lw=0.8, alpha=0.85
            )
        )
        if tile.rows < config.block_m:  # the tile's rows past its expert: read, fed to no stored row
            ax.add_patch(
                patches.Rectangle(
                    (tile.col0, tile.row0 + tile.rows),
                    tile.cols,
                    config.block_m - tile.rows,
                    fc="none",
                    ec=colors[tile.program],
                    ls="--",
                    lw=0.8,
                )
            )
        ax.text(
            tile.col0 + tile.cols / 2,
            tile.row0 + tile.rows / 2,
            f"p{tile.program}.{tile.turn}",
            ha="center",
            va="center",
            fontsize=7,
        )
    for e in offsets[1:-1]:
        ax.axhline(e, color="black", lw=0.6)
    ax.set(
        xlim=(0, n),
        ylim=(max(offsets[-1], 1) + config.block_m / 2, 0),
        xlabel="output column",
        ylabel="row (sorted by expert)",
    )
    ax.set_title(
        f"{programs} programs, {config.block_m}×{grouped_gemm.output_columns(config, epilogue)} tiles "
        f"({config.consumers}), group_m {config.group_m}: p.turn = program p's turn-th tile",
        fontsize=9,
        loc="left",
    )
    fig.tight_layout()
    return fig


def wgrad_schedule_frame(offsets, shapes, config: GemmConfig, programs: int) -> pd.DataFrame:
    """:func:`.grouped_wgrad.schedule` as one row per tile: program, turn, expert, problem, row0, col0 (inside
    C_p[e] [M_p, N_p]) and k_steps, the expert's ⌈n_e / BLOCK_K⌉ (0: no loads, the tile is stored as zeros)."""
    offsets = check_offsets(offsets)
    _check_programs(programs)
    counts = [b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    rows = []
    for program, tiles in enumerate(grouped_wgrad.schedule(len(counts), shapes, config, programs)):
        for turn, (expert, problem, row0, col0) in enumerate(tiles):
            rows.append(
                dict(
                    program=program,
                    turn=turn,
                    expert=expert,
                    problem=problem,
                    row0=row0,
                    col0=col0,
                    k_steps=cdiv(counts[expert], config.block_k),
                )
            )
    return pd.DataFrame(rows, columns=["program", "turn", "expert", "problem", "row0", "col0", "k_steps"])


def wgrad_schedule_figure(frame: pd.DataFrame, offsets, shapes, config: GemmConfig, programs: int, names=None):
    """One panel per (problem, expert): C_p[e]'s tiles coloured by program, labelled p.turn and the tile's K steps;
    an expert without rows hatched (its tiles stored as zeros). Returns the figure."""
    offsets = check_offsets(offsets)
    experts = len(offsets) - 1
    names = names or [f"C_{p}" for p in range(len(shapes))]
    colors = _program_colors(programs)
    fig, axes = plt.subplots(len(shapes), experts, figsize=(2.0 * experts + 1, 2.1 * len(shapes)), squeeze=False)
    for (p, e), ax in zip(((p, e) for p in range(len(shapes)) for e in range(experts)), axes.flat, strict=True):
        m, n = shapes[p]
        rows_e = offsets[e + 1] - offsets[e]
        for tile in frame[(frame.problem == p) & (frame.expert == e)].itertuples():
            w, h = min(config.block_n, n - tile.col0), min(config.block_m, m - tile.row0)
            ax.add_patch(
                patches.Rectangle(
                    (tile.col0, tile.row0),
                    w,
                    h,
                    fc=colors[tile.program],
                    ec="black",
                    lw=0.7,
                    hatch="//" if tile.k_steps == 0 else None,
                    alpha=0.85,
                )
            )
            ax.text(
                tile.col0 + w / 2,
                tile.row0 + h / 2,
                f"p{tile.program}.{tile.turn}\n{tile.k_steps} K",
                ha="center",
                va="center",
                fontsize=6,
            )
        ax.set(xlim=(0, n), ylim=(m, 0), xticks=[], yticks=[])
        ax.set_title(f"{names[p]}[{e}]: {rows_e} rows", fontsize=8)
    fig.suptitle(
        f"varlen-K: {programs} programs, {config.block_m}×{config.block_n} tiles, K steps of "
        f"{config.block_k} rows (hatched: no rows, zeros)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# ================================================================ the twins on the CPU


def twin_errors(counts, n: int, k: int, *, seed: int = 0, programs: int = 3) -> pd.DataFrame:
    """The plain-Triton twins on bf16 inputs drawn from ``seed`` with experts of ``counts`` rows, each output
    NaN-filled first, against float64: the varlen-M kernel ``grouped_gemm_tl`` with the epilogues none, row_scale and
    swiglu (C = A·B_eᵀ, A [M_total, k], B [E, n, k]; swiglu: gate and up [E, n, k] each), and the varlen-K kernel
    ``grouped_weight_grad_tl`` with two products (C_0[e] = A[rows_e]ᵀ·B[rows_e], C_1[e] = B[rows_e]ᵀ·A[rows_e]).
    Rows: kernel, epilogue, output shape, relative error, NaN left (elements never written)."""
    from ..engine.grouped_tl import SMALL_TILES, grouped_gemm_tl
    from ..engine.grouped_wgrad_tl import grouped_weight_grad_tl

    offsets = offsets_of(counts)
    if n < 1 or k < 1:
        raise ValueError(f"n, k: expected positive sizes, got {n}, {k}")
    generator = torch.Generator().manual_seed(seed)
    M, E = offsets[-1], len(counts)

    def draw(*shape):
        return torch.randn(shape, generator=generator).to(torch.bfloat16)

    a, b, gate, up = draw(M, k), draw(E, n, k), draw(E, n, k), draw(E, n, k)
    scale = torch.rand(M, generator=generator)
    device_offsets = torch.tensor(offsets, dtype=torch.int32)

    def expert_product(weights):
        return torch.cat(
            [
                a[s:t].double() @ weights[e].double().T
                for e, (s, t) in enumerate(zip(offsets[:-1], offsets[1:], strict=True))
            ]
        )

    plain = expert_product(b)
    g, u = expert_product(gate), expert_product(up)
    expected = {
        "none": plain,
        "row_scale": plain * scale.double()[:, None],
        "swiglu": torch.nn.functional.silu(g) * u,
    }
    rows = []
    for epilogue, want in expected.items():
        out = torch.full((M, n), float("nan"), dtype=torch.bfloat16)
        weights = (gate, up) if epilogue == "swiglu" else b
        grouped_gemm_tl(
            a,
            weights,
            device_offsets,
            out=out,
            epilogue=epilogue,
            b_transposed=True,
            scale=scale if epilogue == "row_scale" else None,
            config=SMALL_TILES,
            programs=programs,
        )
        rows.append(_error_row("grouped_gemm_tl", epilogue, out, want))
    b_rows = draw(M, n)
    outs = [
        torch.full((E, k, n), float("nan"), dtype=torch.float32),
        torch.full((E, n, k), float("nan"), dtype=torch.float32),
    ]
    grouped_weight_grad_tl([(a, b_rows), (b_rows, a)], device_offsets, outs=outs, config=SMALL_TILES, programs=programs)
    for name, out, (x, y) in zip(("C_0 = Aᵀ·B", "C_1 = Bᵀ·A"), outs, ((a, b_rows), (b_rows, a)), strict=True):
        want = torch.stack(
            [x[s:t].double().T @ y[s:t].double() for s, t in zip(offsets[:-1], offsets[1:], strict=True)]
        )
        rows.append(_error_row("grouped_weight_grad_tl", name, out, want))
    return pd.DataFrame(rows).set_index(["kernel", "epilogue"])


def _error_row(kernel: str, epilogue: str, out: torch.Tensor, want: torch.Tensor) -> dict:
    unwritten = int(torch.isnan(out).sum())
    error = float("inf") if unwritten else relative_error(out.double(), want)
    return {
        "kernel": kernel,
        "epilogue": epilogue,
        "shape": tuple(out.shape),
        "relative error": error,
        "NaN left": unwritten,
    }


# ================================================================ the layer's launches


@contextlib.contextmanager
def recorded_launches():
    """Within the block, every launch of :mod:`moe_lib.moe_experts.engine_layer` is appended to the list yielded, as
    (kernel, epilogue, rows M_total, shapes of its weight operands or products); the launches still run."""
    from ..moe_experts import engine_layer

    launches = engine_layer._Launches  # the layer's one door to the engine's kernels
    gemm, weight_grad = launches.gemm, launches.weight_grad
    record: list[dict] = []

    def recording_gemm(self, a, b, offsets, **kwargs):
        weights = b if isinstance(b, tuple) else (b,)
        gathered = " gathered" if isinstance(a, Gathered) else ""  # its rows read through the routing by the loads
        record.append(
            dict(
                kernel="grouped_gemm",
                epilogue=kwargs.get("epilogue", "none"),
                rows=a.shape[0],
                operands=f"A{gathered} {list(a.shape)}, B " + " + ".join(str(list(w.shape)) for w in weights),
            )
        )
        return gemm(self, a, b, offsets, **kwargs)

    def recording_weight_grad(self, problems, offsets, outs):
        record.append(
            dict(
                kernel="grouped_wgrad",
                epilogue="",
                rows=problems[0][0].shape[0],
                operands=", ".join(f"C {output_shape(out)}" for out in outs),
            )
        )
        return weight_grad(self, problems, offsets, outs)

    launches.gemm, launches.weight_grad = recording_gemm, recording_weight_grad
    try:
        yield record
    finally:
        launches.gemm, launches.weight_grad = gemm, weight_grad


def launch_table(record: list[dict], which: str) -> pd.DataFrame:
    """The launches of ``record`` (:func:`recorded_launches`, one forward or one backward recomputing g and u) beside
    :data:`LAUNCHES` [``which``]: ValueError where the layer launched other kernels than those listed there."""
    listed = LAUNCHES[which]
    if [(r["kernel"], r["epilogue"]) for r in record] != [(k, e) for k, e, _, _ in listed]:
        raise ValueError(
            f"record: the layer's {which} launched {[(r['kernel'], r['epilogue']) for r in record]}, "
            f"LAUNCHES lists {[(k, e) for k, e, _, _ in listed]}"
        )
    rows = [
        dict(kernel=k, epilogue=e or "–", computes=c, weights=w, operands=r["operands"])
        for (k, e, c, w), r in zip(listed, record, strict=True)
    ]
    return pd.DataFrame(rows, index=pd.RangeIndex(1, len(rows) + 1, name="launch"))


def output_shape(out) -> list[int]:
    """An output's [E, M, N]: of a tensor, or of one given in column parts (their N summed)."""
    if isinstance(out, tuple | list):
        return [*out[0].shape[:2], sum(part.shape[2] for part in out)]
    return list(out.shape)


def backward_memory_frame(cases: dict[str, tuple[int, int, int, int, int]], column_tile: int = 256) -> pd.DataFrame:
    """Per case (name → T, K, H, I, E) and per form of x_s (whole; in :func:`.engine_layer.x_s_column_slices`, by
    the rule, at the weight gradients' ``column_tile``; none, x gathered, where
    :func:`.engine_layer.x_as_a_in_weight_grads`), the GB (bf16) alive at the layer backward's three widest
    launches, with g and u saved and spent (their [T·K, 2I] buffer holds [dg | du] and stays to the end) and
    grad_x made: dX's (dX_s, w·a), the gate and up gradients' (dWg, dWu, x_s or its widest slice, w·a) and Wd's
    (the three weight gradients, w·a); ``peak`` names the largest. The launches' own buffers only: no inputs, no
    routing, no partials."""
    from ..moe_experts import engine_layer

    rows = []
    for name, (T, K, H, I, E) in cases.items():
        S = T * K
        always = 2 * (S * 2 * I + S * I + T * H)  # [dg | du] over the saved pair, w·a, grad_x
        weight = 2 * E * I * H
        slices = {"whole": H}
        sliced = engine_layer.x_s_column_slices(S, H, I, E, column_tile)
        if len(sliced) > 1:
            slices[f"{len(sliced)} slices"] = max(c.stop - c.start for c in sliced)
        if engine_layer.x_as_a_in_weight_grads(I, column_tile):  # x read through the routing: no x_s at all
            slices["gathered"] = 0
        for form, width in slices.items():
            phases = {
                "dX (GB)": always + 2 * S * H,
                "dWg, dWu (GB)": always + 2 * weight + 2 * S * width,
                "dWd (GB)": always + 3 * weight,
            }
            row = {"case": name, "x_s": form, **{k: v / 1e9 for k, v in phases.items()}}
            row["peak"] = max(phases, key=phases.get).removesuffix(" (GB)")
            rows.append(row)
    return pd.DataFrame(rows)


def backward_memory_figure(frame: pd.DataFrame):
    """:func:`backward_memory_frame` as bars: per case and form of x_s, the GB at each of the three launches."""
    phases = [c for c in frame.columns if c.endswith("(GB)")]
    colors = {"dX (GB)": "tab:blue", "dWg, dWu (GB)": "tab:red", "dWd (GB)": "tab:green"}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(frame)), 3.8), layout="constrained")
    width = 0.8 / len(phases)
    for i, phase in enumerate(phases):
        xs = [x + (i - (len(phases) - 1) / 2) * width for x in range(len(frame))]
        drawn = ax.bar(xs, frame[phase], width, color=colors.get(phase), label=phase.removesuffix(" (GB)"))
        ax.bar_label(drawn, fmt="%.2f", fontsize=6)
    ax.set_xticks(range(len(frame)), [f"{c}\nx_s {f}" for c, f in zip(frame["case"], frame["x_s"], strict=True)],
                  fontsize=7)  # fmt: skip
    ax.set(ylabel="GB alive at the launch", title="the layer's backward: what each widest launch holds")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return fig
