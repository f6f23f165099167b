"""Bad input gets a clear error naming the argument, before any work."""

import inspect
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import moe_lib
from moe_lib import dispatch, problems


def p1_inputs(T=3, **kw):
    return problems.make_inputs("swiglu_down_backward", T, seed=0, hidden_size=16, intermediate_size=8, **kw)


def p2_inputs(T=5, **kw):
    return problems.make_inputs(
        "moe_experts_backward", T, seed=0, hidden_size=16, intermediate_size=8, num_experts=6, top_k=2, **kw
    )


def call_p1(inputs, **kw):
    return moe_lib.swiglu_down_backward(*inputs.values(), **kw)


def call_p2(inputs, **kw):
    return moe_lib.moe_experts_backward(*inputs.values(), **kw)


@pytest.mark.parametrize(
    "name, bad, error, pattern",
    [
        ("x", lambda t: t[:, :-1], ValueError, r"x: .*\[num_tokens, hidden_size\]|gate_weight"),
        ("grad_output", lambda t: t[:-1], ValueError, "grad_output: expected shape"),
        ("down_weight", lambda t: t.T, ValueError, "down_weight: expected shape"),
        ("gate", lambda t: t[:, :-1], ValueError, "gate: expected shape"),
        ("intermediate", lambda t: t[None], ValueError, "intermediate: expected shape"),
        ("up_weight", lambda t: t.to(torch.int32), TypeError, "up_weight: expected a floating-point"),
        ("up", lambda t: t.float(), TypeError, "up: expected dtype torch.bfloat16"),
        ("gate_sigmoid", lambda t: t.to("meta"), ValueError, "gate_sigmoid: expected device cpu"),
        ("x", lambda t: t.tolist(), TypeError, "x: expected a torch.Tensor"),
    ],
)
def test_p1_bad_inputs(name, bad, error, pattern):
    inputs = p1_inputs()
    inputs[name] = bad(inputs[name])
    with pytest.raises(error, match=pattern):
        call_p1(inputs)


@pytest.mark.parametrize(
    "name, bad, error, pattern",
    [
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
    ],
)
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
    gate_up = _gate_up_inputs()
    with pytest.raises(ValueError, match=r"^gate_up_weights: expected shape \[num_experts=6, 2·intermediate_size=16"):
        moe_lib.moe_experts_gate_up(**dict(gate_up, gate_up_weights=gate_up["gate_up_weights"][:, 1:]))


# ------------------------------------------------------------------------------------------------
# every tensor argument of every public function × every way it can be wrong, on both paths

P1_NAME, P2_NAME = "swiglu_down_backward", "moe_experts_backward"


def _p2_parallel_inputs():
    p2 = p2_inputs()
    return dict(
        hidden_states=p2["hidden_states"],
        topk_indices=p2["topk_indices"],
        topk_weights=p2["topk_weights"],
        local_gate_weights=p2["gate_weights"],
        local_up_weights=p2["up_weights"],
        local_down_weights=p2["down_weights"],
    )


def _gate_up_inputs():
    p2 = _layer_inputs(p2_inputs, moe_lib.moe_experts)
    gate_up = torch.cat((p2.pop("gate_weights"), p2.pop("up_weights")), dim=1)
    return dict(p2, gate_up_weights=gate_up, down_weights=p2.pop("down_weights"))


def _layer_inputs(make, function):
    """The inputs of a layer: those of its backward that its signature names."""
    inputs = make()
    return {name: inputs[name] for name in _tensor_parameters(function)}


