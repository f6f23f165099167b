"""The readable PyTorch every fast path is checked against, gathered from the problem packages.

Inputs are upcast to float32 (float64 stays float64), every product is computed there with TF32 off,
and the results are rounded back to the input dtype at the end. The math of each is in its module's
docstring: :mod:`moe_lib.swiglu_down.reference` (P1) and :mod:`moe_lib.moe_experts.reference` (P2).
"""

from .moe_experts.reference import moe_experts_backward_reference, moe_experts_forward_reference
from .precision import compute_dtype, silu_grad, tf32_disabled
from .swiglu_down.reference import swiglu_down_backward_reference, swiglu_expert_forward_reference

__all__ = [
    "compute_dtype",
    "moe_experts_backward_reference",
    "moe_experts_forward_reference",
    "silu_grad",
    "swiglu_down_backward_reference",
    "swiglu_expert_forward_reference",
    "tf32_disabled",
]
