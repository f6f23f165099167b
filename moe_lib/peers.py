"""Every implementation the benchmark harness can time, under the project's labels.

A peer is a :class:`Peer`: ``prepare(inputs)`` does the untimed setup (weights concatenated once,
a function compiled, indices converted) and returns a callable that does the timed work and returns
the outputs tuple in the problem's order. ``capturable`` says whether that callable can be
captured in a CUDA graph (no host sync inside); ``unavailable(device)`` gives the reason it cannot
run on ``device``, or None.

P1 ``swiglu_down_backward`` (inputs bf16):
- ``reference``: :func:`moe_lib.reference.swiglu_down_backward_reference`, the benchmark's code
  (everything upcast to fp32, fp32 GEMMs with TF32 off, results rounded to bf16).
- ``torch_eager``: ``dWd = dyᵀ·intermediate`` and ``dA = dy·Wd`` as bf16 GEMMs; dA upcast to fp32
  for the elementwise dSwiGLU from the saved tensors; dGate‖dUp concatenated and rounded to bf16;
  ``dx = [dGate‖dUp]·[Wg;Wu]`` and ``[dWg;dWu] = [dGate‖dUp]ᵀ·x`` as bf16 GEMMs. ``[Wg;Wu]`` is
  concatenated once, in ``prepare``.
- ``torch_compile``: ``torch.compile`` (default mode, ``dynamic=False``) of torch_eager's function,
  compiled afresh for each case (``torch._dynamo.reset()``), so that 16 shapes never hit dynamo's
  recompile limit.
- ``triton``: ``moe_lib.swiglu_down_backward(..., impl="triton")``, where its kernel exists.

P2 ``moe_experts_backward`` (fp32 interface) and ``moe_experts_backward_bf16``:
- ``reference``: :func:`moe_lib.reference.moe_experts_backward_reference`, the loop over experts in
  fp32 with TF32 off (``nonzero`` per expert: not capturable). At P2's full size it is also the
  harness's reference, so its error there reads 0.
- ``grouped_mm``: tokens sorted by expert (``argsort`` of the flattened indices, counts by
  ``bincount``, int32 cumulative offsets), rows gathered, the forward recomputed with
  ``torch._grouped_mm`` in bf16 (weights cast to bf16 inside the timed call for the fp32
  interface), ``silu(g)·u``, the down projection, scaled by the routing weights, combined with an
  fp32 ``index_add``; gradients by ``torch.autograd.grad``, which also casts them back to the
  interface dtypes. ``bincount`` syncs with the host: not capturable. On CPU, torch's own fallback
  of ``_grouped_mm`` runs the same code (where the installed torch has one).
- ``liger``: Liger-Kernel 0.8.5 ``LigerFusedMoEFunction`` forward + backward, with gate‖up
  concatenated ([E, 2I, H], gate rows first) and int32 indices prepared once outside the timed call
  for bf16 weights; for the fp32 interface the weights are cast to bf16 inside the timed call,
  written straight into the gate‖up layout, and the gradients cast back to fp32. Its routing
  metadata reads a count back to the host: not capturable. Needs CUDA and ``liger_kernel``. Its
  kernels autotune 32 configs each on first use (minutes at P2's size); ``LIGER_FUSED_MOE_AUTOTUNE=0``
  in the environment before the import pins its default config instead (the harness records it).
- ``triton``: ``moe_lib.moe_experts_backward(..., impl="triton", validate=False)``.

Tests and experiments can add peers with :func:`register` (or the :func:`registered` context).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import api, problems, reference

OPS = ("swiglu_down_backward", "moe_experts_backward")
# peers whose best is the "optimized PyTorch baseline" of the score (the harness picks the fastest)
BASELINE_LABELS = ("reference", "torch_eager", "torch_compile", "grouped_mm", "liger")


@dataclasses.dataclass(frozen=True)
class Peer:
    """One implementation of one problem op, as the harness runs it."""

    label: str
    op: str  # "swiglu_down_backward" or "moe_experts_backward"
    prepare: Callable[[dict], Callable[[], tuple]]
    capturable: bool
    description: str
    unavailable: Callable[[torch.device], str | None] = lambda device: None


_REGISTRY: dict[str, dict[str, Peer]] = {op: {} for op in OPS}


def register(peer: Peer) -> Peer:
    """Adds (or replaces) ``peer`` under its op and label."""
    if peer.op not in _REGISTRY:
        raise ValueError(f"op: expected one of {OPS}, got {peer.op!r}")
    _REGISTRY[peer.op][peer.label] = peer
    return peer


def unregister(op: str, label: str) -> None:
    _REGISTRY[op].pop(label, None)


@contextlib.contextmanager
def registered(peer: Peer):
    """Registers ``peer`` for the duration of the block (restoring any peer it replaced)."""
    previous = _REGISTRY.get(peer.op, {}).get(peer.label)
    register(peer)
    try:
        yield peer
    finally:
        unregister(peer.op, peer.label)
        if previous is not None:
            register(previous)


def op_of(problem: str) -> str:
    """The op (function) a problem name runs: the bf16 variant of P2 runs moe_experts_backward."""
    return problems.load(problem).op


def peers_for(problem: str) -> dict[str, Peer]:
    """Every registered peer of ``problem``, by label, in registration order."""
    return dict(_REGISTRY[op_of(problem)])


def labels(problem: str) -> list[str]:
    return list(peers_for(problem))


def available_labels(problem: str, device) -> list[str]:
    """Labels of the peers of ``problem`` that can run on ``device``."""
    device = torch.device(device)
    return [label for label, peer in peers_for(problem).items() if peer.unavailable(device) is None]


# ---------------------------------------------------------------------------------------------
# availability


def _compile_unavailable(device: torch.device) -> str | None:
    return None if hasattr(torch, "compile") else f"torch {torch.__version__} has no torch.compile"


def _grouped_mm_unavailable(device: torch.device) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return "torch._grouped_mm's fast path needs sm90 or newer"
    return None


def _liger_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs CUDA: Liger-Kernel's fused MoE is Triton GPU kernels (running on {device.type})"
    try:
        _liger_function()
    except Exception as exc:  # ImportError, or anything its import raises
        return f"liger_kernel not importable ({type(exc).__name__}: {exc})"
    return None


def _triton_unavailable_for(op: str):
    def unavailable(device: torch.device) -> str | None:
        if not api.triton_available(op):
            return f"no Triton kernel for {op} yet (module {api.TRITON_MODULES[op]} not found) or triton missing"
        if device.type != "cuda" and not api.triton_interpreter_enabled():
            return f"needs CUDA, or TRITON_INTERPRET=1 on CPU (running on {device.type})"
        return None

    return unavailable


# ---------------------------------------------------------------------------------------------
# P1 · swiglu_down_backward


def swiglu_down_backward_eager(dy, x, w_gate_up, w_down, gate, gate_sigmoid, gate_silu, up, intermediate):
    """P1 the careful PyTorch way: GEMMs in the input dtype (bf16), the elementwise dSwiGLU in fp32.

    ``w_gate_up`` is ``[Wg; Wu]`` [2I, H]. Returns (grad_x, grad_gate_weight, grad_up_weight,
    grad_down_weight); the two I×H gradients are the halves of one [2I, H] product.
    """
    low = x.dtype
    inter = gate.shape[1]
    grad_down = dy.T @ intermediate  # [H, I]
    d_a = (dy @ w_down).float()  # [T, I]
    s = gate_sigmoid.float()
    d_up = d_a * gate_silu.float()
    d_gate = d_a * up.float() * s * (1 + gate.float() * (1 - s))
    d_gate_up = torch.cat([d_gate, d_up], dim=1).to(low)  # [T, 2I]
    grad_x = d_gate_up @ w_gate_up  # [T, H]
    grad_gate_up = d_gate_up.T @ x  # [2I, H]
    return grad_x, grad_gate_up[:inter], grad_gate_up[inter:], grad_down


def _p1_args(inputs: dict) -> tuple:
    return tuple(inputs[name] for name in problems.load("swiglu_down_backward").inputs)


def _p1_eager_args(inputs: dict) -> tuple:
    w_gate_up = torch.cat([inputs["gate_weight"], inputs["up_weight"]], dim=0)
    return (inputs["grad_output"], inputs["x"], w_gate_up, inputs["down_weight"], inputs["gate"],
            inputs["gate_sigmoid"], inputs["gate_silu"], inputs["up"], inputs["intermediate"])  # fmt: skip


def _prepare_p1_reference(inputs: dict):
    args = _p1_args(inputs)
    return lambda: reference.swiglu_down_backward_reference(*args)


def _prepare_p1_eager(inputs: dict):
    args = _p1_eager_args(inputs)
    return lambda: swiglu_down_backward_eager(*args)


def _prepare_p1_compile(inputs: dict):
    args = _p1_eager_args(inputs)
    torch._dynamo.reset()  # a fresh cache per case: static shapes, never the recompile limit
    compiled = torch.compile(swiglu_down_backward_eager, dynamic=False)
    return lambda: compiled(*args)


def _prepare_p1_triton(inputs: dict):
    args = _p1_args(inputs)
    return lambda: api.swiglu_down_backward(*args, impl="triton")


# ---------------------------------------------------------------------------------------------
# P2 · moe_experts_backward


def _p2_args(inputs: dict) -> tuple:
    return tuple(inputs[name] for name in problems.load("moe_experts_backward").inputs)


def low_precision(dtype: torch.dtype) -> torch.dtype:
    """The GEMM dtype of the peers that compute in low precision: bf16, or the input's if 16-bit."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def moe_experts_backward_grouped_mm(grad_output, hidden_states, topk_indices, topk_weights, gate_weights,
                                    up_weights, down_weights):  # fmt: skip
    """P2 as torchtitan-style PyTorch does it: grouped GEMMs in bf16 and autograd.

    Sorts the (token, slot) pairs by expert, recomputes the forward with ``torch._grouped_mm`` and
    takes the gradients with ``torch.autograd.grad``. Returns the five gradients in the interface
    dtypes (autograd casts each back to its leaf's dtype).
    """
    num_tokens, top_k = topk_indices.shape
    num_experts = gate_weights.shape[0]
    low = low_precision(hidden_states.dtype)

    flat_experts = topk_indices.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)  # sorted row -> flat (token, slot) index
    counts = torch.bincount(flat_experts, minlength=num_experts)  # syncs with the host
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)  # end row of each expert's group
    token_of_row = order // top_k

    leaves = [t.detach().requires_grad_() for t in (hidden_states, topk_weights, gate_weights, up_weights,
                                                    down_weights)]  # fmt: skip
    x, routing, w_gate, w_up, w_down = leaves
    with torch.enable_grad():
        x_rows = x.to(low)[token_of_row]  # [TK, H]
        g = torch._grouped_mm(x_rows, w_gate.to(low).transpose(-2, -1), offs=offsets, out_dtype=low)  # [TK, I]
        u = torch._grouped_mm(x_rows, w_up.to(low).transpose(-2, -1), offs=offsets, out_dtype=low)
        a = F.silu(g) * u
        o = torch._grouped_mm(a, w_down.to(low).transpose(-2, -1), offs=offsets, out_dtype=low)  # [TK, H]
        scaled = o.float() * routing.reshape(-1)[order].float()[:, None]
        y = torch.zeros(num_tokens, o.shape[1], dtype=torch.float32, device=o.device).index_add(0, token_of_row, scaled)
        grads = torch.autograd.grad(y, leaves, grad_outputs=grad_output.float())
    grad_x, grad_routing, grad_gate, grad_up, grad_down = grads
    return grad_x, grad_routing, grad_gate, grad_up, grad_down


