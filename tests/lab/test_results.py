"""moe_lib.lab.results, .benchmark and .targets: the committed results as tables, scores and targets."""

import dataclasses
import json
import math
import shutil

import matplotlib
import pandas as pd
import pytest

from moe_lib import problems, roofline
from moe_lib.lab import benchmark, results, targets

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

P1, P2, P2_BF16 = problems.PROBLEM_NAMES
H200_RESULTS = problems.DATA_DIR / "results" / "H200"


@pytest.fixture(scope="module")
def loaded():
    return results.load_results()


@pytest.fixture(scope="module")
def p1(loaded):
    return results.find(loaded, P1)


# ---------------------------------------------------------------- loading


def test_committed_h200_results_load(loaded, p1):
    assert [r.problem for r in loaded.values()] == [P1, P2, P2_BF16]
    assert all(r.gpu_key == "H200" and r.provenance["gpu_name"] == "NVIDIA H200" for r in loaded.values())
    frame = p1.frame
    assert len(frame) == 16 * len(p1.impls) and frame.groupby(["impl", "num_tokens"]).size().eq(1).all()
    assert p1.tokens == sorted(problems.load(P1).suite)
    assert p1.impls == ["reference", "torch_eager", "torch_compile", "triton", "triton_fast"]
    assert set(frame["passes_element_rule"]) == {True}
    assert set(results.find(loaded, P2_BF16).frame["passes_element_rule"]) == {None}  # no rule for bf16
    assert p1.measured_spec.dram_bandwidth == p1.provenance["ceilings"]["copy_bandwidth"]
    assert p1.datasheet_spec is roofline.GPUS["H200"]
    assert [r.title for r in loaded.values()] == [problems.load(name).title for name in problems.PROBLEM_NAMES]


def test_results_paths_and_missing_folders(loaded):
    relative = results.load_results("data/results", "H200")
    assert [r.csv for r in relative.values()] == [r.csv for r in loaded.values()]
    with pytest.raises(FileNotFoundError, match=r"no results folder .*B200.*H200"):
        results.load_results("data/results", "B200")


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
    found = results.load_results(tmp_path, "H200")
    assert list(found) == ["swiglu_down_backward-bfloat16"]
    assert found["swiglu_down_backward-bfloat16"].date == "2026-11-29"


# ---------------------------------------------------------------- tables


def test_times_best_peer_and_speedups(p1):
    times = results.times_table(p1)
    rows = p1.frame.set_index(["impl", "num_tokens"])["median_ms"]
    assert list(times.index) == p1.tokens
    assert times.loc[128, "triton"] == rows[("triton", 128)]
    for t in p1.tokens:
        assert times.loc[t, "T_sol (H200 datasheet)"] == pytest.approx(roofline.sol_time(P1, t, "H200") * 1e3)
    best = benchmark.best_peer(p1)
    speedups = benchmark.speedup_table(p1)
    for t in p1.tokens:
        peer_times = {impl: rows[(impl, t)] for impl in benchmark.baseline_labels() if (impl, t) in rows.index}
        assert best.loc[t, "impl"] == min(peer_times, key=peer_times.get)
        assert speedups.loc[t, "triton"] == pytest.approx(min(peer_times.values()) / rows[("triton", t)])
    fractions = benchmark.roofline_fraction_table(p1)
    assert fractions.loc[8192, "triton"] == pytest.approx(
        times.loc[8192, "T_sol (measured)"] / times.loc[8192, "triton"]
    )


def test_scores_recomputed_equal_the_files(loaded):
    for result in loaded.values():
        table = benchmark.impl_summary(result)
        recorded = result.meta["summary"]
        assert table.attrs["baseline"] == result.meta["baseline"]["impl"]
        for impl, row in table.iterrows():
            assert row["geomean_ms"] == pytest.approx(recorded[impl]["geomean_ms"], rel=1e-12), impl
            assert row["sol_score"] == pytest.approx(recorded[impl]["sol_score"], rel=1e-9), impl
            assert row["all_correct"] == recorded[impl]["all_correct"]
        t_k, t_b, t_sol = table.loc["triton", "geomean_ms"], table.attrs["baseline_ms"], table.attrs["sol_geomean_ms"]
        assert table.loc["triton", "sol_score"] == pytest.approx(1 / (1 + (t_k - t_sol) / (t_b - t_sol)))


