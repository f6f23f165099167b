"""scripts/p1/p1_tune.py refuses bad arguments by name before it needs a GPU or times anything; what the P1 scripts
share from moe_lib.bench.tuning (--configs, the call a name stands for, where results are written)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--tokens", "12,x"], "--tokens: a comma list of positive token counts, got '12,x'"),
        (["--tokens", "0"], "--tokens: a comma list of positive token counts, got '0'"),
        (["--tokens", "12", "--configs", "no_such_candidate"], "--configs: unknown candidate(s) ['no_such_candidate']"),
    ],
)
def test_p1_tune_refuses_bad_arguments_by_name(arguments, message):
    done = subprocess.run(
        [sys.executable, "scripts/p1/p1_tune.py", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
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


def test_p1_scripts_share_one_reading_of_configs():
    """--configs of the P1 scripts: names of P1_CANDIDATES, each once in order, "all" for every one; "default" (the
    chooser's pick) only where the script times it; an unknown name is named."""
    from moe_lib.bench.tuning import P1_CANDIDATES, p1_candidate_names

    assert p1_candidate_names("default, chained,default,gluon_wide") == ["default", "chained", "gluon_wide"]
    assert p1_candidate_names(None) == [] and p1_candidate_names("all") == list(P1_CANDIDATES)
    with pytest.raises(ValueError, match=r"unknown candidate\(s\) \['default'\]"):
        p1_candidate_names("chained,default", default=False)
    with pytest.raises(ValueError, match=r"unknown candidate\(s\) \['nope'\]; see moe_lib.bench.tuning.P1_CANDIDATES"):
        p1_candidate_names("chained,nope")


def test_p1_call_default_is_the_public_call():
    """ "default" runs the public call (here the reference, on the CPU); a candidate's call is built without running."""
    import torch

    import moe_lib
    from moe_lib import problems
    from moe_lib.bench.tuning import p1_call

    inputs = problems.make_inputs("swiglu_down_backward", 4, seed=0, device="cpu", hidden_size=32, intermediate_size=16)
    got = p1_call("default", inputs, "fast")()
    want = moe_lib.swiglu_down_backward(*inputs.values(), precision="fast")
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert callable(p1_call("chained", inputs, "faithful"))


def test_write_out_goes_to_the_path_given_else_into_out_else_nowhere(tmp_path, monkeypatch):
    import json

    from moe_lib.bench.tuning import write_out

    monkeypatch.delenv("OUT", raising=False)
    assert write_out("rows.json", [1]) is None and not list(tmp_path.iterdir())
    assert write_out("rows.json", [1], path=tmp_path / "given.json") == tmp_path / "given.json"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert write_out("rows.json", dict(rows=[2])) == tmp_path / "rows.json"
    assert json.loads((tmp_path / "rows.json").read_text()) == dict(rows=[2])
    assert json.loads((tmp_path / "given.json").read_text()) == [1]
