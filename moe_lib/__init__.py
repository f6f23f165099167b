"""moe_lib: readable references and fast Triton kernels for the backward pass of MoE SwiGLU experts.

- :func:`swiglu_down_backward` — one expert's backward from its saved forward tensors (P1).
- :func:`moe_experts_backward` — all routed experts' backward, forward recomputed (P2).
- :func:`swiglu_expert`, :func:`moe_experts` — differentiable layers whose backward runs them
  (:func:`moe_experts_gate_up`: the gate and up weights fused in one block, as models keep them); registered with
  ``torch.library`` (``torch.ops.moe_lib.*``), so that ``torch.compile(fullgraph=True)`` takes them whole.
- :mod:`moe_lib.nn` — ``SwiGLUExpert`` and ``MoEExperts`` modules over them, in Hugging Face's expert layout;
  :mod:`moe_lib.integrations.hf` runs transformers' MoE models on them (``apply_moe_lib(model)``).
- :mod:`moe_lib.problems` — the problems as data, and seeded inputs.
- :mod:`moe_lib.reference` — the readable PyTorch every fast path is checked against.

One package per problem (``swiglu_down/``, ``moe_experts/``) holds its function, layer, checks,
reference and kernels; ``bench/`` measures them; ``lab/`` serves the notebooks. docs/architecture.md
walks through the house.
"""

from . import nn, problems, reference
from .moe_experts import moe_experts, moe_experts_backward, moe_experts_gate_up
from .swiglu_down import swiglu_down_backward, swiglu_expert

__all__ = [
    "moe_experts",
    "moe_experts_backward",
    "moe_experts_gate_up",
    "nn",
    "problems",
    "reference",
    "swiglu_down_backward",
    "swiglu_expert",
]
__version__ = "0.1.0"
