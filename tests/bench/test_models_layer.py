"""The model suite's training step (python -m moe_lib.bench --models --mode forward_backward) on CPU: its options,
the rows it writes at the models' shapes, and its files kept apart from the function's by every reader."""

import json
import math

import pandas as pd
import pytest

from moe_lib import problems
from moe_lib.bench import cli, layer_step, models, modes, peers, results
from moe_lib.bench.peers import registry
from moe_lib.lab import models as lab_models
from moe_lib.lab import results as lab_results
from moe_lib.lab import training_step

P1 = "swiglu_down_backward"
P2_BF16 = "moe_experts_backward_bf16"
FINE_GRAINED = "Qwen3-30B-A3B,DeepSeek-V2-Lite"
UNALIGNED = "unaligned-1000x300"


def _run(tmp_path, *argv):
    return cli.main(["--models", "--out", str(tmp_path), "--device", "cpu", "--reps", "1", "--warmup", "0", *argv])


def _cli_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit):
        cli.parse_args(["--device", "cpu", "--models", *argv])
    return capsys.readouterr().err


# ---------------------------------------------------------------- the command line


def test_layer_mode_defaults_are_the_layer_peers_that_run_here():
    args = cli.parse_args(["--device", "cpu", "--models", "--mode", "forward_backward", "--problem", P2_BF16])
    assert args.mode == "forward_backward" and args.problems == [P2_BF16]
    # SonicMoE needs CUDA: the other three of LAYER_IMPLS, in its order
    assert args.model_impls[P2_BF16] == ["triton_engine_saved", "triton_saved", "grouped_mm"]
    assert models.default_tokens(P2_BF16, "forward_backward", small=False) == (2048, 8192, 32768)
    assert models.default_tokens(P2_BF16, "op", small=False) == models.TOKENS[P2_BF16]
    assert models.default_tokens(P2_BF16, "forward_backward", small=True) == models.SMALL_TOKENS[P2_BF16]
    args = cli.parse_args(["--device", "cpu", "--models", "--mode", "forward", "--impl", "reference"])
    assert args.problems == list(problems.PROBLEM_NAMES)  # every problem has a layer
    assert all(impls == ["reference"] for impls in args.model_impls.values())


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--mode", "forward_backward", "--problem", P1, "--impl", "triton_fast"], ["--impl", "not a layer peer"]),
        (["--mode", "forward_backward", "--problem", P2_BF16, "--impl", "sonicmoe,nope"], ["--impl", "'nope'"]),
        (["--mode", "forward", "--impl", "reference,reference"], ["--impl"]),
        (["--mode", "forward_backward", "--suite"], ["--suite"]),
        (["--mode", "forward_backward", "--dtype", "bf16"], ["--dtype"]),
        (["--mode", "train"], ["--mode"]),
    ],
)
def test_layer_mode_options_are_checked_and_errors_name_the_option(argv, words, capsys):
    error = _cli_error(capsys, *argv)
    assert all(word in error for word in words), error


def test_a_problem_without_a_layer_is_an_error_naming_the_mode(monkeypatch, capsys):
    monkeypatch.delitem(layer_step.LAYERS, "swiglu_down_backward")
    assert not modes.has_layer(P1) and modes.has_layer(P2_BF16)
    error = _cli_error(capsys, "--mode", "forward_backward", "--problem", P1)
    assert "--mode forward_backward" in error and P1 in error
    with pytest.raises(SystemExit):  # the single-shape benchmark says the same
        cli.parse_args(["--device", "cpu", "--mode", "forward", "--problem", P1])
    assert "--mode forward" in capsys.readouterr().err


# ---------------------------------------------------------------- runs on CPU


def test_cpu_layer_step_at_the_models_writes_checked_rows_with_the_mode(tmp_path, capsys):
    """P2 bf16's forward + backward at the two fine-grained models: every row carries the model's (scaled-down)
    shape and the mode, is checked against the reference layer, and counts the step's FLOPs at its shape."""
    [run] = _run(
        tmp_path,
        "--mode",
        "forward_backward",
        "--problem",
        P2_BF16,
        "--model",
        FINE_GRAINED,
        "--impl",
        "reference,grouped_mm",
        "--tokens",
        "5,16",
    )["runs"]
    suffix = FINE_GRAINED.replace(",", "+")
    assert run["csv"].name.endswith(f"-{P2_BF16}-bfloat16-forward_backward-small-models-{suffix}.csv")
    frame = pd.read_csv(run["csv"])
    assert list(frame.columns[:7]) == ["problem", "mode", *models.shape_columns("moe_experts_backward")]
    assert set(frame["mode"]) == {"forward_backward"} and len(frame) == 2 * 2 * 2
    assert (frame["status"] == "ok").all() and frame["correct"].all() and (frame["median_ms"] > 0).all()
    names = modes.output_names(problems.load(P2_BF16), "forward_backward")
    assert names[0] == "output" and "grad_topk_weights" in names
    for name in names:
        assert (frame[f"rel_error_{name}"] < 2e-2).all(), name
    by_model = {model.name: model for model in models.MODEL_SHAPES}
    for row in frame.itertuples():
        small = models.small_axes(by_model[row.model], "moe_experts_backward")
        assert (row.hidden_size, row.intermediate_size) == (small["hidden_size"], small["intermediate_size"])
        assert (row.num_experts, row.top_k) == (small["num_experts"], small["top_k"])
        assert row.flops == 18 * row.num_tokens * row.top_k * row.hidden_size * row.intermediate_size
    assert set(frame.loc[frame["model"] == "DeepSeek-V2-Lite", "top_k"]) == {6}
    assert "peak_mem_gb" in frame.columns  # NaN on CPU, the bytes the GPU allocated at its peak on CUDA

    document = json.loads(run["json"].read_text())
    assert document["mode"] == "forward_backward" and document["suite"] == results.MODEL_SUITE
    assert document["complete"] is True and document["element_rule"] is None
    assert [m["model"] for m in document["models"]] == FINE_GRAINED.split(",")
    assert document["models"][1]["model_axes"] == dict(
        hidden_size=2048, intermediate_size=1408, num_experts=64, top_k=6
    )
    assert document["summary"]["Qwen3-30B-A3B"]["summary"]["grouped_mm"]["all_correct"] is True
    assert "layer forward_backward" in capsys.readouterr().out


