"""moe_lib.lab.engine_runs: notebook 05's engine section reads the committed runs, and each number is the file's."""

import json
import shutil

import pandas as pd
import pytest

from moe_lib.lab import engine_runs
from moe_lib.lab.results import RESULTS_DIR, ResultFileError, resolve_path

H200 = RESULTS_DIR / "H200"


def test_every_committed_engine_run_is_read_with_its_commit():
    runs = engine_runs.load_engine_runs()
    files = set(runs["file"])
    wanted = {
        f"data/results/H200/{p.relative_to(H200).with_suffix('.csv')}"
        for p in list(H200.glob("*.json")) + list((H200 / "runs").glob("*.json"))
        if set(json.loads(p.read_text()).get("impls") or ()) & set(engine_runs.ENGINE_IMPLS)
    }
    assert files == wanted and any("/runs/" in f for f in files)
    for file, group in runs.groupby("file"):
        meta = json.loads(resolve_path(file).with_suffix(".json").read_text())
        assert set(group["commit"]) == {meta["provenance"]["git_commit"]}


def test_engine_table_is_the_files_medians():
    runs = engine_runs.load_engine_runs()
    table = engine_runs.engine_table(runs)
    assert len(table)
    for (file, mode, tokens), row in table.iterrows():
        csv = pd.read_csv(resolve_path(file))
        case = csv[csv["num_tokens"] == tokens].set_index("impl")["median_ms"]
        engine = row["engine"]
        assert row["engine (ms)"] == case[engine]
        assert row["kernels A-W-D-C (ms)"] == case[engine_runs.ENGINE_IMPLS[engine]]
        assert row["over grouped_mm"] == pytest.approx(case["grouped_mm"] / case[engine])
        assert mode == ("forward_backward" if engine.endswith("saved") else "op")


def test_sonicmoe_comes_from_another_run_and_says_so():
    runs = engine_runs.load_engine_runs()
    sonic = engine_runs.sonicmoe_beside(runs)
    assert len(sonic) and sonic.attrs["sonicmoe_file"] not in sonic.attrs["engine_files"]
    csv = pd.read_csv(resolve_path(sonic.attrs["sonicmoe_file"]))
    for (_, tokens), row in sonic.iterrows():
        want = csv[(csv["impl"] == "sonicmoe") & (csv["num_tokens"] == tokens)]["median_ms"].item()
        assert row["sonicmoe (ms)"] == want
        assert row["engine / sonicmoe"] == pytest.approx(row["engine (ms)"] / want)


def test_models_table_and_reading():
    runs = engine_runs.load_engine_runs()
    models = engine_runs.models_table(runs)
    timed = runs[(runs["suite"] == "models") & (runs["impl"] == "triton_engine")].dropna(subset=["median_ms"])
    assert set(models.index) == set(zip(timed["file"], timed["model"], timed["num_tokens"], strict=True))
    lines = engine_runs.reading(engine_runs.engine_table(runs), engine_runs.sonicmoe_beside(runs), models)
    assert len(lines) == 4 and all("commit" in line for line in lines[:3])


def test_a_malformed_or_missing_run_is_named(tmp_path):
    folder = tmp_path / "H200" / "runs"
    folder.mkdir(parents=True)
    source = H200 / "runs" / "2026-12-04-moe_experts_backward_bf16-bfloat16-engine"
    shutil.copy(source.with_suffix(".json"), folder / "x.json")
    (folder / "x.csv").write_text("impl,median_ms\ntriton_engine,1.0\n")  # no num_tokens, no status
    with pytest.raises(ResultFileError, match="x.csv"):
        engine_runs.load_engine_runs(tmp_path, "H200")
    with pytest.raises(FileNotFoundError, match="results_dir"):
        engine_runs.load_engine_runs(tmp_path, "H100")


def test_reading_without_engine_runs_says_nothing():
    """A results folder with no engine run (a fresh GPU's report): no sentence, no error."""
    import pandas as pd

    from moe_lib.lab.engine_runs import reading

    assert reading(pd.DataFrame(), pd.DataFrame(), pd.DataFrame()) == []


def test_sonicmoe_of_the_same_run_sits_beside_the_engine():
    """The H100's model-suite runs timed SonicMoE beside the engine: its medians, their ratio, and the reading."""
    runs = engine_runs.load_engine_runs(gpu_key="H100-SXM")
    models = engine_runs.models_table(runs)
    assert len(models) and models["sonicmoe (ms)"].notna().all() and models.index.is_unique
    for (file, model, tokens), row in models.iterrows():
        csv = pd.read_csv(resolve_path(file))
        case = csv[(csv["model"] == model) & (csv["num_tokens"] == tokens)].set_index("impl")["median_ms"]
        assert row["engine (ms)"] == case[row["engine"]] and row["sonicmoe (ms)"] == case["sonicmoe"]
        assert row["over sonicmoe"] == pytest.approx(case["sonicmoe"] / case[row["engine"]])
    line = engine_runs.reading(pd.DataFrame(), pd.DataFrame(), models)[-1]
    assert f"ahead of sonicmoe (same run) in {(models['over sonicmoe'] > 1).sum()} of {len(models)}" in line


