"""The model suite (python -m moe_lib.bench --models) on CPU: its shapes, options, files, memory skips, the
dynamic-T compile of P1's torch_compile, and notebook 05's loader, tables and figure (moe_lib.lab.models)."""

import json
import math
import shutil

import matplotlib
import pandas as pd
import pytest
import torch

from moe_lib import problems
from moe_lib.bench import cli, harness, models, peers, results
from moe_lib.bench.peers.swiglu_down import eager_arguments, swiglu_down_backward_eager
from moe_lib.lab import models as lab_models
from moe_lib.lab import results as lab_results

matplotlib.use("Agg")

P1 = "swiglu_down_backward"
P2_BF16 = "moe_experts_backward_bf16"
UNALIGNED = "unaligned-1000x300"


def _run(tmp_path, *argv):
    return cli.main(["--models", "--out", str(tmp_path), "--device", "cpu", "--reps", "2", "--warmup", "1", *argv])


def _cli_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", *argv])
    return capsys.readouterr().err


# ---------------------------------------------------------------- shapes


def test_model_shapes_are_the_public_models_and_one_unaligned_shape():
    by_name = {model.name: model for model in models.MODEL_SHAPES}
    assert len(by_name) == len(models.MODEL_SHAPES) == 8 and all(model.source for model in models.MODEL_SHAPES)
    assert by_name["DeepSeek-V3"].axes("moe_experts_backward") == dict(
        hidden_size=7168, intermediate_size=2048, num_experts=256, top_k=8
    )
    assert by_name["Mixtral-8x7B"].axes(P1) == dict(hidden_size=4096, intermediate_size=14336)
    assert [m.name for m in models.models_of(problems.load(P1))] == list(models.MODEL_NAMES)
    assert UNALIGNED not in [m.name for m in models.models_of(problems.load(P2_BF16))]  # P2 needs experts
    assert by_name[UNALIGNED].intermediate_size * 2 % 16 != 0  # its rows of bf16 are not 16-byte multiples


def test_small_shapes_keep_aligned_sizes_aligned_and_the_unaligned_one_unaligned():
    for model in models.MODEL_SHAPES:
        small = models.small_axes(model, P1)
        for name, size in small.items():
            full = getattr(model, name)
            assert 1 <= size < full
            assert (size % 8 == 0) == (full % 8 == 0), (model.name, name, size)
    assert models.small_axes(models.MODEL_SHAPES[-1], P1) == dict(hidden_size=32, intermediate_size=9)
    deepseek = models.small_axes(models.MODEL_SHAPES[2], "moe_experts_backward")
    assert deepseek["num_experts"] == models.SMALL_MAX_EXPERTS and deepseek["top_k"] == 8


# ---------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    "argv, option",
    [
        (["--models", "--model", "GPT-5"], "--model"),
        (["--models", "--model", "DeepSeek-V3,DeepSeek-V3"], "--model"),
        (["--model", "DeepSeek-V3"], "--model"),  # without --models
        (["--models", "--problem", "moe_experts_backward", "--model", UNALIGNED], "--model"),
        (["--models", "--mode", "forward", "--problem", P1, "--impl", "triton_fast"], "--impl"),  # not a layer peer
        (["--models", "--suite"], "--suite"),
        (["--models", "--dtype", "fp32"], "--dtype"),
        (["--models", "--impl", "triton_fast"], "--impl"),  # not an implementation of P2
        (["--models", "--problem", P1, "--impl", "torch_eager,nope"], "--impl"),
        (["--models", "--tokens", "7,7"], "--tokens"),
        (["--models", "--tokens", "1,x"], "--tokens"),
    ],
)
def test_model_suite_options_are_checked_and_errors_name_the_option(argv, option, capsys):
    assert option in _cli_error(capsys, *argv)


def test_model_suite_options_select_problems_models_and_implementations():
    args = cli.parse_args(["--device", "cpu", "--models"])
    assert args.problems == list(problems.PROBLEM_NAMES) and args.small and args.model is None
    assert not args.official  # the official method is not part of the model suite unless asked for
    for name in args.problems:  # the suite's implementations that run here
        assert args.model_impls[name] and set(args.model_impls[name]) <= set(models.IMPLS[problems.load(name).op])
    args = cli.parse_args(["--device", "cpu", "--models", "--model", f"{UNALIGNED},OLMoE-1B-7B", "--impl", "triton"])
    assert args.problems == list(problems.PROBLEM_NAMES) and args.model == [UNALIGNED, "OLMoE-1B-7B"]
    args = cli.parse_args(["--device", "cpu", "--models", "--model", UNALIGNED, "--impl", "torch_eager"])
    assert args.problems == [P1] and args.model_impls == {P1: ["torch_eager"]}