def test_correctness_flags_peers_that_fail_the_element_rule(loaded):
    result = results.find(loaded, P2)
    table = benchmark.correctness_table(result)
    flagged = table[table["flag"] != ""]
    failing = set(result.frame.loc[result.frame["passes_element_rule"].eq(False), "impl"])
    assert set(flagged.index.get_level_values("impl")) == failing
    assert "grouped_mm" in failing and "triton" not in failing  # bf16 GEMMs fail it; ours must pass
    assert all(flag == "fails the element rule (peer)" for flag in flagged["flag"])
    pivot = benchmark.correctness_pivot(results.find(loaded, P2_BF16))
    assert not any(c.endswith("elements passing") for c in pivot.columns)  # no element rule for bf16


def test_styled_tables_and_figures_render(loaded, p1):
    pytest.importorskip("jinja2")
    html = benchmark.styled_times(p1).to_html()
    assert "µs" in html and "font-weight: bold" in html
    assert "×" in benchmark.styled_speedups(p1).to_html()
    assert "0." in benchmark.styled_fractions(p1).to_html() and "geomean" in benchmark.styled_summary(p1).to_html()
    assert "element rule" in benchmark.styled_correctness(p1).to_html()
    table = targets.targets_table(loaded)
    styler = targets.styled_targets(table)
    words = {True: "met", False: "NOT MET", None: "not settled"}
    assert list(styler.data["met"]) == [words[met] for met in table["met"]]
    shown = styler.to_html()
    for met, colour in ((True, "#1a7f37"), (False, "#cf222e"), (None, "#57606a")):
        assert (colour in shown) == any(value is met for value in table["met"]), words[met]
    assert benchmark.provenance_table(loaded).loc[p1.csv.name, "driver"] == p1.provenance["driver_version"]
    assert json.dumps(benchmark.recorded_summary(p1))  # plain JSON
    figures = [
        benchmark.per_case_figure(loaded, "time"),
        benchmark.per_case_figure({k: loaded[k] for k in list(loaded)[:1]}, "speedup"),
    ]
    for figure in figures:
        assert isinstance(figure, matplotlib.figure.Figure) and figure.axes
        plt.close(figure)
    with pytest.raises(ValueError, match="kind: expected one of"):
        benchmark.per_case_figure(loaded, "speed")


def test_run_benchmark_reads_back_what_the_harness_wrote(tmp_path, monkeypatch):
    commands = []

    def fake_run(command, **kwargs):  # the harness's output, without running it
        commands.append(command)
        folder = tmp_path / "cpu"
        folder.mkdir()
        for suffix in (".csv", ".json"):
            shutil.copy(
                (H200_RESULTS / "2026-11-29-swiglu_down_backward-bfloat16").with_suffix(suffix),
                folder / f"2030-01-01-{P1}-bfloat16-small{suffix}",
            )
        return benchmark.subprocess.CompletedProcess(command, 0, stdout="report", stderr="")

    monkeypatch.setattr(benchmark.subprocess, "run", fake_run)
    found = benchmark.run_benchmark(P1, "1,2", tmp_path)
    assert commands[0][1:] == ["-m", "moe_lib.bench", "--problem", P1, "--tokens", "1,2", "--out", str(tmp_path)]
    assert list(found) == ["swiglu_down_backward-bfloat16-small"]
    assert isinstance(next(iter(found.values())).frame, pd.DataFrame)

    def failing_run(command, **kwargs):
        return benchmark.subprocess.CompletedProcess(command, 2, stdout="", stderr="error: --tokens: bad")

    monkeypatch.setattr(benchmark.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match="exit code 2:\nerror: --tokens: bad"):
        benchmark.run_benchmark(P1, "x", tmp_path / "other")


# ---------------------------------------------------------------- targets


def _with_times(result, impl, scale):
    frame = result.frame.copy()
    mine = frame["impl"] == impl
    frame.loc[mine, "median_ms"] = frame.loc[mine, "median_ms"] * scale
    return dataclasses.replace(result, frame=frame)


P1_SPEEDUP = "≥ 1.5× faster than torch.compile (geomeans)"
P1_NO_SLOWER = "no case slower than torch.compile"
P1_FEW_TOKENS = "T ≤ 16 in ≤ 12 µs"
P1_OFFICIAL = "in NVIDIA's harness: all 16 workloads pass, geomean ≤ 40 µs"
P2_LAYER_PEER = "the layer (forward + backward) faster than SonicMoE at 2048, 8192 and 32768 tokens"
P2_LAYER_RATE = "the layer at T = 32768 at ≥ 620 TFLOP/s (18·T·K·H·I)"


