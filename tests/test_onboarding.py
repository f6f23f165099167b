"""A new user's first commands: the set-up shows what it does, `make lab` runs headless (as root too), and what
`make bench` writes on a CPU machine stays out of git."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(*targets: str) -> str:
    """What make would run for ``targets`` from scratch (-B: as if nothing were set up yet)."""
    out = subprocess.run(["make", "-n", "-B", *targets], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout


@needs_make
def test_setup_shows_its_progress_and_its_errors():
    commands = dry_run("setup")
    installs = [line for line in commands.splitlines() if " install " in line]
    assert any("torch" in line for line in installs) and any('-e ".[lab,report,dev]"' in line for line in installs)
    for line in installs:
        assert " -q " not in line and "2>/dev/null" not in line and ">/dev/null" not in line, line


@needs_make
def test_lab_runs_headless_and_prints_its_url():
    commands = dry_run("lab")
    assert "--no-browser" in commands and "/lab?token=" in commands and "--notebook-dir=notebooks" in commands
    assert ("--allow-root" in commands) == (os.getuid() == 0)


def test_cpu_benchmark_results_are_ignored():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "data/results/cpu/x.csv"], cwd=ROOT)
    assert ignored.returncode == 0
    kept = subprocess.run(["git", "check-ignore", "-q", "data/results/H200/x.csv"], cwd=ROOT)
    assert kept.returncode == 1
