"""The project's targets are stated once, in each problem's lab.json: no page of prose restates a threshold."""

import json
import re
from pathlib import Path

import pytest

from moe_lib import problems
from moe_lib.lab import targets

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "methodology.md", *sorted((ROOT / "notebooks").glob("*.ipynb"))]


def _thresholds() -> set[str]:
    """Every target's threshold as written after ≥ or ≤ (e.g. "620", "7.5", "1.5")."""
    found = set()
    for name in problems.PROBLEM_NAMES:
        for target in targets.problem_targets(name):
            for key in ("at_least", "at_most"):
                if key in target:
                    found.add(f"{target[key]:g}")
    return found


def _prose(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    return path.read_text()


def test_every_threshold_is_found():
    assert {"1.5", "12", "40", "620", "7.5", "15.3", "24.4", "1.25", "1.2"} <= _thresholds()


@pytest.mark.parametrize("path", PAGES, ids=lambda path: path.name)
def test_no_page_restates_a_target(path):
    pattern = re.compile(r"[≥≤]\s*(\d+(?:\.\d+)?)\s*(?:×|µs|ms|TFLOP/s)")
    restated = [match.group(0) for match in pattern.finditer(_prose(path)) if match.group(1) in _thresholds()]
    assert restated == [], f"{path.name} restates targets of lab.json: {restated}"
