"""moe_lib.bench.official: implementations exported as solutions of NVIDIA's harness."""

import json
import math

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
    traces = [
        dict(workload=dict(axes=dict(num_tokens=t)), evaluation=dict(status=s, performance=dict(latency_ms=ms)))
        for t, s, ms in ((1, "PASSED", 0.02), (4, "PASSED", 0.08), (8, "INCORRECT_NUMERICAL", None))
    ]
    rows = official.trace_rows(traces)
    assert official.summary(rows)["passed"] == 2 and official.summary(rows)["geomean_latency_ms"] != 0.04
    assert official.summary(rows[:2])["geomean_latency_ms"] == pytest.approx(0.04)
    assert "2/3 passed" in official.format_table(rows, "title")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_run_needs_cuda_and_the_harness(tmp_path):
    with pytest.raises(ValueError, match="harness: no sol_execbench package"):
        official.run(
            "swiglu_down_backward", "triton", harness=tmp_path, export_dir=tmp_path, results=tmp_path, timeout_s=10
        )


def test_export_of_some_workloads_keeps_their_lines_and_refuses_unknown_counts(tmp_path):
    lines = official.workload_lines("moe_experts_backward")
    assert len(lines) == len(problems.load("moe_experts_backward").workloads)
    folder = official.export("moe_experts_backward", "reference", tmp_path, tokens=[8192, 2048])
    written = (folder / "workload.jsonl").read_text().splitlines()
    assert written == [line for line in lines if json.loads(line)["axes"]["num_tokens"] in (2048, 8192)]
    assert len(written) == 2
    with pytest.raises(ValueError, match=r"tokens: \[5\] not among the workloads of swiglu_down_backward"):
        official.export("swiglu_down_backward", "reference", tmp_path / "other", tokens=[1, 5])
    assert not (tmp_path / "other").exists()
    with pytest.raises(SystemExit):
        official.main(["export", "--problem", "swiglu_down_backward", "--tokens", "1,x", "--out", str(tmp_path)])


def test_partial_runs_join_rows_of_the_same_commit_only():
    def row(t, status="PASSED", ms=1.0):
        return dict(num_tokens=t, status=status, latency_ms=ms, reference_latency_ms=9.0, max_abs_error=0.1)

    earlier = dict(
        provenance=dict(git_commit="abc"),
        workloads=[row(2048), row(8192, "INCORRECT_NUMERICAL", None)],
        traces=["t2048", "t8192-old"],
    )
    rows, traces, joined = official.merged_rows(earlier, [row(8192, ms=4.0), row(3072)], ["t8192", "t3072"], "abc")
    assert joined and [r["num_tokens"] for r in rows] == [2048, 3072, 8192] and traces == ["t2048", "t3072", "t8192"]
    assert rows[2]["latency_ms"] == 4.0  # the workload run again replaces its row
    rows, traces, joined = official.merged_rows(earlier, [row(3072)], ["t3072"], "other commit")
    assert not joined and traces == ["t3072"]
    # the geomean only once every workload of the suite ran and passed
    assert math.isnan(official.summary([row(2048), row(3072)], suite_size=3)["geomean_latency_ms"])
    complete = official.summary([row(2048), row(3072, ms=4.0), row(8192, ms=2.0)], suite_size=3)
    assert complete["geomean_latency_ms"] == pytest.approx(2.0)
    assert "(1 of the suite's 3 not run yet)" in official.format_table([row(2048), row(3072)], "title", 3)
