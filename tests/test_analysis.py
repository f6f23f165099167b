"""moe_lib.analysis: the committed results as tables, the roofline arithmetic by hand, the kernels' grids."""

import dataclasses
import json
import math
import shutil

import matplotlib
import pandas as pd
import pytest

from moe_lib import analysis, peers, problems, roofline

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

P1, P2, P2_BF16 = problems.PROBLEM_NAMES
H200_RESULTS = problems.DATA_DIR / "results" / "H200"


@pytest.fixture(scope="module")
def results():
    return analysis.load_results()


@pytest.fixture(scope="module")
def p1(results):
    return analysis.find(results, P1)


# ---------------------------------------------------------------- loading


def test_committed_h200_results_load(results, p1):
    assert [r.problem for r in results.values()] == [P1, P2, P2_BF16]
    assert all(r.gpu_key == "H200" and r.provenance["gpu_name"] == "NVIDIA H200" for r in results.values())
    frame = p1.frame
    assert len(frame) == 16 * 4 and frame.groupby(["impl", "num_tokens"]).size().eq(1).all()
    assert p1.tokens == sorted(problems.load(P1).suite)
    assert p1.impls == ["reference", "torch_eager", "torch_compile", "triton"]
    assert set(frame["passes_element_rule"]) == {True}
    assert set(analysis.find(results, P2_BF16).frame["passes_element_rule"]) == {None}  # no rule for bf16
    assert p1.measured_spec.dram_bandwidth == p1.provenance["ceilings"]["copy_bandwidth"]
    assert p1.datasheet_spec is roofline.GPUS["H200"]


def test_results_paths_and_missing_folders(tmp_path, results):
    relative = analysis.load_results("data/results", "H200")
    assert [r.csv for r in relative.values()] == [r.csv for r in results.values()]
    with pytest.raises(FileNotFoundError, match=r"no results folder .*B200.*H200"):
        analysis.load_results("data/results", "B200")


def test_newest_file_of_each_kind_and_other_files_left_out(tmp_path):
    folder = tmp_path / "H200"
    folder.mkdir()
    source = H200_RESULTS / "2026-11-29-swiglu_down_backward-bfloat16"
    for date in ("2026-11-28", "2026-11-29"):
        for suffix in (".csv", ".json"):
            shutil.copy(source.with_suffix(suffix), folder / f"{date}-swiglu_down_backward-bfloat16{suffix}")
    shutil.copy(H200_RESULTS / "2026-11-29-moe_experts_backward-float32.csv", folder / "2026-11-30-lonely.csv")
    (folder / "2026-11-30-other_benchmark-float32.csv").write_text("problem,total_ms\nother_benchmark,1.0\n")
    (folder / "2026-11-30-other_benchmark-float32.json").write_text(json.dumps({"problem": "other_benchmark"}))
    loaded = analysis.load_results(tmp_path, "H200")
    assert list(loaded) == ["swiglu_down_backward-bfloat16"]
    assert loaded["swiglu_down_backward-bfloat16"].date == "2026-11-29"


# ---------------------------------------------------------------- tables


def test_times_best_peer_and_speedups(p1):
    times = analysis.times_table(p1)
    rows = p1.frame.set_index(["impl", "num_tokens"])["median_ms"]
    assert list(times.index) == p1.tokens
    assert times.loc[128, "triton"] == rows[("triton", 128)]
    for t in p1.tokens:
        assert times.loc[t, "T_sol (H200 datasheet)"] == pytest.approx(roofline.sol_time(P1, t, "H200") * 1e3)
    best = analysis.best_peer(p1)
    speedups = analysis.speedup_table(p1)
    for t in p1.tokens:
        peer_times = {impl: rows[(impl, t)] for impl in peers.BASELINE_LABELS if (impl, t) in rows.index}
        assert best.loc[t, "impl"] == min(peer_times, key=peer_times.get)
        assert speedups.loc[t, "triton"] == pytest.approx(min(peer_times.values()) / rows[("triton", t)])
    fractions = analysis.roofline_fraction_table(p1)
    assert fractions.loc[8192, "triton"] == pytest.approx(times.loc[8192, "T_sol (measured)"]
                                                          / times.loc[8192, "triton"])  # fmt: skip


