"""moe_lib.lab.measured_designs: the committed tuning runs read as tables, holding what the lab notes and
choose.MEASURED say of them."""

import matplotlib
import pandas as pd
import pytest

from moe_lib.lab import measured_designs, regimes, tuning_index
from moe_lib.swiglu_down.designs.gluon import GluonLaunches

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def chosen(num_tokens, precision, hidden_size=2048, intermediate_size=768):
    """What the chooser runs on the H200 at the benchmark's shape (bf16)."""
    return regimes.chosen_design(num_tokens, hidden_size, intermediate_size, precision)


def on_gluon(num_tokens, precision="fast"):
    return chosen(num_tokens, precision).name == GluonLaunches.name


def test_design_tables_read_the_committed_tuning_runs():
    p1 = measured_designs.p1_design_times()
    assert list(p1.index) == [1, 16, 128, 512]
    assert p1.loc[1, "one launch µs"] == pytest.approx(22.2, abs=0.05)
    assert p1.loc[128, "two launches: config"] == "mid_s4"
    assert (p1["two launches µs"] <= p1["one launch µs"] + 0.5).all()  # what notes/index.md says: no gain
    labels = {"unfused": "design 2", "g_s3": "design 3"}
    p2 = measured_designs.p2_kernel_times(tuning_index.TUNING_DIR / "2026-11-29-p2-design3-tune.json", labels)
    assert list(p2.index) == [
        (case, label) for case in ("fp32:2048", "bf16:2048", "fp32:8192") for label in ("design 2", "design 3")
    ]
    assert p2.loc[("bf16:2048", "design 2"), "graph_ms"] == pytest.approx(12.30, abs=0.01)
    assert p2.loc[("bf16:2048", "design 2"), "G"] == 0 and p2.loc[("bf16:2048", "design 3"), "Wgu"] == 0
    assert (p2["element_rule"] >= 0.99).all()
    figure = measured_designs.kernel_times_figure(p2, "test")
    assert len(figure.axes[0].patches) == 6 * len([k for k in measured_designs.P2_KERNEL_COLUMNS if p2[k].any()])
    plt.close(figure)


def test_few_tokens_table_reads_the_committed_check_run():
    graph, floor = measured_designs.p1_few_tokens_times()
    before = tuning_index.run("few_tokens_check").default  # what "default" ran then
    assert list(graph.columns[:1]) == [before] and "a_reg" in graph.columns
    assert list(graph.index) == [(p, t) for p in ("faithful", "fast") for t in (1, 4, 16, 64)]
    assert graph.loc[("faithful", 1), "a_reg"] == pytest.approx(19.2, abs=0.05)
    assert 3 < floor < 6
    # what notes/index.md and the default say: the chosen tiles ahead up to 16 tokens, behind at 64
    few, more = graph.xs(16, level="num_tokens"), graph.xs(64, level="num_tokens")
    assert (few["a_reg"] < few[before]).all()
    assert (more["a_reg"] > more[before]).all()
    official, _ = measured_designs.p1_few_tokens_times(column="official_us")
    assert official.loc[("faithful", 1), "a_reg"] == pytest.approx(14.6, abs=0.05)
    figure = measured_designs.few_tokens_figure(graph, floor, chosen="a_reg")
    assert len(figure.axes) == 2 and len(figure.axes[0].lines) == len(graph.columns) + 1
    plt.close(figure)


def test_one_graph_host_gap_file_holds_what_notes_say():
    """The two Gluon launches as one CUDA graph: their span in NVIDIA's method under graph replay at every count
    (notes/p1/design-16.md), ahead of the few-token launch from 65 tokens."""
    run = tuning_index.run("host_gap_one_graph")
    table = measured_designs.p1_host_gap_times(run.path, run.labels)
    graph = table.xs("two launches as one CUDA graph", level="design")
    assert list(graph.index) == [65, 100, 128, 256, 512, 1087, 1321]
    assert (graph["gap"] < -2).all()
    few = table.xs("few-token launch to 128, then two launches", level="design")
    assert (graph.loc[[65, 100, 128], "official"] < few.loc[[65, 100, 128], "official"]).all()
    assert graph.loc[128, "official"] == pytest.approx(29.7, abs=0.05)


