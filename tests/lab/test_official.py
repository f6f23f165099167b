"""moe_lib.lab.benchmark on the committed runs beside the result files: NVIDIA's harness joined with graph
replay (the two rulers), and the layer's training step (bench --mode); checked against the raw files."""

import json
import math
import shutil
import statistics

import matplotlib
import pandas as pd
import pytest

from moe_lib import problems
from moe_lib.bench.peers import layer_peers_for
from moe_lib.lab import official_runs, results, training_step

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

P1 = "swiglu_down_backward"
P2_BF16 = "moe_experts_backward_bf16"
H200_RESULTS = problems.DATA_DIR / "results" / "H200"


def _official_documents(problem=P1) -> dict:
    """{impl: the JSON of its newest run of NVIDIA's harness}, read here without moe_lib."""
    found = {}
    for path in sorted(H200_RESULTS.glob(f"*-{problem}-official-*.json")):  # dated names: the newest sorts last
        document = json.loads(path.read_text())
        found[document["impl"]] = dict(document, file=path.name)
    return found


def _newest_graph_csv(problem=P1):
    """The newest full-size graph-replay result file (mode op) of ``problem``."""
    newest = None
    for path in sorted(H200_RESULTS.glob(f"*-{problem}-*.csv")):
        meta_path = path.with_suffix(".json")
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if (
            meta.get("problem") == problem
            and meta.get("mode", "op") == "op"
            and not meta["provenance"]["small"]
            and meta.get("suite") != "models"
        ):
            newest = path
    return newest


def _layer_csvs() -> list:
    """The newest committed layer run of each kind at the problems' own shapes (the model suite's training steps
    are read by lab.models): files named <date>-<kind>.csv, later dates sort later."""
    newest = {}
    for path in sorted(H200_RESULTS.glob("*.csv")):
        meta_path = path.with_suffix(".json")
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if meta.get("mode") in ("forward", "forward_backward") and meta.get("suite") != "models":
            newest[path.stem[len("2026-11-30-") :]] = path
    return list(newest.values())


@pytest.fixture(scope="module")
def rulers():
    return official_runs.ruler_table(P1)


@pytest.fixture(scope="module")
def layer():
    return training_step.load_layer_runs()


# ---------------------------------------------------------------- two rulers


def test_the_committed_runs_exist():
    assert set(_official_documents()) >= {"triton", "triton_fast"}
    assert _newest_graph_csv() is not None and _layer_csvs()


def test_ruler_table_joins_every_workload_with_its_graph_median(rulers):
    documents = _official_documents()
    graph = pd.read_csv(_newest_graph_csv()).set_index(["impl", "num_tokens"])
    assert list(rulers.columns) == ["num_tokens", "impl", "graph_us", "official_us", "gap_us", "status"]
    assert list(dict.fromkeys(rulers["impl"])) == [impl for impl in results.IMPLS if impl in documents]
    assert len(rulers) == sum(len(document["workloads"]) for document in documents.values())
    assert not rulers.duplicated(["impl", "num_tokens"]).any()
    for impl, rows in rulers.groupby("impl"):
        assert list(rows["num_tokens"]) == sorted(w["num_tokens"] for w in documents[impl]["workloads"])
    table = rulers.set_index(["impl", "num_tokens"])
    for impl, document in documents.items():
        for workload in document["workloads"]:
            row = table.loc[(impl, workload["num_tokens"])]
            assert row["status"] == workload["status"]
            graph_us = graph.loc[(impl, workload["num_tokens"]), "median_ms"] * 1e3
            assert row["graph_us"] == pytest.approx(graph_us, rel=1e-12)
            if workload["latency_ms"] is None:  # failed in the harness: not timed there
                assert math.isnan(row["official_us"]) and math.isnan(row["gap_us"])
            else:
                assert row["official_us"] == pytest.approx(workload["latency_ms"] * 1e3, rel=1e-12)
                assert row["gap_us"] == pytest.approx(workload["latency_ms"] * 1e3 - graph_us, rel=1e-9)


