"""P2 · ``moe_experts_backward``: all routed SwiGLU experts' backward, the forward recomputed inside.

api.py        the public function, the forward and the ``moe_experts`` layer, as ``torch.library`` ops
checks.py     input checks           reference.py   readable PyTorch (the benchmark's semantics)
inputs.py     the benchmark's input distributions and the routings (uniform, skewed, hot)
routing.py    slots grouped by expert on the device (no host sync)
launch.py     Triton host side: one call (choose, allocate, run A, W, D, C), workspaces, launch_plan()
choose.py     the chooser: every kernel's tiles, and the designs of kernels W and D
designs/      kernels W and D, each behind one interface: w_tma, w_pointer, d_tma, d_pointer
config.py     LaunchConfig (the tiles) and KernelLaunch (one launch of a plan)
runtime.py    what the host side shares: the allocation hook, the target, persistent grids, dtypes
kernels.py    the @triton.jit kernels A, C and the pointer-based W and D
tma_weight_grad.py  kernel W as a persistent TMA-fed grouped GEMM (the backward's default)
tma_slot_projection.py  kernel D likewise (the backward's and the forward's default)
parallel.py   expert parallelism over torch.distributed (``moe_lib.distributed``)
slot_sum.py   the parallel layer's last step: each token's K combined rows summed
"""

from .api import moe_experts, moe_experts_backward, moe_experts_forward, moe_experts_gate_up
from .inputs import make_inputs, route_tokens
from .reference import moe_experts_backward_reference, moe_experts_forward_reference

__all__ = [
    "make_inputs",
    "moe_experts",
    "moe_experts_backward",
    "moe_experts_backward_reference",
    "moe_experts_forward",
    "moe_experts_forward_reference",
    "moe_experts_gate_up",
    "route_tokens",
]
