"""moe_lib.lab.traces: the committed traces of P1's calls hold what the lab notes say of them."""

import matplotlib
import numpy as np
import pytest

from moe_lib.lab import traces as lab_traces

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def test_few_tokens_traces_and_timeline_figure():
    """The committed traces: every program stamps its steps in order, and the default's two moves (the launch
    count read late, phase 2 staged before the wait) end the median program earlier than the design before."""
    traces = lab_traces.few_tokens_traces()
    steps = list(lab_traces.TRACE_STRETCHES)
    assert (traces[steps].diff(axis=1).iloc[:, 1:] >= 0).all().all()
    for stamps in traces.stamps:
        times = np.asarray(stamps)[:, : len(steps) + 1]
        assert (np.diff(times, axis=1) >= 0).all() and len(times) == 96
    before = traces[(traces.label == "a_reg dirty") & (traces.commit == "c44c149")].iloc[0]
    now = traces[(traces.label == "a_reg_cl_st dirty")].iloc[0]
    assert now["end"] < before["end"] and now.graph_us < before.graph_us
    warm = traces[traces.label == "a_reg_cl none"].iloc[0]
    assert warm["end"] < now["end"] and warm["dx partial stored"] - warm["dA ready"] > 2  # phase 2's chain
    fig = lab_traces.few_tokens_timeline_figure(
        traces, [("a_reg_cl_st dirty", 1, "0329f39"), ("a_reg_cl none", 1, "c44c149")]
    )
    assert len(fig.axes) == 2
    plt.close(fig)


def test_p1_call_kernels_and_timeline_figure():
    """The committed kernels of a call: ours and torch.compile's run the same cuBLAS GEMMs, ours with its copy of
    [Wg; Wu] (a kernel below 1024 tokens, the copy engines from there); one bar per kernel."""
    table = lab_traces.p1_call_kernels(
        labels={"lib_s3": "ours below 1024", "lib_bs3_mc": "ours from 1024", "torch_compile": "torch.compile"}
    )
    assert set(table.num_tokens) == {128, 512, 1321, 4093}
    compiled = table[table.impl == "torch.compile"]
    assert (
        compiled.groupby("num_tokens").kind.apply(list).map(sorted)
        == [["cuBLAS GEMM"] * 4 + ["dSwiGLU pass (Inductor)"]] * 4
    ).all()
    assert set(table[table.impl == "ours below 1024"].kind) >= {"copy of [Wg; Wu], kernel", "dSwiGLU pass (ours)"}
    assert (table[table.impl == "ours from 1024"].kind == "copy of [Wg; Wu], copy engine").sum() == 2 * 4
    assert (table.start_us >= 0).all() and (table.start_us < table.span_us).all()  # medians: no tighter bound
    assert lab_traces.call_kernel_kind("some_new_kernel") == ("other", "tab:grey")
    defaults = lab_traces.p1_call_kernels(defaults_only=True)
    assert set(defaults.impl) == {"ours", "torch.compile"}
    ours = defaults[defaults.impl == "ours"].groupby("num_tokens").kind.apply(set)
    assert "copy of [Wg; Wu], kernel" in ours[128] and "copy of [Wg; Wu], copy engine" in ours[4093]
    fig = lab_traces.call_timeline_figure(table[table.num_tokens.isin([128, 4093])], "test")
    assert len(fig.axes) == 2
    assert sum(len(ax.collections) for ax in fig.axes) == len(table[table.num_tokens.isin([128, 4093])])
    plt.close(fig)


def test_program_traces_show_the_dx_tiles_ending_the_call_until_split():
    """The committed program traces at 128 tokens (notes/p1/design-18.md): with dx unsplit its 16 tiles
    end the call ~9 µs after the weight-gradient tiles; split over 4 programs with the combine in 16-byte loads, they
    end with them, ≥ 3 µs sooner; design 17's combine spent the split's gain (its last split ran ≥ 6 µs past the
    others). One panel per call in the timeline."""
    traces = lab_traces.program_traces()
    assert {"commit", "config", "T", "launch", "program", "sm", "tiles", "start_us", "proceed_us", "end_us"} <= set(
        traces.columns
    )
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
    summary = lab_traces.program_trace_summary(split)
    assert summary.programs.sum() == len(split) and summary.sm_busy.between(0, 1).all()
    fig = lab_traces.program_timeline_figure({"unsplit": unsplit, "split": split})
    assert len(fig.axes) == 2
    plt.close(fig)


def test_program_traces_show_the_persistent_weight_gradient_programs_ending_with_dx():
    """The committed traces at 512 tokens (notes/p1/design-19.md; notebook 04): with one program a weight-gradient tile
    those tiles end the call ~5 µs after dx's; taken in turn by 68 programs they end with dx's, ≥ 2 µs sooner."""
    traces = lab_traces.program_traces()
    at_512 = traces[(traces["T"] == 512) & (traces.config == "default")]
    before, after = (at_512[at_512.commit.str.startswith(commit)] for commit in ("8392274", "fc6a297"))
    ends = {name: rows.groupby("tiles").end_us.max() for name, rows in (("before", before), ("after", after))}
    assert ends["before"]["dWg, dWu"] > ends["before"]["dx"] + 4
    assert abs(ends["after"]["dWg, dWu"] - ends["after"]["dx"]) < 2
    assert ends["after"]["dWg, dWu"] < ends["before"]["dWg, dWu"] - 2
    assert (before.tiles == "dWg, dWu").sum() == 192 and (after.tiles == "dWg, dWu").sum() == 68


def test_pingpong_epilogue_table_says_what_notes_design_24_says():
    """The pingpong traces at 2447 tokens: the main loop ends at 14-18 µs in every form, the epilogue takes ≈ 26.6 µs
    with 4-byte loads, ≈ 31 with 16-byte loads and ≈ 18 with the saved tiles through the ring, stores one after the
    other or all at once."""
    table = lab_traces.pingpong_epilogue_table(2447)
    assert list(table.index) == [
        "gluon_pingpong_from2300_b6_f2",
        "gluon_pingpong_from2300_wide",
        "gluon_pingpong_from2300_ring6",
        "gluon_pingpong_from2300_ring6s",
    ]
    assert table["main_loop_end_us"].between(14, 18).all()
    epilogue = table["epilogue_us"]
    assert epilogue["gluon_pingpong_from2300_b6_f2"] == pytest.approx(26.6, abs=0.5)
    assert epilogue["gluon_pingpong_from2300_wide"] == pytest.approx(31, abs=0.5)
    assert epilogue[["gluon_pingpong_from2300_ring6", "gluon_pingpong_from2300_ring6s"]].between(17.5, 18.7).all()
    assert (table["launch_end_us"] == table["main_loop_end_us"] + epilogue).all()
