"""What P1's tests share: the float64 reference, the accuracy rules, running one configured design."""

from __future__ import annotations

import torch
from conftest import rel_error

from moe_lib import problems, reference
from moe_lib.bench.checks import compare_output
from moe_lib.bench.peers.swiglu_down import swiglu_down_backward_eager

OUTPUTS = ("grad_x", "grad_gate_weight", "grad_up_weight", "grad_down_weight")
ELEMENT_RULE = problems.load("swiglu_down_backward").element_rule
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def float64_reference(inputs: dict):
    return reference.swiglu_down_backward_reference(*[t.double() for t in inputs.values()])


def careful_pytorch_errors(inputs: dict, want) -> list[float]:
    """Relative error of the careful bf16 PyTorch formulation (the yardstick of the GPU accuracy rule)."""
    w_gate_up = torch.cat([inputs["gate_weight"], inputs["up_weight"]])
    got = swiglu_down_backward_eager(
        inputs["grad_output"],
        inputs["x"],
        w_gate_up,
        inputs["down_weight"],
        inputs["gate"],
        inputs["gate_sigmoid"],
        inputs["gate_silu"],
        inputs["up"],
        inputs["intermediate"],
    )
    return [rel_error(g, w) for g, w in zip(got, want, strict=True)]


def check_against_float64(inputs: dict, got, precision: str) -> None:
    """Every output finite and within its rule of the float64 reference: "faithful" the benchmark's
    element rule and at most the careful PyTorch bf16 error + 1e-4; "fast" at most 2× that error + 1e-4."""
    want = float64_reference(inputs)
    yardstick = careful_pytorch_errors(inputs, want)
    for name, g, w, y in zip(OUTPUTS, got, want, yardstick, strict=True):
        assert g.shape == w.shape and g.dtype == inputs["x"].dtype, name
        result = compare_output(g, w, ELEMENT_RULE)
        assert result["finite"], f"{name}: NaN/Inf (an unwritten element?)"
        error = result["rel_error"]
        if precision == "faithful":
            assert result["pass_fraction"] >= ELEMENT_RULE["required_fraction"], f"{name}: {result}"
            assert error <= y + 1e-4, f"{name}: {error:.3g} vs careful PyTorch {y:.3g}"
        else:
            assert error <= 2 * y + 1e-4, f"{name}: {error:.3g} vs careful PyTorch {y:.3g}"


def check_small(got, want, dtype: torch.dtype, precision: str) -> None:
    """The rules of the small CPU shapes: finite, in the input dtype, relative error ≤ 1e-5 in fp32 (exact fp32
    products) and ≤ 2e-2 in 16 bits (the rounding of dGate, dUp and of the outputs), and on the faithful path with
    16-bit inputs the benchmark's element rule; outputs with no tokens to sum over exactly zero."""
    for name, g, w in zip(OUTPUTS, got, want, strict=True):
        assert g.dtype == dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), f"{name}: NaN/Inf (an unwritten element?)"
        if w.numel() and not w.any():
            assert not g.any(), f"{name}: no tokens, yet not zero"
            continue
        error = rel_error(g, w)
        assert error <= (1e-5 if dtype == torch.float32 else 2e-2), f"{name}: {error:.3g}"
        if precision == "faithful" and dtype != torch.float32:
            result = compare_output(g, w, ELEMENT_RULE)
            assert result["pass_fraction"] >= ELEMENT_RULE["required_fraction"], f"{name}: {result}"


def run_design(design, inputs: dict, precision: str):
    """One configured design's ``run`` on ``inputs`` into freshly allocated outputs (through ``runtime.allocate``,
    as a call allocates them), whatever its ``supports`` says: the outputs as a tuple."""
    from moe_lib.swiglu_down.backward import allocate_outputs
    from moe_lib.swiglu_down.designs import Inputs
    from moe_lib.swiglu_down.runtime import carries_low_halves

    x, I = inputs["x"], inputs["gate_weight"].shape[0]
    out = allocate_outputs(x, I)
    design.run(Inputs(*inputs.values()), with_lo=carries_low_halves(x.dtype, precision), out=out)
    return tuple(out)
