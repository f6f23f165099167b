"""The readable references against independent float64 autograd oracles."""

import pytest
import torch
from conftest import rel_error
from oracles import moe_experts_grads, swiglu_expert_grads

import moe_lib
from moe_lib import problems, reference

P1_SHAPES = [
    pytest.param(0, 16, 8, id="T0"),
    pytest.param(1, 16, 8, id="T1"),
    pytest.param(7, 33, 19, id="odd"),
    pytest.param(64, 48, 40, id="T64"),
]


@pytest.mark.parametrize("T, H, I", P1_SHAPES)
def test_swiglu_down_backward_reference_matches_autograd_float64(T, H, I, seed):
    inputs = problems.make_inputs(
        "swiglu_down_backward", T, seed=seed, dtype=torch.float64, hidden_size=H, intermediate_size=I
    )
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="reference")
    want = swiglu_expert_grads(
        inputs["grad_output"], inputs["x"], inputs["gate_weight"], inputs["up_weight"], inputs["down_weight"]
    )
    for name, g, w in zip(problems.load("swiglu_down_backward").outputs, got, want, strict=True):
        assert g.dtype == torch.float64 and g.shape == w.shape, name
        if T == 0:
            assert torch.count_nonzero(g) == 0, name
        else:
            assert rel_error(g, w) <= 1e-10, name


def _p2_inputs(T, H, I, E, K, seed, routing="uniform", dtype=torch.float64):
    return problems.make_inputs(
        "moe_experts_backward",
        T,
        seed=seed,
        dtype=dtype,
        routing=routing,
        hidden_size=H,
        intermediate_size=I,
        num_experts=E,
        top_k=K,
    )


P2_SHAPES = [
    pytest.param(0, 16, 8, 4, 2, "uniform", id="T0"),
    pytest.param(1, 16, 8, 4, 2, "uniform", id="T1"),
    pytest.param(13, 24, 10, 6, 3, "uniform", id="odd"),
    pytest.param(9, 16, 12, 5, 1, "uniform", id="K1"),
    pytest.param(11, 12, 6, 4, 4, "uniform", id="K=E"),
    pytest.param(17, 16, 8, 7, 2, "hot", id="hot"),
    pytest.param(40, 16, 8, 12, 3, "skewed", id="skewed"),
]


@pytest.mark.parametrize("T, H, I, E, K, routing", P2_SHAPES)
def test_moe_experts_backward_reference_matches_autograd_float64(T, H, I, E, K, routing, seed):
    inputs = _p2_inputs(T, H, I, E, K, seed, routing)
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="reference")
    want = moe_experts_grads(*inputs.values())
    for name, g, w in zip(problems.load("moe_experts_backward").outputs, got, want, strict=True):
        assert g.dtype == torch.float64 and g.shape == w.shape, name
        if torch.count_nonzero(w) == 0:  # e.g. T = 0: nothing flows back
            assert torch.count_nonzero(g) == 0, name
        else:
            assert rel_error(g, w) <= 1e-10, name


def test_moe_experts_unchosen_experts_get_exact_zeros(seed):
    inputs = _p2_inputs(23, 16, 8, 9, 3, seed, routing="hot")
    chosen = set(inputs["topk_indices"].unique().tolist())
    assert len(chosen) == 3
    _, _, grad_gate, grad_up, grad_down = moe_lib.moe_experts_backward(*inputs.values(), impl="reference")
    for e in range(9):
        for grad in (grad_gate, grad_up, grad_down):
            if e in chosen:
                assert torch.count_nonzero(grad[e]) > 0
            else:
                assert torch.count_nonzero(grad[e]) == 0


def test_moe_experts_backward_bf16_rounds_like_fp32_reference(seed):
    inputs = _p2_inputs(10, 32, 16, 6, 2, seed, dtype=torch.float32)
    bf16 = {k: (v.bfloat16() if v.is_floating_point() and k != "topk_weights" else v) for k, v in inputs.items()}
    got = moe_lib.moe_experts_backward(*bf16.values(), impl="reference")
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32] + [torch.bfloat16] * 3
    upcast = {k: (v.float() if v.is_floating_point() else v) for k, v in bf16.items()}
    want = reference.moe_experts_backward_reference(*upcast.values())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w.to(g.dtype))


def test_swiglu_bf16_follows_the_benchmark_rounding(seed):
    """fp32 math from bf16 inputs using the saved gate_sigmoid (not a recomputed one), bf16 out."""
    inputs = problems.make_inputs("swiglu_down_backward", 12, seed=seed, hidden_size=64, intermediate_size=32)
    assert all(t.dtype == torch.bfloat16 for t in inputs.values())
    # replace the saved sigmoid by other values: a reference that recomputed σ(gate) would not notice
    inputs["gate_sigmoid"] = torch.rand_like(inputs["gate_sigmoid"])
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="reference")
    f = {k: v.float() for k, v in inputs.items()}
    s = f["gate_sigmoid"]
    d_a = f["grad_output"] @ f["down_weight"]
    d_gate = d_a * f["up"] * s * (1 + f["gate"] * (1 - s))
    d_up = d_a * f["gate_silu"]
    want = (
        d_gate @ f["gate_weight"] + d_up @ f["up_weight"],
        d_gate.T @ f["x"],
        d_up.T @ f["x"],
        f["grad_output"].T @ f["intermediate"],
    )
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.bfloat16
        assert torch.equal(g, w.bfloat16())


@pytest.mark.parametrize("name", problems.PROBLEM_NAMES)
def test_definition_reference_source_agrees_with_moe_lib(name, seed):
    """The Python source stored in definition.json computes what moe_lib.reference computes.

    Both compute in fp32 but spell dSiLU differently, so an fp32 value may land either side of a
    16-bit rounding boundary: 16-bit outputs may differ by one unit in the last place, rarely; and an
    element that cancels to almost nothing carries the fp32 rounding of its terms, relative to the output's
    scale rather than to itself (an absolute 1e-6 of the largest element)."""
    problem = problems.load(name)
    namespace = {}
    exec(compile(problem.reference_source, f"{name}/definition.json", "exec"), namespace)
    inputs = problem.make_inputs(9, seed=seed, **problem.small_axes)
    got = namespace["run"](*inputs.values())
    want = problem.spec.function(*inputs.values(), impl="reference")
    assert len(got) == len(problem.outputs)
    for (out_name, spec), g, w in zip(problem.outputs.items(), got, want, strict=True):
        assert problems.dtype_name(g.dtype) == spec["dtype"], out_name
        if g.dtype == torch.float32:
            assert rel_error(g, w) <= 1e-6, out_name
        else:
            scale = w.abs().max().item()
            torch.testing.assert_close(g, w, rtol=torch.finfo(g.dtype).eps, atol=1e-6 * scale, msg=out_name)
            assert (g != w).float().mean().item() <= 0.01, out_name
