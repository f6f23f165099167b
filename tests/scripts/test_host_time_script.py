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
