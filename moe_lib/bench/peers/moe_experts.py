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
- ``triton_engine``: the same call with the engine's structure preferred
  (``moe_lib.moe_experts.structure.preferred("engine")``: bf16 on Hopper, H and I multiples of 64; an error
  elsewhere).
- ``sonicmoe``: SonicMoE (Dao-AILab, CuTe DSL on QuACK grouped GEMMs; bf16 only) forward + backward
  through ``moe_general_routing_inputs``, the routing flattened (token, expert, score per slot, in token
  order), gate and up rows interleaved into its ``w1`` [2I, H, E] (row 2i gate i, 2i+1 up i) and ``Wd``
  as its ``w2`` [H, I, E], both permuted views of tensors in our layout built once outside the timed
  call; its gradients mapped back (de-interleaved views). "unavailable" with the reason where it does not
  import (CPU, no CUDA, not installed): ``sonicmoe`` must be on the path (it needs the CuTe DSL stack).

Its layer (the training-step modes of :mod:`moe_lib.bench.modes`): ``reference``
(``moe_lib.moe_experts(impl="reference")``), ``grouped_mm`` (:func:`grouped_mm_forward` and autograd),
``liger`` (its ``LigerFusedMoEFunction``, gate‖up held concatenated), ``sonicmoe`` (as above) and
``triton`` (``moe_lib.moe_experts(impl="triton")``, which recomputes g and u in its backward) and
``triton_saved`` (``save_activations=True``: g and u kept from the forward, as SonicMoE keeps them), and both
with the engine's structure preferred, ``triton_engine`` and ``triton_engine_saved``.
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn.functional as F

from ...dispatch import triton_unavailable_reason
from ...moe_experts import moe_experts
from ...moe_experts.structure import preferred
from ...problems import OPS
from ..layer_step import LAYERS, step
from .registry import LayerPeer, Peer, calling, register, register_layer

OP = "moe_experts_backward"


def low_precision(dtype: torch.dtype) -> torch.dtype:
    """The GEMM dtype of the peers that compute in low precision: bf16, or the input's if 16-bit."""
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def grouped_mm_forward(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights):
    """The layer's output y [T, H] (fp32) as torchtitan-style PyTorch computes it: the (token, slot) pairs
    sorted by expert (``argsort``, counts by ``bincount``, which syncs with the host), rows gathered, the
    three products by ``torch._grouped_mm`` in bf16 (the weights cast inside for the fp32 interface),
    ``silu(g)·u``, scaled by the routing weights and combined with an fp32 ``index_add``. Differentiable."""
    num_tokens, top_k = topk_indices.shape
    num_experts = gate_weights.shape[0]
    low = low_precision(hidden_states.dtype)
    flat_experts = topk_indices.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)  # sorted row -> flat (token, slot) index
    counts = torch.bincount(flat_experts, minlength=num_experts)  # syncs with the host
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)  # end row of each expert's group
    token_of_row = order // top_k
    x_rows = hidden_states.to(low)[token_of_row]  # [TK, H]
    g = torch._grouped_mm(x_rows, gate_weights.to(low).transpose(-2, -1), offs=offsets, out_dtype=low)  # [TK, I]
    u = torch._grouped_mm(x_rows, up_weights.to(low).transpose(-2, -1), offs=offsets, out_dtype=low)
    a = F.silu(g) * u
    o = torch._grouped_mm(a, down_weights.to(low).transpose(-2, -1), offs=offsets, out_dtype=low)  # [TK, H]
    scaled = o.float() * topk_weights.reshape(-1)[order].float()[:, None]
    return torch.zeros(num_tokens, o.shape[1], dtype=torch.float32, device=o.device).index_add(0, token_of_row, scaled)


