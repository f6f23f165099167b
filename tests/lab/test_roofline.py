"""moe_lib.lab.roofline: the roofline arithmetic by hand, the measured points and their projection."""

import math

import matplotlib
import pandas as pd
import pytest

from moe_lib import problems, roofline
from moe_lib.lab import results
from moe_lib.lab import roofline as lab_roofline

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

P1 = problems.PROBLEM_NAMES[0]


@pytest.fixture(scope="module")
def loaded():
    return results.load_results()


def test_ridge_point_and_p1_crossing_by_hand():
    h200 = roofline.GPUS["H200"]
    ridge = 989e12 / 4.8e12
    assert lab_roofline.ridge_point("H200") == pytest.approx(ridge)
    H, I = 2048, 768
    a, b, c = 12 * H * I, 2 * (3 * H + 5 * I), 2 * 6 * I * H  # FLOPs per token, bytes per token, fixed bytes
    assert lab_roofline.cost_coefficients(P1) == (a, b, c)
    crossing = ridge * c / (a - ridge * b)
    assert lab_roofline.ridge_crossing(P1, "H200") == pytest.approx(crossing)
    assert 263 < crossing < 264
    assert roofline.sol_time(P1, 263, h200) == pytest.approx(roofline.cost(P1, 263)[1] / h200.dram_bandwidth)
    assert roofline.sol_time(P1, 264, h200) == pytest.approx(roofline.cost(P1, 264)[0] / h200.bf16_dense_flops)
    slow_compute = roofline.GPUSpec.from_measured(copy_bandwidth=1e12, bf16_rate=1e15)  # ridge 1000 > a / b
    assert lab_roofline.ridge_crossing(P1, slow_compute) == math.inf
    measured = {"H200": roofline.GPUSpec.from_measured(copy_bandwidth=4.2e12, bf16_rate=790e12)}
    table = lab_roofline.crossing_table(["H200", "H200", "H100-SXM"], measured, [P1])
    assert list(table.index) == [(P1, "H200"), (P1, "H100-SXM")]  # one row per GPU
    assert table.loc[(P1, "H200"), "first_compute_bound"] == 264
    assert table.loc[(P1, "H200"), "measured_crossing_tokens"] == pytest.approx(
        lab_roofline.ridge_crossing(P1, measured["H200"])
    )
    assert math.isnan(table.loc[(P1, "H100-SXM"), "measured_ridge"])
    assert table.loc[(P1, "H200"), "intensity_limit"] == pytest.approx(a / b)


def test_cost_table_agrees_with_sol_time():
    for name in problems.PROBLEM_NAMES:
        table = lab_roofline.cost_table(name, "H100-SXM")
        assert list(table.index) == sorted(problems.load(name).suite)
        for t, row in table.iterrows():
            assert row["t_sol_us"] == pytest.approx(roofline.sol_time(name, t, "H100-SXM") * 1e6)
            assert row["bound"] == ("compute" if t >= lab_roofline.ridge_crossing(name, "H100-SXM") else "memory")


def test_regime_table_shares_the_weight_bytes():
    table = lab_roofline.regime_table([(P1, 1), (P1, 8192)], "H200")
    _, b, c = lab_roofline.cost_coefficients(P1)
    assert table.loc[(P1, 1), "weight_bytes_share"] == pytest.approx(c / (b + c))
    assert list(table["bound"]) == ["memory", "compute"]


def test_measured_points_and_their_projection(loaded):
    points = lab_roofline.measured_points(loaded)
    ok = sum(int((r.frame["status"] == "ok").sum()) for r in loaded.values())
    assert len(points) == ok
    assert (points["flop_rate"] == points["flops"] / (points["median_ms"] * 1e-3)).all()
    projected = lab_roofline.project_points(points, "H100-SXM")
    ridge_h200 = lab_roofline.ridge_point("H200")
    roof_us = pd.Series(lab_roofline.roof_time_s("H200", points["flops"], points["bytes"]) * 1e6, index=points.index)
    assert (
        projected["projection"]
        == (roof_us >= lab_roofline.LATENCY_BOUND_US).map({True: "keeps its fraction", False: "latency model"})
    ).all()
    kept = projected[projected["projection"] == "keeps its fraction"]
    memory = kept[kept["intensity"] < ridge_h200]  # memory-bound on both (the H100's ridge is higher)
    assert len(memory) and memory["scale"].to_numpy() == pytest.approx(3.35 / 4.8)
    # latency-bound (P1 at few tokens): the time beyond the roof kept, the new roof's time added
    latency = projected[projected["projection"] == "latency model"]
    assert len(latency) and set(latency["problem"]) == {P1}
    beyond = latency["median_ms"] * 1e-3 - lab_roofline.roof_time_s("H200", latency["flops"], latency["bytes"])
    new = beyond + lab_roofline.roof_time_s("H100-SXM", latency["flops"], latency["bytes"])
    assert latency["projected_ms"].to_numpy() == pytest.approx(new.to_numpy() * 1e3)
    assert (latency["scale"] > 3.35 / 4.8).all()  # a slower memory lengthens only the roof's share
    compute = projected[projected["intensity"] > lab_roofline.ridge_point("H100-SXM")]
    assert len(compute) and compute["scale"].to_numpy() == pytest.approx(1.0)  # same tensor rate
    # compute-bound on the H200, memory-bound on the H100 (no committed point lies there): the ratio of the roofs
    between = lab_roofline.project_points(
        points.head(3).assign(intensity=[210.0, 250.0, 290.0]), "H100-SXM", latency_bound_us=0
    )
    assert between["scale"].to_numpy() == pytest.approx(between["intensity"].to_numpy() * 3.35e12 / 989e12)
    same = lab_roofline.project_points(points, "H200")
    assert (same["scale"] == 1).all() and not same["projected"].any()
    b200 = lab_roofline.project_points(points, "B200")
    compute = b200[
        (b200["intensity"] > lab_roofline.ridge_point("B200")) & (b200["projection"] == "keeps its fraction")
    ]
    assert len(compute) and compute["scale"].to_numpy() == pytest.approx(1.81e15 / 989e12)
    unknown = lab_roofline.project_points(points.assign(gpu="cpu"), "H200")
    assert unknown["scale"].isna().all()
    mine = lab_roofline.points_table(projected, "H100-SXM")
    assert (mine["roofline fraction"] <= 1 + 1e-9).all()


