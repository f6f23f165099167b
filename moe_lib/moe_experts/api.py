"""P2's public function, its forward and its differentiable layer, registered with ``torch.library`` as ops.

- :func:`moe_experts_backward`: all routed experts' backward with the forward recomputed inside (the
  benchmark's function): checks, then the reference or the Triton kernels.
- :func:`moe_experts_forward`: y [T, H] for the layers (no checks).
- :func:`moe_experts`: the layer; by default it saves nothing but its inputs, and its backward recomputes the
  forward, as the benchmark's P2 does. Its forward runs the Triton kernels too where the backward
  does (a grouped GEMM per expert over the routed rows, no host synchronisation). Where the grouped engine
  runs the call, the forward keeps the routing in expert order for the backward (a few kilobytes).
- :func:`moe_experts_gate_up`: the same layer with the gate and up weights fused in one [E, 2I, H] block, as
  models keep them; the block's gradient is written whole.

Ops (``torch.ops.moe_lib.*``, each with a fake implementation for shapes and dtypes): ``moe_experts_backward``,
``moe_experts`` (the layer's forward, autograd registered; its backward is the first), ``moe_experts_gate_up``
and ``moe_experts_backward_gate_up`` likewise. ``torch.compile`` sees each as one node, so the layers compile
whole (``fullgraph=True``). The public functions check what metadata
tells (traceable); the checks that read values (expert ids in range and distinct per token, ``check_finite``)
run inside the ops, on their real inputs, in eager and compiled code alike, with the same messages.

NaN and Inf in the inputs are not looked for (that would cost a pass over every input and a host sync):
they flow into the outputs as the arithmetic carries them. ``check_finite=True`` opts into that check.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..dispatch import check_impl, resolve_impl
from ..validation import check_contiguous, finite, flag, float_tensor, not_differentiable_again
from .checks import INPUT_NAMES, check_index_values, check_moe_experts_backward, check_moe_experts_gate_up
from .reference import moe_experts_backward_reference, moe_experts_forward_reference
from .structure import preferred, preferred_now
from .weights import split_gate_up, stacked_gate_up


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


def _moe_experts_backward_body(
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
    preactivations: Tensor | None,
    routing: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The op behind :func:`moe_experts_backward` (metadata checked by it): the value checks, then the reference or
    the Triton kernels. The pre-activations [g | u] and the routing, kept by the layer's Triton forward, are read
    instead of made again (only the Triton path has them); the backward may write [dg | du] over the pre-activations
    (so the op declares that it mutates them: the layer runs its backward once a forward)."""
    args = (grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    return _backward_of(args, impl, validate, check_finite, preactivations, routing)


_moe_experts_backward_op = torch.library.custom_op(
    "moe_lib::moe_experts_backward", _moe_experts_backward_body, mutates_args=("preactivations",)
)


@_moe_experts_backward_op.register_fake
def _(grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, *flags):
    return tuple(t.new_empty(t.shape) for t in (hidden_states, topk_weights, gate_weights, up_weights, down_weights))


def _backward_of(args, impl, validate, check_finite, preactivations, routing, weight_grads_out=None):
    """Both backward ops' work: the value checks, then the reference or the Triton kernels (the weight gradients
    written into ``weight_grads_out`` where given; ``preactivations`` [g | u] spent: [dg | du] may be written over
    them)."""
    _, hidden_states, topk_indices, _, gate_weights, _, _ = args
    if validate:
        check_index_values(topk_indices, gate_weights.shape[0])
    if check_finite:
        finite(dict(zip(INPUT_NAMES, args, strict=True)))
    if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "reference":
        grads = moe_experts_backward_reference(*args)
        if weight_grads_out is None:
            return grads
        for out, grad in zip(weight_grads_out, grads[2:], strict=True):
            out.copy_(grad)
        return (*grads[:2], *weight_grads_out)
    from .launch import moe_experts_backward_triton  # imports triton: only on this path

    return moe_experts_backward_triton(
        *_contiguous(args, 4),
        preactivations=None if preactivations is None else _halves(preactivations),
        weight_grads_out=weight_grads_out,
        routing=_kept(routing),
        spend_preactivations=True,
    )


def _halves(preactivations: Tensor) -> tuple[Tensor, Tensor]:
    """(g, u): the column halves of the layer's saved pre-activations [rows, 2I]."""
    I = preactivations.shape[1] // 2
    return preactivations[:, :I], preactivations[:, I:]


def _kept(routing: Tensor | None) -> Tensor | None:
    """The routing the layer's forward kept (:func:`.launch.layer_routing`); an empty tensor where it kept none."""
    return None if routing is None or routing.numel() == 0 else routing


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
    recomputes either way) and may write its gradients over them, so one backward a forward: a second
    (``retain_graph=True``) raises a ``RuntimeError``. The expert weights may be strided (e.g.
    ``gate_up[:, :I]`` and ``gate_up[:, I:]`` of a fused [E, 2I, H] tensor): the grouped engine reads the
    fused block as it lies, the other Triton kernels copy them contiguous. ``torch.compile(fullgraph=True)`` takes it
    whole: forward and backward are one op each.
    """
    _check_layer_options(impl, validate, check_finite, save_activations)
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
    return _layer_call(
        "moe_experts",
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


def _moe_experts_body(
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
    """The layer's forward: (y, [g | u], routing): the pre-activations [T·K, 2I] (g's columns, then u's) where the
    Triton path keeps them (``save_activations``), else empty [0, 2I]; the routing in expert order where the grouped
    engine runs the call (:func:`.launch.layer_routing`, int32), else empty."""
    inputs = (hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    return _layer_forward(inputs, impl, validate, check_finite, save_activations)


def _layer_forward(inputs, impl, validate, check_finite, save_activations):
    """Both layer ops' forward: (y, [g | u], routing) of :func:`_moe_experts_op`."""
    hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights = inputs
    if validate:
        check_index_values(topk_indices, gate_weights.shape[0])
    if check_finite:
        finite(dict(zip(INPUT_NAMES[1:], inputs, strict=True)))  # float tensors only
    no_routing = topk_indices.new_empty(0, dtype=torch.int32)
    none = hidden_states.new_empty(0, 2 * gate_weights.shape[1])
    if resolve_impl(impl, hidden_states.device, hidden_states.dtype) != "triton":
        return moe_experts_forward(*inputs, impl=impl), none, no_routing
    from .engine_layer import halves_of_one
    from .launch import layer_routing, moe_experts_forward_triton

    inputs = _contiguous(inputs, 3)
    routing = layer_routing(*inputs[:4])
    if not save_activations:
        y = moe_experts_forward_triton(*inputs, routing=routing)
        return y, none, no_routing if routing is None else routing
    y, (gate_pre, up_pre) = moe_experts_forward_triton(*inputs, save_preactivations=True, routing=routing)
    return y, halves_of_one(gate_pre, up_pre), no_routing if routing is None else routing  # [g | u], one buffer


