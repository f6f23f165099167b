"""scripts/p2/gemm_probe.py's parent side on the CPU: a child that stops finishing shapes (a hung kernel) is killed
and its shape named, one that dies is reported, and the table reads TFLOP/s and fractions of torch.mm's off the
rows (the children themselves need a GPU; the sm_90 compile of its configs: test_gluon_gemm.py)."""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("gemm_probe", ROOT / "scripts" / "p2" / "gemm_probe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gemm_probe"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def fake_child(*lines: dict, then: str) -> list[str]:
    """A child printing RESULT lines, then running ``then`` (Python)."""
    prints = "".join(f"print({('RESULT ' + json.dumps(line))!r}, flush=True)\n" for line in lines)
    return [sys.executable, "-c", prints + then]


def test_a_child_that_stops_finishing_shapes_is_killed_and_its_shape_named(probe, tmp_path):
    log = tmp_path / "child.log"
    command = fake_child(
        dict(event="start", shape="p1_da"),
        dict(event="result", shape="p1_da", check="ok"),
        dict(event="start", shape="p1_dx"),
        then="import time\ntime.sleep(120)",
    )
    start = time.monotonic()
    status = probe.watch(command, log, stall=1.5, limit=60)
    assert time.monotonic() - start < 30
    assert status.startswith("killed: no shape finished")
    results = probe.results_in(log, status)
    assert results["p1_da"]["check"] == "ok"
    assert results["p1_dx"]["check"].startswith("HUNG")


def test_a_child_over_its_time_limit_is_killed(probe, tmp_path):
    command = fake_child(
        then='import time\nfor _ in range(100):\n    print(\'RESULT {"event": "result"}\', '
        "flush=True)\n    time.sleep(0.2)"
    )
    status = probe.watch(command, tmp_path / "child.log", stall=10, limit=2)
    assert status == "killed: over 2 s"


def test_a_child_that_dies_is_reported(probe, tmp_path):
    log = tmp_path / "child.log"
    status = probe.watch(fake_child(dict(event="start", shape="p1_da"), then="raise SystemExit(3)"), log, 10, 60)
    assert status == "exit 3"
    assert probe.results_in(log, status)["p1_da"]["check"] == "DIED: exit 3"


def test_table_gives_tflops_fractions_and_the_large_shapes_geomean(probe):
    def ok(tflops):
        return dict(check="ok", tflops=tflops)

    runs = {
        "torch_mm": dict(results={"p1_da": ok(600.0), "p1_dx": ok(640.0), "p2_gate_m256": ok(200.0)}),
        "coop_m128n256k64_s3": dict(
            results={"p1_da": ok(570.0), "p1_dx": ok(640.0), "p2_gate_m256": dict(check="WRONG: relative error 0.5")}
        ),
        "pp_m128n128k64_s5": dict(results={"p1_da": dict(check="HUNG: killed")}),
    }
    text = probe.table(runs, ["p2_gate_m256", "p1_da", "p1_dx"])
    lines = text.splitlines()
    assert lines[0] == "c1 = coop_m128n256k64_s3" and lines[1] == "c2 = pp_m128n128k64_s5"
    assert "570 0.95" in text and "640 1.00" in text and "WRONG" in text and "HUNG" in text
    # the large shapes' geometric mean: √(0.95 · 1.00), torch.mm's own 1.000, none for the hung config
    assert lines[-2].split()[-3:] == ["1.000", f"{(0.95 * 1.0) ** 0.5:.3f}", "-"]
    assert lines[-1].split()[-3:] == ["1.000", "1.000", "-"]  # p1_dx alone of the three fills the GPU