def moe_experts_backward_grouped_mm(
    grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights
):
    """P2 as torchtitan-style PyTorch does it: :func:`grouped_mm_forward` recomputed, gradients by autograd.

    Returns the five gradients in the interface dtypes (autograd casts each back to its leaf's dtype).
    """
    leaves = [
        t.detach().requires_grad_() for t in (hidden_states, topk_weights, gate_weights, up_weights, down_weights)
    ]
    x, routing, w_gate, w_up, w_down = leaves
    with torch.enable_grad():
        y = grouped_mm_forward(x, topk_indices, routing, w_gate, w_up, w_down)
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
        leaves = [
            hidden_states.to(low).detach().requires_grad_(),
            gate_up.detach().requires_grad_(),
            down_weights.to(low).detach().requires_grad_(),
            topk_weights.detach().requires_grad_(),
        ]
        x, w_gate_up, w_down, routing = leaves
        with torch.enable_grad():
            y = function.apply(x, w_gate_up, w_down, indices, routing)
            grad_x, grad_gate_up, grad_down, grad_routing = torch.autograd.grad(
                y, leaves, grad_outputs=grad_output.to(y.dtype)
            )
        return (
            grad_x.to(dtype),
            grad_routing.to(topk_weights.dtype),
            grad_gate_up[:, :inter].to(dtype),
            grad_gate_up[:, inter:].to(dtype),
            grad_down.to(dtype),
        )

    return run


def _liger_parameters(inputs: dict) -> dict:
    """Liger's leaves: x, gate‖up ([E, 2I, H], gate rows first), Wd in the GEMM dtype, and the routing weights."""
    low = low_precision(inputs["hidden_states"].dtype)
    gate_up = torch.cat([inputs["gate_weights"], inputs["up_weights"]], dim=1).to(low)
    return dict(
        x=inputs["hidden_states"].to(low).detach().requires_grad_(),
        gate_up=gate_up.requires_grad_(),
        down=inputs["down_weights"].to(low).detach().requires_grad_(),
        routing=inputs["topk_weights"].detach().requires_grad_(),
    )


def _liger_forward(inputs: dict, leaves: dict) -> torch.Tensor:
    indices = inputs["topk_indices"].to(torch.int32)
    return _liger_function().apply(leaves["x"], leaves["gate_up"], leaves["down"], indices, leaves["routing"])


def _liger_gradients(grads: dict, inputs: dict) -> tuple:
    inter = inputs["gate_weights"].shape[1]
    dtype = inputs["hidden_states"].dtype
    gate_up = grads["gate_up"]
    return (
        grads["x"].to(dtype),
        grads["routing"].to(inputs["topk_weights"].dtype),
        gate_up[:, :inter].to(dtype),
        gate_up[:, inter:].to(dtype),
        grads["down"].to(dtype),
    )


def _sonicmoe():
    """(moe_general_routing_inputs, ActivationType) of the installed SonicMoE."""
    sonicmoe = importlib.import_module("sonicmoe")
    function = getattr(sonicmoe, "moe_general_routing_inputs", None)
    if function is None:
        function = importlib.import_module("sonicmoe.functional").moe_general_routing_inputs
    return function, importlib.import_module("sonicmoe.enums").ActivationType


def _sonicmoe_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"needs CUDA: SonicMoE is CuTe DSL kernels for Hopper (running on {device.type})"
    try:
        _sonicmoe()
    except Exception as exc:  # not installed, or its CuTe DSL stack missing
        return f"sonicmoe not importable ({type(exc).__name__}: {exc})"
    return None


def sonicmoe_parameters(inputs: dict) -> dict:
    """SonicMoE's leaves in its layout: x, the routing weights, w1 [E, 2I, H] with gate and up rows
    interleaved (row 2i gate i, 2i+1 up i) and w2 = Wd [E, H, I]; it takes them as [2I, H, E] and
    [H, I, E] views. bf16 inputs only, as its kernels."""
    if inputs["hidden_states"].dtype != torch.bfloat16:
        raise ValueError(f"hidden_states: SonicMoE runs bf16 inputs only, got {inputs['hidden_states'].dtype}")
    gate, up = inputs["gate_weights"], inputs["up_weights"]
    num_experts, inter, hidden = gate.shape
    w1 = torch.stack([gate, up], dim=2).reshape(num_experts, 2 * inter, hidden)
    return dict(
        x=inputs["hidden_states"].detach().requires_grad_(),
        scores=inputs["topk_weights"].float().detach().requires_grad_(),
        w1=w1.requires_grad_(),
        w2=inputs["down_weights"].detach().requires_grad_(),
    )


