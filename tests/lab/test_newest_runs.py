"""Every results loader of the notebooks picks the newest run of each kind (``moe_lib.lab``).

Each test copies a committed run into a temporary results folder twice, under an older and a newer date, with the
older copy's times changed (so that reading the wrong one shows), and asks the loader which run it read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from moe_lib import problems
from moe_lib.lab import models, official_runs, training_step
from moe_lib.lab import parallel as lab_parallel
from moe_lib.lab import results as lab_results

H200 = problems.DATA_DIR / "results" / "H200"
OLDER, NEWER = "2026-01-01", "2026-02-01"


def _copy_run(stem: str, folder: Path, date: str, *, slower: float = 1.0, date_utc: str | None = None) -> Path:
    """The committed run ``stem`` (CSV and JSON) under ``date`` in ``folder``, its ``*_ms`` columns times
    ``slower``, its JSON's date_utc ``date_utc`` (default: the date's midday); returns the CSV's path."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{date}-{stem[len('2026-12-01-') :]}"
    frame = pd.read_csv(H200 / f"{stem}.csv")
    for column in frame.columns:
        if column.endswith("_ms") and pd.api.types.is_float_dtype(frame[column]):
            frame[column] = frame[column] * slower
    frame.to_csv(folder / f"{name}.csv", index=False)
    document = json.loads((H200 / f"{stem}.json").read_text())
    document.setdefault("provenance", {})["date_utc"] = date_utc or f"{date}T12:00:00+00:00"
    (folder / f"{name}.json").write_text(json.dumps(document))
    return folder / f"{name}.csv"


@pytest.mark.parametrize("newer_first", [False, True])
def test_load_results_reads_the_newest_file_of_each_kind(tmp_path, newer_first):
    stem = "2026-12-03-swiglu_down_backward-bfloat16"
    folder = tmp_path / "H200"
    written = [_copy_run(stem, folder, OLDER, slower=2.0), _copy_run(stem, folder, NEWER)]
    if newer_first:  # the same dates, the newer file written first
        shutil.rmtree(folder)
        written = [_copy_run(stem, folder, NEWER), _copy_run(stem, folder, OLDER, slower=2.0)]
    loaded = lab_results.load_results(tmp_path, "H200")
    assert list(loaded) == ["swiglu_down_backward-bfloat16"]
    result = loaded["swiglu_down_backward-bfloat16"]
    assert result.date == NEWER and result.csv.name.startswith(NEWER)
    committed = pd.read_csv(H200 / f"{stem}.csv")
    assert result.frame["median_ms"].tolist() == pytest.approx(committed["median_ms"].tolist(), nan_ok=True)
    assert len(written) == 2


def test_load_official_runs_reads_the_newest_run_of_each_impl(tmp_path):
    folder = tmp_path / "H200"
    folder.mkdir()
    for stem in (
        "2026-12-02-swiglu_down_backward-official-triton",
        "2026-11-30-swiglu_down_backward-official-triton_fast",
    ):
        document = json.loads((H200 / f"{stem}.json").read_text())
        impl = document["impl"]
        slow = dict(document, workloads=[dict(w, latency_ms=99.0) for w in document["workloads"]])
        (folder / f"{OLDER}-swiglu_down_backward-official-{impl}.json").write_text(json.dumps(slow))
        (folder / f"{NEWER}-swiglu_down_backward-official-{impl}.json").write_text(json.dumps(document))
    runs = official_runs.load_official_runs("swiglu_down_backward", tmp_path, "H200")
    assert set(runs) == {"triton", "triton_fast"}
    for run in runs.values():
        assert run.path.name.startswith(NEWER) and 99.0 not in run.workloads["latency_ms"].tolist()