def test_ruler_table_rows_read_by_hand(rulers):
    """Two rows checked against the raw JSON and CSV lines themselves: a passing and a failing workload."""
    documents = _official_documents()
    graph = pd.read_csv(_newest_graph_csv())
    table = rulers.set_index(["impl", "num_tokens"])
    passing = next(w for w in documents["triton"]["workloads"] if w["num_tokens"] == 512)
    median_ms = graph.query("impl == 'triton' and num_tokens == 512")["median_ms"].item()
    assert passing["status"] == "PASSED"
    assert table.loc[("triton", 512), "gap_us"] == pytest.approx((passing["latency_ms"] - median_ms) * 1e3)
    failing = [w for w in documents["triton_fast"]["workloads"] if w["status"] != "PASSED"]
    assert failing  # the fast path fails the harness's check on its std-1 inputs
    for workload in failing:
        row = table.loc[("triton_fast", workload["num_tokens"])]
        assert row["status"] == workload["status"] and math.isnan(row["official_us"])


def test_ruler_attrs_name_the_files_and_commits(rulers):
    documents = _official_documents()
    graph_csv = _newest_graph_csv()
    graph_meta = json.loads(graph_csv.with_suffix(".json").read_text())
    assert rulers.attrs["note"] == ""
    assert rulers.attrs["graph"]["file"] == graph_csv.name
    assert rulers.attrs["graph"]["commit"].startswith(graph_meta["provenance"]["git_commit"][:10])
    for impl, document in documents.items():
        recorded = rulers.attrs["official"][impl]
        assert recorded["file"] == document["file"]
        assert recorded["commit"].startswith(document["provenance"]["git_commit"][:10])
        passed = sum(w["status"] == "PASSED" for w in document["workloads"])
        assert recorded["passed"] == f"{passed}/{len(document['workloads'])}"
        assert passed == document["summary"]["passed"]
    lines = official_runs.ruler_provenance(rulers)
    commits = {graph_meta["provenance"]["git_commit"]} | {d["provenance"]["git_commit"] for d in documents.values()}
    assert len(lines) == 1 + len(documents) + (len(commits) > 1)
    assert ("different commits" in lines[-1]) == (len(commits) > 1)


def test_ruler_bands_count_and_summarise_the_gaps(rulers):
    bands = official_runs.ruler_bands(rulers)
    documents = _official_documents()
    for impl, document in documents.items():
        few = [w for w in document["workloads"] if w["num_tokens"] <= 16]
        row = bands.loc[(impl, "1 ≤ T ≤ 16")]
        assert row["workloads"] == len(few)
        assert row["passed"] == sum(w["status"] == "PASSED" for w in few)
        assert bands.loc[impl, "passed"].sum() == document["summary"]["passed"]
    table = rulers.set_index(["impl", "num_tokens"])
    gaps = [table.loc[("triton", t), "gap_us"] for t in table.loc["triton"].index if t >= 512]
    row = bands.loc[("triton", "T ≥ 512")]
    assert row["gap median (µs)"] == pytest.approx(statistics.median(gaps))
    assert (row["gap min (µs)"], row["gap max (µs)"]) == (pytest.approx(min(gaps)), pytest.approx(max(gaps)))
    reading = official_runs.ruler_reading(rulers)
    assert len(reading) == len(documents)
    assert reading[0].startswith(f"triton: {documents['triton']['summary']['passed']}/16 workloads pass")
    assert f"median {statistics.median(gaps):+.1f}" in reading[0]
    # bands without a workload are left out, and a band whose workloads all failed says so
    narrow = official_runs.ruler_bands(rulers, bands=((1, 1), (2, 3)))
    assert list(narrow.index.get_level_values("tokens")) == ["1 ≤ T ≤ 1", "2 ≤ T ≤ 3"] * len(documents)
    all_failed = rulers.assign(status="INCORRECT_NUMERICAL")
    assert official_runs.ruler_bands(all_failed)["gap median (µs)"].isna().all()
    assert "no workload passed" in official_runs.ruler_reading(all_failed)[0]