def test_p1_host_gap_times_and_figure():
    path = tuning_index.TUNING_DIR / "2026-12-01-p1-host-gap-chained.json"
    labels = {"default": "before", "chain_f": "chained"}
    table = measured_designs.p1_host_gap_times(path, labels)
    assert list(table.columns) == ["graph", "official", "gap"]
    assert list(table.index.get_level_values("design").unique()) == ["before", "chained"]
    assert table.loc[(512, "before"), "official"] == pytest.approx(112.1, abs=0.05)
    assert table.loc[(512, "chained"), "gap"] < 0 < table.loc[(512, "before"), "gap"]
    assert len(measured_designs.p1_host_gap_times(path)) == 12  # every design of the run without labels
    figure = measured_designs.host_gap_figure(table, "test")
    assert len(figure.axes[0].patches) == 2 * 2 * len(table.index.get_level_values("num_tokens").unique())
    plt.close(figure)


def test_p1_tune_times_and_speedup_figure():
    table = measured_designs.p1_tune_times(
        tuning_index.TUNING_DIR / "2026-12-01-p1-tune-library-fast.json", default_label="Triton launches"
    )
    assert table.columns[0] == "Triton launches" and {"lib", "lib_s", "lib_b", "lib_bs"} <= set(table.columns)
    assert table.index.name == "num_tokens" and 8192 in table.index
    assert (table > 0).all().all()
    fig = measured_designs.speedup_figure(table, "Triton launches", "test", switch=17)
    assert len(fig.axes[0].lines) == len(table.columns) + 1  # every candidate, the line at 1 and the switch
    plt.close(fig)


def test_one_block_table_reads_the_committed_runs_of_both_trees():
    table, floor = measured_designs.p1_one_block_times()
    before, saved_first, now_default = tuning_index.run("few_tokens_one_block").columns_first
    assert list(table.columns) == [before, saved_first, now_default]
    assert 3 < floor < 6
    faithful, fast = table.loc["faithful"], table.loc["fast"]
    # what notes/p1/design-10.md and FEW_TOKENS_MAX_TOKENS say: the faithful path faster at 17-96 tokens, a tie at 128
    now = faithful[now_default].dropna()
    assert list(now.index) == [17, 24, 32, 33, 64, 96, 128]
    assert (now.loc[:96] < faithful.loc[now.loc[:96].index, before] - 5).all()
    assert abs(now.loc[128] - faithful.loc[128, before]) < 1.5
    assert faithful.loc[32, now_default] == pytest.approx(23.6, abs=0.05)
    # the fast path: the one block ahead up to 32 tokens, cuBLAS ahead from 48
    assert (fast[now_default].dropna() < fast[before].loc[[17, 24, 32]]).all()
    assert (fast.loc[[48, 64], saved_first] > fast.loc[[48, 64], before]).all()
    official, _ = measured_designs.p1_one_block_times(column="official_us")
    at_96 = official.loc[("faithful", 96)]
    assert at_96[now_default] < at_96[before]
    figure = measured_designs.few_tokens_figure(
        table, floor, chosen=now_default, before=before, xscale="linear", ticks=[17, 64, 128]
    )
    assert len(figure.axes) == 2 and len(figure.axes[0].lines) == len(table.columns) + 1
    plt.close(figure)


def test_gluon_forms_file_holds_the_measured_gains():
    """The committed tuning runs behind GLUON_FORMS: what notes/p1/design-15.md says of them."""
    forms = tuning_index.run("gluon_forms")
    times = measured_designs.p1_tune_runs_times(forms.path, labels=forms.labels)
    assert list(times.columns) == list(forms.labels.values())
    long_first, wide = times["both at 64 rows, long tiles first"], times["128 rows"]
    assert long_first[512] < 0.8 * wide[512] and long_first[1087] < 0.85 * wide[1087]
    assert wide[8192] < times["launch 2 at 64 rows"][8192]  # the 128-row tiles from 4600 tokens
    figure = measured_designs.speedup_figure(times, "128 rows", "test")
    assert len(figure.axes[0].lines) == len(times.columns)  # four lines and the dotted 1
    plt.close(figure)


