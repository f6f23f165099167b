"""The benchmark harness end to end on CPU (small shapes, few cases), and its pieces."""

import json
import math

import pandas as pd
import pytest
import torch

from moe_lib import problems, roofline
from moe_lib.bench import checks, cli, peers, provenance, results, timing

P1 = "swiglu_down_backward"
P1_OUTPUTS = problems.load(P1).output_names
RESULTS_DIR = problems.DATA_DIR / "results"


def _fake_peer(label, make_outputs, calls):
    """A P1 peer whose callable counts its calls and returns ``make_outputs(inputs)``."""

    def prepare(inputs):
        def run():
            calls.append(label)
            return make_outputs(inputs)

        return run

    return peers.Peer(label, P1, prepare, capturable=True, description="test fake")


def _p1_shaped(inputs, fill):
    x, w_gate, w_down = inputs["x"], inputs["gate_weight"], inputs["down_weight"]
    return tuple(torch.full_like(t, fill) for t in (x, w_gate, w_gate, w_down))


def _run(tmp_path, *argv):
    return cli.main(["--out", str(tmp_path), "--device", "cpu", "--reps", "2", "--warmup", "1", *argv])


def test_cpu_run_writes_csv_and_json(tmp_path, capsys):
    result = _run(tmp_path, "--problem", P1, "--impl", "reference,torch_eager", "--tokens", "1,16", "--tag", "t")
    assert result["csv"].parent == tmp_path / "cpu"
    assert result["csv"].name.endswith(f"-{P1}-bfloat16-small-t.csv")
    assert result["json"] == result["csv"].with_suffix(".json")

    frame = pd.read_csv(result["csv"])
    expected_columns = set(results.CSV_COLUMNS) | {
        f"{column}_{name}" for column in ("rel_error", "element_pass_fraction") for name in P1_OUTPUTS
    }
    assert set(frame.columns) == expected_columns
    assert len(frame) == 4 and set(frame["impl"]) == {"reference", "torch_eager"}
    assert list(frame["num_tokens"].unique()) == [1, 16]
    assert (frame["status"] == "ok").all() and frame["correct"].all() and frame["passes_element_rule"].all()
    assert (frame["timing"] == "cpu").all() and frame["small"].all() and (frame["device"] == "cpu").all()
    assert (frame["median_ms"] > 0).all() and (frame["p20_ms"] <= frame["p80_ms"]).all()
    assert (frame["rel_error"] < 1e-2).all() and (frame["element_pass_fraction"] >= 0.99).all()
    assert {f"sol_ms_datasheet_{key}" for key in roofline.DATASHEET_GPUS} <= set(frame.columns)
    assert (frame["sol_ms"] > 0).all() and (frame["sol_ms_datasheet_H200"] < frame["sol_ms_datasheet_H100-SXM"]).all()
    assert (frame["roofline_fraction"] - frame["sol_ms"] / frame["median_ms"]).abs().max() < 1e-9

    document = json.loads(result["json"].read_text())
    provenance = document["provenance"]
    for key in (
        "gpu_name",
        "driver_version",
        "torch",
        "triton",
        "cuda",
        "git_commit",
        "git_dirty",
        "date_utc",
        "hostname",
        "command",
        "ceilings",
        "seed",
        "suite",
    ):
        assert key in provenance, key
    assert provenance["ceilings"]["rough"] is True and provenance["suite"]["tokens"] == [1, 16]
    assert provenance["reference_precision"] == "float64"
    assert document["axes"] == dict(hidden_size=256, intermediate_size=96)
    for label in ("reference", "torch_eager"):
        summary = document["summary"][label]
        assert summary["all_correct"] is True and summary["n_cases"] == 2
        assert summary["geomean_ms"] > 0 and summary["roofline_fraction"] > 0
    assert document["baseline"]["impl"] in ("reference", "torch_eager")

    printed = capsys.readouterr().out
    assert "geomean" in printed and "torch_eager" in printed and str(result["csv"]) in printed


