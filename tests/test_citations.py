"""Every lab note the code, docs and notebooks cite exists: a renamed or removed note fails here, not in a reader's
hands."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CITED_NOTE = re.compile(r"(?<![\w/])notes/[\w./-]+?\.md")
SUFFIXES = {".py", ".md", ".ipynb", ".sh", ".toml"}


def _tracked_texts() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.split() if Path(name).suffix in SUFFIXES and (ROOT / name).is_file()]


def test_every_cited_note_exists():
    missing = [(path.relative_to(ROOT).as_posix(), note) for path in _tracked_texts()
               for note in CITED_NOTE.findall(path.read_text(errors="replace"))
               if not (ROOT / note).is_file()]  # fmt: skip
    assert not missing, missing


def test_nothing_cites_the_single_log_the_notes_replaced():
    old = [path.relative_to(ROOT).as_posix() for path in _tracked_texts() if "data/results/NOTES.md" in path.read_text(
        errors="replace") and path.relative_to(ROOT).parts[0] not in ("notes", "tests")]  # fmt: skip
    assert not old, old
