"""A benchmark run cut short leaves complete result files or none (``moe_lib.bench.results``: write-then-rename).

A ``KeyboardInterrupt`` (or any exception) in the middle of writing a file leaves the file as it was, and no
temporary file behind; one between the rows of a run leaves a CSV of whole rows and no JSON beside it, which the
loaders need, so that half a run never reads as a run (an earlier run's JSON of the same name is gone too).
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from moe_lib.bench import cli, peers, results
from moe_lib.lab import results as lab_results

P1 = "swiglu_down_backward"


def _interrupt_halfway(monkeypatch, at: int) -> list:
    """Interrupts the ``at``-th file write (1-based) after it wrote half its bytes; returns the paths written."""
    whole = results.write_whole
    written = []

    def write_whole(path, write):
        written.append(path)
        if len(written) != at:
            return whole(path, write)

        def half(temporary):
            write(temporary)
            temporary.write_bytes(temporary.read_bytes()[: temporary.stat().st_size // 2])
            raise KeyboardInterrupt

        return whole(path, half)

    monkeypatch.setattr(results, "write_whole", write_whole)
    return written


def test_an_interrupted_write_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "run.csv"
    before = pd.DataFrame(dict(a=[1.5, 2.5], b=["x", "y"]))
    results.write_csv(path, before)
    _interrupt_halfway(monkeypatch, at=1)
    with pytest.raises(KeyboardInterrupt):
        results.write_csv(path, pd.DataFrame(dict(a=range(1000), b=["z"] * 1000)))
    pd.testing.assert_frame_equal(pd.read_csv(path), before)
    monkeypatch.undo()
    _interrupt_halfway(monkeypatch, at=1)
    with pytest.raises(KeyboardInterrupt):
        results.write_json(tmp_path / "new.json", dict(rows=list(range(1000))))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.csv"]  # no new file, no temporary left


def _run(tmp_path, tokens="1,4,16"):
    return cli.main(
        [
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
            "--reps",
            "2",
            "--warmup",
            "1",
            "--problem",
            P1,
            "--impl",
            "reference,torch_eager",
            "--tokens",
            tokens,
            "--tag",
            "t",
        ]
    )


def _files(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "cpu").iterdir())


@pytest.mark.parametrize("at", [1, 3, 6, 7])
def test_a_run_interrupted_in_any_write_leaves_whole_files(tmp_path, monkeypatch, at):
    """A run of 3 cases × 2 implementations writes its CSV after each of its 6 rows, then the CSV and the JSON:
    interrupted halfway through write ``at``, it leaves a CSV of whole rows (those before it) and no JSON."""
    written = _interrupt_halfway(monkeypatch, at)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path)
    csv = written[0]
    assert all(path.parent == csv.parent for path in written) and csv.suffix == ".csv"
    names = _files(tmp_path)
    if at == 1:
        assert names == []
        return
    assert names == [csv.name]  # no JSON, no temporary file
    frame = pd.read_csv(csv)
    assert len(frame) == at - 1 and (frame["status"] == "ok").all() and frame["median_ms"].notna().all()
    assert lab_results.load_results(tmp_path, "cpu") == {}  # a CSV without its JSON is no run


def test_an_interrupt_between_the_rows_leaves_the_rows_before_it_and_no_json(tmp_path):
    """A KeyboardInterrupt raised by an implementation on the second case; an earlier complete run of the same name
    was there before."""
    first = _run(tmp_path, tokens="1,4")
    assert _files(tmp_path) == sorted([first["csv"].name, first["json"].name])
    calls, eager = [], peers.peers_for(P1)["torch_eager"]

    def prepare(inputs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return eager.prepare(inputs)

    interrupting = peers.Peer("torch_eager", P1, prepare, capturable=True, description="interrupted on case 2")
    with peers.registered(interrupting), pytest.raises(KeyboardInterrupt):
        _run(tmp_path, tokens="1,4")
    assert _files(tmp_path) == [first["csv"].name]  # the earlier run's JSON is gone with its rows
    frame = pd.read_csv(first["csv"])
    assert frame[["impl", "num_tokens"]].values.tolist() == [["reference", 1], ["torch_eager", 1], ["reference", 4]]
    assert (frame["status"] == "ok").all()


def test_a_complete_run_leaves_its_csv_and_json(tmp_path):
    result = _run(tmp_path, tokens="1")
    assert _files(tmp_path) == sorted([result["csv"].name, result["json"].name])
    assert len(pd.read_csv(result["csv"])) == 2 and json.loads(result["json"].read_text())["problem"] == P1


def test_a_run_written_again_and_interrupted_keeps_no_json_of_the_run_before(tmp_path, monkeypatch):
    """write_run (rank_work, the parallel benchmark): the JSON of the run before goes first, the new one last."""
    csv, json_path = tmp_path / "run.csv", tmp_path / "run.json"
    results.write_run(csv, pd.DataFrame(dict(a=[1.0])), json_path, dict(run=1))
    _interrupt_halfway(monkeypatch, at=1)  # the CSV of the run after it
    with pytest.raises(KeyboardInterrupt):
        results.write_run(csv, pd.DataFrame(dict(a=[2.0, 3.0])), json_path, dict(run=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.csv"] and pd.read_csv(csv)["a"].tolist() == [1.0]
    monkeypatch.undo()
    _interrupt_halfway(monkeypatch, at=2)  # its JSON
    with pytest.raises(KeyboardInterrupt):
        results.write_run(csv, pd.DataFrame(dict(a=[2.0, 3.0])), json_path, dict(run=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.csv"] and pd.read_csv(csv)["a"].tolist() == [2.0, 3.0]
