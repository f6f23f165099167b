"""moe_lib.lab.tuning_index: every run the index names exists with what it says of it, and a row's label is read as
the module's docstring says."""

import json
from pathlib import Path

import pytest

from moe_lib.lab import tuning_index

ROOT = Path(__file__).resolve().parents[2]
RUNS = tuning_index.load()


def _values(document, wanted) -> set[str]:
    """Every value under a key ``wanted(key)`` accepts anywhere in a JSON document, as strings."""
    found = set()
    if isinstance(document, dict):
        for key, value in document.items():
            if wanted(key) and isinstance(value, str | int):
                found.add(str(value))
            found |= _values(value, wanted)
    elif isinstance(document, list):
        for value in document:
            found |= _values(value, wanted)
    return found


@pytest.mark.parametrize("key", list(RUNS))
def test_every_file_note_and_script_of_a_run_exists(key):
    run = RUNS[key]
    assert run.files and all(path.is_file() for path in run.paths), run.files
    assert all((ROOT / note).is_file() for note in run.notes), run.notes
    script = (run.script or "").split(" (")[0]
    assert not script.startswith("scripts/") or (ROOT / script).is_file() or "removed since" in run.script, script


@pytest.mark.parametrize("key", [key for key, run in RUNS.items() if all(f.endswith(".json") for f in run.files)])
def test_every_candidate_and_commit_the_index_names_is_in_its_files(key):
    """A label, a band or a "default" of a commit the file does not hold would name nothing: each is checked against
    the candidates (``config``, ``impl``), commits and rounds the run's files record."""
    run = RUNS[key]
    documents = [json.loads(path.read_text()) for path in run.paths]
    candidates = set().union(*(_values(d, lambda key: key in ("config", "impl")) for d in documents))
    commits = set().union(*(_values(d, lambda key: key.endswith("commit")) for d in documents))
    rounds = set().union(*(_values(d, lambda key: key == "round") for d in documents))
    labelled = set(run.labels).union(*run.labels_by_precision.values())
    banded = {name for bands in run.candidate_bands.values() for name in bands}
    named = {run.options[name] for name in ("base", "config", "pointer") if name in run.options}
    named |= set(run.options.get("cublas_candidates", {}))
    assert labelled | banded | named <= candidates, sorted((labelled | banded | named) - candidates)
    for by_run in (run.default_by_run, run.candidate_bands):
        for run_id in by_run:
            assert run_id == "*" or run_id in rounds or any(c.startswith(run_id) for c in commits), run_id


def test_band_label_takes_the_last_band_that_starts_at_or_below():
    bands = [[1, None], [33, "a"], [65, None], [100, "b"]]
    assert [tuning_index.band_label(bands, t) for t in (1, 32, 33, 64, 65, 99, 100, 8192)] == [
        None,
        None,
        "a",
        "a",
        None,
        None,
        "b",
        "b",
    ]
    assert tuning_index.band_label([[10, "x"]], 9) is None


def test_a_rows_label_bands_then_default_then_labels_then_its_own_name():
    run = tuning_index.Run(
        key="t",
        what="a test",
        files=("x.json",),
        labels={"c1": "one"},
        default_by_run={"abcdef1": {"fast": [[1, "before"], [33, None]]}, "2": {"faithful": [[1, "now"]]}},
        candidate_bands={"*": {"c2": [[1, None], [17, "two"]]}, "3": {"c1": [[1, "one, round 3"]]}},
        others="own name",
        left_out_prefixes=("skip",),
    )
    assert run.label("default", "fast", 32, "abcdef1234") == "before"  # a commit by its prefix
    assert run.label("default", "fast", 33, "abcdef1234") is None
    assert run.label("default", "faithful", 1, "abcdef1234") is None  # no default of that path there
    assert run.label("default", "faithful", 1, 2) == "now"  # a round exactly
    assert run.label("default", "fast", 1, "0000000") is None  # a run the index does not name
    assert run.label("c2", "fast", 16) is None and run.label("c2", "fast", 17) == "two"
    assert run.label("c1", "fast", 1, 3) == "one, round 3" and run.label("c1", "fast", 1, 2) == "one"
    assert run.label("other", "fast", 1) == "other" and run.label("skip_me", "fast", 1) is None
    assert tuning_index.Run(key="u", what="u", files=("x.json",)).label("other", "fast", 1) is None
    assert tuning_index.Run(key="v", what="v", files=("x",), default="then").label("default", "fast", 9) == "then"


def test_labels_by_path_and_a_runs_one_path():
    design22 = tuning_index.run("design22")
    assert design22.labels_for("fast")["lib_bs3_mc"] == "cuBLAS"
    with pytest.raises(ValueError, match="not 'exact'"):
        design22.labels_for("exact")
    with pytest.raises(ValueError, match="2 files, not one"):
        _ = tuning_index.run("graph_counters").path
    with pytest.raises(KeyError, match="no run 'nothing'"):
        tuning_index.run("nothing")


def test_a_malformed_entry_is_named(tmp_path):
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"runs": {"bad": {"what": "w", "files": ["f"], "lables": {}}}}))
    with pytest.raises(ValueError, match="run 'bad'.*unknown fields \\['lables'\\]"):
        tuning_index.load(index)
    index.write_text(json.dumps({"runs": {"bad": {"what": "w", "files": ["f"], "others": "keep"}}}))
    with pytest.raises(ValueError, match="others is 'own name' or 'left out'"):
        tuning_index.load(index)
