"""moe_lib.lab.kernels: the kernels' launch plans as tables and diagrams, checked by hand."""

import dataclasses

import matplotlib
import pytest

from moe_lib import problems
from moe_lib.lab import kernels
from moe_lib.moe_experts import launch as p2_launch
from moe_lib.moe_experts.choose import launch_config as p2_launch_config
from moe_lib.swiglu_down.designs.triton_launches import launch_plan, tiles_for
from moe_lib.tiling import cdiv, split_ranges

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

P1, P2, P2_BF16 = problems.PROBLEM_NAMES
PLAN_COLUMNS = ["launch", "kind", "computes", "output", "reduce", "tile", "split", "tiles", "programs", "first_program"]


def test_rows_read_names_the_weight_of_each_split():
    assert [kernels.rows_read(a, b, 16) for a, b in split_ranges(32, 4, 16)] == ["Wg", "Wu", "empty", "empty"]
    assert kernels.rows_read(8, 24, 16) == "Wg and Wu"


def test_p1_plan_table_by_hand():
    T, H, I = 128, 2048, 768
    config = tiles_for(T, with_lo=False)
    table = kernels.p1_plan_table(launch_plan(T, H, I, config))
    assert list(table.columns) == PLAN_COLUMNS
    table = table.set_index("kind")
    bm, bn, bk, split = config.d_intermediate
    assert table.loc["dA", "programs"] == cdiv(T, bm) * cdiv(I, bn) * split
    assert table.loc["dA", "tile"] == f"{bm}×{bn}×{bk}" and table.loc["dA", "reduce"] == f"H = {H}"
    bm, bn, _, split = config.grad_down
    assert table.loc["dWd", "programs"] == cdiv(H, bm) * cdiv(I, bn) * split
    assert table.loc["dWd", "output"] == f"[{H}, {I}]"
    assert table.loc["dA", "first_program"] == table.loc["dWd", "programs"]  # weight gradients first
    assert table.loc["dx", "first_program"] == 2 * table.loc["dWg", "programs"]
    for with_lo in (False, True):
        grid = kernels.p1_grid_table([1, 8192], H, I, with_lo=with_lo)
        assert list(grid.index) == [1, 8192]
        for t in grid.index:
            plan = launch_plan(t, H, I, tiles_for(t, with_lo=with_lo))
            launches = [grid.loc[t, f"launch {n} programs"] for n in (1, 2)]
            assert launches == [sum(k.programs for k in plan if k.launch == n) for n in (1, 2)]
        assert grid.loc[8192, "dx tile (split)"] == ("128×128×64 (1)" if with_lo else "128×256×64 (1)")
    tiny = kernels.p1_grid_table([5], 32, 16, interpreter=True)
    assert tiny.loc[5, "dA tile (split)"] == "16×16×16 (2)"


def _weight_grad_programs(E, size_m, size_n, tile, n_tiles_per_program):
    """Kernel W's programs for one launch: E × M-tiles × groups of n N-tiles, n = min(n_tiles_per_program, N-tiles)."""
    n_tiles = cdiv(size_n, tile[1])
    return E * cdiv(size_m, tile[0]) * cdiv(n_tiles, min(n_tiles_per_program, n_tiles))


def test_p2_plan_and_grid_tables_by_hand():
    T, H, I, E, K = 2048, 4096, 2048, 256, 8
    config = p2_launch_config(T * K, E, input_bytes=4, interpreter=False)
    R, n = config.row_split, config.n_tiles_per_program
    # kernels W and D TMA-fed and persistent: 132 programs (an H200's SMs) looping over their tiles
    table = kernels.p2_plan_table(p2_launch.launch_plan(T, H, I, E, K, config, num_programs=132, weight_bytes=4))
    assert list(table.index) == ["A", "W_gate_up", "W_down", "D", "C"]
    assert list(table["programs"]) == [E * (I // config.block_i) * R, 132, 132, 132, T * (H // config.block_h_sum)]
    assert table.loc["A", "grid"] == f"{E} × {I // config.block_i} × {R} (experts × I-tiles × row split)"
    m, n_tile = config.tma_weight_grad.gate_up_tile[:2]
    assert table.loc["W_gate_up", "grid"] == (
        f"132 (programs (one per SM)), looping over {E} × {I // m} × {H // n_tile} tiles (experts × M-tiles × N-tiles)"
    )
    empty = kernels.p2_plan_table(p2_launch.launch_plan(0, H, I, E, K, config, num_programs=132))  # W writes the zeros
    assert list(empty["programs"]) == [0, 132, 132, 0, 0]
    # the pointer-based kernels W and D where the config has no TMA-fed form: one program per tile (group)
    pointer = dataclasses.replace(config, tma_weight_grad=None, tma_slot_projection=None)
    weight_grads = [
        _weight_grad_programs(E, I, H, config.grad_gate_up_tile, n),
        _weight_grad_programs(E, H, I, config.grad_down_tile, n),
    ]
    assert list(kernels.p2_plan_table(p2_launch.launch_plan(T, H, I, E, K, pointer))["programs"]) == [
        E * (I // config.block_i) * R,
        *weight_grads,
        E * (H // config.block_h_dx) * R,
        T * (H // config.block_h_sum),
    ]
    grid = kernels.p2_grid_table([T], P2)
    assert grid.loc[T, "row split R"] == R and grid.loc[T, "slots per expert (mean)"] == 64
    assert list(grid.columns[2:]) == [f"kernel {step} programs" for step in table.index]
    assert list(grid.loc[T].iloc[2:]) == list(table["programs"])  # 132 persistent programs without a GPU
    bf16 = kernels.p2_grid_table([T], P2_BF16)  # 16-bit inputs: other tiles where the experts are busy
    bf16_config = p2_launch_config(T * K, E, input_bytes=2, interpreter=False)
    assert bf16.loc[T, "row split R"] == bf16_config.row_split


def test_figures_render():
    inputs = problems.make_inputs(P2, 12, hidden_size=32, intermediate_size=16, num_experts=4, top_k=2)
    p2_config = p2_launch_config(24, 4, input_bytes=4, interpreter=True)
    figures = [
        kernels.p1_tiling_figure(16, 2048, 768, tiles_for(16, with_lo=False)),
        kernels.split_k_figure(4),
        kernels.p2_tiling_figure(inputs["topk_indices"], 4, 32, 16, p2_config),
    ]
    matrices = figures[0].axes[0]  # P1: every output matrix in one axes of equal aspect, so all to one scale
    assert matrices.get_aspect() == 1.0
    plan = launch_plan(16, 2048, 768, tiles_for(16, with_lo=False))
    outlines = [p for p in matrices.patches if p.get_fill()]  # one filled rectangle per matrix, [N wide, M high]
    assert [(p.get_width(), p.get_height()) for p in outlines] == [(k.N, k.M) for k in plan]
    for figure in figures:
        assert isinstance(figure, matplotlib.figure.Figure) and figure.axes
        plt.close(figure)
    plan = p2_launch.launch_plan(12, 32, 16, 4, 2, p2_config)
    a_title = figures[2].axes[2].get_title()
    assert a_title == f"kernel A\n{'×'.join(map(str, plan['A'].grid.values()))} programs"
    w_axes = figures[2].axes[3]  # kernel W: one tick label per family of tiles, not one per tile
    assert [label.get_text() for label in w_axes.get_xticklabels()] == ["dWg·dWu", "dWd"]
    pytest.importorskip("jinja2")
    table = kernels.p2_plan_table(plan)
    assert "text-align: left" in kernels.styled_plan(table, "tiny").to_html()
