"""How large P2's weight gradients grow with the shape, and how far bf16 operands in kernel W then stay from the
element rule's absolute tolerance (the model behind :func:`.choose.weight_grad_products`).

The problem's element rule (``data/problems/moe_experts_backward/lab.json``): |out − ref| ≤ 0.11 + 1e-5·|ref| on at
least 99% of each output's elements. Kernel W's element out_ij = Σ_p a_pi·b_pj sums one product per row p of an
expert (n rows). With both operands rounded to bf16, each term carries two independent relative errors of RMS

    δ = 2⁻⁷ / √(32·ln 2) ≈ 1.66e-3      (round to nearest with 8 significant bits: an ulp of 2⁻⁷ over mantissas
                                         log-uniform in [1, 2), an error uniform over one ulp)

so the element's error is a sum of n independent terms, near Gaussian, with an RMS of √2·δ times the element's own
RMS, and that grows as √n: rms(out) = √n · rms(a)·rms(b). The tolerance is absolute (the 1e-5·|ref| adds < 0.001 at
these sizes), so the share of elements within it falls as the rows per expert grow:

    z = 0.11 / (√2 · δ · √n · rms(a)·rms(b)),    share ≈ P(|N(0, 1)| ≤ z).

The operands' RMS follow from the problem's inputs (:mod:`.inputs`): x, dy ~ N(0, 1), weights WEIGHT_STD·N(0, 1), so
that g, u and Wdᵀdy ~ N(0, s²) with s = WEIGHT_STD·√H, and w = softmax over K of N(0, 1):

    dWg = Σ dgᵀ x    dg = w·Wdᵀdy·u·silu'(g)    rms(a)·rms(b) = √E[w²] · s² · √E[silu'(g)²]
    dWu = Σ duᵀ x    du = w·Wdᵀdy·silu(g)       √E[w²] · s · √E[silu(g)²]
    dWd = Σ dyᵀ aw   aw = w·silu(g)·u           √E[w²] · s · √E[silu(g)²]

I enters nowhere: it sets how many elements there are, not how large they grow. The expectations are sample means of
one fixed draw (cached per H and K). ``scripts/p2/fp32_precision_emulation.py --sweep`` checks the model against the
arithmetic itself at the model suite's shapes (notes/p2/fp32-precision-rule.md).
"""

from __future__ import annotations

import functools
import math

import torch

from ..precision import silu_grad
from .inputs import WEIGHT_STD

ATOL = 0.11  # the element rule's absolute tolerance (data/problems/moe_experts_backward/lab.json)
BF16_ROUNDING = 2**-7 / math.sqrt(32 * math.log(2))  # RMS relative error of rounding to bf16 (≈ 1.66e-3)
SAMPLES = 1 << 16  # draws behind each expectation: ≈ 0.5% on an RMS
WEIGHT_GRADS = ("grad_gate_weights", "grad_up_weights", "grad_down_weights")


@functools.cache
def operand_rms(hidden_size: int, top_k: int) -> dict[str, float]:
    """rms(a)·rms(b) of each weight gradient's two operands under the problem's inputs: its element's RMS is this
    times √(rows of the expert)."""
    if hidden_size < 1 or top_k < 1:
        raise ValueError(f"hidden_size, top_k: expected positive sizes, got {hidden_size}, {top_k}")
    generator = torch.Generator().manual_seed(0)  # the same draw every time: the rule is a function of the shape
    w = torch.softmax(torch.randn((SAMPLES, top_k), generator=generator, dtype=torch.float64), dim=1)[:, 0]
    s = WEIGHT_STD * math.sqrt(hidden_size)
    g = s * torch.randn(SAMPLES, generator=generator, dtype=torch.float64)
    w_rms = w.square().mean().sqrt().item()
    silu_rms = (g * torch.sigmoid(g)).square().mean().sqrt().item()
    silu_grad_rms = silu_grad(g).square().mean().sqrt().item()
    return dict(
        grad_gate_weights=w_rms * s * s * silu_grad_rms,
        grad_up_weights=w_rms * s * silu_rms,
        grad_down_weights=w_rms * s * silu_rms,
    )


def bf16_error_rms(rows_per_expert: float, hidden_size: int, top_k: int) -> dict[str, float]:
    """The predicted RMS of each weight gradient's error when kernel W multiplies bf16 operands."""
    scale = math.sqrt(2 * max(rows_per_expert, 0.0)) * BF16_ROUNDING
    return {name: scale * rms for name, rms in operand_rms(hidden_size, top_k).items()}


def bf16_margin(rows_per_expert: float, hidden_size: int, top_k: int) -> float:
    """z: how many predicted error RMS the tolerance lies out, for the weight gradient with the largest error."""
    largest = max(bf16_error_rms(rows_per_expert, hidden_size, top_k).values())
    return math.inf if largest == 0 else ATOL / largest


def predicted_pass_share(rows_per_expert: float, hidden_size: int, top_k: int) -> dict[str, float]:
    """The share of each weight gradient's elements within the tolerance with bf16 operands, P(|N(0, σ²)| ≤ 0.11)."""
    return {
        name: 1.0 if sigma == 0 else math.erf(ATOL / (sigma * math.sqrt(2)))
        for name, sigma in bf16_error_rms(rows_per_expert, hidden_size, top_k).items()
    }