def test_same_run_sonicmoe_is_each_gpus_newest_run_and_its_numbers():
    """Ours beside SonicMoE from one run: each row's times and peaks are its file's, and no newer committed run of
    that GPU and suite timed both."""
    table = engine_runs.same_run_sonicmoe()
    assert len(table) and set(table["gpu"]) >= {"H100-SXM"}
    for file, group in table.groupby("file"):
        csv = pd.read_csv(resolve_path(file))
        meta = json.loads(resolve_path(file).with_suffix(".json").read_text())
        ours = next(impl for impl in engine_runs.OURS_SAVED if impl in set(csv["impl"]))
        for _, row in group.iterrows():
            case = csv[csv["num_tokens"] == row["num_tokens"]]
            if "model" in csv:
                case = case[case["model"] == row["model"]]
            case = case.set_index("impl")
            assert row["ours (ms)"] == case.loc[ours, "median_ms"]
            assert row["sonicmoe (ms)"] == case.loc["sonicmoe", "median_ms"]
            assert row["ours (GB)"] == case.loc[ours, "peak_mem_gb"]
            assert row["sonicmoe (GB)"] == case.loc["sonicmoe", "peak_mem_gb"]
            assert row["time ratio"] == pytest.approx(row["ours (ms)"] / row["sonicmoe (ms)"])
        folder = resolve_path(file).parent
        for other in folder.glob("*.json"):
            theirs = json.loads(other.read_text())
            same_kind = (theirs.get("suite") == meta.get("suite")) and theirs.get("mode") == "forward_backward"
            both = "sonicmoe" in theirs.get("impls", ()) and set(theirs.get("impls", ())) & set(engine_runs.OURS_SAVED)
            if same_kind and both:
                assert theirs["provenance"]["date_utc"] <= meta["provenance"]["date_utc"], other
    lines = engine_runs.same_run_reading(table)
    assert len(lines) == table["gpu"].nunique() and all("commit" in line for line in lines)


def test_same_run_sonicmoe_without_such_a_run_is_empty(tmp_path):
    (tmp_path / "H100").mkdir()
    table = engine_runs.same_run_sonicmoe(tmp_path)
    assert table.empty and list(table.columns) == engine_runs.SAME_RUN_COLUMNS
    assert engine_runs.same_run_reading(table) == []


def test_quack_probe_rows_are_the_files_rates_over_grouped_mm():
    probe = engine_runs.quack_probe()
    assert len(probe) and {"quack_default", "quack_tuned", "coop_m128n256k64_s3"} <= set(probe["column"])
    for file, group in probe.groupby("file"):
        runs = json.loads(resolve_path(file).read_text())["runs"]
        for _, row in group.iterrows():
            mine, base = runs[row["column"]]["results"][row["shape"]], runs["grouped_mm"]["results"][row["shape"]]
            assert mine["check"] == base["check"] == "ok"
            assert row["tflops"] == mine["tflops"]
            assert row["of grouped_mm"] == pytest.approx(mine["tflops"] / base["tflops"])
    table = engine_runs.quack_probe_table(probe)
    for run, wide in table.groupby(level=0):
        wide = wide.droplevel(0).dropna(axis=1, how="all")
        shapes = wide.drop(index="geomean")
        geomean = shapes.apply(lambda c: c.prod() ** (1 / len(c)))
        assert wide.loc["geomean"].to_numpy() == pytest.approx(geomean.to_numpy()), run
        assert "engine 128 × 256" in wide.columns and any(c.startswith("QuACK") for c in wide.columns)


def test_quack_probe_names_a_malformed_file_and_is_empty_without_one(tmp_path):
    assert (
        engine_runs.quack_probe(tmp_path).empty
        and engine_runs.quack_probe_table(engine_runs.quack_probe(tmp_path)).empty
    )
    (tmp_path / "H100" / "tuning").mkdir(parents=True)
    (tmp_path / "H100" / "tuning" / "x-quack-grouped-probe-at-0.json").write_text('{"runs": 3}')
    with pytest.raises(ResultFileError, match="x-quack-grouped-probe-at-0.json"):
        engine_runs.quack_probe(tmp_path)