def test_every_problem_lists_targets_of_known_kinds():
    for name in problems.PROBLEM_NAMES:
        listed = targets.problem_targets(name)
        assert listed and all(t["kind"] in targets.KINDS and t["name"] for t in listed), name


def test_targets_on_the_committed_files(loaded, p1):
    table = targets.targets_table(loaded)
    assert list(dict.fromkeys(table["problem"])) == [problems.load(name).short for name in problems.PROBLEM_NAMES]
    table = table.set_index(["problem", "target"])
    fast_us = p1.meta["summary"]["triton_fast"]["geomean_ms"] * 1e3
    speedup = p1.meta["summary"]["torch_compile"]["geomean_ms"] * 1e3 / fast_us
    row = table.loc[("P1", f"{P1_SPEEDUP} (triton_fast)")]
    assert row["value"] == pytest.approx(speedup) and row["met"] == (speedup >= 1.5)
    worst_small = p1.frame.query("impl == 'triton_fast' and num_tokens <= 16")["median_ms"].max() * 1e3
    row = table.loc[("P1", f"{P1_FEW_TOKENS} (triton_fast)")]
    assert row["value"] == pytest.approx(worst_small) and row["met"] == (worst_small <= 12)
    p2 = results.find(loaded, P2)
    ours = p2.frame.query("impl == 'triton'").set_index("num_tokens")["median_ms"]
    worst = max(ours[t] / targets.precision_floor_ms(p2, t, 28) for t in p2.tokens)
    row = table.loc[("P2 fp32", "every case ≤ 1.25× its floor")]
    assert row["value"] == pytest.approx(worst) and row["met"] is (False if worst > 1.25 else None)
    bf16 = results.find(loaded, P2_BF16).frame.query("impl == 'triton'").set_index("num_tokens")
    assert table.loc[("P2 bf16", "T = 2048 in ≤ 7.5 ms"), "value"] == bf16.loc[2048, "median_ms"]
    assert table.loc[("P1", "correct on every case and passes the element rule"), "met"] is True


def test_targets_read_from_the_other_committed_runs(loaded):
    """NVIDIA's harness, the layer's training step beside SonicMoE, and the model suite: each target's value
    recomputed here from the committed files."""
    from moe_lib.lab import models, official_runs, training_step

    table = targets.targets_table(loaded).set_index(["problem", "target"])
    run = official_runs.load_official_runs(P1)["triton"]
    latencies = [w["latency_ms"] for w in run.meta["workloads"] if w["status"] == official_runs.PASSED]
    geo = math.exp(sum(map(math.log, latencies)) / len(latencies)) * 1e3
    row = table.loc[("P1", P1_OFFICIAL)]
    assert row["value"] == pytest.approx(geo) and row["met"] == (len(latencies) == 16 and geo <= 40)
    layer = training_step.load_layer_runs(problem=P2_BF16)
    layer = layer[layer["mode"] == "forward_backward"].pivot_table(
        index="num_tokens", columns="impl", values="median_ms"
    )
    ratios = [layer.loc[t, "triton_saved"] / layer.loc[t, "sonicmoe"] for t in (2048, 8192, 32768)]
    row = table.loc[("P2 bf16", f"{P2_LAYER_PEER} (triton_saved)")]
    assert row["value"] == pytest.approx(max(ratios)) and row["met"] is bool(max(ratios) < 1)
    rate = 18 * 32768 * 8 * 4096 * 2048 / (layer.loc[32768, "triton_saved"] * 1e-3) / 1e12
    row = table.loc[("P2 bf16", f"{P2_LAYER_RATE} (triton_saved)")]
    assert row["value"] == pytest.approx(rate) and row["met"] is bool(rate >= 620)
    runs = models.load_model_runs()
    per_model = models.geomean_table(models.speedup_table(runs, P2_BF16))
    row = table.loc[("P2 bf16", "at every model shape: ≥ 1.2× grouped_mm (geomean), no case slower")]
    assert row["value"] == pytest.approx(per_model["geomean vs grouped_mm"].min())
    assert row["met"] is bool(
        (per_model["geomean vs grouped_mm"] >= 1.2).all() and (per_model["min vs grouped_mm"] >= 1).all()
    )