def _prepare_p2_reference(inputs: dict):
    args = _p2_args(inputs)
    return lambda: reference.moe_experts_backward_reference(*args)


def _prepare_p2_grouped_mm(inputs: dict):
    args = _p2_args(inputs)
    return lambda: moe_experts_backward_grouped_mm(*args)


def _liger_function():
    return importlib.import_module("liger_kernel.ops.fused_moe").LigerFusedMoEFunction


def _prepare_p2_liger(inputs: dict):
    function = _liger_function()
    dtype = inputs["hidden_states"].dtype
    low = low_precision(dtype)
    indices = inputs["topk_indices"].to(torch.int32).contiguous()
    grad_output, hidden_states = inputs["grad_output"], inputs["hidden_states"]
    topk_weights = inputs["topk_weights"]
    gate_weights, up_weights, down_weights = inputs["gate_weights"], inputs["up_weights"], inputs["down_weights"]
    inter = gate_weights.shape[1]
    cast_inside = dtype != low
    if not cast_inside:  # weights already in the GEMM dtype: concatenate once, outside the timed call
        gate_up_prepared = torch.cat([gate_weights, up_weights], dim=1)

    def run():
        if cast_inside:  # cast to bf16, written straight into the gate‖up layout
            num_experts, _, hidden = gate_weights.shape
            gate_up = torch.empty(num_experts, 2 * inter, hidden, dtype=low, device=gate_weights.device)
            gate_up[:, :inter].copy_(gate_weights)
            gate_up[:, inter:].copy_(up_weights)
        else:
            gate_up = gate_up_prepared
        leaves = [hidden_states.to(low).detach().requires_grad_(), gate_up.detach().requires_grad_(),
                  down_weights.to(low).detach().requires_grad_(), topk_weights.detach().requires_grad_()]  # fmt: skip
        x, w_gate_up, w_down, routing = leaves
        with torch.enable_grad():
            y = function.apply(x, w_gate_up, w_down, indices, routing)
            grad_x, grad_gate_up, grad_down, grad_routing = torch.autograd.grad(
                y, leaves, grad_outputs=grad_output.to(y.dtype)
            )
        return (grad_x.to(dtype), grad_routing.to(topk_weights.dtype), grad_gate_up[:, :inter].to(dtype),
                grad_gate_up[:, inter:].to(dtype), grad_down.to(dtype))  # fmt: skip

    return run


