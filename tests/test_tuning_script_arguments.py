"""scripts/p1/p1_tune.py refuses bad arguments by name before it needs a GPU or times anything."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("arguments", "message"), [
    (["--tokens", "12,x"], "--tokens: a comma list of positive token counts, got '12,x'"),
    (["--tokens", "0"], "--tokens: a comma list of positive token counts, got '0'"),
    (["--tokens", "12", "--configs", "no_such_candidate"], "--configs: unknown candidate(s) ['no_such_candidate']"),
])  # fmt: skip
def test_p1_tune_refuses_bad_arguments_by_name(arguments, message):
    done = subprocess.run([sys.executable, "scripts/p1/p1_tune.py", *arguments], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=300)  # fmt: skip
    assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]


def test_p1_tune_times_the_named_candidates_each_once_and_every_one_only_when_asked():
    """Without --configs only the library's own choice is timed (every candidate would take minutes of GPU time per
    token count); 'all' names every candidate; 'default' and repeats in the list are taken once."""
    sys.path.insert(0, str(ROOT / "scripts" / "p1"))
    try:
        from p1_tune import candidate_names

        from moe_lib.bench.tuning import P1_CANDIDATES
    finally:
        sys.path.remove(str(ROOT / "scripts" / "p1"))
    assert candidate_names(None) == [] and candidate_names("") == []
    assert candidate_names("default,gluon_wide, chained,gluon_wide") == ["gluon_wide", "chained"]
    assert candidate_names("all") == list(P1_CANDIDATES) and len(P1_CANDIDATES) > 40
    assert {"gluon_tall_dwd2", "library_gemms_fast", "chained", "triton_faithful"} <= set(P1_CANDIDATES)