def test_newest_official_run_per_impl_others_left_out(tmp_path):
    folder = tmp_path / "H200"
    folder.mkdir()
    document = _official_documents()["triton"]
    document.pop("file")
    older = dict(document, workloads=[dict(w, latency_ms=1.0) for w in document["workloads"]])
    (folder / f"2026-01-01-{P1}-official-triton.json").write_text(json.dumps(older))
    (folder / f"2026-02-01-{P1}-official-triton.json").write_text(json.dumps(document))
    other = dict(document, problem="moe_experts_backward")  # another problem's run
    (folder / "2026-03-01-moe_experts_backward-official-triton.json").write_text(json.dumps(other))
    runs = official_runs.load_official_runs(P1, tmp_path, "H200")
    assert list(runs) == ["triton"] and runs["triton"].date == "2026-02-01"
    assert runs["triton"].workloads["latency_ms"].tolist() == [w["latency_ms"] for w in document["workloads"]]
    # no graph-replay file in that folder: the harness's side alone, and a note saying so
    table = official_runs.ruler_table(P1, tmp_path, "H200")
    assert len(table) == len(document["workloads"]) and table["graph_us"].isna().all()
    assert table["official_us"].notna().all() and "No graph-replay result file" in table.attrs["note"]
    (folder / f"2026-04-01-{P1}-official-triton_fast.json").write_text(json.dumps(dict(document, workloads=3)))
    with pytest.raises(results.ResultFileError, match="official-triton_fast.json: workloads"):
        official_runs.load_official_runs(P1, tmp_path, "H200")


def test_rulers_without_files_say_so(tmp_path):
    no_folder = official_runs.ruler_table(P1, "data/results", "B200")
    no_run = official_runs.ruler_table("moe_experts_backward")  # no harness run of P2 is committed
    for table in (no_folder, no_run):
        assert table.empty and list(table.columns) == official_runs.RULER_COLUMNS
        assert table.attrs["note"].startswith("No run of NVIDIA's harness")
        assert official_runs.ruler_provenance(table) == [] and official_runs.ruler_reading(table) == []
    folder = tmp_path / "H200"
    folder.mkdir()
    for suffix in (".csv", ".json"):  # the graph-replay file alone
        shutil.copy(_newest_graph_csv().with_suffix(suffix), folder / _newest_graph_csv().with_suffix(suffix).name)
    table = official_runs.ruler_table(P1, tmp_path, "H200")
    assert table.empty and table.attrs["note"].startswith("No run of NVIDIA's harness")
    with pytest.raises(ValueError, match="no workload to draw"):
        official_runs.ruler_figure(table)


def test_ruler_figure_and_styled_table(rulers):
    pytest.importorskip("jinja2")
    figure = official_runs.ruler_figure(rulers)
    assert len(figure.axes) == rulers["impl"].nunique()
    for ax, (impl, rows) in zip(figure.axes, rulers.groupby("impl", sort=False), strict=True):
        assert ax.get_title() == impl and ax.get_xscale() == ax.get_yscale() == "log"
        failed = int((rows["status"] != "PASSED").sum())
        marked = sum(len(c.get_offsets()) for c in ax.collections)  # the failed workloads' red crosses
        assert marked == failed
    plt.close(figure)
    html = official_runs.styled_rulers(rulers).to_html()
    assert "INCORRECT_NUMERICAL" in html and "#cf222e" in html


# ---------------------------------------------------------------- training step


def test_layer_runs_are_the_committed_rows(layer):
    paths = _layer_csvs()
    assert list(layer.columns) == training_step.LAYER_COLUMNS
    assert set(layer["file"]) == {path.name for path in paths}
    raw = pd.concat([pd.read_csv(path).assign(file=path.name) for path in paths], ignore_index=True)
    assert len(layer) == len(raw)
    mine = layer.set_index(["file", "mode", "impl", "num_tokens"])
    for _, row in raw.iterrows():
        got = mine.loc[(row["file"], row["mode"], row["impl"], row["num_tokens"])]
        assert got["status"] == row["status"] and got["problem"] == row["problem"]
        if row["status"] == "ok":
            assert got["median_ms"] == row["median_ms"] and got["peak_mem_gb"] == row["peak_mem_gb"]
            assert got["timing"] == row["timing"]
        else:
            assert math.isnan(got["median_ms"]) and got["timing"] is None
    assert set(layer["mode"]) <= set(training_step.LAYER_MODES)
    p2 = layer[layer["problem"] == P2_BF16]
    row = p2.query("impl == 'triton_saved' and num_tokens == 8192 and mode == 'forward_backward'").iloc[0]
    line = raw.query("impl == 'triton_saved' and num_tokens == 8192 and mode == 'forward_backward'").iloc[0]
    assert (row["median_ms"], row["peak_mem_gb"], row["timing"]) == (line["median_ms"], line["peak_mem_gb"], "graph")
    assert set(layer.attrs["runs"]) == {path.name for path in paths}