def _prepare_p2_triton(inputs: dict):
    args = _p2_args(inputs)
    return lambda: api.moe_experts_backward(*args, impl="triton", validate=False)


# ---------------------------------------------------------------------------------------------
# the registry

for _peer in (
    Peer("reference", "swiglu_down_backward", _prepare_p1_reference, capturable=True,
         description="benchmark reference: fp32 upcast, fp32 GEMMs (TF32 off), bf16 results"),
    Peer("torch_eager", "swiglu_down_backward", _prepare_p1_eager, capturable=True,
         description="bf16 GEMMs, fp32 elementwise dSwiGLU, gate‖up concatenated once"),
    Peer("torch_compile", "swiglu_down_backward", _prepare_p1_compile, capturable=True,
         description="torch.compile (default mode, static shapes) of torch_eager",
         unavailable=_compile_unavailable),
    Peer("triton", "swiglu_down_backward", _prepare_p1_triton, capturable=True,
         description="moe_lib's Triton kernels", unavailable=_triton_unavailable_for("swiglu_down_backward")),
    Peer("reference", "moe_experts_backward", _prepare_p2_reference, capturable=False,
         description="benchmark reference: loop over experts in fp32 (TF32 off)"),
    Peer("grouped_mm", "moe_experts_backward", _prepare_p2_grouped_mm, capturable=False,
         description="torch._grouped_mm in bf16 + autograd (argsort/bincount routing)",
         unavailable=_grouped_mm_unavailable),
    Peer("liger", "moe_experts_backward", _prepare_p2_liger, capturable=False,
         description="Liger-Kernel 0.8.5 LigerFusedMoEFunction forward + backward", unavailable=_liger_unavailable),
    Peer("triton", "moe_experts_backward", _prepare_p2_triton, capturable=True,
         description="moe_lib's Triton kernels", unavailable=_triton_unavailable_for("moe_experts_backward")),
):  # fmt: skip
    register(_peer)
del _peer
