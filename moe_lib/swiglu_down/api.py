"""P1's public function and its differentiable layer, registered with ``torch.library`` as compiler-visible ops.

- :func:`swiglu_down_backward`: the backward of one SwiGLU expert with down projection from its saved
  forward tensors (the benchmark's function): checks, then the reference or the Triton kernels.
- :func:`swiglu_expert`: y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ whose backward runs that function. It saves x,
  gate and up ([T, H] + 2·[T, I]) and recomputes σ(gate), silu(gate) and the intermediate in the
  backward: elementwise work that costs far less than storing and re-reading three more [T, I] tensors.
  On the Triton path that elementwise step is one launch in the forward and one in the backward
  (:func:`.activation.swiglu_activation`), where PyTorch's eager ops take several.

Ops (``torch.ops.moe_lib.*``, each with a fake implementation for shapes and dtypes): ``swiglu_down_backward``,
``swiglu_expert`` (the layer's forward, autograd registered) and ``swiglu_expert_backward`` (its backward).
``torch.compile`` sees each as one node and calls the kernels behind it, so the layer compiles whole
(``fullgraph=True``). The public functions check arguments from metadata alone (traceable), then call the op;
what reads values (``check_finite``) runs inside the op, on real tensors, in eager and compiled code alike.

NaN and Inf in the inputs are not looked for (that would cost a pass over every input and a host sync):
they flow into the outputs as the arithmetic carries them. ``check_finite=True`` opts into that check.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import check_impl, resolve_impl
from ..precision import compute_dtype
from ..validation import check_contiguous, finite, flag, not_differentiable_again
from .checks import INPUT_NAMES, check_precision, check_swiglu_down_backward, check_swiglu_expert
from .reference import swiglu_down_backward_reference


def swiglu_down_backward(
    grad_output,
    x,
    gate_weight,
    up_weight,
    down_weight,
    gate,
    gate_sigmoid,
    gate_silu,
    up,
    intermediate,
    *,
    impl: str = "auto",
    validate: bool = True,
    precision: str = "faithful",
    check_finite: bool = False,
):
    """Backward of one SwiGLU expert with down projection (P1) from its saved forward tensors.

    Shapes: grad_output, x [T, H]; gate_weight, up_weight [I, H]; down_weight [H, I];
    gate, gate_sigmoid, gate_silu, up, intermediate [T, I]; all one float dtype and device.
    Returns freshly allocated (grad_x [T, H], grad_gate_weight [I, H], grad_up_weight [I, H],
    grad_down_weight [H, I]) in the input dtype. ``validate`` is accepted for symmetry with P2:
    P1 has no index values to check, so every check here reads metadata only.
    ``precision`` (Triton path, 16-bit inputs): "faithful" (default) keeps dGate and dUp to about 16
    significant bits, as the benchmark's fp32 reference does, so the outputs pass its element rule on
    inputs of any scale; "fast" rounds them to the input dtype first (as torch.compile does), at about
    half the tensor work of the dx, dWg and dWu products. The design follows the shape, the dtype and the
    device (:func:`.choose.choose_design`, whose docstring lists the rules): one launch for few tokens, then on a
    Hopper GPU two TMA-fed Gluon launches, cuBLAS's GEMMs around one Triton pass for the fast path, and portable
    Triton launches where neither runs.
    NaN/Inf in the inputs pass through unchecked; ``check_finite=True`` raises a ``ValueError`` naming the
    first input that holds one (a pass over every input and one host sync).
    """
    check_impl(impl)
    check_precision(precision)
    flag("check_finite", check_finite)
    args = (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate)
    check_swiglu_down_backward(*args)
    if resolve_impl(impl, x.device, x.dtype) == "triton":
        check_contiguous(dict(zip(INPUT_NAMES, args, strict=True)))
    return _unstacked(torch.ops.moe_lib.swiglu_down_backward(*args, impl, precision, check_finite))


def _unstacked(grads: tuple) -> tuple:
    """(grad_x, grad_gate_up [2I, H], grad_down) → (grad_x, grad_gate, grad_up, grad_down), the middle two
    the row halves of grad_gate_up (views)."""
    grad_x, grad_gate_up, grad_down = grads
    I = grad_gate_up.shape[0] // 2
    return grad_x, grad_gate_up[:I], grad_gate_up[I:], grad_down


# The ops return dWg and dWu stacked as one [2I, H] tensor, as the Triton path computes them: an op's outputs may
# not alias each other, and the public functions hand out its two row halves.
@torch.library.custom_op("moe_lib::swiglu_down_backward", mutates_args=())
def _swiglu_down_backward_op(
    grad_output: Tensor,
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate: Tensor,
    gate_sigmoid: Tensor,
    gate_silu: Tensor,
    up: Tensor,
    intermediate: Tensor,
    impl: str,
    precision: str,
    check_finite: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The op behind :func:`swiglu_down_backward` (arguments checked by it): (grad_x, [dWg; dWu], dWd)."""
    args = (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate)
    if check_finite:
        finite(dict(zip(INPUT_NAMES, args, strict=True)))
    if resolve_impl(impl, x.device, x.dtype) == "reference":
        grad_x, grad_gate, grad_up, grad_down = swiglu_down_backward_reference(*args)
        return grad_x, torch.cat([grad_gate, grad_up]), grad_down
    from .backward import swiglu_down_backward_triton  # imports triton: only on this path

    grad_x, grad_gate, grad_up, grad_down = swiglu_down_backward_triton(*args, precision=precision)
    return grad_x, _stacked(grad_gate, grad_up), grad_down


