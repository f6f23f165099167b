"""The benchmark's thresholds pinned by value, each at its value and one off (``moe_lib.bench``).

Literal numbers, never read from the constants under test: how many timed runs a case gets (10 ms, a 2 s budget,
at least 5), the warm-up, the memory estimate that skips a case, the score's baseline above T_sol, the chunked
comparison's edges, the element rules of the problems, the official summary's completeness.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from moe_lib import problems
from moe_lib.bench import checks, harness, official, results, timing


@pytest.mark.parametrize(
    "estimate_ms, reps, expected",
    [
        (9.999, 300, 300),
        (10.0, 300, 300),
        (10.001, 300, 200),  # over 10 ms: as many as fit in 2 s
        (39.9, 100, 51),
        (40.0, 100, 50),
        (40.1, 100, 50),
        (332.0, 50, 7),
        (333.4, 50, 6),
        (399.0, 50, 6),
        (400.0, 50, 5),
        (401.0, 50, 5),
        (5000.0, 50, 5),  # at least 5
        (20.0, 3, 3),  # never more than asked for
    ],
)
def test_repetitions_at_each_threshold(estimate_ms, reps, expected):
    assert timing.repetitions(estimate_ms, reps) == expected


@pytest.mark.parametrize(
    "warmup, estimate_ms, runs",
    [
        (0, 1.0, [1, 7]),
        (1, 1.0, [1, 1, 7]),
        (2, 1.0, [1, 1, 7]),
        (3, 1.0, [1, 1, 1, 7]),
        (5, 1.0, [1, 1, 3, 7]),
        (5, 10.0, [1, 1, 3, 7]),
        (5, 10.001, [1, 1, 7]),  # a long case skips the rest of the warm-up
    ],
)
def test_warm_up_runs(warmup, estimate_ms, runs, monkeypatch):
    """The runs :func:`timing.measure` asks for, in order: the first call, the estimate, the rest of the warm-up
    (warm-up − 2, cases up to 10 ms only), the timed runs."""
    asked = []
    monkeypatch.setattr(
        timing, "run_and_time", lambda fn, mode, flush, count: asked.append(count) or [estimate_ms] * count
    )
    stats = timing.measure(lambda: None, "cpu", lambda: None, warmup=warmup, reps=7)
    assert asked == runs and stats["reps"] == 7


def test_the_memory_estimate_of_a_case_and_the_skip_at_it(monkeypatch):
    """P1 at its small shapes (H 256, I 96) in bf16, 16 tokens, its reference in float64: inputs 179 200 bytes,
    the upcast copy 716 800 and the reference's outputs 622 592 (larger than those outputs and twice the
    implementation's, 933 888), the workspace 16 · (256 + 96) · 16 = 90 112."""
    problem = problems.load("swiglu_down_backward")
    needed = harness.case_bytes(problem, 16, torch.bfloat16, dict(problem.small_axes), small=True)
    assert needed == 179_200 + 716_800 + 622_592 + 90_112 == 1_608_704
    for free, skipped in ((1_608_703, True), (1_608_704, False), (1_608_705, False)):
        monkeypatch.setattr(harness, "free_device_bytes", lambda device, free=free: free)
        shortfall = harness.memory_shortfall(
            problem, 16, torch.bfloat16, dict(problem.small_axes), True, torch.device("cpu")
        )
        assert (shortfall == "skipped: needs 0.0 GB, 0.0 GB free") if skipped else shortfall is None, free


@pytest.mark.parametrize("baseline_ms, scored", [(0.999, False), (1.0, False), (1.001, True)])
def test_a_score_needs_a_baseline_slower_than_t_sol(baseline_ms, scored):
    frame = pd.DataFrame(
        [
            dict(
                impl="torch_eager",
                num_tokens=1,
                median_ms=baseline_ms,
                status="ok",
                sol_ms=1.0,
                timing="graph",
                passes_element_rule=True,
            ),
            dict(
                impl="triton",
                num_tokens=1,
                median_ms=1.0,
                status="ok",
                sol_ms=1.0,
                timing="graph",
                passes_element_rule=True,
            ),
        ]
    )
    summary, baseline = results.summarize_impls(frame, ["torch_eager", "triton"], ["torch_eager"])
    assert baseline["impl"] == "torch_eager"
    assert (summary["triton"]["sol_score"] is not None) is scored
    if scored:
        assert summary["triton"]["sol_score"] == pytest.approx(1.0)


