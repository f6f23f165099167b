"""Property-based tests (hypothesis): drawn shapes, dtypes, routings and strides; every path against float64.

Each example draws a problem (tiny shapes, edges included: no tokens, K = 0, K = E, one expert), rounds the
inputs to the drawn dtype, and runs the public function on the drawn path: the reference, or the Triton
kernels (under the interpreter on CPU). The outputs must match a float64 computation from the same rounded
inputs (for P2 an independent one: autograd through a dense forward) within the dtype's tolerance; the
reference must give the same answer for inputs laid out with other strides, and the Triton path must refuse
them by name. Examples are few and small so that the file runs in tens of seconds on a CPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import rel_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import moe_experts_forward_dense, moe_experts_grads, moe_experts_term_bounds, swiglu_down_term_bounds

import moe_lib
from moe_lib import problems, reference
from moe_lib.dispatch import interpreter_enabled

P1, P2 = "swiglu_down_backward", "moe_experts_backward"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or interpreter_enabled()
IMPLS = ["reference", "triton"] if TRITON else ["reference"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# relative Frobenius error against float64: fp32 rounding (Triton's P2 takes bf16 products for most outputs),
# and the rounding of 16-bit outputs and intermediates
TOLERANCE = {
    ("reference", torch.float32): 1e-5,
    ("triton", torch.float32): 1e-5,
    ("reference", torch.bfloat16): 2e-2,
    ("triton", torch.bfloat16): 3e-2,
    ("reference", torch.float16): 3e-3,
    ("triton", torch.float16): 6e-3,
}
P2_TRITON_FP32_TOLERANCE = 8e-3  # bf16 products (grad_topk_weights: bf16×3, ≈ 1e-5)
# Triton's P2 on fp32 inputs: every product term of grad_hidden_states and the weight gradients multiplies two
# operands rounded to bf16 (unit roundoff 2⁻⁸ each), so each term is off by at most ≈ 2⁻⁷ of itself; judged
# element by element against the sum of the terms' absolute values, carried through the intermediates g, u and
# dA (oracles.moe_experts_term_bounds), so that sums of few terms that cancel (tiny shapes), inside an
# intermediate as well as in the output, are judged fairly. Twice that, for the fp32 accumulation and the bf16×3
# dg, du behind them. Every output also meets P2_TRITON_FP32_TOLERANCE as a whole.
P2_TRITON_FP32_TERM_ERROR = 2.0**-6

# MOE_HYPOTHESIS_EXAMPLES=500 for a longer search than CI's
SETTINGS = settings(
    max_examples=int(os.environ.get("MOE_HYPOTHESIS_EXAMPLES", 40)),
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values with other strides: "contiguous", "column-major" (transposed storage) or "strided"
    (every other element of a larger buffer)."""
    if layout == "column-major" and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "strided" and t.numel() > 0:
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
        wide[..., ::2] = t
        return wide[..., ::2]
    return t


def close(got, want, tolerance: float, where: str, bounds=None) -> None:
    """Each output within ``tolerance`` of its float64 value as a whole (relative Frobenius error), or else element
    by element: within ``tolerance`` times the size of its product terms (``bounds``: the oracles' term bounds), so
    that sums whose terms cancel (tiny shapes) are judged by what their terms' rounding can move them; without
    bounds, on the output's own scale."""
    bounds = bounds if bounds is not None else [None] * len(want)
    for index, (g, w, bound) in enumerate(zip(got, want, bounds, strict=True)):
        assert g.shape == w.shape, f"{where}: output {index} shape {list(g.shape)}, expected {list(w.shape)}"
        if w.numel() == 0:
            continue
        error = rel_error(g, w)
        if error <= tolerance:
            continue
        difference = (g.double() - w.double()).abs()
        if bound is None:  # outputs that are zero or nearly so (no tokens, tiny sums): on the output's scale
            allowed = tolerance * max(w.double().abs().max().item(), 1e-3)
        else:
            allowed = tolerance * bound
        assert torch.isfinite(g).all() and bool((difference <= allowed).all()), (
            f"{where}: output {index} relative error {error:.3g} > {tolerance:g}, and off by more than "
            f"{tolerance:g} times its terms"
        )