def test_programmatic_launch_gains_pair_each_form_with_its_pdl_candidate():
    """The committed PDL runs: every form measured both ways, and launch 2 by programmatic dependent launch faster
    in each band's form where it is the default (what notes/index.md says, design 16: 0.6-1.2 µs by
    graph replay), and in most of the other cases."""
    gains = measured_designs.programmatic_launch_gains()
    bands = {
        "gluon12_m64_lf": [129, 256, 512, 1087],
        "gluon12_l2m64_lf": [1150, 1200, 1321],
        "gluon12_l2m64_daf": [1571],
        "gluon12_b6": [2447, 8192],
        "gluon12_b6_l2m64b6": [4093],
    }
    assert set(gains.columns) == set(bands)
    in_bands = pd.concat([gains.loc[tokens, form] for form, tokens in bands.items()])
    assert len(in_bands) == 11 and in_bands.between(0.55, 1.25).all()
    assert (gains.stack().dropna() > 0).mean() > 0.9


def test_saved_tiles_early_gains_pair_each_form_with_its_early_candidate():
    """The committed runs of launch 1's saved tiles asked for early: every default form measured both ways, faster in
    most pairs and never more than 0.5 µs slower (what notes/index.md says, design 17: 0.1-1.3 µs in 14
    of 17 pairs, ties within ±0.3 in the rest)."""
    gains = measured_designs.saved_tiles_early_gains()
    assert set(gains.columns) == {
        "gluon12_m64_lf_pdl_sif_graph",
        "gluon12_l2m64_lf_pdl_sif_graph",
        "gluon12_b6_pdl_sif_graph",
        "gluon12_b6_l2m64b6_pdl_sif_graph",
    }
    values = gains.stack().dropna()
    assert len(values) >= 17 and (values > 0).mean() > 0.7 and values.min() > -0.5 and values.max() < 1.5


def test_split_tiles_slower_than_the_unsplit_form():
    """The committed split runs: every split candidate at least as slow as the unsplit 64-row form at every count but
    one tie at 128 tokens (notes/p1/design-17.md)."""
    slowdown = measured_designs.split_tiles_slowdown()
    assert len(slowdown.columns) == 14 and set(slowdown.index) == {65, 128, 256, 512, 768, 1087}
    values = slowdown.stack().dropna()
    assert (values > 0.995).all() and (values > 1.02).mean() > 0.9


def test_phase2_tile_table_reads_the_committed_runs():
    table, floor = measured_designs.p1_phase2_tile_times()
    before, now, cublas = tuning_index.run("few_tokens_phase2_tiles").columns_first
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
    figure = measured_designs.few_tokens_figure(
        table, floor, chosen=now, before=before, xscale="linear", ticks=[2, 16, 32, 64, 128]
    )
    assert len(figure.axes) == 2
    plt.close(figure)


def test_host_gap_runs_of_launch2_in_gluon_step_by_step():
    table = measured_designs.p1_host_gap_runs(labels={1: "jit", 5: "encoded"})
    assert list(table.columns) == ["jit", 2, 3, 4, "encoded"]  # the runs in their order, unlabelled ones by number
    # what notes/p1/design-13.md says: 204-351 µs over graph replay through the JIT, 0-2 µs encoded before launch 1
    assert table["jit"].dropna().between(200, 360).all() and table["encoded"].dropna().abs().max() < 2.5
    assert table.index.is_monotonic_increasing
    figure = measured_designs.host_gap_steps_figure(table.dropna(thresh=3), "test")
    assert len(figure.axes[0].lines) == len(table.dropna(thresh=3)) + 1  # one per token count and the zero line
    plt.close(figure)


def test_gluon_launch2_table_reads_the_committed_probe_runs():
    labels = {"triton launch 2 (default)": "Triton", "gluon m128n256k32b4": "Gluon", "cublas, two GEMMs": "cuBLAS"}
    table = measured_designs.p1_gluon_launch2_times(labels=labels)
    assert list(table.columns) == ["Triton", "Gluon", "cuBLAS"]
    assert list(table.index) == [2447, 4093, 8192]
    # what notes/p1/design-13.md says: the Gluon probe at the Triton launch's rate (-5% to +4%), cuBLAS taking 14-22%
    # less time than either
    assert ((table["Gluon"] / table["Triton"] - 1).abs() < 0.06).all()
    assert (table["cuBLAS"] < 0.87 * table[["Triton", "Gluon"]].min(axis=1)).all()
    assert table.loc[8192, "Triton"] == pytest.approx(310.3, abs=0.05)  # the median of the runs that measured it
    every = measured_designs.p1_gluon_launch2_times()
    assert "gluon pp_m64n256k64b3" in every.columns and every.shape[1] > table.shape[1]
    figure = measured_designs.launch2_figure(table, "test")
    assert len(figure.axes[0].patches) == table.size
    plt.close(figure)


