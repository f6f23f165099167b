"""The benchmark's verdicts, tested for what they decide (``moe_lib.bench.checks``, ``results``, ``timing``,
``harness``, ``official``).

- The element rule per element (at its bound), per output and over the outputs: one good output and one bad fail
  together, with the bad one's fraction; the relative-error verdict likewise, at its threshold ± a little.
- The summary over cases: one wrong case makes an implementation not all-correct, one case failing the element
  rule fails it, the geomean counts the correct cases only, and a baseline must be correct everywhere.
- The L2 flush: larger than each GPU's L2 (``moe_lib.roofline``), run before every timed run.
- The CUDA-graph replay recheck: a graph whose replays write wrong outputs is reported wrong, not timed (on the
  CPU with a stand-in graph; on a GPU with a real one).
- The exported solution's entry point calls the implementation it is named for, with the inputs in order.

Outputs are random (never zeros); numbers at thresholds are literals, not read from the constants under test.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from moe_lib import problems, roofline
from moe_lib.bench import checks, harness, official, peers, results, timing

RULE = dict(atol=1e-2, rtol=1e-2, required_fraction=0.99)  # P1's rule, as its lab.json states it
NAMES = ("good", "bad")


def _random(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, generator=generator, dtype=torch.float64) + 3.0  # |ref| ≥ about 0.5 mostly


def _missing_the_rule(ref: torch.Tensor, failing: int) -> torch.Tensor:
    """``ref`` with its first ``failing`` elements off by twice the rule's bound (a small relative error)."""
    out = ref.clone()
    out[:failing] += 2 * (RULE["atol"] + RULE["rtol"] * ref[:failing].abs())
    return out


# ------------------------------------------------------------------------------------------------
# the element rule: per element, per output, over the outputs


def test_the_element_rule_at_its_bound():
    """|out − ref| ≤ atol + rtol·|ref|: an element exactly at the bound passes, one a hair beyond it fails."""
    ref = torch.tensor([0.0, 0.0, 4.0, 4.0], dtype=torch.float64)
    bound = torch.tensor([1e-2, 1e-2, 5e-2, 5e-2], dtype=torch.float64)  # atol + rtol·|ref|, by hand
    out = ref + bound * torch.tensor([1.0, 1.0 + 1e-9, 1.0, 1.0 + 1e-9], dtype=torch.float64)
    assert checks.compare_output(out[:1], ref[:1], RULE)["pass_fraction"] == 1.0
    assert checks.compare_output(out[1:2], ref[1:2], RULE)["pass_fraction"] == 0.0
    assert checks.compare_output(out[2:3], ref[2:3], RULE)["pass_fraction"] == 1.0
    assert checks.compare_output(out[3:4], ref[3:4], RULE)["pass_fraction"] == 0.0
    assert checks.compare_output(out, ref, RULE)["pass_fraction"] == 0.5


@pytest.mark.parametrize("bad_first", [False, True])
def test_one_good_output_and_one_bad_fail_the_element_rule_with_the_bad_fraction(bad_first):
    good_ref, bad_ref = _random(10_000, 1), _random(10_000, 2)
    outputs = {"good": good_ref.clone(), "bad": _missing_the_rule(bad_ref, 1_000)}
    references = {"good": good_ref, "bad": bad_ref}
    names = ("bad", "good") if bad_first else ("good", "bad")
    verdict = checks.check_outputs([outputs[n] for n in names], [references[n] for n in names], names, RULE)
    assert verdict["pass_fractions"] == {"good": 1.0, "bad": 0.9}
    assert verdict["element_pass_fraction"] == 0.9 and verdict["passes_element_rule"] is False
    assert verdict["correct"] is True  # the relative error is small: failing the rule alone is reported apart
    assert verdict["rel_errors"]["good"] == 0.0 and 0 < verdict["rel_errors"]["bad"] < 5e-2


@pytest.mark.parametrize("failing, passes", [(99, True), (100, True), (101, False)])
def test_the_required_fraction_at_its_value(failing, passes):
    """0.99 of 10 000 elements: 100 failing elements still pass, 101 do not."""
    good_ref, bad_ref = _random(10_000, 3), _random(10_000, 4)
    verdict = checks.check_outputs(
        (good_ref.clone(), _missing_the_rule(bad_ref, failing)), (good_ref, bad_ref), NAMES, RULE
    )
    assert verdict["element_pass_fraction"] == (10_000 - failing) / 10_000
    assert verdict["passes_element_rule"] is passes