def sonicmoe_forward(inputs: dict, leaves: dict) -> torch.Tensor:
    """SonicMoE's layer on the flattened routing: slot s = t·K + k is (token t, expert topk_indices[t, k],
    score topk_weights[t, k]), in token order."""
    function, activation = _sonicmoe()
    num_tokens, top_k = inputs["topk_indices"].shape
    device = inputs["topk_indices"].device
    token_idx = torch.arange(num_tokens, device=device, dtype=torch.int32).repeat_interleave(top_k)
    expert_idx = inputs["topk_indices"].reshape(-1).to(torch.int32)
    num_experts = leaves["w1"].shape[0]
    output, _ = function(
        leaves["x"],
        leaves["scores"].reshape(-1),
        token_idx,
        expert_idx,
        leaves["w1"].permute(1, 2, 0),
        None,
        leaves["w2"].permute(1, 2, 0),
        None,
        num_experts,
        0,
        activation.SWIGLU,
    )
    return output


def sonicmoe_gradients(grads: dict, inputs: dict) -> tuple:
    """Its gradients in our layout: w1's even rows are the gate's, its odd rows the up projection's."""
    return (
        grads["x"],
        grads["scores"].reshape(inputs["topk_weights"].shape).to(inputs["topk_weights"].dtype),
        grads["w1"][:, 0::2],
        grads["w1"][:, 1::2],
        grads["w2"],
    )


def _prepare_sonicmoe(inputs: dict):
    """The op through SonicMoE's layer: forward + backward, the five gradients in our order."""
    run = step(sonicmoe_forward, LAYERS[OP], "forward_backward", inputs, sonicmoe_parameters, sonicmoe_gradients)
    return lambda: run()[1:]


def _engine_unavailable(device: torch.device) -> str | None:
    if (reason := triton_unavailable_reason(device)) is not None:
        return reason
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return "the engine's Gluon kernels need a Hopper GPU (compute capability 9.0)"
    return None


def _preferring(structure: str | None, function):
    """``function`` run with ``structure`` preferred (:func:`moe_lib.moe_experts.structure.preferred`)."""

    def run(*args, **kwargs):
        with preferred(structure):
            return function(*args, **kwargs)

    return run


def _prepare_engine(inputs: dict):
    return _preferring("engine", calling(OP, OPS[OP].function, impl="triton", validate=False)(inputs))


def _ours(save_activations: bool, structure: str | None = None):
    """Our layer's forward, saving the pre-activations for its backward or not, under ``structure``'s preference
    (its backward runs under the same one: the layer keeps it for autograd)."""

    @functools.partial(_preferring, structure)
    def forward(inputs: dict, leaves: dict) -> torch.Tensor:
        return moe_experts(
            leaves["hidden_states"],
            inputs["topk_indices"],
            leaves["topk_weights"],
            leaves["gate_weights"],
            leaves["up_weights"],
            leaves["down_weights"],
            impl="triton",
            validate=False,
            save_activations=save_activations,
        )

    return forward


def _reference_forward(inputs: dict, leaves: dict) -> torch.Tensor:
    return moe_experts(
        leaves["hidden_states"],
        inputs["topk_indices"],
        leaves["topk_weights"],
        leaves["gate_weights"],
        leaves["up_weights"],
        leaves["down_weights"],
        impl="reference",
        validate=False,
    )


