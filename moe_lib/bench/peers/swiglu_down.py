"""The peers of P1 ``swiglu_down_backward`` (inputs bf16).

- ``reference``: :func:`moe_lib.reference.swiglu_down_backward_reference`, the benchmark's code
  (everything upcast to fp32, fp32 GEMMs with TF32 off, results rounded to bf16).
- ``torch_eager``: ``dWd = dyᵀ·intermediate`` and ``dA = dy·Wd`` as bf16 GEMMs; dA upcast to fp32
  for the elementwise dSwiGLU from the saved tensors; dGate‖dUp concatenated and rounded to bf16;
  ``dx = [dGate‖dUp]·[Wg;Wu]`` and ``[dWg;dWu] = [dGate‖dUp]ᵀ·x`` as bf16 GEMMs. ``[Wg;Wu]`` is
  concatenated once, in ``prepare``.
- ``torch_compile``: ``torch.compile`` (default mode, ``dynamic=False``) of torch_eager's function,
  compiled afresh for each case (``torch._dynamo.reset()``), so that 16 shapes never hit dynamo's
  recompile limit.
- ``triton``: ``moe_lib.swiglu_down_backward(..., impl="triton")``, the faithful path (dGate and dUp
  carried as bf16 hi/lo pairs, so that the outputs follow the fp32 reference on inputs of any scale).
- ``triton_fast``: the same with ``precision="fast"``: dGate and dUp rounded to bf16 before the dx, dWg
  and dWu products, as torch_eager and torch_compile do.

Its layer (the training-step modes of :mod:`moe_lib.bench.modes`), y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ:
- ``reference``: ``moe_lib.swiglu_expert(impl="reference")``: PyTorch products in the input dtype, the
  backward the reference function in fp32.
- ``torch_eager``: the plain PyTorch expert (three bf16 products, ``F.silu``) and autograd.
- ``torch_compile``: ``torch.compile`` of that expert (its backward compiled by AOTAutograd).
- ``triton``: ``moe_lib.swiglu_expert(impl="triton")`` (its default ``precision="fast"``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...dispatch import triton_unavailable_reason
from ...problems import OPS
from ...swiglu_down import swiglu_expert
from .registry import LayerPeer, Peer, calling, named, register, register_layer

OP = "swiglu_down_backward"


def swiglu_down_backward_eager(dy, x, w_gate_up, w_down, gate, gate_sigmoid, gate_silu, up, intermediate):
    """P1 the careful PyTorch way: GEMMs in the input dtype (bf16), the elementwise dSwiGLU in fp32.

    ``w_gate_up`` is ``[Wg; Wu]`` [2I, H]. Returns (grad_x, grad_gate_weight, grad_up_weight,
    grad_down_weight); the two I×H gradients are the halves of one [2I, H] product.
    """
    inter = gate.shape[1]
    grad_down = dy.T @ intermediate  # [H, I]
    d_gate_up = swiglu_grads_eager(dy @ w_down, gate, gate_sigmoid, gate_silu, up)  # [T, 2I]
    grad_x = d_gate_up @ w_gate_up  # [T, H]
    grad_gate_up = d_gate_up.T @ x  # [2I, H]
    return grad_x, grad_gate_up[:inter], grad_gate_up[inter:], grad_down


def swiglu_grads_eager(d_a, gate, gate_sigmoid, gate_silu, up):
    """[dGate | dUp] rows [T, 2I] in the saved tensors' dtype, computed in fp32 (or wider, for float64 inputs) from
    dA and the saved tensors: dGate = dA ⊙ up ⊙ s ⊙ (1 + gate ⊙ (1 − s)), dUp = dA ⊙ gate_silu."""
    wide = torch.promote_types(d_a.dtype, torch.float32)
    d_a, s = d_a.to(wide), gate_sigmoid.to(wide)
    d_up = d_a * gate_silu.to(wide)
    d_gate = d_a * up.to(wide) * s * (1 + gate.to(wide) * (1 - s))
    return torch.cat([d_gate, d_up], dim=1).to(gate.dtype)


def eager_arguments(inputs: dict) -> tuple:
    """The arguments of :func:`swiglu_down_backward_eager` from P1's inputs (``[Wg; Wu]`` concatenated here)."""
    w_gate_up = torch.cat([inputs["gate_weight"], inputs["up_weight"]], dim=0)
    return (
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


def _prepare_eager(inputs: dict):
    arguments = eager_arguments(inputs)
    return lambda: swiglu_down_backward_eager(*arguments)


def _prepare_compile(inputs: dict):
    arguments = eager_arguments(inputs)
    torch._dynamo.reset()  # a fresh cache per case: static shapes, never the recompile limit
    compiled = torch.compile(swiglu_down_backward_eager, dynamic=False)
    return lambda: compiled(*arguments)


# torch.compile recompiles for every new shape (static shapes); a harness that runs all 16 cases in one
# process needs more than dynamo's default of 8 cached compilations per function
RECOMPILE_LIMIT = 64


@functools.cache
def _compiled_eager():
    """torch_eager's function compiled once per process, for every shape (harnesses timing every call)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
    return torch.compile(swiglu_down_backward_eager, dynamic=False)


def _run_compile(*args):
    return _compiled_eager()(*eager_arguments(named(OP, args)))


def _run_eager(*args):
    return swiglu_down_backward_eager(*eager_arguments(named(OP, args)))


def plain_expert(x, gate_weight, up_weight, down_weight):
    """The SwiGLU expert as plain PyTorch writes it: y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ, in the input dtype."""
    return (F.silu(x @ gate_weight.T) * (x @ up_weight.T)) @ down_weight.T


@functools.cache
def _compiled_expert():
    return torch.compile(plain_expert, dynamic=False)


def _layer(function):
    """A layer forward ``(inputs, leaves) -> y`` calling ``function(x, Wg, Wu, Wd)`` on the leaves."""
    return lambda inputs, leaves: function(
        leaves["x"], leaves["gate_weight"], leaves["up_weight"], leaves["down_weight"]
    )


def _compile_unavailable(device: torch.device) -> str | None:
    return None if hasattr(torch, "compile") else f"torch {torch.__version__} has no torch.compile"


for _peer in (
    Peer(
        "reference",
        OP,
        calling(OP, OPS[OP].reference),
        capturable=True,
        baseline=True,
        description="benchmark reference: fp32 upcast, fp32 GEMMs (TF32 off), bf16 results",
    ),
    Peer(
        "torch_eager",
        OP,
        _prepare_eager,
        capturable=True,
        baseline=True,
        run=_run_eager,
        description="bf16 GEMMs, fp32 elementwise dSwiGLU, gate‖up concatenated once",
    ),
    Peer(
        "torch_compile",
        OP,
        _prepare_compile,
        capturable=True,
        baseline=True,
        run=_run_compile,
        description="torch.compile (default mode, static shapes) of torch_eager",
        unavailable=_compile_unavailable,
    ),
    Peer(
        "triton",
        OP,
        calling(OP, OPS[OP].function, impl="triton"),
        capturable=True,
        description="moe_lib's Triton kernels, faithful to the fp32 reference",
        unavailable=triton_unavailable_reason,
    ),
    Peer(
        "triton_fast",
        OP,
        calling(OP, OPS[OP].function, impl="triton", precision="fast"),
        capturable=True,
        description="moe_lib's Triton kernels, dGate and dUp rounded to bf16",
        unavailable=triton_unavailable_reason,
    ),
):
    register(_peer)
del _peer

for _layer_peer in (
    LayerPeer(
        "reference",
        OP,
        _layer(lambda *w: swiglu_expert(*w, impl="reference")),
        capturable=True,
        description="PyTorch products, the reference backward in fp32",
    ),
    LayerPeer(
        "torch_eager",
        OP,
        _layer(plain_expert),
        capturable=True,
        baseline=True,
        description="plain PyTorch expert (bf16 products, F.silu) and autograd",
    ),
    LayerPeer(
        "torch_compile",
        OP,
        _layer(lambda *w: _compiled_expert()(*w)),
        capturable=True,
        baseline=True,
        description="torch.compile of the plain PyTorch expert",
        unavailable=_compile_unavailable,
    ),
    LayerPeer(
        "triton",
        OP,
        _layer(lambda *w: swiglu_expert(*w, impl="triton")),
        capturable=True,
        description="moe_lib.swiglu_expert: PyTorch forward, Triton backward (fast)",
        unavailable=triton_unavailable_reason,
    ),
):
    register_layer(_layer_peer)
del _layer_peer
