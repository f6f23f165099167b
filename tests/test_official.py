"""moe_lib.bench.official: implementations exported as solutions of NVIDIA's harness."""

import json

import pytest
import torch

from moe_lib import problems
from moe_lib.bench import official, peers


@pytest.mark.parametrize("name", problems.PROBLEM_NAMES)
def test_export_writes_the_problem_unchanged_and_a_runnable_solution(name, tmp_path, seed):
    folder = official.export(name, "reference", tmp_path)
    for file in ("definition.json", "workload.jsonl"):
        assert (folder / file).read_bytes() == (problems.PROBLEMS_DIR / name / file).read_bytes()
    solution = json.loads((folder / "solution.json").read_text())
    assert solution["definition"] == name and solution["spec"]["entry_point"] == "kernel.py::run"
    assert solution["spec"]["languages"] == ["pytorch"] and not solution["spec"]["destination_passing_style"]
    namespace = {}
    exec(compile(solution["sources"][0]["content"], "kernel.py", "exec"), namespace)
    problem = problems.load(name)
    inputs = problem.make_inputs(3, seed=seed, **problem.small_axes)
    got = namespace["run"](*inputs.values())
    want = problem.spec.reference(*inputs.values())
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_our_kernels_export_as_triton_and_unknown_labels_are_refused(tmp_path):
    solution = json.loads((official.export("swiglu_down_backward", "triton", tmp_path) / "solution.json").read_text())
    assert solution["spec"]["languages"] == ["triton"]
    with pytest.raises(ValueError, match="impl: 'nonsense' is not an implementation"):
        official.export("swiglu_down_backward", "nonsense", tmp_path)
    assert not (tmp_path / "swiglu_down_backward-nonsense").exists()


def test_every_peer_call_matches_its_prepared_call(seed):
    problem = problems.load("swiglu_down_backward")
    inputs = problem.make_inputs(3, seed=seed, **problem.small_axes)
    for label in ("reference", "torch_eager"):
        peer = peers.peers_for(problem.name)[label]
        assert all(torch.equal(a, b) for a, b in zip(peer.call(*inputs.values()), peer.prepare(inputs)(), strict=True))


def test_trace_summary():
    traces = [dict(workload=dict(axes=dict(num_tokens=t)), evaluation=dict(status=s, performance=dict(latency_ms=ms)))
              for t, s, ms in ((1, "PASSED", 0.02), (4, "PASSED", 0.08), (8, "INCORRECT_NUMERICAL", None))]  # fmt: skip
    rows = official.trace_rows(traces)
    assert official.summary(rows)["passed"] == 2 and official.summary(rows)["geomean_latency_ms"] != 0.04
    assert official.summary(rows[:2])["geomean_latency_ms"] == pytest.approx(0.04)
    assert "2/3 passed" in official.format_table(rows, "title")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_run_needs_cuda_and_the_harness(tmp_path):
    with pytest.raises(ValueError, match="harness: no sol_execbench package"):
        official.run("swiglu_down_backward", "triton", harness=tmp_path, export_dir=tmp_path, results=tmp_path,
                     timeout_s=10)  # fmt: skip
