"""The notebooks: committed clean with one typed parameters cell; executed with tiny parameters, the numbers
they write to summary.json agree with moe_lib and the autograd oracles recomputed here."""

import ast
import json
import os
import random
from pathlib import Path

import pytest
import torch
from conftest import rel_error
from oracles import moe_experts_grads, swiglu_expert_grads

import moe_lib
from moe_lib import problems

papermill = pytest.importorskip("papermill")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
KERNEL_NAME = "moe-backward-lab"
P1_OUTPUTS = list(problems.load("swiglu_down_backward").outputs)
P2_OUTPUTS = list(problems.load("moe_experts_backward").outputs)


def test_the_derivation_notebooks_exist():
    stems = {path.stem for path in NOTEBOOKS}
    assert {"01_swiglu_backward_derivation", "02_moe_backward_derivation"} <= stems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_committed_without_outputs_and_with_typed_parameters(path):
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


def _execute(stem, parameters, folder: Path, kernel_name) -> dict:
    papermill.execute_notebook(
        str(NOTEBOOKS_DIR / f"{stem}.ipynb"), str(folder / f"{stem}.ipynb"),
        parameters={**parameters, "output_dir": str(folder)}, kernel_name=kernel_name,
        progress_bar=False, cwd=str(NOTEBOOKS_DIR), extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )  # fmt: skip
    return json.loads((folder / "summary.json").read_text())


# ---------------------------------------------------------------- 01 · SwiGLU backward

P1_STEPS = {"grad_down_weight", "d_intermediate", "silu_grad_formula", "d_up", "d_gate_silu", "d_gate",
            "grad_gate_weight", "grad_up_weight", "grad_x", "grad_x_one_product"}  # fmt: skip


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
    inputs = problems.make_inputs("swiglu_down_backward", parameters["num_tokens"], seed=parameters["seed"],
                                  dtype=torch.float64, hidden_size=parameters["hidden_size"],
                                  intermediate_size=parameters["intermediate_size"])  # fmt: skip
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
    exact_forward = swiglu_expert_grads(*(inputs[k] for k in ("grad_output", "x", "gate_weight", "up_weight",
                                                              "down_weight")))  # fmt: skip
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


# ---------------------------------------------------------------- 02 · MoE experts backward

P2_STEPS = {"d_o", "grad_topk_weights_from_o", "grad_topk_weights", "d_a", "d_g", "d_u", "d_x_slots",
            "grad_gate_weights", "grad_up_weights", "grad_down_weights", "adjoint_identity",
            "grad_hidden_states_scatter_add", "grad_hidden_states"}  # fmt: skip


@pytest.fixture(scope="module")
def p2_run(kernel_name, tmp_path_factory):
    parameters = dict(num_tokens=7, hidden_size=10, intermediate_size=6, num_experts=9, top_k=3, routing="skewed",
                      routing_num_tokens=300, seed=_fresh_seed())  # fmt: skip
    folder = tmp_path_factory.mktemp("p2")
    return parameters, _execute("02_moe_backward_derivation", parameters, folder, kernel_name), folder


def _p2_inputs(parameters):
    return problems.make_inputs(
        "moe_experts_backward", parameters["num_tokens"], seed=parameters["seed"], dtype=torch.float64,
        routing=parameters["routing"], hidden_size=parameters["hidden_size"],
        intermediate_size=parameters["intermediate_size"], num_experts=parameters["num_experts"],
        top_k=parameters["top_k"],
    )  # fmt: skip


def test_p2_every_step_agrees_with_autograd(p2_run):
    parameters, summary, _ = p2_run
    assert summary["sizes"] == {k: parameters[k] for k in ("num_tokens", "hidden_size", "intermediate_size",
                                                           "num_experts", "top_k", "routing")}  # fmt: skip
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


def test_p2_tokens_per_expert_match_route_tokens(p2_run):
    parameters, summary, folder = p2_run
    load = summary["tokens_per_expert"]
    sizes = problems.load("moe_experts_backward").sizes(parameters["routing_num_tokens"])
    T, E, K = parameters["routing_num_tokens"], sizes["num_experts"], sizes["top_k"]
    assert load["sizes"] == {"num_tokens": T, "num_experts": E, "top_k": K}
    assert load["mean"] == T * K / E
    for routing in problems.ROUTINGS:
        generator = torch.Generator().manual_seed(parameters["seed"])
        indices = problems.route_tokens(T, E, K, routing=routing, generator=generator)
        counts = torch.bincount(indices.flatten(), minlength=E)
        stats = load[routing]
        assert (stats["min"], stats["max"]) == (counts.min().item(), counts.max().item()), routing
        assert stats["empty_experts"] == (counts == 0).sum().item(), routing
        assert stats["mean"] == pytest.approx(T * K / E)
        assert stats["std"] == pytest.approx(counts.double().std().item())
    assert load["hot"]["max"] == T and load["hot"]["empty_experts"] == E - K
    for figure in summary["figures"]:
        assert (folder / figure).read_bytes()[:4] == b"\x89PNG", figure