_moe_experts_op = torch.library.custom_op("moe_lib::moe_experts", _moe_experts_body, mutates_args=())


@_moe_experts_op.register_fake
def _(hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights, impl, validate, *flags):
    return _layer_fake(hidden_states, topk_indices, gate_weights, impl, flags[-1])


def _layer_fake(hidden_states, topk_indices, gate_weights, impl, save_activations):
    """Both layer ops' outputs as fake tensors: y; [g | u] of at least one row where kept; the routing, whose
    length (E + 1 + 3·T·K, or 0 where the kernels route in place) depends on the chosen structure."""
    rows = 0
    if _keeps_preactivations(impl, hidden_states, save_activations):  # the kernels' buffers: at least one row
        rows = torch.sym_max(topk_indices.shape[0] * topk_indices.shape[1], 1)
    I = gate_weights.shape[1]
    routing = 0
    if resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "triton":
        from .launch import layer_routing_size

        routing = layer_routing_size(hidden_states, topk_indices, gate_weights)
    return (
        hidden_states.new_empty(hidden_states.shape),
        hidden_states.new_empty(rows, 2 * I),
        topk_indices.new_empty(routing, dtype=torch.int32),
    )


def moe_experts_gate_up(
    hidden_states,
    topk_indices,
    topk_weights,
    gate_up_weights,
    down_weights,
    *,
    impl: str = "auto",
    validate: bool = True,
    check_finite: bool = False,
    save_activations: bool = False,
):
    """:func:`moe_experts` with the gate and up weights fused in one ``gate_up_weights`` [E, 2I, H]: each expert's I
    gate rows, then its I up rows (Hugging Face's ``gate_up_proj``, :class:`moe_lib.nn.MoEExperts`'). The same
    output and options; the block's gradient is one [E, 2I, H] tensor that the kernels write in place, where the
    gradients of two row-half views would be stacked by autograd (a copy of the block a call)."""
    _check_layer_options(impl, validate, check_finite, save_activations)
    check_moe_experts_gate_up(hidden_states, topk_indices, topk_weights, gate_up_weights, down_weights)
    resolve_impl(impl, hidden_states.device, hidden_states.dtype)  # impl="triton" where it cannot run: refused here
    return _layer_call(
        "moe_experts_gate_up",
        hidden_states.contiguous(),
        topk_indices.contiguous(),
        topk_weights.contiguous(),
        gate_up_weights.contiguous(),
        down_weights,
        impl,
        validate,
        check_finite,
        save_activations,
    )[0]


