"""The layers' eager path (``moe_lib/moe_experts/api.py``, ``_EagerLayer``): the op's own body and backward without
torch's op dispatch, giving the bits the op gives (reference path on CPU; the engine's twins under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from moe_lib import moe_experts, moe_experts_gate_up, problems

LEAVES = ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")


def layer_inputs(dtype, seed) -> dict:
    inputs = problems.make_inputs(
        "moe_experts_backward", 13, seed=seed, hidden_size=64, intermediate_size=64, num_experts=5, top_k=2
    )
    for name in ("grad_output", *LEAVES):
        inputs[name] = inputs[name].to(dtype)
    return inputs


def step(inputs, call, fused: bool):
    """y and the gradients of the leaves (the fused block's where ``fused``) of one call's forward + backward."""
    leaves = {name: inputs[name].detach().clone().requires_grad_() for name in LEAVES}
    if fused:
        gate_up = torch.cat([leaves["gate_weights"], leaves["up_weights"]], dim=1).detach().requires_grad_()
        weights, wanted = (gate_up, leaves["down_weights"]), [gate_up, leaves["down_weights"]]
    else:
        weights = tuple(leaves[name] for name in ("gate_weights", "up_weights", "down_weights"))
        wanted = list(weights)
    x, w = leaves["hidden_states"], leaves["topk_weights"]
    y = call(x, inputs["topk_indices"], w, *weights)
    grads = torch.autograd.grad(y, [x, w, *wanted], inputs["grad_output"])
    return y, grads


@pytest.mark.parametrize("fused", [False, True], ids=["three_weights", "gate_up_block"])
@pytest.mark.parametrize("save", [False, True], ids=["recomputed", "saved"])
@pytest.mark.parametrize(("impl", "dtype"), [("reference", torch.float32), ("triton", torch.bfloat16)])
def test_eager_path_gives_the_ops_bits(impl, dtype, save, fused, seed, nan_workspaces):
    inputs = layer_inputs(dtype, seed)
    public = moe_experts_gate_up if fused else moe_experts
    op = torch.ops.moe_lib.moe_experts_gate_up if fused else torch.ops.moe_lib.moe_experts

    def eager(*args):
        return public(*args, impl=impl, validate=False, save_activations=save)

    def through_op(*args):
        return op(*args, impl, False, False, save)[0]

    y_eager, grads_eager = step(inputs, eager, fused)
    y_op, grads_op = step(inputs, through_op, fused)
    assert type(y_eager.grad_fn).__name__ == "_EagerLayerBackward"
    assert "_EagerLayer" not in type(y_op.grad_fn).__name__
    assert torch.isfinite(y_eager).all() and torch.equal(y_eager, y_op)
    for got, want in zip(grads_eager, grads_op, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)


def test_under_a_dispatch_mode_the_op_runs(seed):
    """A dispatch mode (here torch's FLOP counter) sees the layer's op as one call, not its body's ops."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs = layer_inputs(torch.float32, seed)
    x = inputs["hidden_states"].detach().requires_grad_()
    weights = [inputs[name] for name in ("gate_weights", "up_weights", "down_weights")]
    with FlopCounterMode(display=False) as counter:
        y = moe_experts(x, inputs["topk_indices"], inputs["topk_weights"], *weights, impl="reference", validate=False)
    assert "_EagerLayer" not in type(y.grad_fn).__name__
    assert "mm" not in str(counter.get_flop_counts())  # the op is opaque to the counter: no matmul of its body


def test_eager_triton_backward_cannot_be_differentiated_again(seed):
    """As through the op: the Triton path's gradients refuse a second differentiation, naming the way out."""
    inputs = layer_inputs(torch.bfloat16, seed)
    x = inputs["hidden_states"].detach().requires_grad_()
    weights = [inputs[name] for name in ("gate_weights", "up_weights", "down_weights")]
    y = moe_experts(x, inputs["topk_indices"], inputs["topk_weights"], *weights, impl="triton", validate=False)
    (grad_x,) = torch.autograd.grad(y, [x], inputs["grad_output"], create_graph=True)
    with pytest.raises(RuntimeError, match="impl='reference'"):
        torch.autograd.grad(grad_x.sum(), [x])


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["three_weights", "gate_up_block"])
def test_gpu_eager_path_gives_the_ops_bits_on_the_engine(fused, seed):
    """At a fine-grained model's shape (the grouped engine runs the call), pre-activations saved."""
    inputs = problems.make_inputs(
        "moe_experts_backward", 512, seed=seed, device="cuda", hidden_size=2048, intermediate_size=768, num_experts=16,
        top_k=8,
    )  # fmt: skip
    for name in ("grad_output", *LEAVES):
        inputs[name] = inputs[name].to(torch.bfloat16)
    public = moe_experts_gate_up if fused else moe_experts
    op = torch.ops.moe_lib.moe_experts_gate_up if fused else torch.ops.moe_lib.moe_experts
    y_eager, grads_eager = step(inputs, lambda *a: public(*a, validate=False, save_activations=True), fused)
    y_op, grads_op = step(inputs, lambda *a: op(*a, "auto", False, False, True)[0], fused)
    assert type(y_eager.grad_fn).__name__ == "_EagerLayerBackward"
    assert torch.isfinite(y_eager).all() and torch.equal(y_eager, y_op)
    for got, want in zip(grads_eager, grads_op, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)
