"""P1 · ``swiglu_down_backward``: one SwiGLU expert's backward with down projection, from saved tensors.

    api.py         the public function and the ``swiglu_expert`` layer
    checks.py      input checks          reference.py   readable PyTorch (the benchmark's semantics)
    inputs.py      the benchmark's input distributions
    launch.py      Triton host side: tile configs, launch_plan(), workspaces, the two launches
    kernels.py     the @triton.jit kernels
    one_launch.py  one persistent launch around a grid barrier (the faithful path up to 64 tokens)
    chained.py     the two launches' tiles as one launch, programs ordered by tickets (the faithful path, 65–1249,
                   where the Gluon launches cannot run)
    gluon_launch1.py, gluon_launch2.py  the two launches in Gluon (the faithful path from 129 tokens on Hopper)
"""

from .api import swiglu_down_backward, swiglu_expert
from .inputs import make_inputs
from .reference import swiglu_down_backward_reference, swiglu_expert_forward_reference

__all__ = [
    "make_inputs",
    "swiglu_down_backward",
    "swiglu_down_backward_reference",
    "swiglu_expert",
    "swiglu_expert_forward_reference",
]