def test_tables_and_figures_render(loaded):
    pytest.importorskip("jinja2")
    measured = lab_roofline.measured_specs(loaded)
    assert list(measured) == [f"H200 measured ({key})" for key in loaded]
    ceilings = lab_roofline.measured_ceilings(loaded)
    assert list(ceilings) == ["H200"]
    rates = sorted(s.bf16_dense_flops for s in measured.values())
    assert ceilings["H200"].bf16_dense_flops == pytest.approx(rates[len(rates) // 2])  # the median of the runs
    table = lab_roofline.gpu_table(ceilings)
    assert list(table.index) == list(roofline.GPUS)  # one row per GPU
    assert table.loc["H200", "measured bf16 (TFLOP/s)"] == pytest.approx(ceilings["H200"].bf16_dense_flops / 1e12)
    assert table.drop(index="H200")["measured DRAM (TB/s)"].isna().all()
    assert "ddf4ff" in lab_roofline.styled_gpu_table(table, highlight="H200").to_html()
    costs = lab_roofline.cost_table(P1, "H200")
    html = lab_roofline.styled_cost_table(costs, "P1").to_html()
    assert all(f">{t}</th>" in html for t in costs.index) and "<caption>P1</caption>" in html
    for bound, colour in (("memory", "#0969da"), ("compute", "#cf222e")):
        assert (colour in html) == (costs["bound"] == bound).any(), bound
    points = lab_roofline.measured_points(loaded)
    figures = [lab_roofline.roofline_figure("H100-SXM", points, loaded), lab_roofline.intensity_figure("H200")]
    titles = [ax.get_title() for ax in figures[0].axes]
    assert titles == [f"{problems.load(name).title} on H100-SXM" for name in problems.PROBLEM_NAMES]
    for figure in figures:
        assert isinstance(figure, matplotlib.figure.Figure) and figure.axes
        plt.close(figure)


def test_token_labels_keep_apart_and_cover_no_marker(loaded):
    points = lab_roofline.project_points(lab_roofline.measured_points(loaded), "H100-SXM")
    for name in problems.PROBLEM_NAMES:
        ours = points[(points["problem"] == name) & (points["impl"] == results.OURS)].sort_values("num_tokens")
        labelled = lab_roofline.labelled_points(ours)
        assert {ours["num_tokens"].iloc[0], ours["num_tokens"].iloc[-1]} <= set(labelled["num_tokens"])
        x = sorted(math.log10(i) for i in labelled["intensity"])
        assert all(b - a >= 0.35 for a, b in zip(x, x[1:], strict=False)), name
    figure = lab_roofline.roofline_figure("H100-SXM", lab_roofline.measured_points(loaded), loaded)
    figure.canvas.draw()
    for ax in figure.axes:
        labels = [text for text in ax.texts if text.get_text().startswith("T=")]
        assert labels, ax.get_title()
        markers = [xy for collection in ax.collections for xy in ax.transData.transform(collection.get_offsets())]
        for label in labels:
            box = Text.get_window_extent(label).padded(4)  # the text alone (not its line), and a marker's radius
            assert not any(box.contains(x, y) for x, y in markers), (ax.get_title(), label.get_text())
    plt.close(figure)


def test_intensity_legend_sits_beside_the_curves():
    figure = lab_roofline.intensity_figure("H100-SXM")
    figure.canvas.draw()
    ax = figure.axes[0]
    assert ax.get_legend().get_window_extent().x0 >= ax.get_window_extent().x1  # covers no curve
    plt.close(figure)


def test_granularity_view_by_hand():
    H, I, E, K, T = 4096, 2048, 256, 8, 2048
    m = T * K / E  # 64 rows per expert
    flops, traffic = 2 * m * H * 2 * I, 2 * (m * H + 2 * H * I + m * 2 * I)
    assert lab_roofline.expert_gemm_intensity(T, H, I, E, K) == pytest.approx(flops / traffic)
    G, rho = H / I, K / E
    assert lab_roofline.expert_gemm_intensity(T, H, I, E, K) == pytest.approx(2 / ((G + 2) / H + 2 / (T * rho)))
    from moe_lib.bench.models import MODEL_SHAPES

    table = lab_roofline.granularity_table(MODEL_SHAPES, T, "H200")
    assert len(table) == sum(s.num_experts is not None for s in MODEL_SHAPES)
    assert (
        table["bound"]
        == (table["AI (FLOP/B)"] >= lab_roofline.ridge_point("H200")).map({True: "compute", False: "memory"})
    ).all()
    fig = lab_roofline.granularity_figure("H200", MODEL_SHAPES, T)
    assert len(fig.axes[0].texts) == len(table)
    plt.close(fig)


def test_expert_intensity_names_a_bad_argument():
    with pytest.raises(ValueError, match="num_experts"):
        lab_roofline.expert_gemm_intensity(2048, 4096, 2048, 0, 8)