def test_wrong_and_failing_implementations_are_reported_not_timed(tmp_path):
    calls = []

    def raise_error(inputs):
        raise RuntimeError("kernel exploded")

    fakes = [
        _fake_peer("zeros", lambda inputs: _p1_shaped(inputs, 0.0), calls),
        _fake_peer("nans", lambda inputs: _p1_shaped(inputs, math.nan), calls),
        _fake_peer("too_few", lambda inputs: _p1_shaped(inputs, 0.0)[:3], calls),
        _fake_peer("raises", raise_error, calls),
    ]
    with peers.registered(fakes[0]), peers.registered(fakes[1]), peers.registered(fakes[2]), peers.registered(fakes[3]):
        result = _run(tmp_path, "--problem", P1, "--impl", "reference,zeros,nans,too_few,raises", "--tokens", "8")
    frame = result["frame"].set_index("impl")
    assert frame.loc["reference", "status"] == "ok"
    assert frame.loc["zeros", "status"].startswith("wrong:") and "rel. error" in frame.loc["zeros", "status"]
    assert frame.loc["nans", "status"].startswith("wrong:") and "NaN" in frame.loc["nans", "status"]
    assert frame.loc["too_few", "status"].startswith("wrong:") and "3 outputs" in frame.loc["too_few", "status"]
    assert frame.loc["raises", "status"] == "error: RuntimeError: kernel exploded"
    for label in ("zeros", "nans", "too_few", "raises"):
        assert not frame.loc[label, "correct"]
        assert math.isnan(frame.loc[label, "median_ms"]) and frame.loc[label, "reps"] == 0
    assert calls == ["zeros", "nans", "too_few", "raises"]  # each ran once (the check), none was timed
    assert frame.loc["zeros", "rel_error"] == pytest.approx(1.0)
    summary = result["summary"]
    assert summary["reference"]["all_correct"] and not summary["zeros"]["all_correct"]
    assert summary["zeros"]["sol_score"] is None and math.isnan(summary["zeros"]["geomean_ms"])
    assert "WRONG" in result["table"] and "ERROR" in result["table"]


