"""P2 · ``moe_experts_backward``: all routed SwiGLU experts' backward, the forward recomputed inside.

    api.py        the public function, the forward and the ``moe_experts`` layer
    checks.py     input checks           reference.py   readable PyTorch (the benchmark's semantics)
    inputs.py     the benchmark's input distributions and the routings (uniform, skewed, hot)
    routing.py    slots grouped by expert on the device (no host sync)
    launch.py     Triton host side: launch configs, launch_plan(), workspaces, the launches
    kernels.py    the @triton.jit kernels A, W, D, C
    tma_weight_grad.py  kernel W as a persistent TMA-fed grouped GEMM (the backward's default)
    tma_slot_projection.py  kernel D likewise (the backward's and the forward's default)
    parallel.py   expert parallelism over torch.distributed (``moe_lib.distributed``)
"""

from .api import moe_experts, moe_experts_backward, moe_experts_forward
from .inputs import make_inputs, route_tokens
from .reference import moe_experts_backward_reference, moe_experts_forward_reference

__all__ = [
    "make_inputs",
    "moe_experts",
    "moe_experts_backward",
    "moe_experts_backward_reference",
    "moe_experts_forward",
    "moe_experts_forward_reference",
    "route_tokens",
]