def test_gluon_launch1_table_reads_the_committed_tune_runs():
    labels = {"gluon2": "launch 2 in Gluon", "gluon12": "both", "gluon12_a256": "both, 256-wide dA"}
    table = measured_designs.p1_tune_runs_times(labels=labels)
    assert list(table.columns) == list(labels.values())
    assert {1321, 1571, 2447, 4093, 8192} <= set(table.index)
    # what notes/p1/design-14.md says: launch 1 in Gluon 3-7% faster from 1571 tokens; 256-wide dA tiles faster from
    # 5000 tokens, slower at 1321-2447
    many = [1571, 2447, 4093, 8192]
    assert (table.loc[many, "both"] < 0.975 * table.loc[many, "launch 2 in Gluon"]).all()
    most = [5000, 6144, 7168, 8192]
    assert (table.loc[most, "both, 256-wide dA"] < table.loc[most, "both"]).all()
    assert (table.loc[[1321, 1571, 2447], "both, 256-wide dA"] > 1.04 * table.loc[[1321, 1571, 2447], "both"]).all()
    fast = measured_designs.p1_tune_runs_times(precision="fast", labels=labels)
    assert fast.loc[8192, "both"] < table.loc[8192, "both"]  # no lo halves: less tensor work
    figure = measured_designs.speedup_figure(table, "launch 2 in Gluon", "test", switch=4608)
    assert len(figure.axes[0].lines) == table.shape[1] - 1 + 2  # a line per other column, the 1 and the switch
    plt.close(figure)


def test_fast_path_gluon_large_times_hold_the_second_band_of_gluon_fast_tokens():
    """What choose.MEASURED and notes/p1/design-19.md say: beyond 959 tokens the 2300-3299 band's
    Gluon form without the lo halves is ahead of the fast path's cuBLAS design at 2447 and 3089 tokens (by ≥ 0.5% and
    ≥ 5%) and behind at 1087-1571, 3300, 4093; the other bands' forms behind cuBLAS wherever they ran."""
    table = measured_designs.fast_path_gluon_large_times()
    band, cublas = table["Gluon, the 2300-3299 form"], table["cuBLAS"]
    assert band[2447] < 0.995 * cublas[2447] and band[3089] < 0.95 * cublas[3089]
    # (at 1100-3599 tokens, where the forms have not changed since: design 20 moved dWd's tiles at 513-1099 and
    # 3600-5199, and the fast path follows them there)
    assert all(band[T] > cublas[T] for T in (1087, 1321, 1571, 3300, 4093)) and all(
        on_gluon(T) == (band[T] < cublas[T]) for T in table.index if 2600 <= T < 3600 and T != 2767
    )
    # (at 1100-2599 the fast path takes forms of its own since: designs 21-22)
    for form in ("Gluon, the 1100-1399 form", "Gluon, the 1400-2299 form", "Gluon, the 3300-4599 form"):
        both = table[[form, "cuBLAS"]].dropna()
        assert (both[form] > both["cuBLAS"]).all(), form
    fig = measured_designs.launch2_figure(table, "test")
    assert len(fig.axes) == 1
    plt.close(fig)


def test_fast_path_gluon_times_hold_the_band_of_gluon_fast_tokens():
    """What choose.MEASURED and notes/p1/design-18.md say: the Gluon launches (dx unsplit) ahead of
    the fast path's cuBLAS design at 65-896 tokens where both ran, behind from 1024; dx in 4 no better than unsplit
    without the lo halves from 160 tokens."""
    table = measured_designs.fast_path_gluon_times()
    gluon, cublas = table["Gluon launches, dx unsplit"], table["cuBLAS"]
    both = table.dropna(subset=["Gluon launches, dx unsplit", "cuBLAS"]).index
    assert set(both) >= {65, 128, 640, 896, 1024, 1321}
    for T in both:  # the forms of then: ahead to 959 tokens (design 20's forms since lead to 1099)
        assert (gluon[T] < cublas[T]) == (T < 960), T
    assert (table.loc[[160, 192], "Gluon launches, dx in 4"] > gluon[[160, 192]]).all()
    fig = measured_designs.speedup_figure(
        table[["cuBLAS", "Gluon launches, dx unsplit"]],
        "cuBLAS",
        "test",
        switch=next(T for T in range(65, 4096) if not on_gluon(T)),
    )
    assert len(fig.axes[0].lines) == 3
    plt.close(fig)