# ---------------------------------------------------------------- runs on CPU


def test_cpu_model_suite_writes_a_correct_row_per_model_token_and_implementation(tmp_path, capsys):
    [run] = _run(tmp_path, "--problem", P1, "--impl", "torch_eager,reference", "--tokens", "1,7")["runs"]
    assert run["csv"].parent == tmp_path / "cpu" and run["csv"].name.endswith(f"-{P1}-bfloat16-small-models.csv")
    frame = pd.read_csv(run["csv"])
    assert list(frame.columns[:5]) == ["problem", "mode", "model", "hidden_size", "intermediate_size"]
    assert len(frame) == len(models.MODEL_SHAPES) * 2 * 2
    assert set(zip(frame["model"], frame["num_tokens"], frame["impl"], strict=True)) == {
        (model, t, impl) for model in models.MODEL_NAMES for t in (1, 7) for impl in ("torch_eager", "reference")
    }
    assert (frame["status"] == "ok").all() and frame["correct"].all() and (frame["median_ms"] > 0).all()
    assert (frame["rel_error"] < 1e-2).all() and frame["small"].all()
    unaligned = frame[frame["model"] == UNALIGNED]
    assert set(unaligned["hidden_size"]) == {32} and set(unaligned["intermediate_size"]) == {9}
    mixtral = frame[frame["model"] == "Mixtral-8x7B"]  # each shape's own FLOPs: 12·T·H·I
    assert list(mixtral["flops"]) == [12 * t * 128 * 448 for t in mixtral["num_tokens"]]

    document = json.loads(run["json"].read_text())
    assert document["suite"] == results.MODEL_SUITE and document["problem"] == P1 and document["complete"] is True
    assert [m["model"] for m in document["models"]] == list(models.MODEL_NAMES)
    assert document["models"][-1]["model_axes"] == dict(hidden_size=1000, intermediate_size=300)
    assert document["summary"][UNALIGNED]["summary"]["torch_eager"]["all_correct"] is True
    assert document["provenance"]["suite"]["tokens"] == [1, 7] and document["provenance"]["small"] is True
    printed = capsys.readouterr().out
    assert UNALIGNED in printed and str(run["csv"]) in printed


def test_cpu_model_suite_of_p2_and_a_failing_implementation_is_a_row(tmp_path):
    def prepare(inputs):
        if inputs["gate_weights"].shape[0] == 8:  # Mixtral's experts only
            raise RuntimeError("no kernel for 8 experts")
        return peers.calling("moe_experts_backward", problems.OPS["moe_experts_backward"].reference)(inputs)

    flaky = peers.Peer("flaky", "moe_experts_backward", prepare, capturable=True, description="test fake")
    with peers.registered(flaky):
        [run] = _run(
            tmp_path,
            "--problem",
            P2_BF16,
            "--model",
            "Mixtral-8x7B,OLMoE-1B-7B",
            "--impl",
            "grouped_mm,flaky",
            "--tokens",
            "5,16",
        )["runs"]
    assert run["csv"].name.endswith(f"-{P2_BF16}-bfloat16-small-models-Mixtral-8x7B+OLMoE-1B-7B.csv")
    frame = pd.read_csv(run["csv"]).set_index(["model", "num_tokens", "impl"]).sort_index()
    assert len(frame) == 2 * 2 * 2 and {"num_experts", "top_k"} <= set(frame.columns)
    assert set(frame.loc["Mixtral-8x7B", "num_experts"]) == {8} and set(frame.loc["OLMoE-1B-7B", "top_k"]) == {8}
    for t in (5, 16):
        assert frame.loc[("Mixtral-8x7B", t, "flaky"), "status"] == "error: RuntimeError: no kernel for 8 experts"
        assert not frame.loc[("Mixtral-8x7B", t, "flaky"), "correct"]
        for model, impl in (("Mixtral-8x7B", "grouped_mm"), ("OLMoE-1B-7B", "grouped_mm"), ("OLMoE-1B-7B", "flaky")):
            assert frame.loc[(model, t, impl), "status"] == "ok" and frame.loc[(model, t, impl), "correct"]