def test_load_parallel_results_and_scaling_runs_read_the_newest_run(tmp_path):
    folder = tmp_path / "H200"
    for dtype in ("bfloat16", "float32"):
        _copy_run(f"2026-12-01-moe_experts_parallel-{dtype}", folder, OLDER, slower=2.0)
        _copy_run(f"2026-12-01-moe_experts_parallel-{dtype}", folder, NEWER)
    runs = lab_parallel.load_parallel_results(tmp_path, "H200")
    assert list(runs) == ["bfloat16", "float32"]
    assert all(run.date == NEWER for run in runs.values())
    older = lab_parallel.load_parallel_results(tmp_path, "H200", date=OLDER)  # a day asked for by name
    assert all(run.date == OLDER for run in older.values())
    scaling = lab_parallel.load_scaling_runs(tmp_path, "H200")
    assert scaling and all(run.date == NEWER for run in scaling.values())
    committed = pd.read_csv(H200 / "2026-12-01-moe_experts_parallel-bfloat16.csv")
    assert runs["bfloat16"].frame["total_ms"].tolist() == pytest.approx(committed["total_ms"].tolist())


def test_load_rank_work_reads_the_newest_run(tmp_path):
    folder = tmp_path / "H200"
    for dtype in ("bfloat16", "float32"):
        _copy_run(f"2026-12-04-moe_experts_rank_work-{dtype}", folder, NEWER)
        _copy_run(f"2026-12-04-moe_experts_rank_work-{dtype}", folder, OLDER, slower=2.0)
    runs = lab_parallel.load_rank_work(tmp_path, "H200")
    assert list(runs) == ["bfloat16", "float32"] and all(run.date == NEWER for run in runs.values())
    committed = pd.read_csv(H200 / "2026-12-04-moe_experts_rank_work-bfloat16.csv")
    assert runs["bfloat16"].frame["same_work_ms"].tolist() == pytest.approx(committed["same_work_ms"].tolist())


def test_load_layer_runs_reads_the_newest_file_of_each_kind(tmp_path):
    folder = tmp_path / "H200"
    stem = "2026-12-02-swiglu_down_backward-bfloat16-forward_backward"
    _copy_run(stem, folder, NEWER)
    _copy_run(stem, folder, OLDER, slower=2.0)
    table = training_step.load_layer_runs(tmp_path, "H200")
    assert set(table["file"]) == {f"{NEWER}-swiglu_down_backward-bfloat16-forward_backward.csv"}
    committed = pd.read_csv(H200 / f"{stem}.csv")
    timed = committed[committed["status"] == "ok"]
    assert sorted(table["median_ms"].dropna()) == pytest.approx(sorted(timed["median_ms"]))


def test_load_layer_runs_takes_one_of_a_days_runs_named_by_commit(tmp_path):
    """Two runs of one kind on one day, named ``-at-<commit>``: one kind, the run dated last (by date_utc) read."""
    folder = tmp_path / "H200"
    stem = "2026-12-02-swiglu_down_backward-bfloat16-forward_backward"
    runs = (("0aaaaaa", 1.0, "18:00"), ("fbbbbbb", 2.0, "06:00"))  # the earlier run's name sorts last
    for commit, slower, time in runs:
        path = _copy_run(stem, folder, NEWER, slower=slower, date_utc=f"{NEWER}T{time}:00+00:00")
        for suffix in (".csv", ".json"):
            path.with_suffix(suffix).rename(path.with_name(f"{path.stem}-at-{commit}{suffix}"))
    table = training_step.load_layer_runs(tmp_path, "H200")
    assert set(table["file"]) == {f"{path.stem}-at-0aaaaaa.csv"}
    assert training_step.run_kind(f"{path.stem}-at-0aaaaaa") == training_step.run_kind(path.stem)


def test_load_model_runs_keeps_the_rows_of_the_run_dated_last(tmp_path):
    """By the JSON's date_utc, not the file's name: the file named later holds the older run here."""
    folder = tmp_path / "H200"
    stem = "2026-12-04-swiglu_down_backward-bfloat16-models-p1"
    _copy_run(stem, folder, NEWER, slower=2.0, date_utc="2026-01-01T00:00:00+00:00")  # named later, run earlier
    _copy_run(stem, folder, OLDER, date_utc="2026-03-01T00:00:00+00:00")
    runs = models.load_model_runs(tmp_path, "H200")
    assert set(runs["file"]) == {f"{OLDER}-swiglu_down_backward-bfloat16-models-p1.csv"}
    committed = pd.read_csv(H200 / f"{stem}.csv")
    timed = committed[committed["status"] == "ok"]
    assert sorted(runs["median_ms"].dropna()) == pytest.approx(sorted(timed["median_ms"]))