@pytest.mark.parametrize("bad_first", [False, True])
@pytest.mark.parametrize("error, correct", [(0.0499, True), (0.0501, False), (0.3, False)])
def test_one_output_over_the_relative_error_threshold_makes_the_call_wrong(error, correct, bad_first):
    """The worst output's relative error decides (5e-2 the threshold), and the reason names that output."""
    good_ref, bad_ref = _random(1_000, 5), _random(1_000, 6)
    noise = _random(1_000, 7) - 3.0
    bad = bad_ref + noise * (error * bad_ref.norm() / noise.norm())
    names = ("bad", "good") if bad_first else ("good", "bad")
    pairs = {"good": (good_ref.clone(), good_ref), "bad": (bad, bad_ref)}
    verdict = checks.check_outputs([pairs[n][0] for n in names], [pairs[n][1] for n in names], names, None)
    assert verdict["rel_error"] == pytest.approx(error, rel=1e-9)
    assert verdict["rel_errors"]["good"] == 0.0 and verdict["correct"] is correct
    assert verdict["passes_element_rule"] is None and math.isnan(verdict["element_pass_fraction"])
    assert verdict["why"] == ("" if correct else f"bad rel. error {error:.3g} > 0.05")


def test_nan_or_a_wrong_shape_in_one_output_makes_the_call_wrong_naming_it():
    good_ref, bad_ref = _random(100, 8), _random(100, 9)
    poisoned = bad_ref.clone()
    poisoned[17] = math.nan
    verdict = checks.check_outputs((good_ref.clone(), poisoned), (good_ref, bad_ref), NAMES, RULE)
    assert not verdict["correct"] and verdict["why"] == "bad has NaN/Inf (or unwritten elements)"
    assert verdict["rel_error"] == math.inf and verdict["rel_errors"]["good"] == 0.0
    verdict = checks.check_outputs((good_ref.clone(), bad_ref[:99]), (good_ref, bad_ref), NAMES, RULE)
    assert not verdict["correct"] and verdict["why"] == "bad: shape [99], expected [100]"
    assert verdict["passes_element_rule"] is None  # no verdict on the rule without every output's fraction
    verdict = checks.check_outputs((good_ref.clone(),), (good_ref, bad_ref), NAMES, RULE)
    assert not verdict["correct"] and verdict["why"] == "returned 1 outputs, expected 2"


# ------------------------------------------------------------------------------------------------
# the summary over cases


def _frame(rows: list[tuple]) -> pd.DataFrame:
    """Rows of (impl, num_tokens, median_ms, status, passes_element_rule); T_sol 0.5 ms at 1 token, 2 ms at 2."""
    frame = pd.DataFrame(rows, columns=["impl", "num_tokens", "median_ms", "status", "passes_element_rule"])
    frame["timing"] = "graph"
    frame["sol_ms"] = frame["num_tokens"].map({1: 0.5, 2: 2.0})
    return frame


def test_one_wrong_case_makes_an_implementation_not_all_correct_and_no_baseline():
    frame = _frame(
        [
            ("torch_eager", 1, 4.0, "ok", True),
            ("torch_eager", 2, 16.0, "ok", True),
            ("torch_compile", 1, 1.0, "ok", True),
            ("torch_compile", 2, math.nan, "wrong: grad_x rel. error 1", None),
            ("triton", 1, 2.0, "ok", True),
            ("triton", 2, 8.0, "ok", False),
        ]
    )
    summary, baseline = results.summarize_impls(
        frame, ["torch_eager", "torch_compile", "triton"], ["torch_eager", "torch_compile"]
    )
    compiled = summary["torch_compile"]
    assert compiled["all_correct"] is False and (compiled["n_correct"], compiled["n_cases"]) == (1, 2)
    assert compiled["geomean_ms"] == 1.0 and compiled["sol_score"] is None  # the correct case alone
    # the faster torch_compile is wrong on a case: the baseline is torch_eager (geomean 8 ms)
    assert baseline["impl"] == "torch_eager" and baseline["geomean_ms"] == pytest.approx(8.0)
    assert baseline["sol_geomean_ms"] == pytest.approx(1.0)
    assert summary["triton"]["all_correct"] is True and summary["triton"]["passes_element_rule"] is False
    assert summary["triton"]["geomean_ms"] == pytest.approx(4.0)
    assert summary["triton"]["sol_score"] == pytest.approx(1 / (1 + (4.0 - 1.0) / (8.0 - 1.0)))
    assert summary["torch_eager"]["passes_element_rule"] is True