def test_a_run_cut_short_leaves_files_that_read_back(tmp_path, monkeypatch):
    """The JSON is written after every model: a run stopped during its second model keeps the first."""
    run_shape, calls = harness.run_shape, []

    class Stopped(Exception):
        pass

    def stopping_run_shape(*args, **kwargs):
        calls.append(kwargs["columns"]["model"])
        if len(calls) == 2:
            raise Stopped
        return run_shape(*args, **kwargs)

    monkeypatch.setattr(harness, "run_shape", stopping_run_shape)
    with pytest.raises(Stopped):
        _run(tmp_path, "--problem", P1, "--model", f"OLMoE-1B-7B,{UNALIGNED}", "--impl", "torch_eager", "--tokens", "7")
    [json_path] = (tmp_path / "cpu").glob("*-models-*.json")
    document = json.loads(json_path.read_text())
    assert document["complete"] is False and [m["model"] for m in document["models"]] == ["OLMoE-1B-7B"]
    runs = lab_models.load_model_runs(tmp_path, "cpu", small=True)
    assert list(runs["model"]) == ["OLMoE-1B-7B"] and (runs["status"] == "ok").all()
    assert lab_models.run_overview(runs, P1)[0].endswith("(cut short)")


def test_a_case_that_does_not_fit_is_a_skipped_row(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "free_device_bytes", lambda device: 50_000)  # 50 kB free
    [run] = _run(
        tmp_path, "--problem", P1, "--model", f"OLMoE-1B-7B,{UNALIGNED}", "--impl", "torch_eager", "--tokens", "1,300"
    )["runs"]
    frame = pd.read_csv(run["csv"]).set_index(["model", "num_tokens"])
    needed = harness.case_bytes(
        problems.load(P1), 300, torch.bfloat16, dict(hidden_size=64, intermediate_size=32), small=True
    )
    assert needed > 50_000
    assert frame.loc[("OLMoE-1B-7B", 300), "status"] == f"skipped: needs {needed / 1e9:.1f} GB, 0.0 GB free"
    assert not frame.loc[("OLMoE-1B-7B", 300), "correct"] and math.isnan(frame.loc[("OLMoE-1B-7B", 300), "median_ms"])
    one_token = harness.case_bytes(
        problems.load(P1), 1, torch.bfloat16, dict(hidden_size=32, intermediate_size=9), small=True
    )
    assert one_token < 50_000 and frame.loc[(UNALIGNED, 1), "status"] == "ok"  # the run went on


def test_case_bytes_counts_inputs_reference_outputs_and_workspace():
    """P1 at T tokens, written out from its definition: bf16 inputs (dy, x [T, H]; five saved [T, I]; three
    weights), their float64 copy, the float64 and bf16 outputs (dx [T, H], three weight gradients)."""
    T, H, I = 100, 64, 24
    inputs = 2 * (2 * T * H + 5 * T * I + 3 * I * H)
    outputs = T * H + 3 * I * H
    workspace = T * (H + I) * harness.WORKSPACE_BYTES_PER_ROW_VALUE
    expected = inputs + max(4 * inputs + 8 * outputs, 8 * outputs + 2 * 2 * outputs) + workspace
    assert (
        harness.case_bytes(problems.load(P1), T, torch.bfloat16, dict(hidden_size=H, intermediate_size=I), small=False)
        == expected
    )


# ---------------------------------------------------------------- torch.compile with T dynamic


def test_torch_compile_is_compiled_once_per_shape_with_the_tokens_dynamic(seed):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiler = models.TokenDynamicCompile(backend=counter)
    peer = compiler.peer()
    assert "dynamic T" in peer.description and peer.label == "torch_compile"
    problem = problems.load(P1)
    frames = []
    for hidden, inter, tokens in ((64, 24, (2, 7, 33, 64)), (32, 9, (5, 12))):
        before = counter.frame_count
        for t in tokens:
            inputs = problem.make_inputs(t, seed=seed, hidden_size=hidden, intermediate_size=inter)
            got = peer.prepare(inputs)()
            want = swiglu_down_backward_eager(*eager_arguments(inputs))
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        frames.append(counter.frame_count - before)
    assert frames == [1, 1]  # one graph per shape for every token count, not one per case


# ---------------------------------------------------------------- notebook 05's loader, tables and figure


def _write_run(folder, problem, rows, date_utc, stem_date, suffix=None):
    """A model-suite file pair in ``folder`` as the suite writes it, from ``rows`` (model, T, impl, median_ms,
    status) with our fields filled in."""
    frame_rows = []
    for model, t, impl, median, status in rows:
        frame_rows.append(
            dict(
                problem=problem,
                mode="op",
                model=model,
                hidden_size=64,
                intermediate_size=24,
                impl=impl,
                num_tokens=t,
                dtype="bfloat16",
                median_ms=median,
                status=status,
                correct=status == "ok",
                passes_element_rule=True if status == "ok" else None,
                rel_error=1e-3,
                small=False,
            )
        )
    op = problems.load(problem).op
    frame = results.results_frame(frame_rows, problems.load(problem).output_names, models.shape_columns(op))
    stem = models.model_stem(problem, "bfloat16", small=False, date=stem_date, suffix=suffix)
    frame.to_csv(folder / f"{stem}.csv", index=False)
    document = dict(
        problem=problem,
        mode="op",
        suite=results.MODEL_SUITE,
        dtype="bfloat16",
        provenance=dict(date_utc=date_utc, small=False, git_commit="abcdef123456", gpu_key="H200"),
    )
    (folder / f"{stem}.json").write_text(json.dumps(document))


