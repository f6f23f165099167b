"""Bad input gets a clear error naming the argument, before any work."""

import pytest
import torch

import moe_lib
from moe_lib import problems


def p1_inputs(T=3, **kw):
    return problems.make_inputs("swiglu_down_backward", T, seed=0, hidden_size=16, intermediate_size=8, **kw)


def p2_inputs(T=5, **kw):
    return problems.make_inputs("moe_experts_backward", T, seed=0, hidden_size=16, intermediate_size=8,
                                num_experts=6, top_k=2, **kw)  # fmt: skip


def call_p1(inputs, **kw):
    return moe_lib.swiglu_down_backward(*inputs.values(), **kw)


def call_p2(inputs, **kw):
    return moe_lib.moe_experts_backward(*inputs.values(), **kw)


@pytest.mark.parametrize("name, bad, error, pattern", [
    ("x", lambda t: t[:, :-1], ValueError, r"x: .*\[num_tokens, hidden_size\]|gate_weight"),
    ("grad_output", lambda t: t[:-1], ValueError, "grad_output: expected shape"),
    ("down_weight", lambda t: t.T, ValueError, "down_weight: expected shape"),
    ("gate", lambda t: t[:, :-1], ValueError, "gate: expected shape"),
    ("intermediate", lambda t: t[None], ValueError, "intermediate: expected shape"),
    ("up_weight", lambda t: t.to(torch.int32), TypeError, "up_weight: expected a floating-point"),
    ("up", lambda t: t.float(), TypeError, "up: expected dtype torch.bfloat16"),
    ("gate_sigmoid", lambda t: t.to("meta"), ValueError, "gate_sigmoid: expected device cpu"),
    ("x", lambda t: t.tolist(), TypeError, "x: expected a torch.Tensor"),
])  # fmt: skip
def test_p1_bad_inputs(name, bad, error, pattern):
    inputs = p1_inputs()
    inputs[name] = bad(inputs[name])
    with pytest.raises(error, match=pattern):
        call_p1(inputs)


@pytest.mark.parametrize("name, bad, error, pattern", [
    ("hidden_states", lambda t: t[:, :-1], ValueError, "shape"),
    ("grad_output", lambda t: t[:-1], ValueError, "grad_output: expected shape"),
    ("topk_weights", lambda t: t[:, :1], ValueError, "topk_weights: expected shape"),
    ("topk_indices", lambda t: t.float(), TypeError, "topk_indices: expected dtype torch.int64 or torch.int32"),
    ("topk_indices", lambda t: t[:, None], ValueError, "topk_indices: expected a 2-d tensor"),
    ("gate_weights", lambda t: t[:, :, :-1], ValueError, "gate_weights: expected shape"),
    ("up_weights", lambda t: t[:-1], ValueError, "up_weights: expected shape"),
    ("down_weights", lambda t: t.transpose(1, 2), ValueError, "down_weights: expected shape"),
    ("down_weights", lambda t: t.double(), TypeError, "down_weights: expected dtype torch.float32"),
    ("topk_weights", lambda t: t.half(), TypeError, "topk_weights: expected dtype"),
    ("hidden_states", lambda t: t.long(), TypeError, "hidden_states: expected a floating-point"),
    ("up_weights", lambda t: t.to("meta"), ValueError, "up_weights: expected device cpu"),
])  # fmt: skip
def test_p2_bad_inputs(name, bad, error, pattern):
    inputs = p2_inputs()
    inputs[name] = bad(inputs[name])
    with pytest.raises(error, match=pattern):
        call_p2(inputs)


def test_p2_index_values_checked_unless_validate_false():
    inputs = p2_inputs()
    inputs["topk_indices"][2, 1] = 6
    with pytest.raises(ValueError, match=r"topk_indices: expert index 6 out of range \[0, 6\)"):
        call_p2(inputs)
    inputs["topk_indices"][2, 1] = -1
    with pytest.raises(ValueError, match="topk_indices: expert index -1 out of range"):
        call_p2(inputs)
    inputs = p2_inputs()
    inputs["topk_indices"][3, 1] = inputs["topk_indices"][3, 0]
    with pytest.raises(ValueError, match="topk_indices: token 3 lists the same expert twice"):
        call_p2(inputs)
    # validate=False skips the value checks (they need a host sync); the reference still runs
    call_p2(inputs, validate=False)


def test_top_k_larger_than_experts_is_rejected():
    inputs = p2_inputs()
    inputs["topk_indices"] = torch.zeros((5, 7), dtype=torch.int64)
    inputs["topk_weights"] = torch.ones((5, 7))
    with pytest.raises(ValueError, match="topk_indices: top_k=7 exceeds num_experts=6"):
        call_p2(inputs)


@pytest.mark.parametrize("call, make", [(call_p1, p1_inputs), (call_p2, p2_inputs)])
def test_unknown_impl(call, make):
    with pytest.raises(ValueError, match="impl: expected one of"):
        call(make(), impl="cuda")


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from moe_lib import dispatch

    if not dispatch.triton_importable():
        pytest.skip("no triton")
    with pytest.raises(ValueError, match="impl: 'triton' needs CUDA tensors"):
        call_p1(p1_inputs(), impl="triton")


def test_zero_tokens_returns_shaped_zeros():
    grads = call_p1(p1_inputs(T=0))
    assert [tuple(g.shape) for g in grads] == [(0, 16), (8, 16), (8, 16), (16, 8)]
    assert all(g.dtype == torch.bfloat16 and torch.count_nonzero(g) == 0 for g in grads)
    grads = call_p2(p2_inputs(T=0))
    assert [tuple(g.shape) for g in grads] == [(0, 16), (0, 2), (6, 8, 16), (6, 8, 16), (6, 16, 8)]
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_int32_indices_and_auto_impl_on_cpu():
    inputs = p2_inputs()
    want = call_p2(inputs, impl="reference")
    inputs["topk_indices"] = inputs["topk_indices"].int()
    got = call_p2(inputs)  # auto on CPU is the reference
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_layers_validate_their_inputs():
    inputs = p1_inputs()
    with pytest.raises(ValueError, match="up_weight: expected shape"):
        moe_lib.swiglu_expert(inputs["x"], inputs["gate_weight"], inputs["up_weight"][:-1], inputs["down_weight"])
    p2 = p2_inputs()
    p2["topk_indices"][0, 0] = 99
    with pytest.raises(ValueError, match="topk_indices: expert index 99"):
        moe_lib.moe_experts(*list(p2.values())[1:])