def test_layer_overview_names_what_the_runs_hold(layer):
    runs = layer[layer["problem"] == P2_BF16]
    found = training_step.layer_impls(runs)
    assert set(found) == set(runs["impl"])
    assert list(found)[-2:] == ["triton", "triton_saved"]  # LAYER_IMPLS' order: ours last
    for impl, status in found.items():
        statuses = set(runs.loc[runs["impl"] == impl, "status"])
        assert (status == "ok") == (statuses == {"ok"})
    lines = training_step.layer_overview(runs)
    assert lines[0].startswith("forward: ") and lines[1].startswith("forward + backward: ")
    for mode, line in zip(training_step.LAYER_MODES, lines, strict=False):
        assert line.endswith("no run committed") == (mode not in set(runs["mode"]))
    assert ("implementations in the runs: " + ", ".join(found)) in lines
    left_out = [label for label in layer_peers_for(P2_BF16) if label not in found]
    assert any(line.endswith(", ".join(left_out)) for line in lines) == bool(left_out)
    untimed = [impl for impl, status in found.items() if status != "ok"]
    assert sum(line.split(" not timed: ")[0] in untimed for line in lines if " not timed: " in line) == len(untimed)


def test_layer_table_and_figure(layer):
    pytest.importorskip("jinja2")
    runs = layer[layer["problem"] == P2_BF16]
    times = training_step.layer_table(runs)
    timed = runs.dropna(subset=["median_ms"])
    assert set(times.columns) == set(timed["impl"])  # an implementation never timed has no column
    for _, row in timed.iterrows():
        assert times.loc[(row["mode"], row["num_tokens"]), row["impl"]] == row["median_ms"]
    memory = training_step.layer_table(runs, "peak_mem_gb")
    assert memory.shape == times.shape
    assert "font-weight: bold" in training_step.styled_layer(runs).to_html()
    figure = training_step.layer_figure(runs)
    assert len(figure.axes) == 2 * runs["mode"].nunique()
    plt.close(figure)
    two = pd.concat([runs, runs.assign(problem="swiglu_down_backward", file="other.csv")])
    with pytest.raises(ValueError, match="expected one problem's runs"):
        training_step.layer_table(two)
    twice = pd.concat([runs, runs.assign(file="again.csv")])  # the same implementations timed in two files
    with pytest.raises(ValueError, match="each implementation of a mode from one file"):
        training_step.layer_table(twice)


def test_saved_activations_trade_memory_for_recompute(layer):
    runs = layer[layer["problem"] == P2_BF16]
    table = training_step.saved_activations_table(runs)
    raw = pd.concat([pd.read_csv(path) for path in _layer_csvs()]).query(f"problem == '{P2_BF16}'")
    both = raw[raw["impl"].isin(["triton", "triton_saved"]) & (raw["status"] == "ok")]
    cases = both.groupby(["mode", "num_tokens"])["impl"].nunique()
    assert list(table.index) == sorted(cases[cases == 2].index) and len(table)
    meta = json.loads(_layer_csvs()[0].with_suffix(".json").read_text())
    K, I = meta["axes"]["top_k"], meta["axes"]["intermediate_size"]
    for (mode, tokens), row in table.iterrows():
        lines = both[(both["mode"] == mode) & (both["num_tokens"] == tokens)].set_index("impl")
        recompute, saved = lines.loc["triton"], lines.loc["triton_saved"]
        assert row["time saved (ms)"] == pytest.approx(recompute["median_ms"] - saved["median_ms"])
        assert row["extra memory (GB)"] == pytest.approx(saved["peak_mem_gb"] - recompute["peak_mem_gb"])
        assert row["2·T·K·I values (GB)"] == pytest.approx(2 * tokens * K * I * 2 / 1e9)  # bf16: 2 bytes
        # what the run measured is the kept g and u
        assert row["extra memory (GB)"] == pytest.approx(row["2·T·K·I values (GB)"], rel=0.05)
    reading = training_step.saved_activations_reading(table)
    assert len(reading) == len(table) and all("the kept g and u are" in line for line in reading)
    assert training_step.saved_activations_table(runs[runs["impl"] != "triton_saved"]).empty


