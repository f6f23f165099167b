"""The notebooks: committed clean with one typed parameters cell; executed with tiny parameters, the numbers
they write to summary.json agree with moe_lib, the committed result files and the autograd oracles recomputed here."""

import ast
import json
import math
import os
import random
import re
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import rel_error
from oracles import moe_experts_grads, swiglu_expert_grads

import moe_lib
from moe_lib import problems, roofline
from moe_lib.dispatch import interpreter_enabled
from moe_lib.distributed import expert_partition
from moe_lib.lab import derivations, regimes
from moe_lib.lab import models as lab_models
from moe_lib.lab import results as lab_results
from moe_lib.lab import targets as lab_targets
from moe_lib.moe_experts import choose as p2_choose
from moe_lib.moe_experts import runtime as p2_runtime
from moe_lib.moe_experts.inputs import ROUTINGS, route_tokens
from moe_lib.swiglu_down.designs import DESIGNS, triton_launches

papermill = pytest.importorskip("papermill")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
KERNEL_NAME = "moe-backward-lab"
P1_OUTPUTS = list(problems.load("swiglu_down_backward").outputs)
P2_OUTPUTS = list(problems.load("moe_experts_backward").outputs)


def test_the_notebooks_exist():
    stems = {path.stem for path in NOTEBOOKS}
    assert {
        "01_swiglu_backward_derivation",
        "02_moe_backward_derivation",
        "03_roofline",
        "04_inside_the_kernels",
        "05_benchmark_report",
        "06_expert_parallelism",
        "08_design_log",
    } <= stems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_committed_without_outputs_and_with_typed_parameters(path):
    cell_ids = [cell.get("id") for cell in json.loads(path.read_text())["cells"]]  # as committed: nbformat fills in
    assert None not in cell_ids, f"{path.name}: cell {cell_ids.index(None)} has no id"
    assert len(set(cell_ids)) == len(cell_ids), f"{path.name}: cell ids repeat"
    notebook = nbformat.read(path, as_version=4)
    assert notebook.metadata["kernelspec"]["name"] == KERNEL_NAME
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} has outputs"
    tagged = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged 'parameters'"
    statements = ast.parse(tagged[0].source).body
    assert statements, "empty parameters cell"
    for statement in statements:
        assert isinstance(statement, ast.AnnAssign) and statement.value is not None, ast.unparse(statement)
    inspected = papermill.inspect_notebook(str(path))
    assert set(inspected) == {statement.target.id for statement in statements}
    assert "output_dir" in inspected, "the report runner passes output_dir to every notebook"
    for name, spec in inspected.items():
        assert spec["inferred_type_name"] != "None", f"{name} has no type"
        assert spec["help"].strip(), f"{name} has no comment saying what it is"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_keeps_its_plumbing_off_its_page(path):
    """The report's index gives each notebook a line; the cells that only write summary.json are tagged
    remove-cell (run, but left off the HTML page); the notebooks cite no document outside the repository."""
    notebook = nbformat.read(path, as_version=4)
    assert notebook.cells[0].source.startswith(f"# {path.stem[:2]} · ")
    assert 40 < len(notebook.metadata.get("description", "")) < 200
    hidden = [cell for cell in notebook.cells if "remove-cell" in cell.metadata.get("tags", [])]
    writers = [cell for cell in notebook.cells if '"summary.json").write_text' in cell.source]
    assert writers and all(cell in hidden for cell in writers)
    assert not any("parameters" in cell.metadata.get("tags", []) for cell in hidden)
    for cell in notebook.cells:
        assert "problems.md" not in cell.source and "measuring.md" not in cell.source
        for document in re.findall(r"`((?:docs|data|moe_lib|scripts|notes)/[\w./-]+\.(?:md|py|json))`", cell.source):
            assert (ROOT / document).is_file(), document


@pytest.fixture(scope="module")
def kernel_name():
    kernelspec = pytest.importorskip("jupyter_client.kernelspec")
    try:
        kernelspec.KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except kernelspec.NoSuchKernel:
        pytest.skip(f"Jupyter kernel {KERNEL_NAME!r} not installed (make setup installs it)")
    return KERNEL_NAME


