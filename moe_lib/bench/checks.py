"""Is an implementation's output right? Its errors against the high-precision reference, and the verdicts.

Each output is compared with the reference in float64, a chunk at a time: relative Frobenius error
‖out − ref‖/‖ref‖ and, where the problem has one, the element rule ``|out − ref| ≤ atol + rtol·|ref|``
on at least ``required_fraction`` of the elements (:meth:`moe_lib.problems.Problem.element_rule_at`).
NaN/Inf (including unwritten, poisoned outputs), a wrong count or shape, or a relative error above
:data:`WRONG_REL_ERROR` makes an implementation wrong; failing only the element rule is reported apart.
"""

from __future__ import annotations

import math

import torch

from .. import problems
from ..precision import tf32_disabled

WRONG_REL_ERROR = 5e-2
COMPARE_CHUNK = 2**26  # elements compared at a time (bounded float64 temporaries)


def error_sums(out: torch.Tensor, ref: torch.Tensor, rule: dict | None = None) -> dict:
    """Sums over the elements of ``out`` against ``ref`` (same shape), in float64 a chunk at a time:
    dict(diff_sq = Σ(out − ref)², ref_sq = Σref², non_finite = count of NaN/Inf in out, passing = count
    within ``rule``'s atol + rtol·|ref| (0 without a rule), count = elements)."""
    flat_out, flat_ref = out.reshape(-1), ref.to(out.device).reshape(-1)
    total = flat_out.numel()
    sums = torch.zeros(2, dtype=torch.float64, device=out.device)  # Σ diff², Σ ref²
    counts = torch.zeros(2, dtype=torch.int64, device=out.device)  # non-finite, passing
    for start in range(0, total, COMPARE_CHUNK):
        o = flat_out[start : start + COMPARE_CHUNK].double()
        r = flat_ref[start : start + COMPARE_CHUNK].double()
        diff = o - r
        counts[0] += (~torch.isfinite(o)).sum()
        sums[0] += (diff * diff).sum()
        sums[1] += (r * r).sum()
        if rule is not None:
            counts[1] += (diff.abs() <= rule["atol"] + rule["rtol"] * r.abs()).sum()
        del o, r, diff
    diff_sq, ref_sq = sums.tolist()
    non_finite, passing = counts.tolist()
    return dict(diff_sq=diff_sq, ref_sq=ref_sq, non_finite=non_finite, passing=passing, count=total)


def relative_error(diff_sq: float, ref_sq: float) -> float:
    """‖out − ref‖/‖ref‖ from the two sums of squares (the norm of the difference where ref is all zero)."""
    return math.sqrt(diff_sq) / math.sqrt(ref_sq) if ref_sq > 0 else math.sqrt(diff_sq)


def compare_output(out: torch.Tensor, ref: torch.Tensor, rule: dict | None) -> dict:
    """Compares one output with its reference in float64, a chunk at a time.

    Returns dict(rel_error = ‖out − ref‖/‖ref‖ (the norm of the difference where ref is all zero;
    inf if out has NaN/Inf), finite, pass_fraction = share of elements within atol + rtol·|ref|
    (None without a rule)).
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shape {list(out.shape)}, expected {list(ref.shape)}")
    sums = error_sums(out, ref, rule)
    finite = sums["non_finite"] == 0
    rel = relative_error(sums["diff_sq"], sums["ref_sq"]) if finite else math.inf
    pass_fraction = None if rule is None else (sums["passing"] / sums["count"] if sums["count"] else 1.0)
    return dict(rel_error=rel, finite=finite, pass_fraction=pass_fraction)


def check_outputs(outputs, references, names, rule) -> dict:
    """Checks every output; returns per-output errors, the worst ones and the verdicts."""
    if not isinstance(outputs, tuple | list) or len(outputs) != len(references):
        count = len(outputs) if isinstance(outputs, tuple | list) else type(outputs).__name__
        return dict(
            rel_errors={},
            pass_fractions={},
            correct=False,
            passes_element_rule=None,
            rel_error=math.nan,
            element_pass_fraction=math.nan,
            why=f"returned {count} outputs, expected {len(references)}",
        )
    rel_errors, pass_fractions, problems_found = {}, {}, []
    for name, out, ref in zip(names, outputs, references, strict=True):
        try:
            result = compare_output(out, ref, rule)
        except (TypeError, ValueError) as exc:
            problems_found.append(f"{name}: {exc}")
            rel_errors[name] = math.nan
            continue
        rel_errors[name] = result["rel_error"]
        pass_fractions[name] = result["pass_fraction"]
        if not result["finite"]:
            problems_found.append(f"{name} has NaN/Inf (or unwritten elements)")
        elif result["rel_error"] > WRONG_REL_ERROR:
            problems_found.append(f"{name} rel. error {result['rel_error']:.3g} > {WRONG_REL_ERROR:g}")
    worst_rel = max(rel_errors.values(), default=math.nan, key=lambda v: math.inf if math.isnan(v) else v)
    fractions = [f for f in pass_fractions.values() if f is not None]
    worst_fraction = min(fractions) if fractions and rule is not None else math.nan
    passes = None if rule is None or len(fractions) != len(names) else worst_fraction >= rule["required_fraction"]
    return dict(
        rel_errors=rel_errors,
        pass_fractions=pass_fractions,
        correct=not problems_found,
        passes_element_rule=passes,
        rel_error=worst_rel,
        element_pass_fraction=worst_fraction,
        why="; ".join(problems_found),
    )


def reference_outputs(problem: problems.Problem, inputs: dict, small: bool) -> tuple[tuple, str]:
    """The reference outputs the harness checks against, and their dtype's name: the problem's reference
    on the inputs upcast to :meth:`~moe_lib.problems.Problem.reference_dtype` (float64 where it fits,
    else float32), with TF32 off."""
    precision = problem.reference_dtype(small)
    upcast = [
        inputs[name].to(precision) if inputs[name].is_floating_point() else inputs[name] for name in problem.input_names
    ]
    with tf32_disabled():
        outputs = problem.spec.reference(*upcast)
    del upcast
    return tuple(outputs), problems.dtype_name(precision)
