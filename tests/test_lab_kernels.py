"""moe_lib.lab.kernels: the kernels' launch plans as tables and diagrams, checked by hand; the tuning runs."""

import dataclasses

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch

from moe_lib import problems
from moe_lib.lab import kernels
from moe_lib.moe_experts import launch as p2_launch
from moe_lib.moe_experts.choose import launch_config as p2_launch_config
from moe_lib.swiglu_down.choose import choose_design
from moe_lib.swiglu_down.designs.chained import CHAINED_TILES
from moe_lib.swiglu_down.designs.gluon import FORMS, GluonLaunches, grad_down_in_second_launch, with_second
from moe_lib.swiglu_down.designs.triton_launches import launch_plan, tiles_for
from moe_lib.swiglu_down.runtime import Device
from moe_lib.tiling import cdiv, split_ranges

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

P1, P2, P2_BF16 = problems.PROBLEM_NAMES
PLAN_COLUMNS = ["launch", "kind", "computes", "output", "reduce", "tile", "split", "tiles", "programs", "first_program"]
A100 = Device("cuda", sms=108, shared_memory=166912, capability=(8, 0))  # no Gluon launches there


def chosen(num_tokens, precision, hidden_size=2048, intermediate_size=768):
    """What the chooser runs on the H200 at the benchmark's shape (bf16)."""
    return kernels.chosen_design(num_tokens, hidden_size, intermediate_size, precision)