@pytest.fixture
def committed(tmp_path):
    """An older run of two models, and a newer part of a split run that measured one of them again."""
    folder = tmp_path / "H200"
    folder.mkdir()
    _write_run(
        folder,
        P1,
        [
            ("Qwen3-30B-A3B", 7, "triton_fast", 1.0, "ok"),
            ("Qwen3-30B-A3B", 7, "torch_eager", 9.0, "ok"),
            ("Qwen3-30B-A3B", 7, "torch_compile", 9.0, "ok"),
            ("OLMoE-1B-7B", 7, "triton_fast", 1.0, "ok"),
            ("OLMoE-1B-7B", 7, "torch_eager", 3.0, "ok"),
            ("OLMoE-1B-7B", 7, "torch_compile", 1.5, "ok"),
            ("OLMoE-1B-7B", 64, "triton_fast", 2.0, "ok"),
            ("OLMoE-1B-7B", 64, "torch_eager", 24.0, "ok"),
            ("OLMoE-1B-7B", 64, "torch_compile", 1.0, "ok"),
        ],
        "2026-12-01T10:00:00+00:00",
        "2026-12-01",
    )
    _write_run(
        folder,
        P1,
        [
            ("Qwen3-30B-A3B", 7, "triton_fast", 1.0, "ok"),
            ("Qwen3-30B-A3B", 7, "torch_eager", 2.0, "ok"),
            ("Qwen3-30B-A3B", 7, "torch_compile", math.nan, "error: RuntimeError: inductor failed"),
        ],
        "2026-12-05T10:00:00+00:00",
        "2026-12-05",
        suffix="Qwen3-30B-A3B",
    )
    return tmp_path


def test_loader_keeps_the_newest_row_of_each_case_and_combines_split_runs(committed):
    runs = lab_models.load_model_runs(committed, "H200")
    assert runs.attrs["note"] == "" and len(runs) == 9
    qwen = runs[(runs["model"] == "Qwen3-30B-A3B")].set_index("impl")
    assert qwen.loc["torch_eager", "median_ms"] == 2.0 and qwen.loc["torch_eager", "date_utc"].startswith("2026-12-05")
    assert qwen.loc["torch_compile", "status"].startswith("error")
    assert math.isnan(qwen.loc["torch_compile", "median_ms"])
    olmoe = runs[runs["model"] == "OLMoE-1B-7B"]
    assert set(olmoe["file"]) == {f"2026-12-01-{P1}-bfloat16-models.csv"}  # kept from the older part
    assert list(dict.fromkeys(runs["model"])) == ["Qwen3-30B-A3B", "OLMoE-1B-7B"]  # MODEL_SHAPES' order
    assert lab_models.problems_in(runs) == [P1]
    assert len(lab_models.run_overview(runs, P1)) == 2
    assert lab_results.load_results(committed, "H200") == {}  # the benchmark's one-shape reader leaves them out


def test_loader_says_so_when_there_is_no_model_suite_run(tmp_path):
    (tmp_path / "H200").mkdir()
    runs = lab_models.load_model_runs(tmp_path, "H200")
    assert runs.empty and "No model-suite run" in runs.attrs["note"] and runs.attrs["runs"] == {}


