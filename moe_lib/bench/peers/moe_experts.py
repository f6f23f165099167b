"""The peers of P2 ``moe_experts_backward`` (fp32 interface) and its bf16 variant.

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
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from ...dispatch import triton_unavailable_reason
from ...problems import OPS
from . import Peer, calling, register

OP = "moe_experts_backward"


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


def _grouped_mm_unavailable(device: torch.device) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return "torch._grouped_mm's fast path needs sm90 or newer"
    return None


def _liger_function():
    return importlib.import_module("liger_kernel.ops.fused_moe").LigerFusedMoEFunction


def _liger_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs CUDA: Liger-Kernel's fused MoE is Triton GPU kernels (running on {device.type})"
    try:
        _liger_function()
    except Exception as exc:  # ImportError, or anything its import raises
        return f"liger_kernel not importable ({type(exc).__name__}: {exc})"
    return None


def _prepare_liger(inputs: dict):
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


for _peer in (
    Peer("reference", OP, calling(OP, OPS[OP].reference), capturable=False, baseline=True,
         description="benchmark reference: loop over experts in fp32 (TF32 off)"),
    Peer("grouped_mm", OP, calling(OP, moe_experts_backward_grouped_mm), capturable=False, baseline=True,
         description="torch._grouped_mm in bf16 + autograd (argsort/bincount routing)",
         unavailable=_grouped_mm_unavailable),
    Peer("liger", OP, _prepare_liger, capturable=False, baseline=True,
         description="Liger-Kernel 0.8.5 LigerFusedMoEFunction forward + backward", unavailable=_liger_unavailable),
    Peer("triton", OP, calling(OP, OPS[OP].function, impl="triton", validate=False), capturable=True,
         description="moe_lib's Triton kernels", unavailable=triton_unavailable_reason),
):  # fmt: skip
    register(_peer)
del _peer