def on_gluon(num_tokens, precision="fast"):
    return isinstance(chosen(num_tokens, precision), GluonLaunches)


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
    assert table.loc["W_gate_up", "grid"] == (f"132 (programs (one per SM)), looping over {E} × {I // m} × "
                                              f"{H // n_tile} tiles (experts × M-tiles × N-tiles)")  # fmt: skip
    empty = kernels.p2_plan_table(p2_launch.launch_plan(0, H, I, E, K, config, num_programs=132))  # W writes the zeros
    assert list(empty["programs"]) == [0, 132, 132, 0, 0]
    # the pointer-based kernels W and D where the config has no TMA-fed form: one program per tile (group)
    pointer = dataclasses.replace(config, tma_weight_grad=None, tma_slot_projection=None)
    weight_grads = [_weight_grad_programs(E, I, H, config.grad_gate_up_tile, n),
                    _weight_grad_programs(E, H, I, config.grad_down_tile, n)]  # fmt: skip
    assert list(kernels.p2_plan_table(p2_launch.launch_plan(T, H, I, E, K, pointer))["programs"]) == \
        [E * (I // config.block_i) * R, *weight_grads, E * (H // config.block_h_dx) * R, T * (H // config.block_h_sum)]
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


def test_design_tables_read_the_committed_tuning_runs():
    p1 = kernels.p1_design_times()
    assert list(p1.index) == [1, 16, 128, 512]
    assert p1.loc[1, "one launch µs"] == pytest.approx(22.2, abs=0.05)
    assert p1.loc[128, "two launches: config"] == "mid_s4"
    assert (p1["two launches µs"] <= p1["one launch µs"] + 0.5).all()  # what notes/index.md says: no gain
    labels = {"unfused": "design 2", "g_s3": "design 3"}
    p2 = kernels.p2_kernel_times(kernels.TUNING_DIR / "2026-11-29-p2-design3-tune.json", labels)
    assert list(p2.index) == [(case, label) for case in ("fp32:2048", "bf16:2048", "fp32:8192") for label in
                              ("design 2", "design 3")]  # fmt: skip
    assert p2.loc[("bf16:2048", "design 2"), "graph_ms"] == pytest.approx(12.30, abs=0.01)
    assert p2.loc[("bf16:2048", "design 2"), "G"] == 0 and p2.loc[("bf16:2048", "design 3"), "Wgu"] == 0
    assert (p2["element_rule"] >= 0.99).all()
    figure = kernels.kernel_times_figure(p2, "test")
    assert len(figure.axes[0].patches) == 6 * len([k for k in kernels.P2_KERNEL_COLUMNS if p2[k].any()])
    plt.close(figure)


def test_few_tokens_table_reads_the_committed_check_run():
    graph, floor = kernels.p1_few_tokens_times()
    assert list(graph.columns[:1]) == [kernels.FEW_TOKENS_BEFORE] and "a_reg" in graph.columns
    assert list(graph.index) == [(p, t) for p in ("faithful", "fast") for t in (1, 4, 16, 64)]
    assert graph.loc[("faithful", 1), "a_reg"] == pytest.approx(19.2, abs=0.05)
    assert 3 < floor < 6
    # what notes/index.md and the default say: the chosen tiles ahead up to 16 tokens, behind at 64
    few, more = graph.xs(16, level="num_tokens"), graph.xs(64, level="num_tokens")
    assert (few["a_reg"] < few[kernels.FEW_TOKENS_BEFORE]).all()
    assert (more["a_reg"] > more[kernels.FEW_TOKENS_BEFORE]).all()
    official, _ = kernels.p1_few_tokens_times(column="official_us")
    assert official.loc[("faithful", 1), "a_reg"] == pytest.approx(14.6, abs=0.05)
    figure = kernels.few_tokens_figure(graph, floor, chosen="a_reg")
    assert len(figure.axes) == 2 and len(figure.axes[0].lines) == len(graph.columns) + 1
    plt.close(figure)


def test_p1_design_by_tokens_follows_choose_design():
    """The designs by token count on the H200 at the benchmark's shape (what choose.MEASURED holds), and off Hopper."""
    table = kernels.p1_design_by_tokens([1, 16, 17, 64, 65, 128, 129, 1087, 3300, 8192], 2048, 768)
    assert list(table.columns) == ["fast", "faithful"]
    assert (table.loc[[1, 16, 17, 64]] == "few_tokens").all().all()
    assert table.loc[65, "fast"] == table.loc[129, "faithful"] == "gluon_launches: narrow, dWd in launch 2"
    assert table.loc[65, "faithful"] == table.loc[128, "faithful"] == "gluon_launches: narrow"
    assert table.loc[1087].tolist() == ["gluon_launches: tall_dx_first, dWd in launch 2"] * 2
    assert table.loc[3300].tolist() == ["library_gemms", "gluon_launches: wide_tall"]
    assert table.loc[8192].tolist() == ["library_gemms", "gluon_launches: wide"]
    for T in table.index:
        for path in table.columns:
            design = choose_design(T, 2048, 768, dtype=torch.bfloat16, precision=path, device=kernels.H200)
            assert table.loc[T, path] == kernels.design_label(design), (T, path)
    elsewhere = kernels.p1_design_by_tokens([129, 512, 8192], 2048, 768, device=A100)
    assert elsewhere["fast"].tolist() == ["library_gemms"] * 3
    assert elsewhere["faithful"].tolist() == ["chained", "chained", "triton_launches"]  # the few-token launch to 128
    shapes = [(2048, 768), (4096, 1536), (7168, 2048)]
    side_by_side = kernels.p1_design_table([1, 512, 8192], shapes)
    assert list(side_by_side.columns) == [(f"H {H}, I {I}", path) for H, I in shapes for path in ("fast", "faithful")]
    assert side_by_side["H 2048, I 768"].equals(kernels.p1_design_by_tokens([1, 512, 8192], 2048, 768))


def test_p1_registry_table_lists_every_design_of_the_registry():
    from moe_lib.swiglu_down.designs import DESIGNS

    table = kernels.p1_registry_table()
    assert list(table.index) == list(DESIGNS) and table.loc["gluon_launches", "config"] == "GluonLaunches"
    assert table.loc["chained", "module"] == "swiglu_down.designs.chained"
    assert table.loc["triton_launches", "what it is"].startswith("P1's portable design: two Triton launches")
    assert not table["what it is"].str.contains(":mod:|``").any()  # Sphinx roles read as plain names


def test_gluon_form_of_names_every_form_the_chooser_can_make():
    """Each form of FORMS, with dWd's tiles moved, dx split or the persistent programs dropped, is named back; every
    Gluon design the chooser picks at three model shapes has a name; a configuration no form has is refused."""
    for name, form in FORMS.items():
        for moved in (False, True):
            for splits in (1, 2, 4):
                design = with_second(grad_down_in_second_launch(form) if moved else form, grad_x_splits=splits)
                assert kernels.gluon_form_of(design) == (name, moved, splits)
        assert kernels.gluon_form_of(with_second(form, weight_grad_programs=0))[0] == name
    assert len({kernels.design_label(form) for form in FORMS.values()}) == len(FORMS)
    named = set()
    for H, I in ((2048, 768), (4096, 1536), (7168, 2048)):
        for T in (65, 100, 129, 300, 513, 1100, 1500, 2300, 3000, 3600, 5200, 8192):
            for path in ("fast", "faithful"):
                design = chosen(T, path, H, I)
                if isinstance(design, GluonLaunches):
                    named.add(kernels.gluon_form_of(design)[0])
    assert {"narrow", "tall", "wide"} <= named
    assert kernels.design_label(tiles_for(16, with_lo=False)) == "triton_launches"
    with pytest.raises(ValueError, match="not a form"):
        kernels.gluon_form_of(with_second(FORMS["wide"], block_n=128))


def test_p1_design_map_draws_every_run_of_the_design_choice():
    """The design map: per path, runs of equal designs that cover 1..max_tokens without gaps, each the name of what
    choose_design returns at its first and last token count."""
    assert kernels.design_runs(["a", "a", "b", "a"]) == [(1, 3, "a"), (3, 4, "b"), (4, 5, "a")]
    fig = kernels.p1_design_map_figure(2048, 768, max_tokens=4096, marks=(128, 1087))
    assert list(fig.paths) == ["fast", "faithful"] and len(fig.axes) == 2
    for path, runs in fig.paths.items():
        assert runs[0][0] == 1 and runs[-1][1] == 4097
        assert all(a[1] == b[0] and a[2] != b[2] for a, b in zip(runs, runs[1:], strict=False))
        table = kernels.p1_design_by_tokens([start for start, _, _ in runs] + [stop - 1 for _, stop, _ in runs],
                                            2048, 768)  # fmt: skip
        for start, stop, name in runs:
            assert table.loc[start, path] == table.loc[stop - 1, path] == name, (path, start)
    fast = {name for _, _, name in fig.paths["fast"]}
    assert {"few_tokens", "library_gemms"} <= fast
    plt.close(fig)


def test_one_graph_host_gap_file_holds_what_notes_say():
    """The two Gluon launches as one CUDA graph: their span in NVIDIA's method under graph replay at every count
    (notes/p1/design-16.md), ahead of the few-token launch from 65 tokens."""
    table = kernels.p1_host_gap_times(kernels.ONE_GRAPH_HOST_GAP_FILE, kernels.ONE_GRAPH_LABELS)
    graph = table.xs("two launches as one CUDA graph", level="design")
    assert list(graph.index) == [65, 100, 128, 256, 512, 1087, 1321]
    assert (graph["gap"] < -2).all()
    few = table.xs("few-token launch to 128, then two launches", level="design")
    assert (graph.loc[[65, 100, 128], "official"] < few.loc[[65, 100, 128], "official"]).all()
    assert graph.loc[128, "official"] == pytest.approx(29.7, abs=0.05)


def test_p1_host_gap_times_and_figure():
    path = kernels.TUNING_DIR / "2026-12-01-p1-host-gap-chained.json"
    labels = {"default": "before", "chain_f": "chained"}
    table = kernels.p1_host_gap_times(path, labels)
    assert list(table.columns) == ["graph", "official", "gap"]
    assert list(table.index.get_level_values("design").unique()) == ["before", "chained"]
    assert table.loc[(512, "before"), "official"] == pytest.approx(112.1, abs=0.05)
    assert table.loc[(512, "chained"), "gap"] < 0 < table.loc[(512, "before"), "gap"]
    assert len(kernels.p1_host_gap_times(path)) == 12  # every design of the run without labels
    figure = kernels.host_gap_figure(table, "test")
    assert len(figure.axes[0].patches) == 2 * 2 * len(table.index.get_level_values("num_tokens").unique())
    plt.close(figure)


def test_p1_tune_times_and_speedup_figure():
    table = kernels.p1_tune_times(kernels.TUNING_DIR / "2026-12-01-p1-tune-library-fast.json",
                                  default_label="Triton launches")  # fmt: skip
    assert table.columns[0] == "Triton launches" and {"lib", "lib_s", "lib_b", "lib_bs"} <= set(table.columns)
    assert table.index.name == "num_tokens" and 8192 in table.index
    assert (table > 0).all().all()
    fig = kernels.speedup_figure(table, "Triton launches", "test", switch=17)
    assert len(fig.axes[0].lines) == len(table.columns) + 1  # every candidate, the line at 1 and the switch
    plt.close(fig)


def test_few_tokens_traces_and_timeline_figure():
    """The committed traces: every program stamps its steps in order, and the default's two moves (the launch
    count read late, phase 2 staged before the wait) end the median program earlier than the design before."""
    traces = kernels.few_tokens_traces()
    steps = list(kernels.TRACE_STRETCHES)
    assert (traces[steps].diff(axis=1).iloc[:, 1:] >= 0).all().all()
    for stamps in traces.stamps:
        times = np.asarray(stamps)[:, : len(steps) + 1]
        assert (np.diff(times, axis=1) >= 0).all() and len(times) == 96
    before = traces[(traces.label == "a_reg dirty") & (traces.commit == "c44c149")].iloc[0]
    now = traces[(traces.label == "a_reg_cl_st dirty")].iloc[0]
    assert now["end"] < before["end"] and now.graph_us < before.graph_us
    warm = traces[traces.label == "a_reg_cl none"].iloc[0]
    assert warm["end"] < now["end"] and warm["dx partial stored"] - warm["dA ready"] > 2  # phase 2's chain
    fig = kernels.few_tokens_timeline_figure(traces, [("a_reg_cl_st dirty", 1, "0329f39"),
                                                      ("a_reg_cl none", 1, "c44c149")])  # fmt: skip
    assert len(fig.axes) == 2
    plt.close(fig)


def test_p1_call_kernels_and_timeline_figure():
    """The committed kernels of a call: ours and torch.compile's run the same cuBLAS GEMMs, ours with its copy of
    [Wg; Wu] (a kernel below 1024 tokens, the copy engines from there); one bar per kernel."""
    table = kernels.p1_call_kernels(labels={"lib_s3": "ours below 1024", "lib_bs3_mc": "ours from 1024",
                                            "torch_compile": "torch.compile"})  # fmt: skip
    assert set(table.num_tokens) == {128, 512, 1321, 4093}
    compiled = table[table.impl == "torch.compile"]
    assert (compiled.groupby("num_tokens").kind.apply(list).map(sorted)
            == [["cuBLAS GEMM"] * 4 + ["dSwiGLU pass (Inductor)"]] * 4).all()  # fmt: skip
    assert set(table[table.impl == "ours below 1024"].kind) >= {"copy of [Wg; Wu], kernel", "dSwiGLU pass (ours)"}
    assert (table[table.impl == "ours from 1024"].kind == "copy of [Wg; Wu], copy engine").sum() == 2 * 4
    assert (table.start_us >= 0).all() and (table.start_us < table.span_us).all()  # medians: no tighter bound
    assert kernels.call_kernel_kind("some_new_kernel") == ("other", "tab:grey")
    defaults = kernels.p1_call_kernels(defaults_only=True)
    assert set(defaults.impl) == {"ours", "torch.compile"}
    ours = defaults[defaults.impl == "ours"].groupby("num_tokens").kind.apply(set)
    assert "copy of [Wg; Wu], kernel" in ours[128] and "copy of [Wg; Wu], copy engine" in ours[4093]
    fig = kernels.call_timeline_figure(table[table.num_tokens.isin([128, 4093])], "test")
    assert len(fig.axes) == 2
    assert sum(len(ax.collections) for ax in fig.axes) == len(table[table.num_tokens.isin([128, 4093])])
    plt.close(fig)


def test_one_block_table_reads_the_committed_runs_of_both_trees():
    table, floor = kernels.p1_one_block_times()
    assert list(table.columns) == [kernels.ONE_BLOCK_BEFORE, kernels.ONE_BLOCK_SAVED_FIRST, kernels.ONE_BLOCK_NOW]
    assert 3 < floor < 6
    faithful, fast = table.loc["faithful"], table.loc["fast"]
    # what notes/p1/design-10.md and FEW_TOKENS_MAX_TOKENS say: the faithful path faster at 17-96 tokens, a tie at 128
    now = faithful[kernels.ONE_BLOCK_NOW].dropna()
    assert list(now.index) == [17, 24, 32, 33, 64, 96, 128]
    assert (now.loc[:96] < faithful.loc[now.loc[:96].index, kernels.ONE_BLOCK_BEFORE] - 5).all()
    assert abs(now.loc[128] - faithful.loc[128, kernels.ONE_BLOCK_BEFORE]) < 1.5
    assert faithful.loc[32, kernels.ONE_BLOCK_NOW] == pytest.approx(23.6, abs=0.05)
    # the fast path: the one block ahead up to 32 tokens, cuBLAS ahead from 48
    assert (fast[kernels.ONE_BLOCK_NOW].dropna() < fast[kernels.ONE_BLOCK_BEFORE].loc[[17, 24, 32]]).all()
    assert (fast.loc[[48, 64], kernels.ONE_BLOCK_SAVED_FIRST] > fast.loc[[48, 64], kernels.ONE_BLOCK_BEFORE]).all()
    official, _ = kernels.p1_one_block_times(column="official_us")
    at_96 = official.loc[("faithful", 96)]
    assert at_96[kernels.ONE_BLOCK_NOW] < at_96[kernels.ONE_BLOCK_BEFORE]
    figure = kernels.few_tokens_figure(table, floor, chosen=kernels.ONE_BLOCK_NOW, before=kernels.ONE_BLOCK_BEFORE,
                                       xscale="linear", ticks=[17, 64, 128])  # fmt: skip
    assert len(figure.axes) == 2 and len(figure.axes[0].lines) == len(table.columns) + 1
    plt.close(figure)


def test_chained_schedule_keeps_every_sm_busy_with_one_tile_at_a_time():
    """The model of the chained launch's tickets: every program placed once, no two tiles on one SM at once,
    launch 2's tiles after the last dA tile, and the total work that of the plan's products."""
    T, H, I = 512, 2048, 768
    tiles = CHAINED_TILES[512]
    plan = launch_plan(T, H, I, tiles)
    for first in (False, True):
        schedule = kernels.chained_schedule(T, H, I, dataclasses.replace(tiles, grad_x_first=first))
        assert len(schedule) == sum(k.programs for k in plan)
        for _, rows in schedule.sort_values("start").groupby("sm"):
            assert (rows.start.to_numpy()[1:] >= rows.end.to_numpy()[:-1] - 1e-9).all()
        d_a_end = schedule[schedule.kind == "dA"].end.max()
        assert schedule[schedule.kind.isin(["dx", "dWg", "dWu"])].start.min() >= d_a_end
        work = sum(2 * k.block_m * k.block_n * k.reduce_length * k.tiles * (2 if k.launch == 2 else 1)
                   for k in plan) / 1e6
        assert abs((schedule.end - schedule.start).sum() - work) < 1e-6 * work
    # the longest tiles first leave the shorter tail at 512 tokens
    spans = {first: kernels.chained_schedule(T, H, I, dataclasses.replace(tiles, grad_x_first=first)).end.max()
             for first in (False, True)}
    assert spans[True] < spans[False]
    # the dWd tiles last: the same work, after launch 2's tiles in the tickets; a shorter tail at 1321 tokens
    last = kernels.chained_schedule(1321, H, I, CHAINED_TILES[1153], grad_down_last=True)
    before = kernels.chained_schedule(1321, H, I, CHAINED_TILES[1153])
    assert abs((last.end - last.start).sum() - (before.end - before.start).sum()) < 1e-6 * last.end.sum()
    assert last[last.kind == "dWd"].start.min() >= last[last.kind.isin(["dx", "dWg", "dWu"])].start.min()
    assert last.end.max() < before.end.max()


def test_gluon_launch_schedule_places_every_tile_and_the_long_ones_first_shorten_the_tail():
    """The model of a Gluon launch's program order: every tile placed once, one at a time per SM, the work that of
    its products (launch 2's twice with the lo halves); with the long tiles first they start at 0 and, at 512 tokens
    on 64-row tiles, the launch ends sooner, in both launches."""
    T, H, I = 512, 2048, 768
    launch1, launch2 = FORMS["tall"].first, FORMS["tall"].second  # the faithful path's form at 257-512 tokens
    spans = {}
    for form, flag, long_kind in ((launch1, "d_a_first", "dA"), (launch2, "grad_x_first", "dx")):
        for first in (False, True):
            schedule = kernels.gluon_launch_schedule(T, H, I, dataclasses.replace(form, **{flag: first}))
            for _, rows in schedule.sort_values("start").groupby("sm"):
                assert (rows.start.to_numpy()[1:] >= rows.end.to_numpy()[:-1] - 1e-9).all()
            if form is launch1:
                tiles = {"dWd": (cdiv(H, 64) * cdiv(I, 128), 64 * 128 * T), "dA": (cdiv(T, 64) * cdiv(I, 128),
                                                                                   64 * 128 * H)}  # fmt: skip
            else:
                weight = (cdiv(I, 64) * cdiv(H, 256), 64 * 256 * T * 2)
                tiles = {"dWg": weight, "dWu": weight, "dx": (cdiv(T, 64) * cdiv(H, 256), 64 * 256 * 2 * I * 2)}
            assert schedule.kind.value_counts().to_dict() == {kind: n for kind, (n, _) in tiles.items()}
            work = sum(2 * n * multiply_adds for n, multiply_adds in tiles.values()) / 1e6
            assert abs((schedule.end - schedule.start).sum() - work) < 1e-6 * work
            assert (schedule[schedule.kind == long_kind].start.min() == 0) == first
            spans[long_kind, first] = schedule.end.max()
        assert spans[long_kind, True] < 0.85 * spans[long_kind, False], long_kind


def test_gluon_forms_table_follows_the_bands():
    table = kernels.gluon_forms_table([64, 128, 129, 1099, 1100, 1400, 2300, 3300, 8192], 2048, 768)
    assert list(table.index) == [128, 129, 1099, 1100, 1400, 2300, 3300, 8192]  # the few-token launch's left out
    assert table.loc[129].to_dict() == {"form": "narrow", "launch 1 rows": 64, "launch 1 ring": 8,
                                        "dA tiles first": True, "launch 2 rows": 64, "launch 2 ring": 6,
                                        "dx tiles first": True, "launch 2 early": True, "saved tiles early": True,
                                        "dWd in launch 2": True, "dx splits": 2}  # fmt: skip
    assert table["form"].tolist() == ["narrow", "narrow", "tall_dx_first", "wide_da_first", "wide_da_first_tall",
                                      "wide", "wide_tall", "wide"]  # fmt: skip
    fast = kernels.gluon_forms_table([64, 128, 3300, 8192], 2048, 768, precision="fast")
    assert list(fast.index) == [128] and fast.loc[128, "dWd in launch 2"]  # cuBLAS's GEMMs at 3300 and 8192
    assert table.loc[1100, "launch 1 rows"] == 128 and table.loc[1100, "dA tiles first"]
    assert table.loc[1100, "dx tiles first"] and not table.loc[1400, "dx tiles first"]
    assert table.loc[3300, "launch 2 rows"] == 64 and table.loc[8192, "launch 2 rows"] == 128
    assert not table.loc[8192, ["dA tiles first", "dx tiles first"]].any()
    assert table["saved tiles early"].all()
    assert table.loc[128, "dx splits"] == 4 and (table.loc[[1099, 1100, 8192], "dx splits"] == 1).all()


def test_gluon_forms_file_holds_the_measured_gains():
    """The committed tuning runs behind GLUON_FORMS: what notes/p1/design-15.md says of them."""
    times = kernels.p1_tune_runs_times(kernels.GLUON_FORMS_FILE, labels=kernels.GLUON_FORM_LABELS)
    assert list(times.columns) == list(kernels.GLUON_FORM_LABELS.values())
    long_first, wide = times["both at 64 rows, long tiles first"], times["128 rows"]
    assert long_first[512] < 0.8 * wide[512] and long_first[1087] < 0.85 * wide[1087]
    assert wide[8192] < times["launch 2 at 64 rows"][8192]  # the 128-row tiles from 4600 tokens
    figure = kernels.speedup_figure(times, "128 rows", "test")
    assert len(figure.axes[0].lines) == len(times.columns)  # four lines and the dotted 1
    plt.close(figure)


def test_programmatic_launch_gains_pair_each_form_with_its_pdl_candidate():
    """The committed PDL runs: every form measured both ways, and launch 2 by programmatic dependent launch faster
    in each band's form where it is the default (what notes/index.md says, design 16: 0.6-1.2 µs by
    graph replay), and in most of the other cases."""
    gains = kernels.programmatic_launch_gains()
    bands = {"gluon12_m64_lf": [129, 256, 512, 1087], "gluon12_l2m64_lf": [1150, 1200, 1321],
             "gluon12_l2m64_daf": [1571], "gluon12_b6": [2447, 8192], "gluon12_b6_l2m64b6": [4093]}  # fmt: skip
    assert set(gains.columns) == set(bands)
    in_bands = pd.concat([gains.loc[tokens, form] for form, tokens in bands.items()])
    assert len(in_bands) == 11 and in_bands.between(0.55, 1.25).all()
    assert (gains.stack().dropna() > 0).mean() > 0.9


def test_saved_tiles_early_gains_pair_each_form_with_its_early_candidate():
    """The committed runs of launch 1's saved tiles asked for early: every default form measured both ways, faster in
    most pairs and never more than 0.5 µs slower (what notes/index.md says, design 17: 0.1-1.3 µs in 14
    of 17 pairs, ties within ±0.3 in the rest)."""
    gains = kernels.saved_tiles_early_gains()
    assert set(gains.columns) == {"gluon12_m64_lf_pdl_sif_graph", "gluon12_l2m64_lf_pdl_sif_graph",
                                  "gluon12_b6_pdl_sif_graph", "gluon12_b6_l2m64b6_pdl_sif_graph"}  # fmt: skip
    values = gains.stack().dropna()
    assert len(values) >= 17 and (values > 0).mean() > 0.7 and values.min() > -0.5 and values.max() < 1.5


def test_split_tiles_slower_than_the_unsplit_form():
    """The committed split runs: every split candidate at least as slow as the unsplit 64-row form at every count but
    one tie at 128 tokens (notes/p1/design-17.md)."""
    slowdown = kernels.split_tiles_slowdown()
    assert len(slowdown.columns) == 14 and set(slowdown.index) == {65, 128, 256, 512, 768, 1087}
    values = slowdown.stack().dropna()
    assert (values > 0.995).all() and (values > 1.02).mean() > 0.9


def test_phase2_tile_table_reads_the_committed_runs():
    table, floor = kernels.p1_phase2_tile_times()
    before, now, cublas = kernels.PHASE2_TILES_BEFORE, kernels.PHASE2_TILES_NOW, kernels.PHASE2_TILES_CUBLAS
    assert list(table.columns[:3]) == [before, now, cublas]
    assert 3 < floor < 6
    for precision in ("faithful", "fast"):
        part = table.loc[precision]
        # what notes/p1/design-12.md says: the 64 × 256 tiles ahead at 4–32 tokens on both paths, within 1.5 µs above
        assert (part.loc[[4, 8, 16, 32], now] < part.loc[[4, 8, 16, 32], before]).all()
        both = part[[before, now]].loc[48:]
        assert (both.diff(axis=1).iloc[:, 1].abs() < 1.5).all()
    # cuBLAS measured on the fast path only, from 33 tokens: behind the one block at 48, ahead from 96
    measured = table[cublas].dropna()
    assert set(measured.index.get_level_values("precision")) == {"fast"}
    assert min(measured.index.get_level_values("num_tokens")) > 32
    fast = table.loc["fast"]
    assert fast.loc[48, now] < fast.loc[48, cublas]
    assert (fast.loc[[96, 128], cublas] < fast.loc[[96, 128], now]).all()
    figure = kernels.few_tokens_figure(table, floor, chosen=now, before=before, xscale="linear",
                                       ticks=[2, 16, 32, 64, 128])
    assert len(figure.axes) == 2
    plt.close(figure)


def test_host_gap_runs_of_launch2_in_gluon_step_by_step():
    table = kernels.p1_host_gap_runs(labels={1: "jit", 5: "encoded"})
    assert list(table.columns) == ["jit", 2, 3, 4, "encoded"]  # the runs in their order, unlabelled ones by number
    # what notes/p1/design-13.md says: 204-351 µs over graph replay through the JIT, 0-2 µs encoded before launch 1
    assert table["jit"].dropna().between(200, 360).all() and table["encoded"].dropna().abs().max() < 2.5
    assert table.index.is_monotonic_increasing
    figure = kernels.host_gap_steps_figure(table.dropna(thresh=3), "test")
    assert len(figure.axes[0].lines) == len(table.dropna(thresh=3)) + 1  # one per token count and the zero line
    plt.close(figure)


def test_gluon_launch2_table_reads_the_committed_probe_runs():
    labels = {"triton launch 2 (default)": "Triton", "gluon m128n256k32b4": "Gluon", "cublas, two GEMMs": "cuBLAS"}
    table = kernels.p1_gluon_launch2_times(labels=labels)
    assert list(table.columns) == ["Triton", "Gluon", "cuBLAS"]
    assert list(table.index) == [2447, 4093, 8192]
    # what notes/p1/design-13.md says: the Gluon probe at the Triton launch's rate (-5% to +4%), cuBLAS taking 14-22%
    # less time than either
    assert ((table["Gluon"] / table["Triton"] - 1).abs() < 0.06).all()
    assert (table["cuBLAS"] < 0.87 * table[["Triton", "Gluon"]].min(axis=1)).all()
    assert table.loc[8192, "Triton"] == pytest.approx(310.3, abs=0.05)  # the median of the runs that measured it
    every = kernels.p1_gluon_launch2_times()
    assert "gluon pp_m64n256k64b3" in every.columns and every.shape[1] > table.shape[1]
    figure = kernels.launch2_figure(table, "test")
    assert len(figure.axes[0].patches) == table.size
    plt.close(figure)


def test_gluon_launch1_table_reads_the_committed_tune_runs():
    labels = {"gluon2": "launch 2 in Gluon", "gluon12": "both", "gluon12_a256": "both, 256-wide dA"}
    table = kernels.p1_tune_runs_times(labels=labels)
    assert list(table.columns) == list(labels.values())
    assert {1321, 1571, 2447, 4093, 8192} <= set(table.index)
    # what notes/p1/design-14.md says: launch 1 in Gluon 3-7% faster from 1571 tokens; 256-wide dA tiles faster from
    # 5000 tokens, slower at 1321-2447
    many = [1571, 2447, 4093, 8192]
    assert (table.loc[many, "both"] < 0.975 * table.loc[many, "launch 2 in Gluon"]).all()
    most = [5000, 6144, 7168, 8192]
    assert (table.loc[most, "both, 256-wide dA"] < table.loc[most, "both"]).all()
    assert (table.loc[[1321, 1571, 2447], "both, 256-wide dA"] > 1.04 * table.loc[[1321, 1571, 2447], "both"]).all()
    fast = kernels.p1_tune_runs_times(precision="fast", labels=labels)
    assert fast.loc[8192, "both"] < table.loc[8192, "both"]  # no lo halves: less tensor work
    figure = kernels.speedup_figure(table, "launch 2 in Gluon", "test", switch=4608)
    assert len(figure.axes[0].lines) == table.shape[1] - 1 + 2  # a line per other column, the 1 and the switch
    plt.close(figure)


def test_program_traces_show_the_dx_tiles_ending_the_call_until_split():
    """The committed program traces at 128 tokens (notes/p1/design-18.md): with dx unsplit its 16 tiles
    end the call ~9 µs after the weight-gradient tiles; split over 4 programs with the combine in 16-byte loads, they
    end with them, ≥ 3 µs sooner; design 17's combine spent the split's gain (its last split ran ≥ 6 µs past the
    others). One panel per call in the timeline."""
    traces = kernels.program_traces()
    assert {"commit", "config", "T", "launch", "program", "sm", "tiles", "start_us", "proceed_us", "end_us"} <= set(
        traces.columns)
    assert (traces.start_us <= traces.proceed_us + 1e-9).all() and (traces.proceed_us <= traces.end_us).all()
    at_128 = traces[traces["T"] == 128]

    def call(commit, config):
        return at_128[at_128.commit.str.startswith(commit) & (at_128.config == config)]

    unsplit, split = call("d06a8bf", "default"), call("8392274", "default")
    last_end = {name: rows.groupby("tiles").end_us.max() for name, rows in (("unsplit", unsplit), ("split", split))}
    assert last_end["unsplit"]["dx"] > last_end["unsplit"]["dWg, dWu"] + 5
    assert abs(last_end["split"]["dx"] - last_end["split"]["dWg, dWu"]) < 2
    assert last_end["split"]["dx"] < last_end["unsplit"]["dx"] - 3
    assert (split.tiles == "dx").sum() == 4 * (unsplit.tiles == "dx").sum()
    old_combine = call("d06a8bf", "gluon12_m64_da1_dx4")
    dx_ends = old_combine[old_combine.tiles == "dx"].end_us.sort_values()
    assert dx_ends.iloc[-1] - dx_ends.iloc[len(dx_ends) // 2] > 6
    summary = kernels.program_trace_summary(split)
    assert summary.programs.sum() == len(split) and summary.sm_busy.between(0, 1).all()
    fig = kernels.program_timeline_figure({"unsplit": unsplit, "split": split})
    assert len(fig.axes) == 2
    plt.close(fig)


def test_program_traces_show_the_persistent_weight_gradient_programs_ending_with_dx():
    """The committed traces at 512 tokens (notes/p1/design-19.md; notebook 04): with one program a weight-gradient tile
    those tiles end the call ~5 µs after dx's; taken in turn by 68 programs they end with dx's, ≥ 2 µs sooner."""
    traces = kernels.program_traces()
    at_512 = traces[(traces["T"] == 512) & (traces.config == "default")]
    before, after = (at_512[at_512.commit.str.startswith(commit)] for commit in ("8392274", "fc6a297"))
    ends = {name: rows.groupby("tiles").end_us.max() for name, rows in (("before", before), ("after", after))}
    assert ends["before"]["dWg, dWu"] > ends["before"]["dx"] + 4
    assert abs(ends["after"]["dWg, dWu"] - ends["after"]["dx"]) < 2
    assert ends["after"]["dWg, dWu"] < ends["before"]["dWg, dWu"] - 2
    assert (before.tiles == "dWg, dWu").sum() == 192 and (after.tiles == "dWg, dWu").sum() == 68


def test_fast_path_gluon_large_times_hold_the_second_band_of_gluon_fast_tokens():
    """What choose.MEASURED and notes/p1/design-19.md say: beyond 959 tokens the 2300-3299 band's
    Gluon form without the lo halves is ahead of the fast path's cuBLAS design at 2447 and 3089 tokens (by ≥ 0.5% and
    ≥ 5%) and behind at 1087-1571, 3300, 4093; the other bands' forms behind cuBLAS wherever they ran."""
    table = kernels.fast_path_gluon_large_times()
    band, cublas = table["Gluon, the 2300-3299 form"], table["cuBLAS"]
    assert band[2447] < 0.995 * cublas[2447] and band[3089] < 0.95 * cublas[3089]
    # (at 1100-3599 tokens, where the forms have not changed since: design 20 moved dWd's tiles at 513-1099 and
    # 3600-5199, and the fast path follows them there)
    assert all(band[T] > cublas[T] for T in (1087, 1321, 1571, 3300, 4093)) and all(
        on_gluon(T) == (band[T] < cublas[T]) for T in table.index if 2600 <= T < 3600 and T != 2767)
    # (at 1100-2599 the fast path takes forms of its own since: designs 21-22)
    for form in ("Gluon, the 1100-1399 form", "Gluon, the 1400-2299 form", "Gluon, the 3300-4599 form"):
        both = table[[form, "cuBLAS"]].dropna()
        assert (both[form] > both["cuBLAS"]).all(), form
    fig = kernels.launch2_figure(table, "test")
    assert len(fig.axes) == 1
    plt.close(fig)


def test_fast_path_gluon_times_hold_the_band_of_gluon_fast_tokens():
    """What choose.MEASURED and notes/p1/design-18.md say: the Gluon launches (dx unsplit) ahead of
    the fast path's cuBLAS design at 65-896 tokens where both ran, behind from 1024; dx in 4 no better than unsplit
    without the lo halves from 160 tokens."""
    table = kernels.fast_path_gluon_times()
    gluon, cublas = table["Gluon launches, dx unsplit"], table["cuBLAS"]
    both = table.dropna(subset=["Gluon launches, dx unsplit", "cuBLAS"]).index
    assert set(both) >= {65, 128, 640, 896, 1024, 1321}
    for T in both:  # the forms of then: ahead to 959 tokens (design 20's forms since lead to 1099)
        assert (gluon[T] < cublas[T]) == (T < 960), T
    assert (table.loc[[160, 192], "Gluon launches, dx in 4"] > gluon[[160, 192]]).all()
    fig = kernels.speedup_figure(table[["cuBLAS", "Gluon launches, dx unsplit"]], "cuBLAS", "test",
                                 switch=next(T for T in range(65, 4096) if not on_gluon(T)))  # fmt: skip
    assert len(fig.axes[0].lines) == 3
    plt.close(fig)


def test_design20_times_hold_its_forms():
    """What choose.MEASURED and notes/p1/design-20.md say: launch 1's 64-wide dA
    tiles ahead of the forms before at 65-256 tokens (by ≥ 2 µs to 128) and behind from 320, with 64-wide dWd tiles
    behind 128-wide ones; dWd's tiles in launch 2 ahead at 576-1099 and 3600-5000 tokens, behind at 1200, 3300 and
    6144, not ahead at 8192; the fast path on those forms ahead of its cuBLAS design at 960-1087 and 3600-4093, behind
    from 1200 and at 4500-5000; and the forms chosen follow."""
    table = kernels.design20_times("faithful")
    before = table["forms before"]
    narrow = table[["dA 64 wide, dx in 4", "dA 64 wide, dx in 2"]].min(axis=1)
    assert all(table["dA 64 wide, dx in 4"][T] < before[T] - 2 for T in (65, 96, 128))
    assert all(table["dA 64 wide, dx in 2"][T] < before[T] - 1 for T in (160, 192, 224, 256))
    assert all(narrow[T] > before[T] for T in (320, 384, 512))
    both = table[["dA and dWd 64 wide, dx in 4", "dA 64 wide, dx in 4"]].dropna()
    assert (both.iloc[:, 0] > both.iloc[:, 1]).all()
    moved, wide = table["dWd in launch 2, 64-row launch 2"], table["dWd in launch 2, 128-row launch 2, dA 256 wide"]
    assert all(moved[T] < before[T] for T in (576, 640, 768, 896, 1024, 1087, 1099)) and moved[1200] > before[1200]
    assert all(wide[T] < 0.98 * before[T] for T in (3600, 4093, 4500, 5000))
    assert all(wide[T] > before[T] for T in (3300, 6144)) and wide[8192] > 0.995 * before[8192]

    def form(T):
        return chosen(T, "faithful")

    assert all(form(T).first.d_a_block_n == 64 for T in (65, 128, 192, 256))
    assert all(form(T).first.d_a_block_n == 128 for T in (320, 384, 512))
    assert all(form(T).second.grad_down_tiles for T in (576, 1087, 1099, 3600, 4093, 5000))
    assert not any(form(T).second.grad_down_tiles for T in (512, 1200, 3300, 6144, 8192))
    fast = kernels.design20_times("fast")
    gluon = fast[["dA 64 wide", "dWd in launch 2, 64-row launch 2", "dWd in launch 2, 128-row launch 2, dA 256 wide"]]
    gluon = gluon.min(axis=1)
    assert all(gluon[T] < fast["forms before"][T] for T in (65, 128, 192))
    assert all(gluon[T] < fast["cuBLAS"][T] for T in (960, 1024, 1087, 3600, 4093))
    assert all(gluon[T] > fast["cuBLAS"][T] for T in (1200, 1321, 4500, 5000))
    assert all(on_gluon(T) for T in (960, 1024, 1087, 3600, 4093))
    assert not any(on_gluon(T) for T in (4500, 5000))  # 1200, 1321: forms of their own since (designs 21-22)
    fig = kernels.launch2_figure(table.loc[[65, 128, 256], ["forms before", "dA 64 wide, dx in 4"]], "test")
    assert len(fig.axes) == 1
    plt.close(fig)


def test_gluon_launch_schedule_places_grad_down_tiles_where_launch_2_takes_them():
    """With dWd's tiles in launch 2 the model of a launch puts them first (or after dWg's and dWu's), in their own
    width, and launch 1 has none; the work is the same products either way."""
    T, H, I = 8192, 2048, 768
    moved = grad_down_in_second_launch(FORMS["wide_da256"])  # the 3600-5199 band's form
    for name, config, width, after in (("dWd 256 wide", moved, 256, False),
                                       ("dWd 128 wide", with_second(moved, grad_down_block_n=128), 128, False),
                                       ("dWd after dWg, dWu", with_second(moved, grad_down_after_weight_grad=True), 256,
                                        True)):  # fmt: skip
        launch1 = kernels.gluon_launch_schedule(T, H, I, config.first)
        launch2 = kernels.gluon_launch_schedule(T, H, I, config.second)
        assert set(launch1.kind) == {"dA"}
        kinds = list(dict.fromkeys(launch2.kind))  # in program-id order
        assert kinds == (["dWg", "dWu", "dWd", "dx"] if after else ["dWd", "dWg", "dWu", "dx"]), name
        assert (launch2.kind == "dWd").sum() == cdiv(H, 128) * cdiv(I, width), name
        grad_down_work = ((launch2.end - launch2.start)[launch2.kind == "dWd"]).sum()
        assert abs(grad_down_work - 2 * H * I * T / 1e6) < 1e-6 * grad_down_work, name


def test_design21_times_hold_the_fast_paths_own_forms():
    """What choose.MEASURED and notes/p1/design-21.md say: on the fast path each
    band's own form is ahead of the cuBLAS design (and at 2300-2599 of the faithful path's form) wherever the runs
    measured it inside the band, cuBLAS ahead at 1100-1200 tokens of the forms measured there then; the faithful path's
    1500 form (the 1400 band's with dWd's tiles in launch 2) ahead of the forms before at 1571-2200; the labelled
    candidates are the forms the paths take."""
    table = kernels.design21_times("fast")
    own = {range(1250, 1408): ("2300 form, dWd in launch 2, dA 64 wide", "wide_narrow_da"),
           range(1408, 1500): ("1400 form, dWd in launch 2", "wide_da_first_tall"),
           range(1500, 2300): ("2300 form, dWd in launch 2", "wide"),
           range(2300, 2600): ("3600 form", "wide_da256")}  # the candidates' labels, the forms of FORMS  # fmt: skip
    measured = 0
    for band, (label, form) in own.items():
        assert kernels.gluon_form_of(chosen(band.start, "fast")) == (form, True, 1)
        assert kernels.gluon_form_of(chosen(band.stop - 1, "fast")) == (form, True, 1)
        for T in (T for T in table.index if T in band):
            others = table.loc[T].drop(label).dropna()
            assert on_gluon(T) and (table.loc[T, label] < others).all(), T
            measured += 1
    assert measured >= 9
    for T in (1100, 1200):  # where design 21 did not measure the 64-wide dA tiles (design 22 did: they lead there)
        assert table.loc[T, "cuBLAS"] == table.loc[T].min(), T
        assert pd.isna(table.loc[T, "2300 form, dWd in launch 2, dA 64 wide"]), T
    assert table.loc[1321, "2300 form, dWd in launch 2, dA 64 wide"] < 0.95 * table.loc[1321, "cuBLAS"]
    assert table.loc[1571, "2300 form, dWd in launch 2"] < 0.96 * table.loc[1571, "cuBLAS"]
    # beyond 1407 tokens the 64-wide dA tiles come in two waves
    wide, narrow = table["1400 form, dWd in launch 2"], table["2300 form, dWd in launch 2, dA 64 wide"]
    assert narrow[1450] > 1.05 * wide[1450]
    faithful = kernels.design21_times("faithful")
    assert kernels.gluon_form_of(chosen(1500, "faithful")) == ("wide_da_first_tall", True, 1)  # "1400 form, dWd in 2"
    moved, before = faithful["1400 form, dWd in launch 2"], faithful["forms before"]
    assert all(moved[T] < before[T] for T in (1571, 1700, 1800, 2047, 2200))
    assert all(moved[T] < 0.95 * before[T] for T in (1800, 2047))
    assert all(moved[T] > before[T] for T in (1087, 1200, 1321))  # not below 1500, where the 1100 band's form runs


def test_design22_times_hold_the_forms_to_512_tokens():
    """What choose.MEASURED and notes/p1/design-22.md say: on the fast path at 65-512
    tokens the form each band takes is within 0.2 µs of the fastest measured and ahead of the forms before at 96-448;
    the 64-wide dA form ahead of cuBLAS at 1100-1249; on the faithful path dWd's tiles in launch 2 ahead at 160-256 (dx
    in 2) and a tie at 65-128 (dx in 4, not taken); the labelled candidates are the forms the paths take."""
    fast = kernels.design22_times("fast")
    bands = {range(65, 129): ("gluon12_m64_early_dx4_wp68_ibw_n64_dwd2", ("narrow", True, 4)),
             range(129, 193): ("gluon12_m64_early_dx2_wp68_ibw_n64_dwd2", ("narrow", True, 2)),
             range(193, 385): ("gluon12_m64_early_dx1_wp68_ibw_n64_dwd2", ("narrow", True, 1)),
             range(385, 513): ("gluon12_m64_early_dx1_wp68_ibw_dwd2", ("tall", True, 1))}  # fmt: skip
    before = fast[["dA 64 wide (before, to 256)", "257 form (before, 257-512)"]].min(axis=1)
    measured = 0
    for band, (candidate, form) in bands.items():
        assert kernels.gluon_form_of(chosen(band.start, "fast")) == form
        assert kernels.gluon_form_of(chosen(band.stop - 1, "fast")) == form
        label = kernels.DESIGN22_LABELS["fast"][candidate]
        for T in (T for T in fast.index if T in band):
            assert fast.loc[T, label] <= fast.loc[T].min() + 0.2, T
            if 96 <= T <= 448:
                assert fast.loc[T, label] < before[T] - 0.2, T
            measured += 1
    assert measured >= 14
    narrow = fast["2300 form, dWd in launch 2, dA 64 wide"]
    assert all(narrow[T] < fast.loc[T, "cuBLAS"] for T in (1100, 1150, 1200, 1249))
    faithful = kernels.design22_times("faithful")
    moved, kept = faithful["dx in 2, dWd in launch 2"], faithful["dx in 2 (before)"]
    assert all(moved[T] < kept[T] for T in (160, 192, 224, 256)) and moved[256] < kept[256] - 1
    assert all(abs(faithful.loc[T, "dx in 4, dWd in launch 2"] - faithful.loc[T, "dx in 4 (before)"]) < 0.5
               for T in (65, 96, 128))  # fmt: skip
    assert kernels.gluon_form_of(chosen(160, "faithful")) == ("narrow", True, 2)  # "dx in 2, dWd in launch 2"
    assert kernels.gluon_form_of(chosen(128, "faithful")) == ("narrow", False, 4)  # "dx in 4 (before)"


def test_runs_side_by_side_hold_the_graph_counters_gain():
    """What notes/p1/design-23.md and the README say of the committed runs before and after a captured graph kept an
    eager call's counters: both paths 0.8-1.6 µs faster at 1-128 tokens (torch.compile's changes, the same code in
    both runs, are the runs' spread), one token 14.7 µs on both."""
    table = kernels.runs_side_by_side(*kernels.GRAPH_COUNTERS_RUNS)
    assert list(table.index) == [1, 2, 4, 8, 16, 128]
    for impl in ("triton", "triton_fast"):
        assert table[(impl, "Δ")].between(-1.7, -0.7).all(), table[impl]
        assert (table[(impl, "after")] - table[(impl, "before")] - table[(impl, "Δ")]).abs().max() < 1e-9
    assert round(table.loc[1, ("triton", "after")], 1) == round(table.loc[1, ("triton_fast", "after")], 1) == 14.7
    assert table[("torch_compile", "Δ")].abs().max() < 2


def test_pingpong_epilogue_table_says_what_notes_design_24_says():
    """The pingpong traces at 2447 tokens: the main loop ends at 14-18 µs in every form, the epilogue takes ≈ 26.6 µs
    with 4-byte loads, ≈ 31 with 16-byte loads and ≈ 18 with the saved tiles through the ring, stores one after the
    other or all at once."""
    table = kernels.pingpong_epilogue_table(2447)
    assert list(table.index) == ["gluon_pingpong_from2300_b6_f2", "gluon_pingpong_from2300_wide",
                                 "gluon_pingpong_from2300_ring6", "gluon_pingpong_from2300_ring6s"]
    assert table["main_loop_end_us"].between(14, 18).all()
    epilogue = table["epilogue_us"]
    assert epilogue["gluon_pingpong_from2300_b6_f2"] == pytest.approx(26.6, abs=0.5)
    assert epilogue["gluon_pingpong_from2300_wide"] == pytest.approx(31, abs=0.5)
    assert epilogue[["gluon_pingpong_from2300_ring6", "gluon_pingpong_from2300_ring6s"]].between(17.5, 18.7).all()
    assert (table["launch_end_us"] == table["main_loop_end_us"] + epilogue).all()


def test_halves_from_two_designs_say_what_notes_design_25_says():
    """The fast path's first half on cuBLAS and its second on the Gluon launch 2: slower than the default at every size
    measured (2767 tokens 97.0 against 94.8 µs, 8192 241.8 against 235.1); "default" kept only for a named run."""
    table = kernels.p1_tune_runs_times(kernels.HALVES_FILE, "fast", kernels.HALVES_LABELS, runs=(1,))
    assert list(table.columns) == list(kernels.HALVES_LABELS.values())
    assert list(table.index) == [1321, 2047, 2767, 3089, 4093, 8192]
    default, cublas, halves, halves_dwd = (table[label] for label in kernels.HALVES_LABELS.values())
    assert (halves > default).all() and (halves_dwd > default).all()
    assert (table.loc[2767] - [94.8, 95.2, 97.0, 97.2]).abs().max() < 0.05
    assert (table.loc[8192] - [235.1, 235.3, 241.8, 247.0]).abs().max() < 0.05
    assert "default" not in kernels.p1_tune_runs_times(kernels.HALVES_FILE, "fast").columns