def test_a_wrong_layer_is_a_wrong_row_not_a_time(tmp_path, monkeypatch):
    """A layer whose output is 10% off, at one model: the check fails it and it is not timed."""
    grouped = peers.layer_peers_for(P2_BF16)["grouped_mm"]

    def off(inputs, leaves):
        return grouped.forward(inputs, leaves) * 1.1

    fake = registry.LayerPeer("off", "moe_experts_backward", off, capturable=False, description="test fake")
    monkeypatch.setitem(registry._LAYER_REGISTRY["moe_experts_backward"], "off", fake)
    [run] = _run(
        tmp_path,
        "--mode",
        "forward",
        "--problem",
        P2_BF16,
        "--model",
        "Qwen3-30B-A3B",
        "--impl",
        "grouped_mm,off",
        "--tokens",
        "9",
    )["runs"]
    frame = pd.read_csv(run["csv"]).set_index("impl")
    assert frame.loc["grouped_mm", "status"] == "ok" and frame.loc["grouped_mm", "correct"]
    assert frame.loc["off", "status"].startswith("wrong") and not frame.loc["off", "correct"]
    assert math.isnan(frame.loc["off", "median_ms"]) and frame.loc["off", "rel_error_output"] > 5e-2
    assert list(pd.read_csv(run["csv"]).columns).count("rel_error_output") == 1
    assert "rel_error_grad_x" not in frame.columns  # forward only: the output is all that is checked


def test_p1_layer_at_the_unaligned_shape(tmp_path):
    [run] = _run(
        tmp_path,
        "--mode",
        "forward_backward",
        "--problem",
        P1,
        "--model",
        UNALIGNED,
        "--impl",
        "reference,torch_eager",
        "--tokens",
        "7",
    )["runs"]
    frame = pd.read_csv(run["csv"])
    assert run["csv"].name.endswith(f"-{P1}-bfloat16-forward_backward-small-models-{UNALIGNED}.csv")
    assert (frame["status"] == "ok").all() and frame["correct"].all() and set(frame["intermediate_size"]) == {9}
    assert (frame["rel_error_grad_x"] < 2e-2).all() and list(frame["flops"]) == [18 * 7 * 32 * 9] * 2


@pytest.mark.gpu
def test_the_layers_at_the_fine_grained_models_on_a_gpu(tmp_path):
    """On a Hopper GPU, at the models' own shapes: our layers, grouped_mm and SonicMoE (where installed) check
    correct against the reference layer, and each row records its peak memory."""
    argv = ["--models", "--mode", "forward_backward", "--problem", P2_BF16, "--model", FINE_GRAINED]
    argv += ["--tokens", "8192", "--impl", ",".join(models.LAYER_IMPLS["moe_experts_backward"])]
    [run] = cli.main([*argv, "--out", str(tmp_path), "--reps", "3", "--warmup", "1"])["runs"]
    frame = pd.read_csv(run["csv"])
    assert not frame["small"].any() and set(frame["intermediate_size"]) == {768, 1408}
    ran = frame[~frame["status"].str.startswith("unavailable")]
    assert set(ran["impl"]) >= {"triton_engine_saved", "triton_saved", "grouped_mm"}
    assert (ran["status"] == "ok").all() and ran["correct"].all(), ran[["model", "impl", "status"]]
    assert (ran["peak_mem_gb"] > 0).all() and (ran["median_ms"] > 0).all()


# ---------------------------------------------------------------- the files apart