@st.composite
def p1_cases(draw):
    return dict(
        T=draw(st.integers(0, 20)),
        H=draw(st.integers(1, 40)),
        I=draw(st.integers(1, 24)),
        dtype=draw(st.sampled_from(DTYPES)),
        impl=draw(st.sampled_from(IMPLS)),
        precision=draw(st.sampled_from(["faithful", "fast"])),
        distribution=draw(st.sampled_from(["forward", "harness"])),
        layout=draw(st.sampled_from(["contiguous", "column-major", "strided"])),
        relaid=draw(st.sets(st.sampled_from(problems.load(P1).input_names), max_size=3)),
        seed=draw(st.integers(0, 2**31 - 1)),
        # Triton: the design chosen by token count, or the design on cuBLAS GEMMs with its options drawn (dA in fp32
        # or not, dx in two products, [Wg; Wu] stacked aside or by memcpy)
        library=draw(st.none() | st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans())),
        # Triton, where no library design is drawn: the interpreter's tiles chained into one launch by tickets
        chained=draw(st.booleans()),
    )


@SETTINGS
@given(case=p1_cases())
def test_p1_every_path_matches_float64(case):
    inputs = problems.make_inputs(
        P1,
        case["T"],
        seed=case["seed"],
        device=DEVICE,
        dtype=case["dtype"],
        hidden_size=case["H"],
        intermediate_size=case["I"],
        distribution=case["distribution"],
    )
    want = reference.swiglu_down_backward_reference(*[t.double() for t in inputs.values()])
    relaid = {name: relayout(t, case["layout"]) if name in case["relaid"] else t for name, t in inputs.items()}
    strided = [name for name, t in relaid.items() if not t.is_contiguous()]
    where = f"P1 {case}"
    if case["impl"] == "triton" and strided:
        with pytest.raises(ValueError, match=f"^{strided[0]}: expected a contiguous tensor"):
            moe_lib.swiglu_down_backward(*relaid.values(), impl="triton", precision=case["precision"])
        relaid = inputs
    if case["impl"] == "triton" and case["library"] is not None and case["dtype"] != torch.float32:
        from swiglu_down.helpers import run_design

        from moe_lib.swiglu_down.designs import LibraryGemmsConfig

        d_a_fp32, dx_in_two, stack_aside, stack_by_memcpy = case["library"]
        config = LibraryGemmsConfig(
            d_a_fp32=d_a_fp32, dx_in_two=dx_in_two, stack_aside=stack_aside, stack_by_memcpy=stack_by_memcpy
        )
        # its run, whatever its supports says (cuBLAS's design refuses the interpreter: torch.mm stands in there)
        got = run_design(config, relaid, case["precision"])
    elif case["impl"] == "triton" and case["chained"]:
        from moe_lib.swiglu_down.backward import swiglu_down_backward_triton
        from moe_lib.swiglu_down.designs import ChainedConfig
        from moe_lib.swiglu_down.designs.triton_launches import INTERPRETER_TILES

        config = ChainedConfig(INTERPRETER_TILES, warps=1, stages=1)
        got = swiglu_down_backward_triton(*relaid.values(), config=config, precision=case["precision"])
    else:
        got = moe_lib.swiglu_down_backward(*relaid.values(), impl=case["impl"], precision=case["precision"])
    assert all(g.dtype == case["dtype"] for g in got), where
    close(got, want, TOLERANCE[(case["impl"], case["dtype"])], where, swiglu_down_term_bounds(*inputs.values()))


