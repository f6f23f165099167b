"""P2's public function, its forward and its differentiable layer, registered with ``torch.library`` as ops.

- :func:`moe_experts_backward`: all routed experts' backward with the forward recomputed inside (the
  benchmark's function): checks, then the reference or the Triton kernels.
- :func:`moe_experts_forward`: y [T, H] for the layers (no checks).
- :func:`moe_experts`: the layer; it saves nothing but its inputs, and its backward recomputes the
  forward, as the benchmark's P2 does. Its forward runs the Triton kernels too where the backward
  does (a grouped GEMM per expert over the routed rows, no host synchronisation).

Ops (``torch.ops.moe_lib.*``, each with a fake implementation for shapes and dtypes): ``moe_experts_backward``
and ``moe_experts`` (the layer's forward, autograd registered; its backward is the first). ``torch.compile`` sees
each as one node, so the layer compiles whole (``fullgraph=True``). The public functions check what metadata
tells (traceable); the checks that read values (expert ids in range and distinct per token, ``check_finite``)
run inside the ops, on their real inputs, in eager and compiled code alike, with the same messages.

NaN and Inf in the inputs are not looked for (that would cost a pass over every input and a host sync):
they flow into the outputs as the arithmetic carries them. ``check_finite=True`` opts into that check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import check_impl, resolve_impl
from ..validation import check_contiguous, finite, flag, float_tensor, not_differentiable_again
from .checks import INPUT_NAMES, check_index_values, check_moe_experts_backward
from .reference import moe_experts_backward_reference, moe_experts_forward_reference
from .structure import preferred, preferred_now
from .weights import stacked_gate_up


def moe_experts_backward(
    grad_output,
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    up_weights,
    down_weights,
    *,
    impl: str = "auto",
    validate: bool = True,
    check_finite: bool = False,
):
    """Backward of all routed SwiGLU experts of one MoE layer (P2), the forward recomputed inside.

    Shapes: grad_output, hidden_states [T, H]; topk_indices [T, K] int64/int32 (K distinct experts
    per token); topk_weights [T, K]; gate_weights, up_weights [E, I, H]; down_weights [E, H, I].
    Returns freshly allocated (grad_hidden_states [T, H], grad_topk_weights [T, K],
    grad_gate_weights [E, I, H], grad_up_weights [E, I, H], grad_down_weights [E, H, I]);
    experts no token chose get exact zeros. ``validate=False`` skips the index-value checks
    (range, duplicates), which need a host sync. NaN/Inf in the inputs pass through unchecked;
    ``check_finite=True`` raises a ``ValueError`` naming the first float input that holds one (a pass over
    every input and one host sync).
    """
    check_impl(impl)
    flag("validate", validate)
    flag("check_finite", check_finite)
    args = (grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    check_moe_experts_backward(*args, validate=False)  # the values: in the op
    if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "triton":
        check_contiguous(dict(zip(INPUT_NAMES, args, strict=True)))
    return torch.ops.moe_lib.moe_experts_backward(*args, impl, validate, check_finite, None, None)


@torch.library.custom_op("moe_lib::moe_experts_backward", mutates_args=())
def _moe_experts_backward_op(
    grad_output: Tensor,
    hidden_states: Tensor,
    topk_indices: Tensor,
    topk_weights: Tensor,
    gate_weights: Tensor,
    up_weights: Tensor,
    down_weights: Tensor,
    impl: str,
    validate: bool,
    check_finite: bool,
    gate_preactivations: Tensor | None,
    up_preactivations: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The op behind :func:`moe_experts_backward` (metadata checked by it): the value checks, then the reference or
    the Triton kernels. The pre-activations (g, u), saved by the layer's Triton forward, are read instead of
    recomputed (only the Triton path has them)."""
    args = (grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    if validate:
        check_index_values(topk_indices, gate_weights.shape[0])
    if check_finite:
        finite(dict(zip(INPUT_NAMES, args, strict=True)))
    if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "reference":
        return moe_experts_backward_reference(*args)
    from .launch import moe_experts_backward_triton  # imports triton: only on this path

    preactivations = None if gate_preactivations is None else (gate_preactivations, up_preactivations)
    return moe_experts_backward_triton(*_contiguous(args, 4), preactivations=preactivations)


@_moe_experts_backward_op.register_fake
def _(grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, *flags):
    return tuple(t.new_empty(t.shape) for t in (hidden_states, topk_weights, gate_weights, up_weights, down_weights))


def _contiguous(tensors: tuple, gate_at: int) -> tuple:
    """The Triton paths address their operands by row-major strides: strided inputs are copied contiguous (the public
    backward refuses them instead), except gate and up weights (at ``gate_at`` and after it) that are the row
    halves of one fused [E, 2I, H] block, which the grouped engine reads as it lies (:mod:`.weights`; the other
    kernels copy them)."""
    fused = stacked_gate_up(tensors[gate_at], tensors[gate_at + 1]) is not None
    return tuple(t if fused and i in (gate_at, gate_at + 1) else t.contiguous() for i, t in enumerate(tensors))


def moe_experts_forward(
    hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, *, impl: str = "auto"
):
    """P2's forward y [T, H] (no validation: for the layers): the Triton kernels where ``impl``
    resolves to Triton (bf16×3 for g and u with fp32 inputs, bf16 products for Wd·a), the reference
    loop over experts otherwise."""
    inputs = (hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "triton":
        from .launch import moe_experts_forward_triton

        return moe_experts_forward_triton(*_contiguous(inputs, 3))
    return moe_experts_forward_reference(*inputs)


def moe_experts(
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    up_weights,
    down_weights,
    *,
    impl: str = "auto",
    validate: bool = True,
    check_finite: bool = False,
    save_activations: bool = False,
):
    """y_t = Σ_k w_tk · Wd_e (silu(Wg_e x_t) ⊙ Wu_e x_t), e = topk_indices[t, k].

    Differentiable in hidden_states, topk_weights and the three expert weight tensors; the backward
    recomputes the forward and runs ``moe_experts_backward(impl=impl)``. With the Triton path the
    forward is :func:`moe_lib.moe_experts.launch.moe_experts_forward_triton` (fp32 inputs: g and u
    from bf16×3 products, Wd·a from bf16 products: relative error ≈ 2e-3).
    Twice differentiable (``create_graph=True``) on the reference path; differentiating the Triton
    path's gradients again raises a ``RuntimeError``. NaN/Inf pass through unchecked;
    ``check_finite=True`` raises a ``ValueError`` naming the first non-finite input (in the backward:
    grad_output and the saved inputs).
    ``save_activations``: the memory/compute choice. False (default) saves nothing but the inputs and
    the backward recomputes g and u; True keeps the pre-activations g and u (2·T·K·I values in the input
    dtype) from the forward, and the backward reads them instead (on the Triton path; the reference
    recomputes either way). The expert weights may be strided (e.g. ``gate_up[:, :I]`` and ``gate_up[:, I:]`` of
    a fused [E, 2I, H] tensor): the grouped engine reads the fused block as it lies, the other Triton kernels copy
    them contiguous. ``torch.compile(fullgraph=True)`` takes it
    whole: forward and backward are one op each.
    """
    check_impl(impl)
    flag("validate", validate)
    flag("check_finite", check_finite)
    flag("save_activations", save_activations)
    float_tensor("hidden_states", hidden_states)  # named as itself, before it stands in for grad_output below
    check_moe_experts_backward(
        hidden_states,
        hidden_states,
        topk_indices,
        topk_weights,
        gate_weights,
        up_weights,
        down_weights,
        validate=False,
    )
    resolve_impl(impl, hidden_states.device, hidden_states.dtype)  # impl="triton" where it cannot run: refused here
    return torch.ops.moe_lib.moe_experts(
        hidden_states.contiguous(),
        topk_indices.contiguous(),
        topk_weights.contiguous(),
        gate_weights,
        up_weights,
        down_weights,
        impl,
        validate,
        check_finite,
        save_activations,
    )[0]


@torch.library.custom_op("moe_lib::moe_experts", mutates_args=())
def _moe_experts_op(
    hidden_states: Tensor,
    topk_indices: Tensor,
    topk_weights: Tensor,
    gate_weights: Tensor,
    up_weights: Tensor,
    down_weights: Tensor,
    impl: str,
    validate: bool,
    check_finite: bool,
    save_activations: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's forward: (y, g, u), the pre-activations g and u [T·K, I] where the Triton path keeps them
    (``save_activations``), else empty [0, I]."""
    inputs = (hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    if validate:
        check_index_values(topk_indices, gate_weights.shape[0])
    if check_finite:
        finite(
            dict(
                hidden_states=hidden_states,
                topk_weights=topk_weights,
                gate_weights=gate_weights,
                up_weights=up_weights,
                down_weights=down_weights,
            )
        )
    if not _keeps_preactivations(impl, hidden_states, save_activations):
        none = hidden_states.new_empty(0, gate_weights.shape[1])
        return moe_experts_forward(*inputs, impl=impl), none, none.clone()
    from .launch import moe_experts_forward_triton

    y, (gate_pre, up_pre) = moe_experts_forward_triton(*_contiguous(inputs, 3), save_preactivations=True)
    return y, gate_pre, up_pre


@_moe_experts_op.register_fake
def _(
    hidden_states,
    topk_indices,
    topk_weights,
    gate_weights,
    up_weights,
    down_weights,
    impl,
    validate,
    check_finite,
    save_activations,
):
    rows = 0
    if _keeps_preactivations(impl, hidden_states, save_activations):  # the kernels' buffers: at least one row
        rows = torch.sym_max(topk_indices.shape[0] * topk_indices.shape[1], 1)
    I = gate_weights.shape[1]
    return (
        hidden_states.new_empty(hidden_states.shape),
        hidden_states.new_empty(rows, I),
        hidden_states.new_empty(rows, I),
    )


def _keeps_preactivations(impl: str, hidden_states, save_activations: bool) -> bool:
    """Whether the forward keeps g and u: asked for, and on the Triton path (the reference recomputes them)."""
    return save_activations and resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "triton"


def _save_for_backward(ctx, inputs, output):
    (
        hidden_states,
        topk_indices,
        topk_weights,
        gate_weights,
        up_weights,
        down_weights,
        impl,
        _,
        check_finite,
        save_activations,
    ) = inputs
    ctx.save_for_backward(
        hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, output[1], output[2]
    )
    ctx.impl, ctx.check_finite = impl, check_finite
    ctx.structure = preferred_now()  # the backward runs the structure the forward ran
    ctx.preactivations = _keeps_preactivations(impl, hidden_states, save_activations)
    # g and u are outputs no loss reaches: without this autograd hands the backward zeros of their [T·K, I] shapes
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_output, _grad_gate_pre, _grad_up_pre):
    hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, gate_pre, up_pre = (
        ctx.saved_tensors
    )
    args = (grad_output.contiguous(), hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    on_triton = resolve_impl(ctx.impl, hidden_states.device, hidden_states.dtype) == "triton"
    if torch.is_grad_enabled() and not on_triton:
        # create_graph=True on the reference path: its PyTorch ops run where autograd sees them, so that the
        # gradients are differentiable again (exactly)
        if ctx.check_finite:
            finite(dict(zip(INPUT_NAMES, args, strict=True)))
        grads = moe_experts_backward_reference(*args)
    else:
        with torch.no_grad(), preferred(ctx.structure):  # the op is opaque to autograd: its gradients are constants
            grads = torch.ops.moe_lib.moe_experts_backward(
                *args,
                ctx.impl,
                False,
                ctx.check_finite,
                gate_pre if ctx.preactivations else None,
                up_pre if ctx.preactivations else None,
            )
    grad_x, grad_w, grad_gate, grad_up, grad_down = grads
    if on_triton:
        depends_on = (grad_output, hidden_states, topk_weights, gate_weights, up_weights, down_weights)
        grad_x, grad_w, grad_gate, grad_up, grad_down = not_differentiable_again(
            (grad_x, grad_w, grad_gate, grad_up, grad_down), depends_on, DOUBLE_BACKWARD_REFUSED
        )
    return grad_x, None, grad_w, grad_gate, grad_up, grad_down, None, None, None, None


torch.library.register_autograd("moe_lib::moe_experts", _backward, setup_context=_save_for_backward)

DOUBLE_BACKWARD_REFUSED = (
    "impl: moe_experts' Triton backward cannot be differentiated again (double backward); "
    "use impl='reference' for higher-order gradients"
)