def test_design20_times_hold_its_forms():
    """What choose.MEASURED and notes/p1/design-20.md say: launch 1's 64-wide dA
    tiles ahead of the forms before at 65-256 tokens (by ≥ 2 µs to 128) and behind from 320, with 64-wide dWd tiles
    behind 128-wide ones; dWd's tiles in launch 2 ahead at 576-1099 and 3600-5000 tokens, behind at 1200, 3300 and
    6144, not ahead at 8192; the fast path on those forms ahead of its cuBLAS design at 960-1087 and 3600-4093, behind
    from 1200 and at 4500-5000; and the forms chosen follow."""
    table = measured_designs.design20_times("faithful")
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
    fast = measured_designs.design20_times("fast")
    gluon = fast[["dA 64 wide", "dWd in launch 2, 64-row launch 2", "dWd in launch 2, 128-row launch 2, dA 256 wide"]]
    gluon = gluon.min(axis=1)
    assert all(gluon[T] < fast["forms before"][T] for T in (65, 128, 192))
    assert all(gluon[T] < fast["cuBLAS"][T] for T in (960, 1024, 1087, 3600, 4093))
    assert all(gluon[T] > fast["cuBLAS"][T] for T in (1200, 1321, 4500, 5000))
    assert all(on_gluon(T) for T in (960, 1024, 1087, 3600, 4093))
    assert not any(on_gluon(T) for T in (4500, 5000))  # 1200, 1321: forms of their own since (designs 21-22)
    fig = measured_designs.launch2_figure(table.loc[[65, 128, 256], ["forms before", "dA 64 wide, dx in 4"]], "test")
    assert len(fig.axes) == 1
    plt.close(fig)


def test_design21_times_hold_the_fast_paths_own_forms():
    """What choose.MEASURED and notes/p1/design-21.md say: on the fast path each
    band's own form is ahead of the cuBLAS design (and at 2300-2599 of the faithful path's form) wherever the runs
    measured it inside the band, cuBLAS ahead at 1100-1200 tokens of the forms measured there then; the faithful path's
    1500 form (the 1400 band's with dWd's tiles in launch 2) ahead of the forms before at 1571-2200; the labelled
    candidates are the forms the paths take."""
    table = measured_designs.design21_times("fast")
    own = {
        range(1250, 1408): ("2300 form, dWd in launch 2, dA 64 wide", "wide_narrow_da"),
        range(1408, 1500): ("1400 form, dWd in launch 2", "wide_da_first_tall"),
        range(1500, 2300): ("2300 form, dWd in launch 2", "wide"),
        range(2300, 2600): ("3600 form", "wide_da256"),
    }  # the candidates' labels, the forms of FORMS
    measured = 0
    for band, (label, form) in own.items():
        assert regimes.gluon_form_of(chosen(band.start, "fast")) == (form, True, 1)
        assert regimes.gluon_form_of(chosen(band.stop - 1, "fast")) == (form, True, 1)
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
    faithful = measured_designs.design21_times("faithful")
    assert regimes.gluon_form_of(chosen(1500, "faithful")) == ("wide_da_first_tall", True, 1)  # "1400 form, dWd in 2"
    moved, before = faithful["1400 form, dWd in launch 2"], faithful["forms before"]
    assert all(moved[T] < before[T] for T in (1571, 1700, 1800, 2047, 2200))
    assert all(moved[T] < 0.95 * before[T] for T in (1800, 2047))
    assert all(moved[T] > before[T] for T in (1087, 1200, 1321))  # not below 1500, where the 1100 band's form runs