@pytest.mark.parametrize("count, poisoned", [(15, False), (16, False), (17, False), (16, True), (25, True)])
def test_the_chunked_comparison_counts_every_element_at_the_chunks_edges(count, poisoned, monkeypatch):
    """Chunks of 8 elements: errors in the first, the last and the elements at each chunk's edge all count, and a
    NaN in the last chunk too."""
    monkeypatch.setattr(checks, "COMPARE_CHUNK", 8)
    generator = torch.Generator().manual_seed(count)
    ref = torch.randn(count, generator=generator, dtype=torch.float64) + 2.0
    out = ref.clone()
    edges = sorted({0, 7, 8, count - 1} | ({15, 16} if count > 16 else set()))
    out[edges] += 1.0
    sums = checks.error_sums(out, ref, dict(atol=0.5, rtol=0.0, required_fraction=0.99))
    assert (sums["count"], sums["non_finite"], sums["passing"]) == (count, 0, count - len(edges))
    assert sums["diff_sq"] == pytest.approx(len(edges)) and sums["ref_sq"] == pytest.approx(float((ref * ref).sum()))
    if poisoned:
        out[count - 1] = math.nan
        assert checks.error_sums(out, ref, None)["non_finite"] == 1
        assert checks.compare_output(out, ref, None)["rel_error"] == math.inf


def test_the_element_rules_of_the_problems():
    """P1 in bf16 and P2 in fp32 carry the benchmark's rules; P2 in bf16, and any other dtype, none."""
    p1, p2, p2_bf16 = (problems.load(name) for name in problems.PROBLEM_NAMES)
    assert p1.element_rule_at(torch.bfloat16) == dict(atol=1e-2, rtol=1e-2, required_fraction=0.99)
    assert p2.element_rule_at(torch.float32) == dict(atol=0.11, rtol=1e-5, required_fraction=0.99)
    assert p1.element_rule_at(torch.float32) is None and p2.element_rule_at(torch.bfloat16) is None
    assert p2_bf16.element_rule_at(torch.bfloat16) is None


@pytest.mark.parametrize("rows, suite_size, complete", [(3, 3, True), (2, 3, False), (3, 4, False)])
def test_the_official_geomean_needs_every_workload_run_and_passing(rows, suite_size, complete):
    table = [dict(num_tokens=t, status="PASSED", latency_ms=ms) for t, ms in ((1, 0.5), (2, 2.0), (4, 1.0))][:rows]
    summary = official.summary(table, suite_size)
    assert summary["passed"] == rows and summary["suite_workloads"] == suite_size
    geomean = summary["geomean_latency_ms"]
    assert geomean == pytest.approx(1.0) if complete else math.isnan(geomean)
    failing = [dict(row, status="INCORRECT_NUMERICAL") if row["num_tokens"] == 2 else row for row in table]
    assert math.isnan(official.summary(failing, suite_size)["geomean_latency_ms"])


def test_geomean_is_nan_for_empty_zero_or_negative_times():
    """A zero or negative time is no time: the geomean is NaN, as for no times at all (it does not raise)."""
    assert results.geomean([2.0, 8.0]) == pytest.approx(4.0)
    for values in ([], [1.0, 0.0], [0.0], [3.0, -1.0]):
        assert math.isnan(results.geomean(values)), values


def test_relative_error_of_an_all_zero_reference_is_the_norm_of_the_output():
    """‖out − ref‖/‖ref‖; where the reference is all zero, the difference's norm itself (a wrong output stays wrong)."""
    assert checks.relative_error(4.0, 16.0) == pytest.approx(0.5)
    assert checks.relative_error(4.0, 0.0) == pytest.approx(2.0)
    assert checks.relative_error(0.0, 0.0) == 0.0