def test_scores_recomputed_equal_the_files(results):
    for result in results.values():
        table = analysis.impl_summary(result)
        recorded = result.meta["summary"]
        assert table.attrs["baseline"] == result.meta["baseline"]["impl"]
        for impl, row in table.iterrows():
            assert row["geomean_ms"] == pytest.approx(recorded[impl]["geomean_ms"], rel=1e-12), impl
            assert row["sol_score"] == pytest.approx(recorded[impl]["sol_score"], rel=1e-9), impl
            assert row["all_correct"] == recorded[impl]["all_correct"]
        t_k, t_b, t_sol = table.loc["triton", "geomean_ms"], table.attrs["baseline_ms"], table.attrs["sol_geomean_ms"]
        assert table.loc["triton", "sol_score"] == pytest.approx(1 / (1 + (t_k - t_sol) / (t_b - t_sol)))


def test_correctness_flags_peers_that_fail_the_element_rule(results):
    table = analysis.correctness_table(analysis.find(results, P2))
    flagged = table[table["flag"] != ""]
    assert set(flagged.index.get_level_values("impl")) == {"grouped_mm", "liger"}
    assert all(flag == "fails the element rule (peer)" for flag in flagged["flag"])
    pivot = analysis.correctness_pivot(analysis.find(results, P2_BF16))
    assert not any(c.endswith("elements passing") for c in pivot.columns)  # no element rule for bf16


def _with_times(result, impl, scale):
    frame = result.frame.copy()
    mine = frame["impl"] == impl
    frame.loc[mine, "median_ms"] = frame.loc[mine, "median_ms"] * scale
    return dataclasses.replace(result, frame=frame)


def test_targets_on_the_committed_files(results, p1):
    targets = analysis.targets_table(results).set_index(["problem", "target"])
    geomean_us = p1.meta["summary"]["triton"]["geomean_ms"] * 1e3
    assert targets.loc[("P1", "geomean ≤ 30 µs"), "value"] == pytest.approx(geomean_us)
    assert targets.loc[("P1", "geomean ≤ 30 µs"), "met"] == (geomean_us <= 30)
    p2 = analysis.find(results, P2)
    worst = max(p2.frame.query("impl == 'triton'").set_index("num_tokens")["median_ms"][t]
                / analysis.p2_fp32_floor_ms(p2, t) for t in p2.tokens)  # fmt: skip
    row = targets.loc[("P2 fp32", "every case ≤ 1.25× its floor")]
    assert row["value"] == pytest.approx(worst)
    assert row["met"] is (False if worst > 1.25 else None)  # 2 of 16 suite cases: never settled as met
    bf16 = analysis.find(results, P2_BF16).frame.query("impl == 'triton'").set_index("num_tokens")
    rate = bf16.loc[32768, "flops"] / (bf16.loc[32768, "median_ms"] * 1e-3) / 1e12
    assert rate == pytest.approx(16 * 32768 * 8 * 4096 * 2048 / (bf16.loc[32768, "median_ms"] * 1e-3) / 1e12)
    assert targets.loc[("P2 bf16", "T = 32768 at ≥ 600 TFLOP/s (16·T·K·H·I)"), "value"] == pytest.approx(rate)


def test_p2_fp32_floor_counts_the_precision_flops(results):
    p2 = analysis.find(results, P2)
    spec = p2.measured_spec
    t = 8192
    precision = 28 * t * 8 * 4096 * 2048 / spec.bf16_dense_flops * 1e3
    traffic = roofline.minimal_bytes(P2, t) / spec.dram_bandwidth * 1e3
    assert analysis.p2_fp32_floor_ms(p2, t) == pytest.approx(max(precision, traffic))
    assert precision > traffic  # at 8192 tokens the precision's tensor work is the floor


