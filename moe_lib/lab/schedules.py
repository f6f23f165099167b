"""Models of how P1's tiles fill the SMs, for the lab notes: the chained launch's tickets (:func:`chained_schedule`)
and a Gluon launch's program order (:func:`gluon_launch_schedule`, which notes/p1/design-21.md and design-25.md cite),
one program per SM, each tile as long as its multiply-adds, and their figure (:func:`schedule_figure`).

A model, not a measurement: it knows nothing of a tile's efficiency or of what runs beside it; the measured traces
are :mod:`.traces`.
"""

from __future__ import annotations

import heapq

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib import patches

from ..swiglu_down.designs.triton_launches import TileConfig, launch_plan
from ..swiglu_down.gluon_launch1 import GluonFirstLaunchConfig
from ..tiling import cdiv
from .kernels import KIND_COLORS


def chained_schedule(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    tiles: TileConfig,
    *,
    programs_at_once: int = 132,
    with_lo: bool = True,
    grad_down_last: bool = False,
) -> pd.DataFrame:
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


def gluon_launch_schedule(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    form,
    *,
    programs_at_once: int = 132,
    with_lo: bool = True,
) -> pd.DataFrame:
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
        ax.set_title(
            f"{title}: last tile ends at {makespan:.0f}, a perfect balance at {balance:.0f} ({balance / makespan:.0%})",
            fontsize=9,
            loc="left",
        )
    handles = [patches.Patch(color=color, label=kind) for kind, color in KIND_COLORS.items()]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    axes[-1, 0].set_xlabel("MFLOP of one SM's work since the launch started (the model's time)")
    fig.tight_layout()
    return fig