def _moe_experts_gate_up_body(
    hidden_states: Tensor,
    topk_indices: Tensor,
    topk_weights: Tensor,
    gate_up_weights: Tensor,
    down_weights: Tensor,
    impl: str,
    validate: bool,
    check_finite: bool,
    save_activations: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`moe_experts_gate_up`'s forward: (y, [g | u], routing) as :func:`_moe_experts_op`'s."""
    gate_weights, up_weights = split_gate_up(gate_up_weights)
    inputs = (hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights)
    return _layer_forward(inputs, impl, validate, check_finite, save_activations)


_moe_experts_gate_up_op = torch.library.custom_op(
    "moe_lib::moe_experts_gate_up", _moe_experts_gate_up_body, mutates_args=()
)


@_moe_experts_gate_up_op.register_fake
def _(hidden_states, topk_indices, topk_weights, gate_up_weights, down_weights, impl, validate, *flags):
    return _layer_fake(hidden_states, topk_indices, split_gate_up(gate_up_weights)[0], impl, flags[-1])


def _moe_experts_backward_gate_up_body(
    grad_output: Tensor,
    hidden_states: Tensor,
    topk_indices: Tensor,
    topk_weights: Tensor,
    gate_up_weights: Tensor,
    down_weights: Tensor,
    impl: str,
    validate: bool,
    check_finite: bool,
    preactivations: Tensor | None,
    routing: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`moe_experts_gate_up`'s backward: (grad_hidden_states, grad_topk_weights, grad_gate_up [E, 2I, H],
    grad_down), the block's gradient written whole (its two halves' gradients are its row halves)."""
    if check_finite:
        finite(
            dict(
                grad_output=grad_output,
                hidden_states=hidden_states,
                topk_weights=topk_weights,
                gate_up_weights=gate_up_weights,
                down_weights=down_weights,
            )
        )
    grad_gate_up = torch.empty(gate_up_weights.shape, dtype=gate_up_weights.dtype, device=gate_up_weights.device)
    grad_down = torch.empty(down_weights.shape, dtype=down_weights.dtype, device=down_weights.device)
    weights = (*split_gate_up(gate_up_weights.contiguous()), down_weights)
    args = (grad_output, hidden_states, topk_indices, topk_weights, *weights)
    outs = (*split_gate_up(grad_gate_up), grad_down)
    grad_x, grad_w, *_ = _backward_of(args, impl, validate, False, preactivations, routing, outs)
    return grad_x, grad_w, grad_gate_up, grad_down


_moe_experts_backward_gate_up_op = torch.library.custom_op(
    "moe_lib::moe_experts_backward_gate_up", _moe_experts_backward_gate_up_body, mutates_args=("preactivations",)
)


@_moe_experts_backward_gate_up_op.register_fake
def _(grad_output, hidden_states, topk_indices, topk_weights, gate_up_weights, down_weights, *flags):
    return tuple(t.new_empty(t.shape) for t in (hidden_states, topk_weights, gate_up_weights, down_weights))


def _check_layer_options(impl, validate, check_finite, save_activations) -> None:
    """Both layers' options, each named where it is wrong."""
    check_impl(impl)
    flag("validate", validate)
    flag("check_finite", check_finite)
    flag("save_activations", save_activations)


def _keeps_preactivations(impl: str, hidden_states, save_activations: bool) -> bool:
    """Whether the forward keeps g and u: asked for, and on the Triton path (the reference recomputes them)."""
    return save_activations and resolve_impl(impl, hidden_states.device, hidden_states.dtype) == "triton"


def _save_for_backward(ctx, inputs, output):
    """Both layer ops': their tensor inputs (gate and up weights, or the fused block), [g | u] and the routing."""
    *tensors, impl, _, check_finite, save_activations = inputs
    ctx.save_for_backward(*tensors, *output[1:])
    ctx.impl, ctx.check_finite = impl, check_finite
    ctx.structure = preferred_now()  # the backward runs the structure the forward ran
    ctx.preactivations = _keeps_preactivations(impl, tensors[0], save_activations)
    ctx.spent = False  # set by the backward that spends [g | u]
    # [g | u] and the routing are outputs no loss reaches: without this autograd hands the backward zeros of them
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_output, *_not_reached):
    if ctx.spent:
        raise RuntimeError(SECOND_BACKWARD_REFUSED)
    *inputs, preactivations, routing = ctx.saved_tensors
    fused = len(inputs) == 5  # (x, ids, w, gate_up, down): moe_experts_gate_up
    hidden_states, topk_indices, topk_weights, *weights = inputs
    grad_output = grad_output.contiguous()
    on_triton = resolve_impl(ctx.impl, hidden_states.device, hidden_states.dtype) == "triton"
    if torch.is_grad_enabled() and not on_triton:
        # create_graph=True on the reference path: its PyTorch ops run where autograd sees them, so that the
        # gradients are differentiable again (exactly)
        if fused:
            weights = (*split_gate_up(weights[0]), weights[1])
        args = (grad_output, hidden_states, topk_indices, topk_weights, *weights)
        if ctx.check_finite:
            finite(dict(zip(INPUT_NAMES, args, strict=True)))
        grads = moe_experts_backward_reference(*args)
        if fused:
            grads = (*grads[:2], torch.cat(grads[2:4], dim=1), grads[4])
    else:
        if getattr(ctx, "eager", False):  # the backward op's body, without its dispatch (:class:`_EagerLayer`)
            op = _moe_experts_backward_gate_up_body if fused else _moe_experts_backward_body
        else:  # the op: a node of what torch.compile traces
            op = torch.ops.moe_lib.moe_experts_backward_gate_up if fused else torch.ops.moe_lib.moe_experts_backward
        kept = preactivations if ctx.preactivations else None
        with torch.no_grad(), preferred(ctx.structure):  # the op is opaque to autograd: its gradients are constants
            grads = op(grad_output, *inputs, ctx.impl, False, ctx.check_finite, kept, routing)
        if kept is not None:  # [dg | du] may now lie there: a second backward would read them as g and u
            ctx.spent = True
            torch.autograd.graph.increment_version(kept)  # as the op's dispatch does; its body alone does not
    if on_triton:
        depends_on = (grad_output, hidden_states, topk_weights, *weights)
        grads = not_differentiable_again(grads, depends_on, DOUBLE_BACKWARD_REFUSED)
    grad_x, grad_w, *weight_grads = grads
    return grad_x, None, grad_w, *weight_grads, None, None, None, None


