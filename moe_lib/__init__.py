"""moe_lib: readable references and fast Triton kernels for the backward pass of MoE SwiGLU experts.

- :func:`swiglu_down_backward` — one expert's backward from its saved forward tensors (P1).
- :func:`moe_experts_backward` — all routed experts' backward, forward recomputed (P2).
- :func:`swiglu_expert`, :func:`moe_experts` — differentiable layers whose backward runs them.
- :mod:`moe_lib.problems` — the two problems as data, and seeded inputs.
- :mod:`moe_lib.reference` — the readable PyTorch every fast path is checked against.
"""

from . import problems, reference
from .api import moe_experts_backward, swiglu_down_backward
from .autograd import moe_experts, swiglu_expert

__all__ = [
    "moe_experts",
    "moe_experts_backward",
    "problems",
    "reference",
    "swiglu_down_backward",
    "swiglu_expert",
]
__version__ = "0.1.0"
