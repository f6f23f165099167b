"""scripts/host_time.py runs end to end on the CPU (a smoke run: the GPU's numbers come from an H200), and its
micro-benchmarks name every host function they time."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "host_time.py"


def run(*arguments):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_cpu_smoke_run_writes_the_table_and_the_logs(tmp_path):
    out = run("--device", "cpu", "--impl", "reference", "--cases", "tiny", "--calls", "2", "--repeats", "1",
              "--profile-calls", "1", "--out", str(tmp_path))  # fmt: skip
    rows = json.loads((tmp_path / "host_time.json").read_text())["rows"]
    phases = {(r["layer"], r["phase"]) for r in rows}
    assert ("moe_experts", "backward (function)") in phases and ("swiglu_expert", "forward+backward") in phases
    assert all(r["cpu_us"] > 0 and len(r["top_cpu_ops"]) > 0 for r in rows)
    assert "moe_experts    tiny        forward " in out
    assert (tmp_path / "moe_experts-tiny-forward_and_backward.txt").is_file()


def test_micro_benchmarks_time_each_host_function(tmp_path):
    run("--micro", "--number", "50", "--out", str(tmp_path))
    times = json.loads((tmp_path / "micro.json").read_text())
    assert "choose (model, Hopper)" in times and "check_moe_experts_backward (model shape)" in times
    assert all(t > 0 for t in times.values())


def test_host_sync_check_sections_name_functions_that_exist(monkeypatch):
    """Each section of scripts/p2/host_sync_check.py --sections is a function its module has, timed and put back."""
    import importlib

    import torch

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.syspath_prepend(str(ROOT / "scripts" / "p2"))
    check = importlib.import_module("host_sync_check")
    originals = {(m, a): getattr(importlib.import_module(m), a) for m, a in check.SECTIONS}
    assert len(originals) == len(check.SECTIONS)
    monkeypatch.setattr(check.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(check.torch.cuda, "_sleep", lambda cycles: None)

    def call():  # reaches two sections, one of them twice
        from moe_lib.moe_experts import engine_layer

        engine_layer.packed_routing(torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]]), 2)
        engine_layer.packed_routing(torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.5]]), 2)

    rows = {name: (count, micros) for name, count, micros in check.section_times(call, 3)}
    assert rows["engine_layer.packed_routing"][0] == 2 and rows["the whole call"][0] == 1
    assert rows["the whole call"][1] >= rows["engine_layer.packed_routing"][1] > 0
    assert all(getattr(importlib.import_module(m), a) is fn for (m, a), fn in originals.items())  # put back