def test_speedup_table_geomeans_and_figure(committed):
    runs = lab_models.load_model_runs(committed, "H200")
    table = lab_models.speedup_table(runs, P1)
    assert table.loc[("OLMoE-1B-7B", 7), "vs torch_eager"] == pytest.approx(3.0)
    assert table.loc[("OLMoE-1B-7B", 64), "vs torch_eager"] == pytest.approx(12.0)
    assert table.loc[("OLMoE-1B-7B", 64), "vs torch_compile"] == pytest.approx(0.5)
    assert table.loc[("Qwen3-30B-A3B", 7), "vs torch_eager"] == pytest.approx(2.0)  # the newer run's
    assert math.isnan(table.loc[("Qwen3-30B-A3B", 7), "vs torch_compile"])
    assert table.loc[("Qwen3-30B-A3B", 7), "correct"] is False
    assert "torch_compile: error: RuntimeError: inductor failed" in table.loc[("Qwen3-30B-A3B", 7), "issues"]
    assert table.loc[("OLMoE-1B-7B", 7), "correct"] is True and table.loc[("OLMoE-1B-7B", 7), "issues"] == ""

    summary = lab_models.geomean_table(table)
    assert summary.loc["OLMoE-1B-7B", "geomean vs torch_eager"] == pytest.approx(6.0)  # √(3 · 12)
    assert summary.loc["OLMoE-1B-7B", "geomean vs torch_compile"] == pytest.approx(math.sqrt(1.5 * 0.5))
    assert summary.loc["OLMoE-1B-7B", "min vs torch_compile"] == pytest.approx(0.5)
    assert summary.loc["OLMoE-1B-7B", "cases timed"] == "2/2" and summary.loc["Qwen3-30B-A3B", "cases timed"] == "0/1"
    assert summary.loc["OLMoE-1B-7B", "all correct"] and not summary.loc["Qwen3-30B-A3B", "all correct"]
    lab_models.styled_speedups(table).to_html()
    lab_models.styled_geomeans(summary).to_html()

    fig = lab_models.speedup_figure(table)
    axes = fig.axes
    assert len(axes) == 2  # one panel per peer
    eager = axes[0]
    olmoe = next(line for line in eager.lines if line.get_label() == "OLMoE-1B-7B")
    assert list(olmoe.get_xdata()) == [7, 64] and list(olmoe.get_ydata()) == pytest.approx([3.0, 12.0])
    levels = sorted(line.get_ydata()[0] for line in eager.lines if line.get_label() not in models.MODEL_NAMES)
    assert levels == [1.0, lab_models.TARGET_SPEEDUP]
    matplotlib.pyplot.close(fig)


def test_our_kernels_at_the_unaligned_shape_on_cpu(tmp_path):
    """Under the Triton interpreter (conftest sets it without CUDA): both of our P1 paths, rows of 9 values."""
    [run] = _run(
        tmp_path,
        "--problem",
        P1,
        "--model",
        UNALIGNED,
        "--impl",
        "triton,triton_fast",
        "--tokens",
        "7",
        "--reps",
        "1",
        "--warmup",
        "0",
    )["runs"]
    frame = pd.read_csv(run["csv"])
    assert list(frame["impl"]) == ["triton", "triton_fast"] and set(frame["intermediate_size"]) == {9}
    assert (frame["status"] == "ok").all() and frame["correct"].all() and (frame["rel_error"] < 1e-2).all()


@pytest.mark.slow
def test_report_notebook_shows_the_models_section_from_model_suite_files(committed, tmp_path):
    """Notebook 05 on a results folder holding the benchmark's own files and two model-suite runs: the section's
    geomeans in summary.json are those of lab.models, and its figure is written."""
    papermill = pytest.importorskip("papermill")
    kernelspec = pytest.importorskip("jupyter_client.kernelspec")
    try:
        kernelspec.KernelSpecManager().get_kernel_spec("moe-backward-lab")
    except kernelspec.NoSuchKernel:
        pytest.skip("Jupyter kernel 'moe-backward-lab' not installed (make setup installs it)")
    for result in lab_results.load_results().values():
        for path in (result.csv, result.csv.with_suffix(".json")):
            shutil.copy(path, committed / "H200" / path.name)
    out = tmp_path / "out"
    out.mkdir()
    notebook = problems.DATA_DIR.parent / "notebooks" / "05_benchmark_report.ipynb"
    papermill.execute_notebook(
        str(notebook),
        str(out / notebook.name),
        parameters=dict(results_dir=str(committed), output_dir=str(out)),
        kernel_name="moe-backward-lab",
        progress_bar=False,
        cwd=str(notebook.parent),
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
    summary = json.loads((out / "summary.json").read_text())
    table = lab_models.geomean_table(lab_models.speedup_table(lab_models.load_model_runs(committed, "H200"), P1))
    assert set(summary["model_suite"]) == {P1}
    geomeans = summary["model_suite"][P1]["geomeans"]
    assert geomeans["OLMoE-1B-7B"]["geomean vs torch_eager"] == pytest.approx(6.0)
    assert geomeans["Qwen3-30B-A3B"]["geomean vs torch_compile"] is None  # not timed there
    assert list(geomeans) == list(table.index)
    assert f"models_{P1}.png" in summary["figures"] and (out / f"models_{P1}.png").read_bytes()[:4] == b"\x89PNG"