def _stacked(grad_gate: Tensor, grad_up: Tensor) -> Tensor:
    """[grad_gate; grad_up] as one [2I, H] tensor: the one they are the row halves of where they are (the Triton
    path allocates them so), else a copy."""
    base = grad_gate._base
    whole = (grad_gate.shape[0] + grad_up.shape[0], *grad_gate.shape[1:])
    if (
        base is not None
        and base is grad_up._base
        and base.shape == whole
        and base.is_contiguous()
        and grad_gate.data_ptr() == base.data_ptr()
        and grad_up.data_ptr() == base[grad_gate.shape[0] :].data_ptr()
    ):
        return base
    return torch.cat([grad_gate, grad_up])


@_swiglu_down_backward_op.register_fake
def _(grad_output, x, gate_weight, up_weight, down_weight, *saved_and_flags):
    return _stacked_gradients_like(x, gate_weight, down_weight)


def _stacked_gradients_like(x, gate_weight, down_weight) -> tuple:
    I, H = gate_weight.shape
    return x.new_empty(x.shape), x.new_empty(2 * I, H), x.new_empty(down_weight.shape)


def swiglu_expert(
    x, gate_weight, up_weight, down_weight, *, impl: str = "auto", precision: str = "fast", check_finite: bool = False
):
    """y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ for x [..., H], gate/up weights [I, H], down weight [H, I].

    Differentiable in all four arguments; the backward runs ``swiglu_down_backward(impl=impl,
    precision=precision)``: "fast" by default, as training frameworks round the intermediate gradients.
    Twice differentiable (``create_graph=True``) on the reference path; differentiating the Triton
    path's gradients again raises a ``RuntimeError``. NaN/Inf pass through unchecked;
    ``check_finite=True`` raises a ``ValueError`` naming the first non-finite input (in the backward:
    grad_output and the saved tensors). Passing ``gate_weight`` and ``up_weight`` as the two row halves of one
    [2I, H] tensor (``w[:I]``, ``w[I:]``) spares the fast backward a copy of both per call.
    ``torch.compile(fullgraph=True)`` takes it whole: forward and backward are one op each.
    """
    check_impl(impl)
    check_precision(precision)
    flag("check_finite", check_finite)
    check_swiglu_expert(x, gate_weight, up_weight, down_weight)
    if resolve_impl(impl, x.device, x.dtype) == "triton":  # (impl="triton" where it cannot run: refused there)
        check_contiguous(dict(gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight))
    lead, H = x.shape[:-1], x.shape[-1]
    y = torch.ops.moe_lib.swiglu_expert(
        x.reshape(-1, H).contiguous(), gate_weight, up_weight, down_weight, impl, precision, check_finite
    )[0]
    return y.reshape(*lead, H)