def test_function_and_layer_runs_sit_side_by_side_and_readers_keep_them_apart(tmp_path):
    """One run of the function and one of the layer at the same model, token count and implementation: their
    files do not collide, lab.models reads each only in its mode, and the single-shape readers read neither."""
    common = ("--problem", P2_BF16, "--model", "OLMoE-1B-7B", "--impl", "grouped_mm", "--tokens", "5")
    [op] = _run(tmp_path, *common)["runs"]
    [layer] = _run(tmp_path, "--mode", "forward_backward", *common)["runs"]
    assert op["csv"] != layer["csv"] and op["csv"].is_file() and layer["csv"].is_file()
    assert op["json"] != layer["json"] and layer["json"].is_file()

    functions = lab_models.load_model_runs(tmp_path, "cpu", small=True)
    assert list(functions.columns) == lab_models.RUN_COLUMNS and functions.attrs["mode"] == "op"
    assert list(functions["file"]) == [op["csv"].name]
    assert functions["median_ms"].iloc[0] == pytest.approx(pd.read_csv(op["csv"])["median_ms"].iloc[0])
    steps = lab_models.load_model_runs(tmp_path, "cpu", small=True, mode="forward_backward")
    assert list(steps["file"]) == [layer["csv"].name] and set(steps["mode"]) == {"forward_backward"}
    assert {"peak_mem_gb", "flops"} <= set(steps.columns) and steps.attrs["mode"] == "forward_backward"
    assert steps["median_ms"].iloc[0] == pytest.approx(pd.read_csv(layer["csv"])["median_ms"].iloc[0])
    forward = lab_models.load_model_runs(tmp_path, "cpu", small=True, mode="forward")
    assert forward.empty and "--mode forward" in forward.attrs["note"]
    with pytest.raises(ValueError, match="mode"):
        lab_models.load_model_runs(tmp_path, "cpu", small=True, mode="backward")

    assert lab_results.load_results(tmp_path, "cpu") == {}
    assert training_step.load_layer_runs(tmp_path, "cpu").empty


def _write(folder, mode, date, medians):
    """A full-size model-suite file pair of P2 bf16 at Qwen3-30B-A3B, 8192 tokens, in ``mode``: ``medians``
    {impl: ms}."""
    rows = [
        dict(
            problem=P2_BF16,
            mode=mode,
            model="Qwen3-30B-A3B",
            hidden_size=2048,
            intermediate_size=768,
            num_experts=128,
            top_k=8,
            impl=impl,
            num_tokens=8192,
            dtype="bfloat16",
            median_ms=median,
            peak_mem_gb=1.0,
            flops=18 * 8192 * 8 * 2048 * 768,
            status="ok",
            correct=True,
            passes_element_rule=None,
            rel_error=1e-3,
            small=False,
        )
        for impl, median in medians.items()
    ]
    names = modes.output_names(problems.load(P2_BF16), mode)
    frame = results.results_frame(rows, names, models.shape_columns("moe_experts_backward"))
    stem = models.model_stem(P2_BF16, "bfloat16", small=False, date=date, suffix=None, mode=mode)
    frame.to_csv(folder / f"{stem}.csv", index=False)
    document = dict(
        problem=P2_BF16,
        mode=mode,
        suite=results.MODEL_SUITE,
        dtype="bfloat16",
        provenance=dict(date_utc=f"{date}T10:00:00+00:00", small=False, git_commit="abcdef123456", gpu_key="H200"),
    )
    (folder / f"{stem}.json").write_text(json.dumps(document))


def test_newer_layer_rows_never_replace_the_functions_and_compare_as_layers(tmp_path):
    """The layer run is newer and has the same (problem, model, tokens, impl) keys: mixed in, its rows would win."""
    folder = tmp_path / "H200"
    folder.mkdir()
    _write(folder, "op", "2026-12-01", {"triton": 2.0, "grouped_mm": 3.0})
    _write(
        folder,
        "forward_backward",
        "2026-12-05",
        {"triton": 7.0, "triton_engine_saved": 4.0, "grouped_mm": 9.0, "sonicmoe": 5.0},
    )
    functions = lab_models.load_model_runs(tmp_path, "H200")
    assert dict(zip(functions["impl"], functions["median_ms"], strict=True)) == {"triton": 2.0, "grouped_mm": 3.0}
    table = lab_models.speedup_table(functions, P2_BF16)
    assert table.loc[("Qwen3-30B-A3B", 8192), "vs grouped_mm"] == pytest.approx(1.5)

    steps = lab_models.load_model_runs(tmp_path, "H200", mode="forward_backward")
    assert dict(zip(steps["impl"], steps["median_ms"], strict=True)) == {
        "triton": 7.0,
        "triton_engine_saved": 4.0,
        "grouped_mm": 9.0,
        "sonicmoe": 5.0,
    }
    assert (steps["peak_mem_gb"] == 1.0).all() and set(steps["flops"]) == {18 * 8192 * 8 * 2048 * 768}
    table = lab_models.speedup_table(steps, P2_BF16)
    assert table.attrs["ours"] == "triton_engine_saved" and table.attrs["mode"] == "forward_backward"
    assert table.loc[("Qwen3-30B-A3B", 8192), "vs grouped_mm"] == pytest.approx(9.0 / 4.0)
    assert table.loc[("Qwen3-30B-A3B", 8192), "vs sonicmoe"] == pytest.approx(5.0 / 4.0)
    assert "layer forward_backward" in lab_models.styled_speedups(table).to_html()
    assert training_step.load_layer_runs(tmp_path, "H200").empty  # of other shapes than the problem's own