def test_no_baseline_when_every_baseline_is_wrong_somewhere():
    frame = _frame(
        [
            ("torch_eager", 1, 4.0, "ok", True),
            ("torch_eager", 2, math.nan, "error: RuntimeError", None),
            ("triton", 1, 2.0, "ok", True),
            ("triton", 2, 8.0, "ok", True),
        ]
    )
    summary, baseline = results.summarize_impls(frame, ["torch_eager", "triton"], ["torch_eager"])
    assert baseline["impl"] is None and summary["triton"]["sol_score"] is None
    assert summary["triton"]["all_correct"] is True and summary["torch_eager"]["all_correct"] is False


# ------------------------------------------------------------------------------------------------
# the L2 flush


@pytest.mark.parametrize("gpu", [key for key, spec in roofline.GPUS.items() if spec.l2_bytes])
def test_the_flush_is_four_times_each_gpus_l2(gpu):
    """Streaming four times the L2 through it leaves none of what a run before put there (H100 50 MB, H200 60 MB,
    B200 126 MB)."""
    assert timing.L2_FLUSH_BYTES >= 4 * roofline.GPUS[gpu].l2_bytes
    assert roofline.GPUS[gpu].l2_bytes >= 50_000_000  # the table's figures are those of the datasheets


def test_the_flush_runs_before_every_timed_run():
    events = []
    timing.measure(lambda: events.append("run"), "cpu", lambda: events.append("flush"), warmup=4, reps=5)
    assert events == ["flush", "run"] * (1 + 1 + 2 + 5)  # warm-up, estimate, the rest of the warm-up, timed
    flusher = timing.L2Flusher("cpu")
    flusher.buffer = torch.zeros(64, dtype=torch.uint8)  # as on CUDA, where it holds L2_FLUSH_BYTES
    flusher()
    assert bool((flusher.buffer == 1).all())


@pytest.mark.gpu
def test_the_cuda_flusher_overwrites_its_whole_buffer():
    flusher = timing.L2Flusher("cuda")
    assert flusher.buffer.numel() == timing.L2_FLUSH_BYTES and flusher.buffer.is_cuda
    flusher.buffer.zero_()
    flusher()
    assert bool((flusher.buffer == 1).all())


# ------------------------------------------------------------------------------------------------
# the CUDA-graph replay recheck

P1 = "swiglu_down_backward"


class _DriftingGraph:
    """Stands in for a captured graph whose replays add to their outputs instead of rewriting them (a counter or
    an accumulator captured without its reset)."""

    def __init__(self, outputs):
        self.outputs = outputs

    def replay(self):
        for out in self.outputs:
            out.add_(1.0)


def test_time_graph_rechecks_what_the_replays_wrote(monkeypatch):
    outputs = (_random(8, 10),)
    right = outputs[0].clone()
    monkeypatch.setattr(timing, "capture", lambda fn, warmup=2: (_DriftingGraph(outputs), outputs))
    monkeypatch.setattr(timing, "run_and_time", lambda fn, mode, flush, count: [fn() or 1.0 for _ in range(count)])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    seen = []

    def check_replay(replayed):
        seen.append(replayed[0].clone())
        return None if torch.equal(replayed[0], right) else "drifted"

    stats = timing.time_graph(lambda: outputs, warmup=2, reps=3, check_replay=check_replay)
    assert stats["replay_wrong"] == "drifted" and stats["reps"] == 3
    assert len(seen) == 1 and torch.equal(seen[0], right + 5)  # checked once, after every replay (1 + 1 + 3)