class _EagerLayer(torch.autograd.Function):
    """A layer op's forward and backward for an eager call, without torch's op dispatch: the op's own body, the same
    context and the same backward (:func:`_save_for_backward`, :func:`_backward`), so the same results. The op's
    dispatch and its autograd wrapper cost ~50 µs of host a call, the backward op's as much again
    (notes/p2/host-time.md, "The ops' dispatch"); ``torch.compile`` still sees the op."""

    @staticmethod
    def forward(ctx, body, *inputs):
        output = body(*inputs)
        _save_for_backward(ctx, inputs, output)
        ctx.eager = True
        return output

    @staticmethod
    def backward(ctx, grad_output, *not_reached):
        return None, *_backward(ctx, grad_output, *not_reached)


LAYER_BODIES = {"moe_experts": _moe_experts_body, "moe_experts_gate_up": _moe_experts_gate_up_body}


def _layer_call(name: str, *inputs):
    """The layer op ``name``'s outputs (y, [g | u], routing): the op where ``torch.compile`` traces, else
    :class:`_EagerLayer` with the op's body."""
    if torch.compiler.is_compiling() or not _plain(inputs):
        return getattr(torch.ops.moe_lib, name)(*inputs)
    return _EagerLayer.apply(LAYER_BODIES[name], *inputs)


def _plain(inputs) -> bool:
    """Whether nothing intercepts torch's ops here: no dispatch mode (FakeTensorMode, FlopCounterMode, ...) and plain
    tensors (no subclass, as fake tensors are), so that the op's body may run in its place."""
    if _get_current_dispatch_mode() is not None:
        return False
    return all(type(t) in (Tensor, torch.nn.Parameter) for t in inputs if isinstance(t, Tensor))


torch.library.register_autograd("moe_lib::moe_experts", _backward, setup_context=_save_for_backward)
torch.library.register_autograd("moe_lib::moe_experts_gate_up", _backward, setup_context=_save_for_backward)

SECOND_BACKWARD_REFUSED = (
    "moe_experts: save_activations=True runs one backward a forward: the first wrote its gradients over the saved "
    "pre-activations (retain_graph=True cannot reuse them); call the layer again, or use save_activations=False"
)
DOUBLE_BACKWARD_REFUSED = (
    "impl: moe_experts' Triton backward cannot be differentiated again (double backward); "
    "use impl='reference' for higher-order gradients"
)