def test_layer_runs_without_files_say_so(tmp_path):
    empty = training_step.load_layer_runs("data/results", "B200")
    assert empty.empty and list(empty.columns) == training_step.LAYER_COLUMNS
    assert (
        empty.attrs["note"] == "No training-step run (bench --mode forward or forward_backward) is committed in "
        "data/results/B200."
    )
    assert training_step.load_layer_runs(problem="moe_experts_backward").empty  # no fp32 layer run committed
    folder = tmp_path / "H200"
    folder.mkdir()
    path = _layer_csvs()[0]
    for date in ("2026-01-01", path.name[:10]):  # an older copy of the same kind is left out
        for suffix in (".csv", ".json"):
            shutil.copy(path.with_suffix(suffix), folder / (date + path.with_suffix(suffix).name[10:]))
    (folder / ("2026-01-01" + path.name[10:])).write_text("problem,impl\n")  # malformed but older: not read
    newest = training_step.load_layer_runs(tmp_path, "H200")
    assert set(newest["file"]) == {path.name} and len(newest) == len(pd.read_csv(path))
    path_csv = folder / path.name
    path_csv.write_text("problem,impl\n")
    with pytest.raises(results.ResultFileError, match="missing column"):
        training_step.load_layer_runs(tmp_path, "H200")


def test_op_mode_loading_is_unchanged():
    loaded = results.load_results()
    assert all(result.meta.get("mode", "op") == "op" for result in loaded.values())
    assert not any("forward_backward" in result.csv.name for result in loaded.values())


# ---------------------------------------------------------------- notebook 05 without these files


@pytest.mark.slow
def test_report_notebook_runs_without_the_harness_and_layer_files(tmp_path):
    """Notebook 05 on a results folder holding only the graph-replay files: both sections say so, no error."""
    papermill = pytest.importorskip("papermill")
    kernelspec = pytest.importorskip("jupyter_client.kernelspec")
    try:
        kernelspec.KernelSpecManager().get_kernel_spec("moe-backward-lab")
    except kernelspec.NoSuchKernel:
        pytest.skip("Jupyter kernel 'moe-backward-lab' not installed (make setup installs it)")
    folder = tmp_path / "results" / "H200"
    folder.mkdir(parents=True)
    for result in results.load_results().values():
        for path in (result.csv, result.csv.with_suffix(".json")):
            shutil.copy(path, folder / path.name)
    out = tmp_path / "out"
    out.mkdir()
    notebook = problems.DATA_DIR.parent / "notebooks" / "05_benchmark_report.ipynb"
    papermill.execute_notebook(
        str(notebook),
        str(out / notebook.name),
        parameters=dict(results_dir=str(tmp_path / "results"), output_dir=str(out)),
        kernel_name="moe-backward-lab",
        progress_bar=False,
        cwd=str(notebook.parent),
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rulers"] == {} and summary["training_step"] == {} and summary["model_suite"] == {}
    assert not any(name.startswith(("rulers_", "training_step_", "models_")) for name in summary["figures"])
    nbformat = pytest.importorskip("nbformat")
    executed = nbformat.read(out / notebook.name, as_version=4)
    printed = "".join(o.get("text", "") for cell in executed.cells for o in cell.get("outputs", []))
    assert "No run of NVIDIA's harness is committed" in printed and "No training-step run" in printed
    assert "No model-suite run" in printed
