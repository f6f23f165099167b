"""Every lab note the code, docs and notebooks cite exists, and every script they or the result files cite can be
found: a renamed, moved or removed note or script fails here, not in a reader's hands."""

import functools
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITED_NOTE = re.compile(r"(?<![\w/])notes/[\w./-]+?\.md")
SUFFIXES = {".py", ".md", ".ipynb", ".sh", ".toml"}


@functools.cache
def _tracked() -> dict[Path, str] | None:
    """Each tracked text file and its text, read once for all the tests (None outside a git checkout)."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    paths = [ROOT / name for name in listed.split() if Path(name).suffix in SUFFIXES and (ROOT / name).is_file()]
    return {path: path.read_text(errors="replace") for path in paths}


def _tracked_texts() -> dict[Path, str]:
    tracked = _tracked()
    if tracked is None:
        pytest.skip("not a git checkout")
    return tracked


def test_every_cited_note_exists():
    missing = [
        (path.relative_to(ROOT).as_posix(), note)
        for path, text in _tracked_texts().items()
        for note in CITED_NOTE.findall(text)
        if not (ROOT / note).is_file()
    ]
    assert not missing, missing


def test_nothing_cites_the_single_log_the_notes_replaced():
    old = [
        path.relative_to(ROOT).as_posix()
        for path, text in _tracked_texts().items()
        if "data/results/NOTES.md" in text and path.relative_to(ROOT).parts[0] not in ("notes", "tests")
    ]
    assert not old, old


CITED_SCRIPT = re.compile(r"(?<![\w/])scripts/[\w./-]+?\.(?:py|sh)\b")
REMOVED_LISTS = ("notes/p1/removed.md", "notes/p2/removed.md")


def _scripts_by_name() -> dict[str, list[str]]:
    found = {}
    for path in (ROOT / "scripts").rglob("*"):
        if path.suffix in (".py", ".sh"):
            found.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    return found


def _removed_scripts() -> set[str]:
    return {script for name in REMOVED_LISTS for script in CITED_SCRIPT.findall((ROOT / name).read_text())}


def test_every_cited_script_is_where_it_is_cited_or_recorded_as_removed():
    """A script the code, docs, notebooks, tests or notes cite is at that path. Where it is not: outside the notes it
    is listed in a removed-list with the commit that has its code; nowhere is it a moved script's old place."""
    by_name, removed = _scripts_by_name(), _removed_scripts()
    stale, unrecorded = [], []
    for path, text in _tracked_texts().items():
        name = path.relative_to(ROOT).as_posix()
        if name.startswith("data/"):
            continue
        for script in CITED_SCRIPT.findall(text):
            if (ROOT / script).is_file():
                continue
            if Path(script).name in by_name:
                stale.append((name, script, by_name[Path(script).name]))
            elif not name.startswith("notes/") and script not in removed:
                unrecorded.append((name, script))
    assert not stale, stale
    assert not unrecorded, unrecorded


def test_every_script_a_committed_result_names_can_be_found():
    """Result files keep the paths they were made with: each script one names is still there, or under the same name
    in its problem's folder (the scripts were grouped later), or recorded as removed with its commit."""
    by_name, removed = _scripts_by_name(), _removed_scripts()
    results = ROOT / "data" / "results"
    lost = sorted(
        {
            (path.relative_to(ROOT).as_posix(), script)
            for path in results.rglob("*")
            if path.is_file() and path.suffix in (".json", ".txt", ".csv")
            for script in CITED_SCRIPT.findall(path.read_text(errors="replace"))
            if not (ROOT / script).is_file() and Path(script).name not in by_name and script not in removed
        }
    )
    assert not lost, lost