def _grouped_mm_layer(inputs: dict, leaves: dict) -> torch.Tensor:
    return grouped_mm_forward(
        leaves["hidden_states"],
        inputs["topk_indices"],
        leaves["topk_weights"],
        leaves["gate_weights"],
        leaves["up_weights"],
        leaves["down_weights"],
    )


for _peer in (
    Peer(
        "reference",
        OP,
        calling(OP, OPS[OP].reference),
        capturable=False,
        baseline=True,
        description="benchmark reference: loop over experts in fp32 (TF32 off)",
    ),
    Peer(
        "grouped_mm",
        OP,
        calling(OP, moe_experts_backward_grouped_mm),
        capturable=False,
        baseline=True,
        description="torch._grouped_mm in bf16 + autograd (argsort/bincount routing)",
        unavailable=_grouped_mm_unavailable,
    ),
    Peer(
        "liger",
        OP,
        _prepare_liger,
        capturable=False,
        baseline=True,
        description="Liger-Kernel 0.8.5 LigerFusedMoEFunction forward + backward",
        unavailable=_liger_unavailable,
    ),
    Peer(
        "triton",
        OP,
        calling(OP, OPS[OP].function, impl="triton", validate=False),
        capturable=True,
        description="moe_lib's Triton kernels",
        unavailable=triton_unavailable_reason,
    ),
    Peer(
        "triton_engine",
        OP,
        _prepare_engine,
        capturable=True,
        description="moe_lib's Triton path, the grouped engine's structure preferred",
        unavailable=_engine_unavailable,
    ),
    Peer(
        "sonicmoe",
        OP,
        _prepare_sonicmoe,
        capturable=False,
        description="SonicMoE forward + backward (CuTe DSL, bf16)",
        unavailable=_sonicmoe_unavailable,
    ),
):
    register(_peer)
del _peer

for _layer_peer in (
    LayerPeer(
        "reference",
        OP,
        _reference_forward,
        capturable=False,
        description="loop over experts in fp32 (TF32 off), the reference backward",
    ),
    LayerPeer(
        "grouped_mm",
        OP,
        _grouped_mm_layer,
        capturable=False,
        baseline=True,
        unavailable=_grouped_mm_unavailable,
        description="torch._grouped_mm in bf16 + autograd (argsort/bincount routing)",
    ),
    LayerPeer(
        "liger",
        OP,
        _liger_forward,
        capturable=False,
        baseline=True,
        unavailable=_liger_unavailable,
        parameters=_liger_parameters,
        gradients=_liger_gradients,
        description="Liger-Kernel LigerFusedMoEFunction, gate‖up held concatenated",
    ),
    LayerPeer(
        "sonicmoe",
        OP,
        sonicmoe_forward,
        capturable=False,
        unavailable=_sonicmoe_unavailable,
        parameters=sonicmoe_parameters,
        gradients=sonicmoe_gradients,
        description="SonicMoE (CuTe DSL, bf16): w1 gate/up interleaved, saves its pre-activations",
    ),
    LayerPeer(
        "triton",
        OP,
        _ours(False),
        capturable=True,
        unavailable=triton_unavailable_reason,
        description="moe_lib.moe_experts: Triton forward, backward recomputing g and u",
    ),
    LayerPeer(
        "triton_saved",
        OP,
        _ours(True),
        capturable=True,
        unavailable=triton_unavailable_reason,
        description="moe_lib.moe_experts(save_activations=True): g and u kept from the forward",
    ),
    LayerPeer(
        "triton_engine",
        OP,
        _ours(False, "engine"),
        capturable=True,
        unavailable=_engine_unavailable,
        description="moe_lib.moe_experts on the grouped engine, its backward recomputing g and u",
    ),
    LayerPeer(
        "triton_engine_saved",
        OP,
        _ours(True, "engine"),
        capturable=True,
        unavailable=_engine_unavailable,
        description="moe_lib.moe_experts(save_activations=True) on the grouped engine: six weight passes",
    ),
):
    register_layer(_layer_peer)
del _layer_peer