def _fresh_seed() -> int:
    seed = int(os.environ.get("MOE_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"seed={seed}")
    return seed


def _assert_figures_written(summary: dict, folder: Path) -> None:
    """The notebook listed at least one figure, and every figure it lists is a PNG file in ``folder``."""
    assert summary["figures"], "the notebook lists no figure"
    for figure in summary["figures"]:
        assert (folder / figure).read_bytes()[:4] == b"\x89PNG", figure


def _execute(stem, parameters, folder: Path, kernel_name) -> dict:
    papermill.execute_notebook(
        str(NOTEBOOKS_DIR / f"{stem}.ipynb"),
        str(folder / f"{stem}.ipynb"),
        parameters={**parameters, "output_dir": str(folder)},
        kernel_name=kernel_name,
        progress_bar=False,
        cwd=str(NOTEBOOKS_DIR),
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
    return json.loads((folder / "summary.json").read_text())


# ---------------------------------------------------------------- 01 · SwiGLU backward

P1_STEPS = {
    "grad_down_weight",
    "d_intermediate",
    "silu_grad_formula",
    "d_up",
    "d_gate_silu",
    "d_gate",
    "grad_gate_weight",
    "grad_up_weight",
    "grad_x",
    "grad_x_one_product",
}


@pytest.fixture(scope="module")
def p1_run(kernel_name, tmp_path_factory):
    parameters = dict(num_tokens=5, hidden_size=12, intermediate_size=7, bf16_num_tokens=3, seed=_fresh_seed())
    folder = tmp_path_factory.mktemp("p1")
    return parameters, _execute("01_swiglu_backward_derivation", parameters, folder, kernel_name), folder


def test_p1_every_step_agrees_with_autograd(p1_run):
    parameters, summary, _ = p1_run
    assert summary["seed"] == parameters["seed"]
    assert summary["sizes"] == {k: parameters[k] for k in ("num_tokens", "hidden_size", "intermediate_size")}
    assert set(summary["step_rel_errors"]) == P1_STEPS
    assert all(error < 1e-10 for error in summary["step_rel_errors"].values()), summary["step_rel_errors"]
    assert set(summary["reference_rel_errors"]) == set(P1_OUTPUTS)
    assert all(error < 1e-10 for error in summary["reference_rel_errors"].values())


def test_p1_gradients_are_those_of_moe_lib_and_the_oracle(p1_run):
    parameters, summary, _ = p1_run
    inputs = problems.make_inputs(
        "swiglu_down_backward",
        parameters["num_tokens"],
        seed=parameters["seed"],
        dtype=torch.float64,
        hidden_size=parameters["hidden_size"],
        intermediate_size=parameters["intermediate_size"],
    )
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="reference")
    oracle = swiglu_expert_grads(*(inputs[k] for k in ("grad_output", "x", "gate_weight", "up_weight", "down_weight")))
    for name, g, want in zip(P1_OUTPUTS, got, oracle, strict=True):
        assert rel_error(g, want) < 1e-10, name
        assert summary["grad_norms"][name] == pytest.approx(want.norm().item(), rel=1e-12), name


def test_p1_bf16_errors_match_a_recomputation(p1_run):
    parameters, summary, folder = p1_run
    bf16 = summary["bf16"]
    problem = problems.load("swiglu_down_backward")
    assert bf16["sizes"] == problem.sizes(parameters["bf16_num_tokens"])
    inputs = problem.make_inputs(parameters["bf16_num_tokens"], seed=parameters["seed"])
    assert inputs["x"].dtype == torch.bfloat16
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="reference")
    exact_saved = moe_lib.swiglu_down_backward(*(t.double() for t in inputs.values()), impl="reference")
    exact_forward = swiglu_expert_grads(
        *(inputs[k] for k in ("grad_output", "x", "gate_weight", "up_weight", "down_weight"))
    )
    errors = bf16["rel_errors"]
    for name, g, saved, forward in zip(P1_OUTPUTS, got, exact_saved, exact_forward, strict=True):
        assert errors["bf16 output rounding"][name] == pytest.approx(rel_error(g, saved), rel=1e-3), name
        assert errors["bf16 saved forward"][name] == pytest.approx(rel_error(g, forward), rel=1e-3), name
        assert errors["fp32 arithmetic"][name] < 1e-5 < errors["bf16 output rounding"][name] < 1e-2, name
    # only dW_g and dx read the saved sigmoid
    recomputed = errors["recomputed sigmoid"]
    assert recomputed["grad_up_weight"] == recomputed["grad_down_weight"] == 0
    assert recomputed["grad_x"] > 1e-5 and recomputed["grad_gate_weight"] > 1e-5
    assert bf16["gate"]["std"] == pytest.approx(inputs["gate"].double().std().item(), rel=1e-9)
    assert (folder / "silu_and_gates.png").read_bytes()[:4] == b"\x89PNG"


def test_p1_element_rule_table_matches_a_recomputation(p1_run):
    parameters, summary, folder = p1_run
    rows = derivations.representation_pass_fractions(
        parameters["bf16_num_tokens"], scales=(1.0, 4.0), seed=parameters["seed"]
    )
    assert summary["element_rule"] == rows
    for row in rows:  # the faithful path's hi/lo pairs keep every output within the rule at both scales
        if row["representation"] == "bf16 hi/lo":
            assert min(row[f"{output} pass"] for output in ("dx", "dWg", "dWu")) >= 0.99, row
    assert (folder / "element_rule.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- 02 · MoE experts backward

P2_STEPS = {
    "d_o",
    "grad_topk_weights_from_o",
    "grad_topk_weights",
    "d_a",
    "d_g",
    "d_u",
    "d_x_slots",
    "grad_gate_weights",
    "grad_up_weights",
    "grad_down_weights",
    "adjoint_identity",
    "grad_hidden_states_scatter_add",
    "grad_hidden_states",
}


@pytest.fixture(scope="module")
def p2_run(kernel_name, tmp_path_factory):
    parameters = dict(
        num_tokens=7,
        hidden_size=10,
        intermediate_size=6,
        num_experts=9,
        top_k=3,
        routing="skewed",
        routing_num_tokens=300,
        rule_num_rows=8,
        rule_hidden_size=256,
        rule_intermediate_size=128,
        seed=_fresh_seed(),
    )
    folder = tmp_path_factory.mktemp("p2")
    return parameters, _execute("02_moe_backward_derivation", parameters, folder, kernel_name), folder


def _p2_inputs(parameters):
    return problems.make_inputs(
        "moe_experts_backward",
        parameters["num_tokens"],
        seed=parameters["seed"],
        dtype=torch.float64,
        routing=parameters["routing"],
        hidden_size=parameters["hidden_size"],
        intermediate_size=parameters["intermediate_size"],
        num_experts=parameters["num_experts"],
        top_k=parameters["top_k"],
    )


def test_p2_every_step_agrees_with_autograd(p2_run):
    parameters, summary, _ = p2_run
    assert summary["sizes"] == {
        k: parameters[k] for k in ("num_tokens", "hidden_size", "intermediate_size", "num_experts", "top_k", "routing")
    }
    assert set(summary["step_rel_errors"]) == P2_STEPS
    assert all(error < 1e-10 for error in summary["step_rel_errors"].values()), summary["step_rel_errors"]
    assert set(summary["reference_rel_errors"]) == set(P2_OUTPUTS)
    assert all(error < 1e-10 for error in summary["reference_rel_errors"].values())


def test_p2_gradients_and_empty_experts_are_those_of_moe_lib(p2_run):
    parameters, summary, _ = p2_run
    inputs = _p2_inputs(parameters)
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="reference")
    oracle = moe_experts_grads(*inputs.values())
    for name, g, want in zip(P2_OUTPUTS, got, oracle, strict=True):
        assert rel_error(g, want) < 1e-10, name
        assert summary["grad_norms"][name] == pytest.approx(want.norm().item(), rel=1e-12), name
    chosen = set(inputs["topk_indices"].flatten().tolist())
    assert summary["empty_experts"] == sorted(set(range(parameters["num_experts"])) - chosen)


def test_p2_element_rule_check_is_that_of_the_lab(p2_run):
    parameters, summary, _ = p2_run
    want = derivations.topk_weight_grad_rule(
        parameters["rule_num_rows"],
        seed=parameters["seed"],
        hidden_size=parameters["rule_hidden_size"],
        intermediate_size=parameters["rule_intermediate_size"],
    )
    assert summary["topk_weight_grad_rule"] == pytest.approx(want)
    assert want["bf16×3 rel err"] < want["one bf16 product rel err"] / 16  # three products: far closer


def test_p2_tokens_per_expert_match_route_tokens(p2_run):
    parameters, summary, folder = p2_run
    load = summary["tokens_per_expert"]
    sizes = problems.load("moe_experts_backward").sizes(parameters["routing_num_tokens"])
    T, E, K = parameters["routing_num_tokens"], sizes["num_experts"], sizes["top_k"]
    assert load["sizes"] == {"num_tokens": T, "num_experts": E, "top_k": K}
    assert load["mean"] == T * K / E
    for routing in ROUTINGS:
        generator = torch.Generator().manual_seed(parameters["seed"])
        indices = route_tokens(T, E, K, routing=routing, generator=generator)
        counts = torch.bincount(indices.flatten(), minlength=E)
        stats = load[routing]
        assert (stats["min"], stats["max"]) == (counts.min().item(), counts.max().item()), routing
        assert stats["empty_experts"] == (counts == 0).sum().item(), routing
        assert stats["mean"] == pytest.approx(T * K / E)
        assert stats["std"] == pytest.approx(counts.double().std().item())
    assert load["hot"]["max"] == T and load["hot"]["empty_experts"] == E - K
    _assert_figures_written(summary, folder)


# ---------------------------------------------------------------- 03 · roofline

H200_RESULTS = problems.DATA_DIR / "results" / "H200"


def _committed_csvs() -> list[Path]:
    """The benchmark harness's newest result file of each problem's function (mode op) at its own shape, as the
    notebooks read them (the training-step runs, the model suite's and the expert-parallel benchmark's sit
    beside them; older runs stay committed)."""
    newest = {}
    for path in sorted(H200_RESULTS.glob("*.csv")):  # named <date>-...: later dates sort later
        meta_path = path.with_suffix(".json")
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if (
            meta.get("problem") in problems.PROBLEM_NAMES
            and meta.get("mode", "op") == "op"
            and meta.get("suite") != "models"
        ):
            newest[meta["problem"]] = path
    return sorted(newest.values())


@pytest.fixture(scope="module")
def roofline_run(kernel_name, tmp_path_factory):
    parameters = dict(gpu="B200")  # not the GPU the committed points ran on: every point is projected
    folder = tmp_path_factory.mktemp("roofline")
    return parameters, _execute("03_roofline", parameters, folder, kernel_name), folder


def _coefficients(name: str) -> tuple[int, int, int]:
    """(FLOPs per token, bytes per token, fixed bytes) of a problem, written out from its definition."""
    s = problems.load(name).sizes(0)
    H, I, E, K = s["hidden_size"], s["intermediate_size"], s.get("num_experts"), s.get("top_k")
    if name == "swiglu_down_backward":  # dy, x, dx [T, H]; five saved [T, I]; three weights and their grads; bf16
        return 12 * H * I, 2 * (3 * H + 5 * I), 2 * 6 * I * H
    item = 4 if name == "moe_experts_backward" else 2  # the bf16 variant keeps fp32 routing weights
    per_token = item * 3 * H + 8 * K + 4 * K + 4 * K  # dy, x, dx; int64 indices; weights and their grads (fp32)
    return 16 * K * H * I, per_token, item * 6 * E * I * H


def test_roofline_crossings_match_a_hand_calculation(roofline_run):
    parameters, summary, _ = roofline_run
    spec = roofline.GPUS[parameters["gpu"]]
    ridge = spec.bf16_dense_flops / spec.dram_bandwidth
    assert summary["gpu"] == parameters["gpu"] and summary["ridge_flop_per_byte"] == pytest.approx(ridge)
    for name in problems.PROBLEM_NAMES:
        a, b, c = _coefficients(name)
        crossing = ridge * c / (a - ridge * b)
        assert summary["ridge_crossing_tokens"][name] == pytest.approx(crossing, rel=1e-12), name
        below, above = (roofline.cost(name, t) for t in (math.ceil(crossing) - 1, math.ceil(crossing)))
        assert below[0] / below[1] < ridge <= above[0] / above[1], name
        compute_bound = [t for t in problems.load(name).suite if t >= crossing]
        assert summary["compute_bound_cases"][name] == len(compute_bound), name
        for t, t_sol in summary["t_sol_us"][name].items():
            assert t_sol == pytest.approx(roofline.sol_time(name, int(t), parameters["gpu"]) * 1e6), (name, t)


def test_roofline_plots_every_committed_point_projected(roofline_run):
    _, summary, folder = roofline_run
    ok_rows = sum(int((pd.read_csv(path)["status"] == "ok").sum()) for path in _committed_csvs())
    assert summary["measured_points"] == ok_rows > 0
    assert summary["projected_points"] == ok_rows  # measured on the H200, drawn for the B200
    assert summary["result_files"] == [path.name for path in _ordered(_committed_csvs())]
    _assert_figures_written(summary, folder)


# ---------------------------------------------------------------- 04 · inside the kernels

KERNEL_PARAMETERS = dict(
    p1_num_tokens=3,
    p1_hidden_size=32,
    p1_intermediate_size=32,
    split_k=2,
    split_k_steps=2,
    p2_num_tokens=10,
    p2_hidden_size=32,
    p2_intermediate_size=16,
    p2_num_experts=3,
    p2_top_k=2,
    diagram_num_tokens=16,
)


@pytest.fixture(scope="module")
def kernels_run(kernel_name, tmp_path_factory):
    parameters = dict(KERNEL_PARAMETERS, seed=_fresh_seed())
    folder = tmp_path_factory.mktemp("kernels")
    return parameters, _execute("04_inside_the_kernels", parameters, folder, kernel_name), folder


def test_kernels_notebook_grids_are_those_of_moe_lib(kernels_run):
    p, summary, folder = kernels_run
    assert summary["interpret"] is True
    T, H, I = p["p1_num_tokens"], p["p1_hidden_size"], p["p1_intermediate_size"]
    plan = triton_launches.launch_plan(T, H, I, triton_launches.INTERPRETER_TILES)  # the chooser's pick there
    assert summary["p1"]["grid"] == {f"launch {n}": sum(k.programs for k in plan if k.launch == n) for n in (1, 2)}
    config = p2_choose.launch_config(
        p["p2_num_tokens"] * p["p2_top_k"], p["p2_num_experts"], input_bytes=4, interpreter=True
    )
    T, H, I = p["p2_num_tokens"], p["p2_hidden_size"], p["p2_intermediate_size"]
    E, R = p["p2_num_experts"], config.row_split

    persistent = p2_runtime.default_persistent_programs()  # kernels W and D, TMA-fed: programs loop over tiles
    assert config.tma_weight_grad is not None and config.tma_slot_projection is not None
    assert summary["p2"]["grid"] == {
        "A": E * -(-I // config.block_i) * R,
        "W_gate_up": persistent,
        "W_down": persistent,
        "D": persistent,
        "C": T * -(-H // config.block_h_sum),
    }
    assert sum(summary["p2"]["rows_per_expert"]) == p["p2_num_tokens"] * p["p2_top_k"]
    sizes = problems.load("swiglu_down_backward").sizes(p["diagram_num_tokens"])
    H, I = sizes["hidden_size"], sizes["intermediate_size"]
    diagram = triton_launches.launch_plan(
        p["diagram_num_tokens"], H, I, triton_launches.tiles_for(p["diagram_num_tokens"], with_lo=True)
    )
    assert summary["diagram"]["programs"]["launch 1"] == sum(k.programs for k in diagram if k.launch == 1)
    # the chooser's bands on the H200 at the benchmark's shape: designs of the registry, one launch at one token
    assert {row["design"] for row in summary["regimes"]} <= set(DESIGNS)
    assert [row["design"] for row in summary["regimes"] if row["first"] == 1] == ["few_tokens", "few_tokens"]
    _assert_figures_written(summary, folder)
    # the page shows the kernels' own source: the teaching kernels and the library's
    executed = nbformat.read(folder / "04_inside_the_kernels.ipynb", as_version=4)
    outputs = [out for cell in executed.cells if cell.cell_type == "code" for out in cell.outputs]
    shown = "".join(out.get("data", {}).get("text/html", "") for out in outputs)
    for kernel in (
        "rowwise_matmul_kernel",
        "tiled_matmul_kernel",
        "fused_dswiglu_kernel",
        "grouped_gather_matmul_kernel",
        "accumulate_product",
        "d_intermediate_program",
        "combine_splits",
        "swiglu_grad_kernel",
        "expert_weight_grad_kernel",
        "slot_projection_kernel",
        "token_sum_kernel",
        "ring_barriers",
        "load_steps",
        "mma_steps",
        "tile_product",
        "mma_partition",
        "weight_grad_region",
        "weight_grad_tiles_partition",
        "grouped_weight_grad_kernel",
        "slot_projection_tma_kernel",
        "choose_design",
        "generic_gluon_form",
        "grouped_gemm_tl_kernel",
        "grouped_wgrad_tl_kernel",
        "grouped_load_partition",
        "grouped_consumer_partition",
    ):
        assert f'<span class="nf">{kernel}</span>' in shown, kernel


def test_kernels_notebook_errors_agree_with_a_rerun(kernels_run):
    p, summary, _ = kernels_run
    assert summary["p1"]["max_rel_error"] < 1e-5  # fp32 products: rounding only
    assert summary["p2"]["rel_errors"]["grad_topk_weights"] < 1e-4  # bf16x3 products
    assert summary["p2"]["max_rel_error"] < 1e-2  # bf16 products for the rest
    split = summary["split_k"]
    # determinism is shown on a GPU only: under the interpreter the programs run one at a time
    on_gpu = not summary["interpret"]
    assert split["bitwise_identical_runs"] is (True if on_gpu else None)
    assert summary["p2"]["bitwise_identical_runs"] is (True if on_gpu else None)
    # several BLOCK_K steps a split: the split sum groups them differently, a rounding difference, visible
    assert split["size"] == p["split_k"] * p["split_k_steps"] * 16
    assert 0 < max(split["rel_diff_vs_unsplit"].values()) < 1e-5
    assert split["partials_sum_rel_error"] < 1e-5 and max(split["rel_diff_vs_unsplit"].values()) < 1e-5
    # the ladder's costs: each rung predicted faster than the one below; the Hopper rung measured faster than Triton
    costs = [value for key, value in summary["rung_costs_us"].items() if key != "num_tokens"]
    assert costs == sorted(costs, reverse=True) and len(costs) == 3
    assert summary["ring"]["error"] is None and summary["ring"]["events"] == 2 * (3 * 4 + 2)
    for tokens, row in summary["launch2"].items():
        assert row["Gluon (the library's)"] < row["Triton"], tokens
        assert row["predicted (µs)"] < row["cuBLAS, same arithmetic"], tokens
    assert all(row["Gluon over Triton"] > 1 > row["floor over Gluon"] for row in summary["call_ladder"].values())
    # the regimes the page shows are the chooser's
    table = regimes.regime_table(2048, 768)
    assert summary["regimes"] == table.to_dict(orient="records")
    # the teaching kernels, naive → tiled → fused for P1 and per expert → grouped for P2, against float64
    tutorial = summary["tutorial"]
    assert list(tutorial) == [
        "P1 step 1 · naive",
        "P1 step 2 · tiled",
        "P1 step 3 · fused",
        "P2 step 1 · per expert",
        "P2 step 2 · grouped",
    ]
    assert set(tutorial["P1 step 3 · fused"]) == {"d_gate", "d_up"}
    assert all(error < 1e-5 for errors in tutorial.values() for error in errors.values()), tutorial
    # the grouped engine: its twins and its layer against float64, every output written, the launches recorded
    engine = summary["engine"]
    assert engine["twin_nan_left"] == 0 and max(engine["twin_errors"].values()) < 1e-2
    assert engine["max_rel_error"] < 2e-2
    assert [tuple(launch) for launch in engine["launches"]["backward"]] == [
        ("grouped_gemm", "swiglu"),
        ("grouped_gemm", "dswiglu"),
        ("grouped_gemm", "none"),
        ("grouped_wgrad", ""),
        ("grouped_wgrad", ""),
    ]
    if not interpreter_enabled():
        pytest.skip("the rerun below compares interpreter numbers; this process runs Triton on CUDA")
    p1 = problems.make_inputs(
        "swiglu_down_backward",
        p["p1_num_tokens"],
        seed=p["seed"],
        dtype=torch.float32,
        hidden_size=p["p1_hidden_size"],
        intermediate_size=p["p1_intermediate_size"],
    )
    got = moe_lib.swiglu_down_backward(*p1.values(), impl="triton")
    want = moe_lib.swiglu_down_backward(*p1.values(), impl="reference")
    for name, g, w in zip(P1_OUTPUTS, got, want, strict=True):
        assert summary["p1"]["rel_errors"][name] == pytest.approx(rel_error(g, w), rel=1e-6, abs=1e-12), name
    p2 = problems.make_inputs(
        "moe_experts_backward",
        p["p2_num_tokens"],
        seed=p["seed"],
        hidden_size=p["p2_hidden_size"],
        intermediate_size=p["p2_intermediate_size"],
        num_experts=p["p2_num_experts"],
        top_k=p["p2_top_k"],
    )
    got = moe_lib.moe_experts_backward(*p2.values(), impl="triton")
    want = moe_lib.moe_experts_backward(*p2.values(), impl="reference")
    for name, g, w in zip(P2_OUTPUTS, got, want, strict=True):
        assert summary["p2"]["rel_errors"][name] == pytest.approx(rel_error(g, w), rel=1e-6, abs=1e-12), name


# ---------------------------------------------------------------- 05 · benchmark report


@pytest.fixture(scope="module")
def report_run(kernel_name, tmp_path_factory):
    # live=True without CUDA must fall back to the committed files and say so (with CUDA it would benchmark)
    parameters = dict(live=not torch.cuda.is_available())
    folder = tmp_path_factory.mktemp("report")
    return parameters, _execute("05_benchmark_report", parameters, folder, kernel_name), folder


def test_report_of_a_gpu_with_layer_runs_only_runs_through(kernel_name, tmp_path):
    """The H100's folder holds the layer's and the model suite's runs beside SonicMoE, no run of a problem's
    function: the report still runs, with no per-case file and the same-run SonicMoE column in its model table."""
    summary = _execute("05_benchmark_report", dict(gpu_key="H100-SXM"), tmp_path, kernel_name)
    assert summary["files"] == [] and (tmp_path / "time_per_case.png").is_file()
    executed = nbformat.read(tmp_path / "05_benchmark_report.ipynb", as_version=4)
    outputs = "".join(str(o) for cell in executed.cells if cell.cell_type == "code" for o in cell.get("outputs", []))
    assert "sonicmoe (same run)" in outputs
    assert "H100-SXM: ours faster than SonicMoE in" in outputs and (tmp_path / "same_run_sonicmoe.png").is_file()


def test_report_reads_the_committed_files(report_run):
    parameters, summary, folder = report_run
    assert summary["source"] == "committed" and summary["live_requested"] == parameters["live"]
    assert summary["files"] == [path.name for path in _ordered(_committed_csvs())]
    for path in _committed_csvs():
        recorded = json.loads(path.with_suffix(".json").read_text())
        for impl, values in recorded["summary"].items():
            mine = summary["problems"][recorded["problem"]][impl]
            assert mine == {"geomean_ms": values["geomean_ms"], "all_correct": values["all_correct"]}, impl
    runs = [json.loads(path.with_suffix(".json").read_text()) for path in _committed_csvs()]
    fp32_run = next(run for run in runs if run["problem"] == "moe_experts_backward")
    failing = {impl for impl, values in fp32_run["summary"].items() if values["passes_element_rule"] is False}
    assert "grouped_mm" in failing and set(summary["flagged"]["moe_experts_backward"]) == failing  # bf16 GEMMs
    model_runs = lab_models.load_model_runs()
    assert set(summary["model_suite"]) == set(lab_models.problems_in(model_runs))
    for name, suite in summary["model_suite"].items():
        assert suite["files"] == sorted(set(model_runs.loc[model_runs["problem"] == name, "file"]))
    if parameters["live"]:
        executed = nbformat.read(folder / "05_benchmark_report.ipynb", as_version=4)
        printed = "".join(out.get("text", "") for cell in executed.cells for out in cell.get("outputs", []))
        assert "no CUDA GPU" in printed
    from moe_lib.lab import engine_runs

    engine = engine_runs.load_engine_runs()
    assert summary["engine"]["files"] == dict(zip(engine["file"], engine["commit"], strict=True))
    assert any("/runs/" in file for file in summary["engine"]["files"]) and summary["engine"]["sonicmoe"]
    assert ("quack_probe.png" in summary["figures"]) == (not engine_runs.quack_probe().empty)
    _assert_figures_written(summary, folder)


def test_report_targets_are_computed_from_the_files(report_run):
    _, summary, _ = report_run
    targets = {(t["problem"], t["target"]): t for t in summary["targets"]}
    p1 = json.loads((H200_RESULTS / _ordered(_committed_csvs())[0].with_suffix(".json").name).read_text())
    assert p1["problem"] == "swiglu_down_backward"
    fast_us = p1["summary"]["triton_fast"]["geomean_ms"] * 1e3
    speedup = p1["summary"]["torch_compile"]["geomean_ms"] * 1e3 / fast_us
    target = targets[("P1", "≥ 1.5× faster than torch.compile (geomeans) (triton_fast)")]
    assert target["value"] == pytest.approx(speedup) and target["met"] == (speedup >= 1.5)
    table = lab_targets.targets_table(lab_results.load_results())  # every verdict, recomputed here
    assert [(t["problem"], t["target"], t["met"]) for t in summary["targets"]] == [
        (row["problem"], row["target"], row["met"]) for row in table.to_dict(orient="records")
    ]


def test_report_sets_ours_beside_sonicmoe_from_the_files(report_run):
    """The layer against SonicMoE and the backward's kernels by ncu: the numbers 05 shows, recomputed here."""
    from moe_lib.lab import sonicmoe

    _, summary, _ = report_run
    layer = sonicmoe.layer_comparison()
    assert {int(t) for t in summary["sonicmoe"]["layer"]} == set(layer.index) and len(layer)
    for tokens, row in summary["sonicmoe"]["layer"].items():
        assert row == pytest.approx(layer.loc[int(tokens)].to_dict())
        flops = 18 * int(tokens) * 8 * 4096 * 2048  # the layer's usual count at the bf16 variant's shape
        assert row["sonicmoe (TFLOP/s)"] == pytest.approx(flops / (row["sonicmoe (ms)"] * 1e-3) / 1e12)
    kernels = sonicmoe.ncu_kernels().xs(("bfloat16", 32768), level=("dtype", "tokens"))
    assert summary["sonicmoe"]["kernels_ms"] == {k: kernels.loc[k, "time (ms)"] for k in sonicmoe.GEMMS}
    assert all(summary["sonicmoe"]["kernels_at_busy_ms"][k] < ms for k, ms in summary["sonicmoe"]["kernels_ms"].items())


# ---------------------------------------------------------------- 06 · expert parallelism

PARALLEL_OUTPUTS = ["output", *P2_OUTPUTS]


@pytest.fixture(scope="module")
def parallel_run(kernel_name, tmp_path_factory):
    # three ranks sharing five experts: an uneven partition (2, 2, 1) under skewed routing
    parameters = dict(
        world_size=3,
        num_tokens_per_rank=4,
        hidden_size=8,
        intermediate_size=4,
        num_experts=5,
        top_k=2,
        routing="skewed",
        model_world_size=4,
        seed=_fresh_seed(),
    )
    folder = tmp_path_factory.mktemp("parallel")
    return parameters, _execute("06_expert_parallelism", parameters, folder, kernel_name), folder


def test_parallel_live_run_matches_one_process_and_sends_the_routed_rows(parallel_run):
    p, summary, folder = parallel_run
    live = summary["live"]
    assert live["sizes"] == {
        k: p[k]
        for k in (
            "world_size",
            "num_tokens_per_rank",
            "hidden_size",
            "intermediate_size",
            "num_experts",
            "top_k",
            "routing",
        )
    }
    assert set(live["rel_errors"]) == set(PARALLEL_OUTPUTS)
    assert live["max_rel_error"] == max(live["rel_errors"].values()) < 1e-10
    partition = expert_partition(p["num_experts"], p["world_size"])
    assert live["partition"] == [[block.start, block.stop] for block in partition] == [[0, 2], [2, 4], [4, 5]]
    inputs = problems.make_inputs(
        "moe_experts_backward",
        p["world_size"] * p["num_tokens_per_rank"],
        seed=p["seed"],
        dtype=torch.float64,
        routing=p["routing"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_experts=p["num_experts"],
        top_k=p["top_k"],
    )
    owner = torch.tensor([rank for rank, block in enumerate(partition) for _ in block])  # expert -> its rank
    token_rank = inputs["topk_indices"].reshape(p["world_size"], -1)  # rank r's tokens are the r-th block
    expected = [
        torch.bincount(owner[token_rank[rank]], minlength=p["world_size"]).tolist() for rank in range(p["world_size"])
    ]
    assert live["rows_sent"] == expected
    assert live["rows_received"] == [[row[rank] for row in expected] for rank in range(p["world_size"])]
    _assert_figures_written(summary, folder)


def _parallel_files() -> list[Path]:
    """The newest full-size result file of the expert-parallel benchmark per dtype, bfloat16 first."""
    newest = {}
    for path in sorted(H200_RESULTS.glob("*-moe_experts_parallel-*.csv")):  # dated names: the newest sorts last
        document = json.loads(path.with_suffix(".json").read_text())
        if not document["provenance"]["small"]:
            newest[document["dtype"]] = path
    return [newest[dtype] for dtype in ("bfloat16", "float32") if dtype in newest]


def test_parallel_measured_numbers_are_those_of_the_committed_files(parallel_run):
    _, summary, _ = parallel_run
    measured = summary["measured"]
    files = _parallel_files()
    assert measured["files"] == [path.name for path in files] and files
    for path in files:
        frame = pd.read_csv(path)
        if "chunks" in frame:  # the summary speaks of the runs without overlap
            frame = frame[frame["chunks"] == 1]
        frame = frame.set_index("tokens_per_rank")
        document = json.loads(path.with_suffix(".json").read_text())
        provenance = document["provenance"]
        assert measured["provenance"][path.name]["nccl"] == provenance["nccl"]
        assert measured["provenance"][path.name]["git_commit"] == provenance["git_commit"]
        cases = measured["cases"][document["dtype"]]
        assert set(cases) == {str(t) for t in frame.index}
        H, K = document["axes"]["hidden_size"], document["axes"]["top_k"]
        W, E = provenance["world_size"], document["axes"]["num_experts"]
        element = 2 if document["dtype"] == "bfloat16" else 4
        counts = (W - 1) * (3 + -(-E // W)) * 8  # the int64 counts: 3 status columns and L_max expert columns
        for case in (case for case in document["cases"] if case.get("chunks", 1) == 1):
            tokens = case["tokens_per_rank"]
            mine, row = cases[str(tokens)], frame.loc[tokens]
            assert mine["all_to_all_share"] == pytest.approx(row["all_to_all_ms"] / row["total_ms"], rel=1e-12)
            assert mine["total_ms"] == pytest.approx(row["total_ms"], rel=1e-12)
            assert mine["max_rel_error"] == pytest.approx(row["max_rel_error"], rel=1e-12)
            assert mine["correct"] == bool(row["correct"])
            assert sum(map(sum, case["rows_sent_by_rank"])) == W * tokens * K == row["rows_sent_total"]
            for rank in range(W):
                out_rows = sum(case["rows_sent_by_rank"][rank]) - case["rows_sent_by_rank"][rank][rank]
                in_rows = sum(case["rows_received_by_rank"][rank]) - case["rows_received_by_rank"][rank][rank]
                # dispatch and backward combine carry a 4-byte routing weight (or its gradient) per row
                sent = (out_rows + in_rows) * (2 * H * element + 4) + counts
                seconds = case["times_by_rank"][rank]["all_to_all_ms"] / 1e3
                assert mine["achieved_gb_per_s_out"][rank] == pytest.approx(sent / seconds / 1e9, rel=1e-9)
        largest = cases[str(max(frame.index))]  # the model's link bandwidth: the best rank's at the largest case
        link = summary["model"][document["dtype"]]["link_gb_per_s"]
        assert link == pytest.approx(max(largest["achieved_gb_per_s_out"]))
        # the table for one and two nodes takes the same link bandwidth
        node_rows = [r for r in summary["node_scaling"]["rows"] if r["dtype"] == document["dtype"]]
        assert node_rows and all(r["link_gb_per_s"] == pytest.approx(link) for r in node_rows)


def test_parallel_rank_work_is_that_of_the_committed_files_and_feeds_the_model(parallel_run):
    p, summary, _ = parallel_run
    files = sorted((ROOT / "data" / "results" / "H200").glob("*-moe_experts_rank_work-*.csv"))
    newest = {json.loads(path.with_suffix(".json").read_text())["dtype"]: path for path in files}  # by date
    assert set(summary["rank_work"]) == set(newest) and newest
    for dtype, path in newest.items():
        frame = pd.read_csv(path)
        frame = frame[frame.status == "ok"].set_index(["world_size", "tokens_per_rank"])
        mine = summary["rank_work"][dtype]
        assert mine["file"] == path.name and len(mine["cases"]) == len(frame)
        axes = json.loads(path.with_suffix(".json").read_text())["axes"]
        for case in mine["cases"]:
            row = frame.loc[(case["world_size"], case["tokens_per_rank"])]
            assert case["same_work_ms"] == pytest.approx(row["same_work_ms"], rel=1e-12)
            flops = 22 * row["rows_received"] * axes["hidden_size"] * axes["intermediate_size"]
            assert case["TFLOP/s"] == pytest.approx(flops / (row["same_work_ms"] * 1e-3) / 1e12, rel=1e-12)
        # the one-node/two-node table: each world size at its own measured rate, where one was measured
        at_w = [r for r in summary["node_scaling"]["rows"] if r["dtype"] == dtype and r["experts"] == "measured at W"]
        modelled = {int(r["setting"].split(",")[0].removeprefix("W = ")) for r in at_w}
        measured = {w for w, t in frame.index if t == summary["node_scaling"]["tokens_per_rank"]}
        assert modelled == {2, p["model_world_size"], 2 * p["model_world_size"]} & measured


def _ordered(paths: list[Path]) -> list[Path]:
    """The result files in the report's order: P1, P2 fp32, P2 bf16."""
    return sorted(
        paths,
        key=lambda path: problems.PROBLEM_NAMES.index(json.loads(path.with_suffix(".json").read_text())["problem"]),
    )


# ------------------------------------------------------------------------------------------------
# 07: moe_lib in a Hugging Face model, trained four ways


@pytest.fixture(scope="module")
def model_run(kernel_name, tmp_path_factory):
    pytest.importorskip("transformers")
    # aot_eager: the compiled variants trace the same graphs as inductor's, without its code generation
    parameters = dict(
        steps=12,
        warmup_steps=2,
        compile_backend="aot_eager",
        hidden_size=32,
        moe_intermediate_size=16,
        num_experts=6,
        top_k=2,
        num_layers=1,
        batch_size=4,
        sequence_length=16,
        seed=_fresh_seed(),
    )
    folder = tmp_path_factory.mktemp("model")
    return parameters, _execute("07_use_it_in_a_model", parameters, folder, kernel_name), folder


def test_model_trains_alike_with_moe_lib_and_its_own_experts(model_run):
    p, summary, folder = model_run
    assert summary["device"] == "cpu" and summary["dtype"] == "float32"
    assert summary["learning_rate"] == 3e-3 and summary["compile"] == {"backend": "aot_eager", "mode": "default"}
    assert summary["compiled_loss"] == {"graphs": 1, "graph_breaks": 0}
    variants = summary["variants"]
    assert list(variants) == ["grouped_mm (eager)", "moe_lib (eager)", "batched_mm (compiled)", "moe_lib (compiled)"]
    first = {name: v["losses"][0] for name, v in variants.items()}
    assert max(first.values()) - min(first.values()) <= 1e-5  # one initial model, one first batch
    for name, variant in variants.items():
        assert len(variant["losses"]) == p["steps"] and variant["losses"][-1] < variant["losses"][0] - 0.1, name
        assert variant["step_ms"] > 0 and variant["saved_for_backward_bytes"] > 0, name
    for row in summary["agreement"]:  # in float32 over a few steps: rounding only
        assert row["max_loss_difference"] <= 1e-4 and row["within_noise"], row
    # moe_lib's layer keeps only its inputs for the backward; transformers' grouped_mm keeps its products
    assert (
        variants["moe_lib (eager)"]["saved_for_backward_bytes"]
        < variants["grouped_mm (eager)"]["saved_for_backward_bytes"]
    )
    assert math.log(p.get("vocab_size", 64)) > summary["entropy_rate"] > 0
    _assert_figures_written(summary, folder)


# ---------------------------------------------------------------- 08 · design log


def test_design_log_counts_every_row_of_the_notes_index(kernel_name, tmp_path):
    from moe_lib.lab import design_log

    summary = _execute("08_design_log", {}, tmp_path, kernel_name)
    log = design_log.read_index()
    assert summary["rows"] == len(log)
    counts = design_log.status_counts(log)
    assert summary["counts"] == {
        section: {kind: int(n) for kind, n in row.items()} for section, row in counts.iterrows()
    }
    _assert_figures_written(summary, tmp_path)