def test_targets_met_and_unsettled_when_the_numbers_say_so(results, p1):
    fast = dict(results, **{p1.key: _with_times(p1, "triton", 1e-3)})  # a thousand times faster
    targets = analysis.targets_table(fast).set_index(["problem", "target"])["met"]
    assert targets[("P1", "geomean ≤ 30 µs")] is True
    assert targets[("P1", "no case slower than torch.compile")] is True
    partial = dataclasses.replace(p1, frame=p1.frame[p1.frame["num_tokens"] <= 16])  # 5 of the 16 cases
    targets = analysis.targets_table({p1.key: _with_times(partial, "triton", 1e-3)}).set_index(["problem", "target"])
    assert targets.loc[("P1", "geomean ≤ 30 µs"), "met"] is None  # a geomean over part of the suite settles nothing
    assert targets.loc[("P2 bf16", "T = 2048 in ≤ 7.5 ms"), "ours"] == "not measured"


# ---------------------------------------------------------------- roofline


def test_ridge_point_and_p1_crossing_by_hand():
    h200 = roofline.GPUS["H200"]
    ridge = 989e12 / 4.8e12
    assert analysis.ridge_point("H200") == pytest.approx(ridge)
    H, I = 2048, 768
    a, b, c = 12 * H * I, 2 * (3 * H + 5 * I), 2 * 6 * I * H  # FLOPs per token, bytes per token, fixed bytes
    assert analysis.cost_coefficients(P1) == (a, b, c)
    crossing = ridge * c / (a - ridge * b)
    assert analysis.ridge_crossing(P1, "H200") == pytest.approx(crossing)
    assert 263 < crossing < 264
    assert roofline.sol_time(P1, 263, h200) == pytest.approx(roofline.cost(P1, 263)[1] / h200.dram_bandwidth)
    assert roofline.sol_time(P1, 264, h200) == pytest.approx(roofline.cost(P1, 264)[0] / h200.bf16_dense_flops)
    slow_compute = roofline.GPUSpec.from_measured(copy_bandwidth=1e12, bf16_rate=1e15)  # ridge 1000 > a / b
    assert analysis.ridge_crossing(P1, slow_compute) == math.inf
    table = analysis.crossing_table({"H200": "H200"}, [P1])
    assert table.loc[(P1, "H200"), "first_compute_bound"] == 264
    assert table.loc[(P1, "H200"), "intensity_limit"] == pytest.approx(a / b)


def test_cost_table_agrees_with_sol_time():
    for name in problems.PROBLEM_NAMES:
        table = analysis.cost_table(name, "H100-SXM")
        assert list(table.index) == sorted(problems.load(name).suite)
        for t, row in table.iterrows():
            assert row["t_sol_us"] == pytest.approx(roofline.sol_time(name, t, "H100-SXM") * 1e6)
            assert row["bound"] == ("compute" if t >= analysis.ridge_crossing(name, "H100-SXM") else "memory")


def test_measured_points_and_their_projection(results):
    points = analysis.measured_points(results)
    ok = sum(int((r.frame["status"] == "ok").sum()) for r in results.values())
    assert len(points) == ok
    assert (points["flop_rate"] == points["flops"] / (points["median_ms"] * 1e-3)).all()
    projected = analysis.project_points(points, "H100-SXM")
    ridge_h200 = analysis.ridge_point("H200")
    memory = projected[projected["intensity"] < ridge_h200]  # memory-bound on both (the H100's ridge is higher)
    assert len(memory) and memory["scale"].to_numpy() == pytest.approx(3.35 / 4.8)
    compute = projected[projected["intensity"] > analysis.ridge_point("H100-SXM")]
    assert len(compute) and compute["scale"].to_numpy() == pytest.approx(1.0)  # same tensor rate
    between = projected[(projected["intensity"] > ridge_h200) & (projected["intensity"] < 295)]
    for _, row in between.iterrows():  # compute-bound on the H200, memory-bound on the H100: ratio of the roofs
        assert row["scale"] == pytest.approx(row["intensity"] * 3.35e12 / 989e12)
    same = analysis.project_points(points, "H200")
    assert (same["scale"] == 1).all() and not same["projected"].any()
    b200 = analysis.project_points(points, "B200")
    compute = b200[b200["intensity"] > analysis.ridge_point("B200")]
    assert compute["scale"].to_numpy() == pytest.approx(1.81e15 / 989e12)
    unknown = analysis.project_points(points.assign(gpu="cpu"), "H200")
    assert unknown["scale"].isna().all()