@st.composite
def p2_cases(draw):
    E = draw(st.integers(1, 6))
    return dict(
        T=draw(st.integers(0, 10)),
        H=draw(st.integers(1, 32)),
        I=draw(st.integers(1, 24)),
        E=E,
        K=draw(st.integers(0, min(E, 3))),
        routing=draw(st.sampled_from(["uniform", "skewed", "hot"])),
        dtype=draw(st.sampled_from(DTYPES)),
        fp32_topk_weights=draw(st.booleans()),
        index_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        impl=draw(st.sampled_from(IMPLS)),
        layout=draw(st.sampled_from(["contiguous", "column-major", "strided"])),
        relaid=draw(st.sets(st.sampled_from(problems.load(P2).input_names), max_size=3)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@SETTINGS
@given(case=p2_cases())
def test_p2_every_path_matches_autograd_in_float64(case):
    inputs = problems.make_inputs(
        P2,
        case["T"],
        seed=case["seed"],
        device=DEVICE,
        routing=case["routing"],
        hidden_size=case["H"],
        intermediate_size=case["I"],
        num_experts=case["E"],
        top_k=max(case["K"], 1),
    )
    for name in ("topk_indices", "topk_weights"):  # K = 0: no expert per token
        inputs[name] = inputs[name][:, : case["K"]].contiguous()
    for name in ("grad_output", "hidden_states", "gate_weights", "up_weights", "down_weights"):
        inputs[name] = inputs[name].to(case["dtype"])
    inputs["topk_weights"] = inputs["topk_weights"].to(torch.float32 if case["fp32_topk_weights"] else case["dtype"])
    inputs["topk_indices"] = inputs["topk_indices"].to(case["index_dtype"])
    want = moe_experts_grads(*inputs.values())
    relaid = {name: relayout(t, case["layout"]) if name in case["relaid"] else t for name, t in inputs.items()}
    strided = [name for name, t in relaid.items() if not t.is_contiguous()]
    where = f"P2 {case}"
    if case["impl"] == "triton" and strided:
        with pytest.raises(ValueError, match=f"^{strided[0]}: expected a contiguous tensor"):
            moe_lib.moe_experts_backward(*relaid.values(), impl="triton")
        relaid = inputs
    got = moe_lib.moe_experts_backward(*relaid.values(), impl=case["impl"])
    assert got[1].dtype == inputs["topk_weights"].dtype and all(g.dtype == case["dtype"] for g in got[:1] + got[2:])
    tolerance = TOLERANCE[(case["impl"], case["dtype"])]
    if (case["impl"], case["dtype"]) == ("triton", torch.float32):
        bounds = moe_experts_term_bounds(*inputs.values())
        # grad_topk_weights: bf16×3; the others judged by their terms where their sums cancel (tiny shapes)
        close(got, want, P2_TRITON_FP32_TOLERANCE, where, [bounds[0], None, *bounds[1:]])
        for index, g, w, bound in zip((0, 2, 3, 4), got[:1] + got[2:], want[:1] + want[2:], bounds, strict=True):
            excess = (g.double() - w).abs() - P2_TRITON_FP32_TERM_ERROR * bound
            worst = excess.max().item() if excess.numel() else 0.0
            assert torch.isfinite(g).all() and worst <= 1e-30, (
                f"{where}: output {index} off by more than 2⁻⁶ of its terms, worst by {worst:.3g}"
            )
    else:
        close(got, want, tolerance, where)
    chosen = torch.zeros(case["E"], dtype=torch.bool, device=DEVICE)
    chosen[inputs["topk_indices"].reshape(-1).long()] = True
    for grad in got[2:]:  # experts no token chose: exact zeros
        assert torch.count_nonzero(grad[~chosen]) == 0, where


@st.composite
def layer_cases(draw):
    return dict(
        layer=draw(st.sampled_from(["swiglu_expert", "moe_experts"])),
        T=draw(st.integers(0, 8)),
        H=draw(st.integers(1, 24)),
        I=draw(st.integers(1, 16)),
        impl=draw(st.sampled_from(IMPLS)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@settings(SETTINGS, max_examples=max(1, SETTINGS.max_examples // 3))
@given(case=layer_cases())
def test_layers_gradients_match_autograd_in_float64(case):
    """The layers in fp32: their forward and the gradients their backward gives, against autograd in float64."""
    if case["layer"] == "swiglu_expert":
        inputs = problems.make_inputs(
            P1,
            case["T"],
            seed=case["seed"],
            device=DEVICE,
            dtype=torch.float32,
            hidden_size=case["H"],
            intermediate_size=case["I"],
        )
        names = ("x", "gate_weight", "up_weight", "down_weight")

        def forward(x, gate, up, down):
            return moe_lib.swiglu_expert(x, gate, up, down, impl=case["impl"])

        def dense(x, gate, up, down):
            return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    else:
        inputs = problems.make_inputs(
            P2,
            case["T"],
            seed=case["seed"],
            device=DEVICE,
            hidden_size=case["H"],
            intermediate_size=case["I"],
            num_experts=3,
            top_k=2,
        )
        names = ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")
        indices = inputs["topk_indices"]

        def forward(x, w, gate, up, down):
            return moe_lib.moe_experts(x, indices, w, gate, up, down, impl=case["impl"])

        def dense(x, w, gate, up, down):
            return moe_experts_forward_dense(x, indices, w, gate, up, down)

    leaves = [inputs[name].clone().requires_grad_() for name in names]
    exact = [inputs[name].double().requires_grad_() for name in names]
    dy = inputs["grad_output"]
    y = forward(*leaves)
    got = torch.autograd.grad(y, leaves, dy)
    y_want = dense(*exact)
    want = torch.autograd.grad(y_want, exact, dy.double())
    tolerance = 1e-5 if case["impl"] == "reference" else P2_TRITON_FP32_TOLERANCE
    close([y, *got], [y_want.detach(), *want], tolerance, f"layer {case}")