def test_a_wrong_replay_makes_the_row_wrong_and_untimed(monkeypatch):
    """The harness's recheck compares the replayed outputs with the reference, and a wrong replay is a wrong row."""
    problem = problems.load(P1)
    inputs = problem.make_inputs(4, seed=11, **problem.small_axes)
    references, _ = checks.reference_outputs(problem, inputs, small=True)
    peer = peers.peers_for(P1)["torch_eager"]

    def replays_of_a_drifting_graph(fn, capturable, device, flush, *, warmup, reps, check_replay):
        outputs = fn()
        for out in outputs:  # what the replays would have left: the outputs doubled
            out.mul_(2)
        return dict(
            median_ms=1.0, p20_ms=1.0, p80_ms=1.0, reps=reps, timing="graph", replay_wrong=check_replay(outputs)
        )

    monkeypatch.setattr(harness, "time_callable", replays_of_a_drifting_graph)
    row = harness.run_case_impl(
        peer,
        "torch_eager",
        inputs,
        references,
        problem.output_names,
        problem.element_rule,
        torch.device("cpu"),
        timing.L2Flusher("cpu"),
        warmup=1,
        reps=3,
        poison_bytes=0,
    )
    assert row["status"].startswith("wrong: CUDA graph replay: grad_x rel. error 1 > 0.05"), row["status"]
    assert row["correct"] is False and math.isnan(row["median_ms"]) and row["timing"] == "graph"

    def right_replays(fn, capturable, device, flush, *, warmup, reps, check_replay):
        return dict(median_ms=1.0, p20_ms=1.0, p80_ms=1.0, reps=reps, timing="graph", replay_wrong=check_replay(fn()))

    monkeypatch.setattr(harness, "time_callable", right_replays)
    row = harness.run_case_impl(
        peer,
        "torch_eager",
        inputs,
        references,
        problem.output_names,
        problem.element_rule,
        torch.device("cpu"),
        timing.L2Flusher("cpu"),
        warmup=1,
        reps=3,
        poison_bytes=0,
    )
    assert row["status"] == "ok" and row["correct"] is True and row["median_ms"] == 1.0


@pytest.mark.gpu
def test_cuda_a_graph_whose_replays_write_wrong_outputs_is_reported(tmp_path):
    """A peer right in its first (checked) call whose captured call computes something else: every replay writes
    wrong outputs, which the recheck after the timing must catch."""
    from moe_lib.bench import cli

    calls = []

    def prepare(inputs):
        eager = peers.peers_for(P1)["torch_eager"].prepare(inputs)

        def run():
            calls.append(1)
            outputs = eager()
            return outputs if len(calls) == 1 else tuple(2 * out for out in outputs)

        return run

    drifting = peers.Peer("drifting", P1, prepare, capturable=True, description="right once, then wrong")
    with peers.registered(drifting):
        result = cli.main(
            [
                "--out",
                str(tmp_path),
                "--device",
                "cuda",
                "--small",
                "--reps",
                "3",
                "--warmup",
                "1",
                "--problem",
                P1,
                "--tokens",
                "64",
                "--impl",
                "torch_eager,drifting",
            ]
        )
    frame = result["frame"].set_index("impl")
    assert frame.loc["torch_eager", "status"] == "ok"
    assert frame.loc["drifting", "status"].startswith("wrong: CUDA graph replay:"), frame.loc["drifting", "status"]
    assert math.isnan(frame.loc["drifting", "median_ms"])


# ------------------------------------------------------------------------------------------------
# the exported solution


class _Stub:
    """Stands in for a peer: its call records its label and the arguments it got."""

    def __init__(self, label, log):
        self.label, self.log = label, log

    def call(self, *args):
        self.log.append((self.label, args))
        return (self.label,)


@pytest.mark.parametrize("name", problems.PROBLEM_NAMES)
def test_the_exported_entry_point_calls_the_implementation_it_is_named_for(name, tmp_path, monkeypatch):
    """Each label's exported kernel.py (its solution.json's source), executed, calls that label's peer (of every
    peer of the problem, stubbed) with the inputs in the definition's order."""
    problem = problems.load(name)
    inputs = problem.make_inputs(2, seed=12, **problem.small_axes)
    log = []
    for label in peers.labels(name):
        solution = json.loads((official.export(name, label, tmp_path) / "solution.json").read_text())
        assert solution["name"] == f"moe_lib_{label}" and solution["definition"] == name
        assert solution["spec"]["languages"] == (["triton"] if label.startswith("triton") else ["pytorch"])
        namespace = {}
        monkeypatch.setattr(
            peers, "peers_for", lambda problem_name: {other: _Stub(other, log) for other in peers.labels(problem_name)}
        )
        exec(compile(solution["sources"][0]["content"], "kernel.py", "exec"), namespace)
        monkeypatch.undo()
        log.clear()
        assert namespace["run"](**inputs) == (label,)
        assert [entry[0] for entry in log] == [label]
        assert all(a is b for a, b in zip(log[0][1], inputs.values(), strict=True)), label