# ---------------------------------------------------------------- kernels


def test_split_ranges_cover_the_reduction_in_aligned_pieces():
    assert analysis.split_ranges(32, 4, 16) == [(0, 16), (16, 32), (32, 32), (32, 32)]
    assert analysis.split_ranges(2048, 8, 128) == [(256 * s, 256 * (s + 1)) for s in range(8)]
    for length, split, block in ((1536, 4, 64), (100, 4, 16), (5, 2, 16)):
        ranges = analysis.split_ranges(length, split, block)
        assert ranges[0][0] == 0 and ranges[-1][1] == length
        assert all(a == b_prev for (_, b_prev), (a, _) in zip(ranges[:-1], ranges[1:], strict=True))
        assert all(a % block == 0 for a, _ in ranges if a < length)
    assert [analysis.rows_read(a, b, 16) for a, b in analysis.split_ranges(32, 4, 16)] == ["Wg", "Wu", "empty", "empty"]
    assert analysis.rows_read(8, 24, 16) == "Wg and Wu"


def test_p1_launch_plan_by_hand():
    T, H, I = 128, 2048, 768
    config = analysis.p1_config(T, H, I, interpreter=False)
    assert config == analysis.p1_config(T, H, I, interpreter=False)  # the environment is restored
    plan = analysis.p1_launch_plan(T, H, I, config).set_index("kind")
    bm, bn, _, split = config.d_intermediate
    assert plan.loc["dA", "programs"] == -(-T // bm) * -(-I // bn) * split
    bm, bn, _, split = config.grad_down
    assert plan.loc["dWd", "programs"] == -(-H // bm) * -(-I // bn) * split
    assert plan.loc["dA", "first_program"] == plan.loc["dWd", "programs"]  # weight gradients first
    assert plan.loc["dx", "first_program"] == 2 * plan.loc["dWg", "programs"]
    tiny = analysis.p1_config(5, 32, 16, interpreter=True)
    assert tiny.d_intermediate[:3] == (16, 16, 16)
    grid = analysis.p1_grid_table([1, 8192], H, I)
    assert list(grid.index) == [1, 8192] and {"launch 1 programs", "launch 2 programs"} <= set(grid.columns)


def _weight_grad_programs(E, size_m, size_n, tile, n_tiles_per_program):
    """Kernel W's programs for one launch: E × M-tiles × groups of n N-tiles, n = min(n_tiles_per_program, N-tiles)."""
    n_tiles = -(-size_n // tile[1])
    return E * -(-size_m // tile[0]) * -(-n_tiles // min(n_tiles_per_program, n_tiles))


def test_p2_launch_plan_by_hand():
    config = analysis.p2_config(2048, 256, 8, input_bytes=4, interpreter=False)
    plan = analysis.p2_launch_plan(2048, 4096, 2048, 256, 8, config)["programs"]
    R, n = config.row_split, config.n_tiles_per_program
    weight_grads = [_weight_grad_programs(256, 2048, 4096, config.grad_gate_up_tile, n),
                    _weight_grad_programs(256, 4096, 2048, config.grad_down_tile, n)]  # fmt: skip
    assert list(plan) == [0, 256 * (2048 // config.block_i) * R, *weight_grads, 256 * (4096 // config.block_h_dx) * R,
                          2048 * (4096 // config.block_h_sum)]  # fmt: skip
    empty = analysis.p2_launch_plan(0, 4096, 2048, 256, 8, config)["programs"]  # W alone writes the zeros
    assert list(empty) == [0, 0, *weight_grads, 0, 0]
    table = analysis.p2_grid_table([2048], P2)
    assert table.loc[2048, "row split R"] == R and table.loc[2048, "slots per expert (mean)"] == 64
    kernels = ["A", "W_gate_up", "W_down", "D", "C"]
    assert list(table.columns[2:]) == [f"kernel {k} programs" for k in kernels]
    assert list(table.loc[2048].iloc[2:]) == list(plan)[1:]


def test_figures_render(results):
    points = analysis.measured_points(results)
    inputs = problems.make_inputs(P2, 12, hidden_size=32, intermediate_size=16, num_experts=4, top_k=2)
    p2_config = analysis.p2_config(12, 4, 2, input_bytes=4, interpreter=True)
    figures = [
        analysis.roofline_figure("H100-SXM", points, results),
        analysis.intensity_figure("H200"),
        analysis.p1_tiling_figure(16, 2048, 768, analysis.p1_config(16, 2048, 768, interpreter=False)),
        analysis.split_k_figure(4),
        analysis.p2_tiling_figure(inputs["topk_indices"], 4, 32, 16, p2_config),
        analysis.per_case_figure(results, "time"),
        analysis.per_case_figure({k: results[k] for k in list(results)[:1]}, "speedup"),
    ]
    for figure in figures:
        assert isinstance(figure, matplotlib.figure.Figure) and figure.axes
        plt.close(figure)


def test_styled_tables_render(results, p1):
    pytest.importorskip("jinja2")
    html = analysis.styled_times(p1).to_html()
    assert "µs" in html and "font-weight: bold" in html
    assert "×" in analysis.styled_speedups(p1).to_html()
    targets = analysis.styled_targets(analysis.targets_table(results)).to_html()
    assert "NOT MET" in targets or "met" in targets
    assert analysis.provenance_table(results).loc[p1.csv.name, "driver"] == p1.provenance["driver_version"]
    assert isinstance(analysis.styled_cost_table(analysis.cost_table(P1, "H200"), "P1").to_html(), str)
    assert json.dumps(analysis.recorded_summary(p1))  # plain JSON


def test_run_benchmark_reads_back_what_the_harness_wrote(tmp_path, monkeypatch):
    from moe_lib import bench

    def fake_run(args):  # the harness's output, without running it
        folder = tmp_path / "cpu"
        folder.mkdir()
        for suffix in (".csv", ".json"):
            shutil.copy((H200_RESULTS / "2026-11-29-swiglu_down_backward-bfloat16").with_suffix(suffix),
                        folder / f"2030-01-01-{args.problem}-bfloat16-small{suffix}")  # fmt: skip
        return dict(csv=folder / f"2030-01-01-{args.problem}-bfloat16-small.csv")

    monkeypatch.setattr(bench, "run", fake_run)
    loaded = analysis.run_benchmark(P1, "1,2", tmp_path)
    assert list(loaded) == ["swiglu_down_backward-bfloat16-small"]
    assert isinstance(next(iter(loaded.values())).frame, pd.DataFrame)


def test_design_tables_read_the_committed_tuning_runs():
    p1 = analysis.p1_design_times()
    assert list(p1.index) == [1, 16, 128, 512]
    assert p1.loc[1, "one launch µs"] == pytest.approx(22.2, abs=0.05)
    assert p1.loc[128, "two launches: config"] == "mid_s4"
    assert (p1["two launches µs"] <= p1["one launch µs"] + 0.5).all()  # what NOTES.md says: no gain
    labels = {"unfused": "design 2", "g_s3": "design 3"}
    p2 = analysis.p2_kernel_times(analysis.TUNING_DIR / "2026-11-29-p2-design3-tune.json", labels)
    assert list(p2.index) == [(case, label) for case in ("fp32:2048", "bf16:2048", "fp32:8192") for label in
                              ("design 2", "design 3")]  # fmt: skip
    assert p2.loc[("bf16:2048", "design 2"), "graph_ms"] == pytest.approx(12.30, abs=0.01)
    assert p2.loc[("bf16:2048", "design 2"), "G"] == 0 and p2.loc[("bf16:2048", "design 3"), "Wgu"] == 0
    assert (p2["element_rule"] >= 0.99).all()
    figure = analysis.kernel_times_figure(p2, "test")
    assert len(figure.axes[0].patches) == 6 * len([k for k in analysis.P2_KERNEL_COLUMNS if p2[k].any()])