def _tensor_parameters(function) -> list[str]:
    """The positional parameters of a public function: its tensor arguments."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds]


def _parallel(**kw):
    from moe_lib.distributed import moe_experts_parallel

    return moe_experts_parallel(**kw, num_experts=6)


# name -> (the function, its inputs, the arguments taking any leading dimensions, whether the Triton path needs
# contiguous tensors)
FUNCTIONS = {
    "swiglu_down_backward": (lambda **kw: moe_lib.swiglu_down_backward(**kw), p1_inputs, (), True),
    "swiglu_expert": (
        lambda **kw: moe_lib.swiglu_expert(**kw),
        lambda: _layer_inputs(p1_inputs, moe_lib.swiglu_expert),
        ("x",),
        True,
    ),
    "moe_experts_backward": (lambda **kw: moe_lib.moe_experts_backward(**kw), p2_inputs, (), True),
    "moe_experts": (
        lambda **kw: moe_lib.moe_experts(**kw),
        lambda: _layer_inputs(p2_inputs, moe_lib.moe_experts),
        (),
        True,
    ),
    "moe_experts_gate_up": (lambda **kw: moe_lib.moe_experts_gate_up(**kw), _gate_up_inputs, (), True),
    "moe_experts_parallel": (_parallel, _p2_parallel_inputs, (), False),
}
INDEX_ARGUMENTS = ("topk_indices",)


def test_the_tables_are_the_definitions_and_the_signatures():
    """Each op's table lists the definition's inputs, in its order, with its shapes and dtype kinds; the public
    functions take exactly those tensors."""
    from moe_lib.distributed import moe_experts_parallel
    from moe_lib.moe_experts import checks as p2_checks
    from moe_lib.swiglu_down import checks as p1_checks
    from moe_lib.validation import ANY_LEADING, INDEX

    for problem, table in (
        (P1_NAME, p1_checks.BACKWARD_ARGUMENTS),
        (P2_NAME, p2_checks.BACKWARD_ARGUMENTS),
        ("moe_experts_backward_bf16", p2_checks.BACKWARD_ARGUMENTS),
    ):
        definition = problems.load(problem).inputs
        assert [a.name for a in table] == list(definition), problem
        assert {a.name: list(a.axes) for a in table} == {n: spec["shape"] for n, spec in definition.items()}, problem
        assert {a.name for a in table if a.dtype == INDEX} == {
            n for n, spec in definition.items() if not problems.DTYPES[spec["dtype"]].is_floating_point
        }, problem
    assert _tensor_parameters(moe_lib.swiglu_down_backward) == list(p1_checks.INPUT_NAMES)
    assert _tensor_parameters(moe_lib.moe_experts_backward) == list(p2_checks.INPUT_NAMES)
    assert _tensor_parameters(moe_lib.swiglu_expert) == [a.name for a in p1_checks.LAYER_ARGUMENTS]
    assert p1_checks.LAYER_ARGUMENTS[0].axes == (ANY_LEADING, "hidden_size")
    assert _tensor_parameters(moe_lib.moe_experts) == list(p2_checks.INPUT_NAMES[1:])
    assert _tensor_parameters(moe_experts_parallel) == [a.name for a in p2_checks.PARALLEL_ARGUMENTS]
    assert _tensor_parameters(moe_lib.moe_experts_gate_up) == [a.name for a in p2_checks.GATE_UP_ARGUMENTS]


def _wrongs(function: str) -> list:
    """(function, argument, wrongness) for every tensor argument of ``function`` (its signature's) and every way
    it can be wrong: not a tensor, a dtype of the wrong kind, another dtype, one dimension more or fewer, each
    dimension one shorter, on another device, not contiguous."""
    _, make, leading, _ = FUNCTIONS[function]
    inputs = make()
    cases = []
    for name in inputs:
        ways = ["not_a_tensor", "wrong_kind", "other_dtype", "other_device", "not_contiguous"]
        if name not in leading:  # x [..., H] takes any leading dimensions
            ways += ["one_more_dim", "one_fewer_dim"]
        first = 1 if name in leading else 0
        ways += [f"dim_{d}_shorter" for d in range(first, inputs[name].dim())]
        cases += [pytest.param(function, name, way, id=f"{function}-{name}-{way}") for way in ways]
    return cases


def _wronged(t: torch.Tensor, way: str, index: bool, float_dtype: torch.dtype):
    """``t`` made wrong in ``way``, and the error and message pattern that must name it."""
    if way == "not_a_tensor":
        return t.tolist(), TypeError, r"^{name}: expected a torch\.Tensor"
    if way == "wrong_kind":
        if index:
            return t.float(), TypeError, r"^{name}: expected dtype torch\.int64 or torch\.int32"
        return t.to(torch.int32), TypeError, "^{name}: expected a floating-point tensor"
    if way == "other_dtype":
        other = torch.int16 if index else torch.float64 if float_dtype != torch.float64 else torch.float32
        return t.to(other), TypeError, r"^{name}: expected dtype|\(the dtype of {name}\)"
    if way == "other_device":
        return t.to("meta"), ValueError, r"^{name}: expected device|\(the device of {name}\)"
    if way == "not_contiguous":
        wide = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2], ValueError, "^{name}: expected a contiguous tensor"
    if way == "one_more_dim":
        return t[None], ValueError, "^{name}: expected"
    if way == "one_fewer_dim":
        return t[0], ValueError, "^{name}: expected"
    dim = int(way.split("_")[1])
    return t.narrow(dim, 0, t.shape[dim] - 1), ValueError, r"^{name}: expected shape|from {name}\)"


class _NoWork(TorchDispatchMode):
    """Fails any tensor operation: the checks read metadata only, and must refuse before any work."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} ran before the argument checks refused the call")


needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not dispatch.interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)


LAYERS = ("swiglu_expert", "moe_experts", "moe_experts_gate_up")


def _impls(function: str, way: str) -> list:
    return [pytest.param("reference"), pytest.param("triton", marks=[needs_triton])]


@pytest.mark.parametrize(
    "function, name, way, impl",
    [
        pytest.param(*case.values, impl, marks=[*case.marks, *param.marks], id=f"{case.id}-{impl}")
        for function in FUNCTIONS
        for case in _wrongs(function)
        for param in _impls(function, case.values[2])
        for impl in param.values
    ],
)
def test_every_argument_of_every_public_function_is_checked(function, name, way, impl):
    """The named TypeError/ValueError, before any tensor operation (no kernel, no allocation). Tensors of other
    strides: the reference takes them (and gives what it gives for contiguous ones), the Triton path refuses
    them by name; the layers either refuse them by name (in their forward or backward) or get them right."""
    call, make, _, triton_needs_contiguous = FUNCTIONS[function]
    inputs = make()
    float_dtype = next(t.dtype for t in inputs.values() if t.is_floating_point())
    bad, error, pattern = _wronged(inputs[name], way, name in INDEX_ARGUMENTS, float_dtype)
    pattern = pattern.format(name=re.escape(name))
    if way == "not_contiguous" and function == "moe_experts_parallel":
        return  # it makes its tensors contiguous itself; running it needs a process group
    if way == "not_contiguous" and (impl == "reference" or function in LAYERS):
        want = list(_steps(call, inputs, impl))
        try:
            for got, expected in zip(_steps(call, dict(inputs, **{name: bad}), impl), want, strict=True):
                torch.testing.assert_close(got, expected)  # the forward before its backward runs
        except ValueError as exc:
            assert impl == "triton" and re.search(pattern, str(exc)), exc
        return
    with _NoWork(), pytest.raises(error, match=pattern):
        call(**dict(inputs, **{name: bad}), impl=impl)


def _steps(call, inputs: dict, impl: str):
    """Yields the outputs of ``call``, then for a layer (one output) the gradients of its float inputs."""
    leaves = {name: t.detach().requires_grad_(t.is_floating_point()) for name, t in inputs.items()}  # strides kept
    out = call(**leaves, impl=impl)
    yield out
    if not isinstance(out, tuple):
        out.backward(torch.ones_like(out))
        yield [leaf.grad for leaf in leaves.values() if leaf.is_floating_point()]