def test_design22_times_hold_the_forms_to_512_tokens():
    """What choose.MEASURED and notes/p1/design-22.md say: on the fast path at 65-512
    tokens the form each band takes is within 0.2 µs of the fastest measured and ahead of the forms before at 96-448;
    the 64-wide dA form ahead of cuBLAS at 1100-1249; on the faithful path dWd's tiles in launch 2 ahead at 160-256 (dx
    in 2) and a tie at 65-128 (dx in 4, not taken); the labelled candidates are the forms the paths take."""
    fast = measured_designs.design22_times("fast")
    bands = {
        range(65, 129): ("gluon12_m64_early_dx4_wp68_ibw_n64_dwd2", ("narrow", True, 4)),
        range(129, 193): ("gluon12_m64_early_dx2_wp68_ibw_n64_dwd2", ("narrow", True, 2)),
        range(193, 385): ("gluon12_m64_early_dx1_wp68_ibw_n64_dwd2", ("narrow", True, 1)),
        range(385, 513): ("gluon12_m64_early_dx1_wp68_ibw_dwd2", ("tall", True, 1)),
    }
    before = fast[["dA 64 wide (before, to 256)", "257 form (before, 257-512)"]].min(axis=1)
    measured = 0
    for band, (candidate, form) in bands.items():
        assert regimes.gluon_form_of(chosen(band.start, "fast")) == form
        assert regimes.gluon_form_of(chosen(band.stop - 1, "fast")) == form
        label = tuning_index.run("design22").labels_for("fast")[candidate]
        for T in (T for T in fast.index if T in band):
            assert fast.loc[T, label] <= fast.loc[T].min() + 0.2, T
            if 96 <= T <= 448:
                assert fast.loc[T, label] < before[T] - 0.2, T
            measured += 1
    assert measured >= 14
    narrow = fast["2300 form, dWd in launch 2, dA 64 wide"]
    assert all(narrow[T] < fast.loc[T, "cuBLAS"] for T in (1100, 1150, 1200, 1249))
    faithful = measured_designs.design22_times("faithful")
    moved, kept = faithful["dx in 2, dWd in launch 2"], faithful["dx in 2 (before)"]
    assert all(moved[T] < kept[T] for T in (160, 192, 224, 256)) and moved[256] < kept[256] - 1
    assert all(
        abs(faithful.loc[T, "dx in 4, dWd in launch 2"] - faithful.loc[T, "dx in 4 (before)"]) < 0.5
        for T in (65, 96, 128)
    )
    assert regimes.gluon_form_of(chosen(160, "faithful")) == ("narrow", True, 2)  # "dx in 2, dWd in launch 2"
    assert regimes.gluon_form_of(chosen(128, "faithful")) == ("narrow", False, 4)  # "dx in 4 (before)"


def test_runs_side_by_side_hold_the_graph_counters_gain():
    """What notes/p1/design-23.md and the README say of the committed runs before and after a captured graph kept an
    eager call's counters: both paths 0.8-1.6 µs faster at 1-128 tokens (torch.compile's changes, the same code in
    both runs, are the runs' spread), one token 14.7 µs on both."""
    table = measured_designs.runs_side_by_side(*tuning_index.run("graph_counters").paths)
    assert list(table.index) == [1, 2, 4, 8, 16, 128]
    for impl in ("triton", "triton_fast"):
        assert table[(impl, "Δ")].between(-1.7, -0.7).all(), table[impl]
        assert (table[(impl, "after")] - table[(impl, "before")] - table[(impl, "Δ")]).abs().max() < 1e-9
    assert round(table.loc[1, ("triton", "after")], 1) == round(table.loc[1, ("triton_fast", "after")], 1) == 14.7
    assert table[("torch_compile", "Δ")].abs().max() < 2


def test_halves_from_two_designs_say_what_notes_design_25_says():
    """The fast path's first half on cuBLAS and its second on the Gluon launch 2: slower than the default at every size
    measured (2767 tokens 97.0 against 94.8 µs, 8192 241.8 against 235.1); "default" kept only for a named run."""
    halves_run = tuning_index.run("library_then_gluon_launch2")
    table = measured_designs.p1_tune_runs_times(halves_run.path, "fast", halves_run.labels, runs=(1,))
    assert list(table.columns) == list(halves_run.labels.values())
    assert list(table.index) == [1321, 2047, 2767, 3089, 4093, 8192]
    default, cublas, halves, halves_dwd = (table[label] for label in halves_run.labels.values())
    assert (halves > default).all() and (halves_dwd > default).all()
    assert (table.loc[2767] - [94.8, 95.2, 97.0, 97.2]).abs().max() < 0.05
    assert (table.loc[8192] - [235.1, 235.3, 241.8, 247.0]).abs().max() < 0.05
    assert "default" not in measured_designs.p1_tune_runs_times(halves_run.path, "fast").columns
