"""moe_lib.lab.tutorial: the teaching kernels of notebook 04 against float64 torch (under the interpreter
without a GPU), and the sources the notebook shows."""

import inspect

import pytest
import torch
from conftest import rel_error

from moe_lib import problems
from moe_lib.moe_experts.routing import route_by_expert

tutorial = pytest.importorskip("moe_lib.lab.tutorial")  # imports triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P1_STEPS = {"naive": tutorial.p1_naive, "tiled": tutorial.p1_tiled, "fused": tutorial.p1_fused}


@pytest.mark.parametrize("step", P1_STEPS)
@pytest.mark.parametrize("num_tokens, hidden_size, intermediate_size", [(5, 64, 32), (17, 40, 24), (1, 16, 16)])
def test_p1_steps_agree_with_float64(step, num_tokens, hidden_size, intermediate_size, seed):
    inputs = problems.make_inputs(
        "swiglu_down_backward",
        num_tokens,
        seed=seed,
        device=DEVICE,
        dtype=torch.float32,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
    )
    reference = tutorial.p1_reference(inputs)
    outputs = P1_STEPS[step](inputs)
    assert set(outputs) == ({"d_gate", "d_up"} if step == "fused" else {"d_intermediate", "d_gate", "d_up"})
    for name, errors in tutorial.errors(outputs, reference).items():
        assert errors < 1e-5, (step, name)
    # the reference is notebook 01's chain rule
    dy, wd = inputs["grad_output"].double(), inputs["down_weight"].double()
    assert rel_error(reference["d_up"], (dy @ wd) * inputs["gate_silu"].double()) < 1e-12


def test_p1_steps_take_fp32_only():
    inputs = problems.make_inputs("swiglu_down_backward", 3, hidden_size=16, intermediate_size=16)  # bf16
    with pytest.raises(TypeError, match="grad_output: the teaching kernels take contiguous float32"):
        tutorial.p1_tiled(inputs)


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(32, 4, 2), (7, 9, 3), (20, 3, 1)])
def test_p2_steps_agree_with_float64_and_each_other(num_tokens, num_experts, top_k, seed):
    inputs = problems.make_inputs(
        "moe_experts_backward",
        num_tokens,
        seed=seed,
        device=DEVICE,
        hidden_size=40,
        intermediate_size=24,
        num_experts=num_experts,
        top_k=top_k,
    )
    x, weights, indices = inputs["hidden_states"], inputs["gate_weights"], inputs["topk_indices"]
    routing = route_by_expert(indices, num_experts)
    reference = tutorial.p2_reference(x, weights, indices)
    # by hand: row p of the sorted order is W_e x_t for its slot s = sorted_slot[p]
    slot = int(routing.sorted_slot[-1])
    expert, token = int(indices.reshape(-1)[slot]), slot // top_k
    assert torch.allclose(reference[-1], weights[expert].double() @ x[token].double())
    per_expert = tutorial.p2_per_expert(x, weights, routing, top_k)
    grouped = tutorial.p2_grouped(x, weights, routing, top_k)
    assert rel_error(per_expert, reference) < 1e-5 and rel_error(grouped, reference) < 1e-5
    assert torch.allclose(per_expert, grouped, rtol=1e-5, atol=1e-6)


def test_sources_are_the_modules_own():
    from moe_lib.moe_experts import kernels as p2_kernels
    from moe_lib.swiglu_down import kernels as p1_kernels

    for module, kernel in (
        (tutorial, tutorial.fused_dswiglu_kernel),
        (p1_kernels, p1_kernels.combine_splits),
        (p2_kernels, p2_kernels.swiglu_grad_kernel),
    ):
        source = tutorial.kernel_source(kernel)
        assert source.startswith("@triton.jit\ndef ") and source in inspect.getsource(module)
    block = tutorial.show_source(p1_kernels.split_range, p1_kernels.combine_splits)
    assert "def split_range(" in repr(block) and "def combine_splits(" in repr(block)
    html = block._repr_html_()
    assert 'class="highlight"' in html and "monospace" in html and "combine_splits" in html
