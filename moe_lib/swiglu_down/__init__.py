"""P1 · ``swiglu_down_backward``: one SwiGLU expert's backward with down projection, from saved tensors.

api.py         the public function and the ``swiglu_expert`` layer, as ``torch.library`` ops
checks.py      input checks          reference.py   readable PyTorch (the benchmark's semantics)
inputs.py      the benchmark's input distributions
backward.py    the Triton path's call: choose -> allocate -> design.run()
choose.py      which design runs a call: a readable heuristic over (T, H, I, dtype, device)
designs/       one file per design behind one interface (designs/__init__.py lists them)
runtime.py     what the designs share on the host: the allocation hook, device limits, workspaces, dot flags
kernels.py     @triton.jit blocks the designs share
gluon_launch1.py, gluon_launch2.py   the Gluon kernels of designs/gluon.py
activation.py  the swiglu_expert layer's elementwise step in one launch
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