@torch.library.custom_op("moe_lib::swiglu_expert", mutates_args=())
def _swiglu_expert_op(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    impl: str,
    precision: str,
    check_finite: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's forward on x [T, H]: (y, gate, up), gate and up saved for the backward."""
    if check_finite:
        finite(dict(x=x, gate_weight=gate_weight, up_weight=up_weight, down_weight=down_weight))
    gate = x @ gate_weight.T
    up = x @ up_weight.T
    if resolve_impl(impl, x.device, x.dtype) == "triton":  # one launch for the elementwise step
        from .activation import swiglu_activation  # imports triton: only on this path

        intermediate = swiglu_activation(gate, up, with_saved=False)
    else:
        intermediate = _swiglu_saved(gate, up)[2]
    return intermediate @ down_weight.T, gate, up


@_swiglu_expert_op.register_fake
def _(x, gate_weight, up_weight, down_weight, impl, precision, check_finite):
    T, I = x.shape[0], gate_weight.shape[0]
    return x.new_empty(T, down_weight.shape[0]), x.new_empty(T, I), x.new_empty(T, I)


@torch.library.custom_op("moe_lib::swiglu_expert_backward", mutates_args=())
def _swiglu_expert_backward_op(
    grad_output: Tensor,
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate: Tensor,
    up: Tensor,
    impl: str,
    precision: str,
    check_finite: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The layer's backward: σ(gate), silu(gate) and the intermediate recomputed, then P1's backward."""
    if resolve_impl(impl, x.device, x.dtype) == "triton":  # the saved tensors in one launch
        from .activation import swiglu_activation

        gate_sigmoid, gate_silu, intermediate = swiglu_activation(gate, up, with_saved=True)
    else:
        gate_sigmoid, gate_silu, intermediate = _swiglu_saved(gate, up)
    args = (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate)
    return _swiglu_down_backward_op(*args, impl, precision, check_finite)


@_swiglu_expert_backward_op.register_fake
def _(grad_output, x, gate_weight, up_weight, down_weight, *saved_and_flags):
    return _stacked_gradients_like(x, gate_weight, down_weight)


def _save_for_backward(ctx, inputs, output):
    x, gate_weight, up_weight, down_weight, impl, precision, check_finite = inputs
    ctx.save_for_backward(x, gate_weight, up_weight, down_weight, output[1], output[2])
    ctx.impl, ctx.precision, ctx.check_finite = impl, precision, check_finite
    # the saved outputs are reached by no loss: without this autograd hands the backward zeros of their shapes
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_output, _grad_gate, _grad_up):
    x, gate_weight, up_weight, down_weight, gate, up = ctx.saved_tensors
    grad_output = grad_output.contiguous()
    on_triton = resolve_impl(ctx.impl, x.device, x.dtype) == "triton"
    if torch.is_grad_enabled() and not on_triton:
        # create_graph=True on the reference path: the reference's PyTorch ops run where autograd sees them, gate
        # and up recomputed too, so that the gradients are differentiable again (exactly)
        gate, up = x @ gate_weight.T, x @ up_weight.T
        gate_sigmoid, gate_silu, intermediate = _swiglu_saved(gate, up)
        args = (grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate)
        if ctx.check_finite:
            finite(dict(zip(INPUT_NAMES, args, strict=True)))
        return (*swiglu_down_backward_reference(*args), None, None, None)
    with torch.no_grad():  # the op is opaque to autograd: its gradients are constants to it
        grads = torch.ops.moe_lib.swiglu_expert_backward(
            grad_output, x, gate_weight, up_weight, down_weight, gate, up, ctx.impl, ctx.precision, ctx.check_finite
        )
    grads = _unstacked(grads)
    if on_triton:
        grads = not_differentiable_again(
            grads, (grad_output, x, gate_weight, up_weight, down_weight), DOUBLE_BACKWARD_REFUSED
        )
    return (*grads, None, None, None)


torch.library.register_autograd("moe_lib::swiglu_expert", _backward, setup_context=_save_for_backward)

DOUBLE_BACKWARD_REFUSED = (
    "impl: swiglu_expert's Triton backward cannot be differentiated again (double backward); "
    "use impl='reference' for higher-order gradients"
)


def _swiglu_saved(gate, up):
    """σ(gate), silu(gate) and the intermediate as the benchmark's forward rounds them."""
    f = compute_dtype(gate.dtype)
    gate_sigmoid = torch.sigmoid(gate.to(f)).to(gate.dtype)
    gate_silu = gate * gate_sigmoid
    return gate_sigmoid, gate_silu, gate_silu * up