def test_p2_case_targets_name_the_floor_of_todays_decomposition(loaded):
    from moe_lib.lab import ledger

    table = targets.targets_table(loaded).set_index(["problem", "target"])
    p2 = results.find(loaded, P2)
    floor = ledger.decomposition_floor_ms(P2, 2048, p2.measured_spec)
    assert 15.3 < floor < 2 * 15.3  # eight weight-sized passes of fp32 weights: more than the target allows
    note = table.loc[("P2 fp32", "T = 2048 in ≤ 15.3 ms"), "note"]
    assert f"≥ {floor:.2f} ms" in note and "above the target" in note
    note = table.loc[("P2 bf16", f"{P2_LAYER_RATE} (triton_saved)"), "note"]
    assert "today's decomposition" not in note  # a layer's target: the backward's decomposition does not bound it
    assert ledger.decomposition_floor_ms(P1, 2048, p2.measured_spec) is None
    assert all("decomposition" not in n for n in table.loc["P1", "note"])


def test_precision_floor_counts_the_precision_flops(loaded):
    p2 = results.find(loaded, P2)
    spec = p2.measured_spec
    t = 8192
    precision = 28 * t * 8 * 4096 * 2048 / spec.bf16_dense_flops * 1e3
    traffic = roofline.minimal_bytes(P2, t) / spec.dram_bandwidth * 1e3
    assert targets.precision_floor_ms(p2, t, 28) == pytest.approx(max(precision, traffic))
    assert precision > traffic  # at 8192 tokens the precision's tensor work is the floor


def test_targets_met_and_unsettled_when_the_numbers_say_so(loaded, p1):
    fast = dict(loaded, **{p1.key: _with_times(p1, "triton_fast", 1e-3)})  # a thousand times faster
    met = targets.targets_table(fast).set_index(["problem", "target"])["met"]
    assert met[("P1", f"{P1_SPEEDUP} (triton_fast)")] is True
    assert met[("P1", f"{P1_NO_SLOWER} (triton_fast)")] is True
    assert met[("P1", f"{P1_FEW_TOKENS} (triton_fast)")] is True
    partial = dataclasses.replace(p1, frame=p1.frame[p1.frame["num_tokens"] <= 16])  # 5 of the 16 cases
    table = targets.targets_table({p1.key: _with_times(partial, "triton_fast", 1e-3)}).set_index(["problem", "target"])
    assert table.loc[("P1", f"{P1_SPEEDUP} (triton_fast)"), "met"] is None  # part of the suite settles nothing
    assert table.loc[("P1", f"{P1_NO_SLOWER} (triton_fast)"), "met"] is None
    assert table.loc[("P1", f"{P1_FEW_TOKENS} (triton_fast)"), "met"] is True  # every few-token case is there
    row = table.loc[("P2 bf16", "T = 2048 in ≤ 7.5 ms")]
    assert row["ours"] == "not measured" and row["met"] is None
    no_compile = dataclasses.replace(p1, frame=p1.frame[p1.frame["impl"] != "torch_compile"])
    table = targets.targets_table({p1.key: no_compile}).set_index(["problem", "target"])
    assert table.loc[("P1", f"{P1_SPEEDUP} (triton_fast)"), "ours"] == "torch_compile not measured"


def test_a_target_of_an_unknown_kind_names_its_file(monkeypatch, tmp_path):
    source, folder = problems.PROBLEMS_DIR / P1, tmp_path / P1
    folder.mkdir()
    for name in ("definition.json", "workload.jsonl"):
        (folder / name).write_text((source / name).read_text())
    lab = json.loads((source / "lab.json").read_text())
    (folder / "lab.json").write_text(json.dumps(dict(lab, targets=[{"name": "fast", "kind": "fastest"}])))
    monkeypatch.setattr(problems, "PROBLEMS_DIR", tmp_path)
    problems.load.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"lab.json: target 'fast' has kind 'fastest', expected one of"):
            targets.problem_targets(P1)
    finally:
        problems.load.cache_clear()


def test_model_speedup_colours_a_slowdown_only_below_one():
    from moe_lib.lab import models

    assert models._speedup_colour(0.99) == "color: #b00020"
    assert models._speedup_colour(1.0) == ""  # a tie is no slowdown
    assert models._speedup_colour(models.TARGET_SPEEDUP * 1.01) == "font-weight: bold"
    assert models._speedup_colour(None) == ""