def test_unavailable_peer_is_reported_with_its_reason(tmp_path):
    result = _run(tmp_path, "--problem", "moe_experts_backward", "--impl", "reference,liger", "--tokens", "8")
    frame = result["frame"].set_index("impl")
    assert frame.loc["reference", "status"] == "ok"
    assert frame.loc["liger", "status"].startswith("unavailable:") and "CUDA" in frame.loc["liger", "status"]
    assert frame.loc["reference", "passes_element_rule"]  # P2 fp32's rule (atol 0.11, rtol 1e-5) applies
    assert "rel_error_grad_topk_weights" in frame.columns
    # each output's share of passing elements, the row's fraction the smallest of them
    fractions = frame.loc["reference", [c for c in frame.columns if c.startswith("element_pass_fraction_")]]
    assert len(fractions) == 5 and fractions.min() == frame.loc["reference", "element_pass_fraction"]


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--problem", "nope"], "--problem"),
        (["--impl", "reference,nope"], "--impl"),
        (["--impl", "liger"], "--impl"),  # a P2 label, unknown for P1
        (["--impl", ","], "--impl"),
        (["--tokens", "1,x"], "--tokens"),
        (["--tokens", "-3"], "--tokens"),
        (["--tokens", ""], "--tokens"),
        (["--tokens", "4,4"], "--tokens"),
        (["--tokens", "4", "--suite"], "--suite"),
        (["--dtype", "int8"], "--dtype"),
        (["--reps", "0"], "--reps"),
        (["--tag", "a/b"], "--tag"),
    ],
)
def test_bad_arguments_get_clear_errors(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--device", "cpu", *argv])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


def test_arguments_defaults_on_cpu():
    args = cli.parse_args(["--device", "cpu"])
    assert args.small and args.problem == P1 and args.reps == 3 and args.warmup == 1
    assert args.impls[:2] == ["reference", "torch_eager"] and "liger" not in args.impls
    args = cli.parse_args(["--device", "cpu", "--problem", "moe_experts_backward", "--dtype", "bf16"])
    assert args.dtype == "bfloat16" and "liger" not in args.impls


def test_gpu_keys():
    assert roofline.gpu_key_from_name("NVIDIA H200") == "H200"
    assert roofline.gpu_key_from_name("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert roofline.gpu_key_from_name("NVIDIA H100 PCIe") == "H100-PCIe"
    assert roofline.gpu_key_from_name("NVIDIA B200") == "B200"
    assert roofline.gpu_key_from_name("NVIDIA GH200 480GB") == "GH200-480GB"
    assert provenance.gpu_key(torch.device("cpu")) == "cpu"


def test_compare_output_and_element_rule():
    ref = torch.linspace(-1, 1, 1001, dtype=torch.float64)
    rule = dict(atol=1e-2, rtol=1e-2, required_fraction=0.99)
    exact = checks.compare_output(ref.float(), ref, rule)
    assert exact["finite"] and exact["rel_error"] < 1e-6 and exact["pass_fraction"] == 1.0
    zeros = checks.compare_output(torch.zeros(1001), ref, rule)
    assert zeros["rel_error"] == pytest.approx(1.0) and zeros["pass_fraction"] < 0.05
    poisoned = ref.clone()
    poisoned[7] = math.nan
    assert checks.compare_output(poisoned, ref, rule)["rel_error"] == math.inf
    assert checks.compare_output(ref, ref, None)["pass_fraction"] is None
    with pytest.raises(ValueError, match="shape"):
        checks.compare_output(ref[:5], ref, rule)
    assert problems.load(P1).element_rule_at(torch.bfloat16) == rule
    assert problems.load("moe_experts_backward").element_rule_at(torch.float32)["atol"] == 0.11
    assert problems.load("moe_experts_backward").element_rule_at(torch.bfloat16) is None
    assert problems.load("moe_experts_backward_bf16").element_rule_at(torch.bfloat16) is None


def test_reference_outputs_follow_the_problems_precision():
    for name, small, expected in (
        ("swiglu_down_backward", False, "float64"),
        ("moe_experts_backward", True, "float64"),
        ("moe_experts_backward", False, "float32"),
    ):
        problem = problems.load(name)
        inputs = problem.make_inputs(3, **problem.small_axes)
        outputs, precision = checks.reference_outputs(problem, inputs, small)
        assert precision == expected and all(out.dtype == getattr(torch, expected) for out in outputs), name
        assert len(outputs) == len(problem.output_names)


def test_committed_results_load():
    """The committed harness CSVs load with pandas and carry the current columns (files written before the
    datasheet columns were named by GPU key have them as sol_ms_datasheet_h100/h200; files written before
    the training-step modes have no mode, op implied, and no peak_mem_gb; files written before the official
    timing method have no official_* columns)."""
    files = [
        path
        for path in RESULTS_DIR.glob("*/*.csv")
        if any(
            path.name.endswith(f"-{name}-{dtype}.csv")
            for name in problems.PROBLEM_NAMES
            for dtype in ("bfloat16", "float32")
        )
    ]
    assert files
    for path in files:
        frame = pd.read_csv(path)
        newer = (
            set(results.DATASHEET_COLUMNS)
            | {"mode", "peak_mem_gb"}
            | {c for c in results.CSV_COLUMNS if c.startswith("official_")}
        )
        missing = set(results.CSV_COLUMNS) - newer - set(frame.columns)
        assert not missing and len(frame) > 0, (path, missing)
        assert {"sol_ms_datasheet_h100", "sol_ms_datasheet_h200"} <= set(frame.columns) or set(
            results.DATASHEET_COLUMNS
        ) <= set(frame.columns), path


def test_repetitions_and_summary():
    assert timing.repetitions(0.05, 50) == 50
    assert timing.repetitions(40.0, 50) == 50  # 2 s / 40 ms
    assert timing.repetitions(331.0, 50) == 7
    assert timing.repetitions(5000.0, 50) == 5
    stats = timing.summarize([1.0, 2.0, 3.0, 4.0, 50.0])  # one slow outlier: the median ignores it, a mean would not
    assert stats["median_ms"] == 3.0 and stats["p20_ms"] < 3.0 < stats["p80_ms"] and stats["reps"] == 5
    assert timing.measure(lambda: None, "cpu", timing.L2Flusher("cpu"), warmup=2, reps=4)["reps"] == 4
    with pytest.raises(ValueError, match="mode"):
        timing.run_and_time(lambda: None, "nope", timing.L2Flusher("cpu"), 1)


def test_scores_use_the_best_baseline_peer():
    rows = []
    for impl, times in (("reference", (4.0, 16.0)), ("torch_eager", (2.0, 8.0)), ("triton", (1.0, 4.0))):
        for num_tokens, median in zip((1, 2), times, strict=True):
            rows.append(
                dict(
                    impl=impl,
                    num_tokens=num_tokens,
                    median_ms=median,
                    status="ok",
                    timing="graph",
                    passes_element_rule=True,
                )
            )
    frame = pd.DataFrame(rows)
    frame["sol_ms"] = frame["num_tokens"].map({1: 0.25, 2: 1.0})
    summary, baseline = results.summarize_impls(
        frame, ["reference", "torch_eager", "triton"], peers.baseline_labels(P1)
    )
    assert baseline["impl"] == "torch_eager" and baseline["geomean_ms"] == pytest.approx(4.0)
    assert baseline["sol_geomean_ms"] == pytest.approx(0.5)
    assert summary["torch_eager"]["sol_score"] == pytest.approx(0.5)
    assert summary["triton"]["sol_score"] == pytest.approx(1 / (1 + (2.0 - 0.5) / (4.0 - 0.5)))
    assert summary["triton"]["roofline_fraction"] == pytest.approx(0.25)


def _cuda_run(tmp_path, *argv):
    return cli.main(["--out", str(tmp_path), "--device", "cuda", "--small", "--reps", "3", "--warmup", "1", *argv])


@pytest.mark.gpu
def test_cuda_unwritten_outputs_read_as_nan(tmp_path):
    """The reference runs first and leaves right answers in freed memory: outputs allocated and never
    written must still be caught."""
    calls = []
    unwritten = _fake_peer(
        "unwritten", lambda inputs: tuple(torch.empty_like(t) for t in _p1_shaped(inputs, 0.0)), calls
    )
    with peers.registered(unwritten):
        result = _cuda_run(tmp_path, "--problem", P1, "--tokens", "1,16,300", "--impl", "reference,unwritten")
    frame = result["frame"]
    assert (frame[frame["impl"] == "reference"]["timing"] == "graph").all()
    statuses = frame[frame["impl"] == "unwritten"]["status"]
    assert statuses.str.startswith("wrong:").all() and statuses.str.contains("NaN").all(), list(statuses)


@pytest.mark.gpu
def test_cuda_capture_failure_is_an_error_and_the_run_goes_on(tmp_path):
    calls = []

    def syncs_with_the_host(inputs):
        outputs = peers.peers_for(P1)["torch_eager"].prepare(inputs)()
        if outputs[0].float().abs().sum().item() < 0:  # .item(): a host sync, not capturable
            raise AssertionError
        return outputs

    with peers.registered(_fake_peer("host_sync", syncs_with_the_host, calls)):
        result = _cuda_run(tmp_path, "--problem", P1, "--tokens", "64", "--impl", "host_sync,torch_eager")
    frame = result["frame"].set_index("impl")
    assert frame.loc["host_sync", "correct"] and frame.loc["host_sync", "status"].startswith("error: CaptureError")
    assert frame.loc["torch_eager", "status"] == "ok" and frame.loc["torch_eager", "timing"] == "graph"


@pytest.mark.gpu
def test_cuda_p2_peers_are_timed_with_events(tmp_path):
    result = _cuda_run(
        tmp_path, "--problem", "moe_experts_backward", "--tokens", "256", "--impl", "reference,grouped_mm,liger"
    )
    frame = result["frame"].set_index("impl")
    assert frame.loc["reference", "status"] == "ok" and frame.loc["reference", "timing"] == "events"
    assert frame.loc["grouped_mm", "status"] == "ok" and frame.loc["grouped_mm", "timing"] == "events"
    assert frame.loc["liger", "status"] == "ok" or frame.loc["liger", "status"].startswith("unavailable")


def test_kernel_benchmark_run_keeps_what_was_measured(tmp_path, capsys, monkeypatch):
    from moe_lib.bench.tuning import run_cases

    monkeypatch.delenv("OUT", raising=False)

    def run_case(case):
        if case == "bf16:32768":
            raise RuntimeError("the CUDA context is unusable")
        return [dict(case=case, ok=True)]

    cases = [("bf16:2048", None), ("bf16:32768", None), ("bf16:8192", None)]
    shown = []
    code = run_cases(run_case, cases, out=str(tmp_path / "rows.json"), out_name="unused.json", print_table=shown.append)
    assert code == 0 and "stopped: the CUDA context is unusable" in capsys.readouterr().out
    assert shown == [[dict(case="bf16:2048", ok=True)]]
    assert json.loads((tmp_path / "rows.json").read_text()) == shown[0]
    wrong = run_cases(
        lambda case: [dict(case=case, ok=False)], cases[:1], out=None, out_name="x.json", print_table=lambda rows: None
    )
    assert wrong == 1


def test_kernel_times_match_kernels_by_name_when_streams_reorder_them():
    """Two streams start their kernels in another order from call to call: each kernel's median start and
    duration must still be its own, not a mix of whichever kernels came i-th."""
    import runpy
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "p1" / "p1_kernel_times.py"
    script = runpy.run_path(str(path), run_name="test")
    gemm = lambda start, end: dict(name="gemm", start=start, end=end, stream=7)  # noqa: E731
    copy = lambda start, end: dict(name="copy", start=start, end=end, stream=8)  # noqa: E731
    calls = [
        [gemm(0, 6), copy(1, 4), gemm(7, 9)],  # the copy started second
        [copy(100, 103), gemm(101, 107), gemm(108, 110)],  # the copy started first
        [copy(200, 203), gemm(201, 207), gemm(208, 210)],
    ]  # the copy started first
    got = script["summary"](calls)
    assert got["span_us"] == 10 and got["calls"] == 3
    assert [(k["name"], k["start_us"], k["duration_us"], k["stream"], k["calls"]) for k in got["kernels"]] == [
        ("copy", 0, 3, 8, 3),
        ("gemm", 1, 6, 7, 3),
        ("gemm", 8, 2, 7, 3),
    ]
