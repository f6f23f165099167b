"""What the layers keep between calls to spare host time (notes/p2/host-time.md) answers as made afresh.

- :func:`moe_lib.validation.check_arguments`' one-pass acceptance of valid arguments accepts exactly what its
  step-by-step checks accept, with the same sizes; what it refuses is named by those steps, with their messages.
- :func:`moe_lib.moe_experts.choose.choose` and :func:`moe_lib.moe_experts.launch.launch_plan`, kept per arguments,
  give what they compute afresh; a plan handed out is the caller's own dict.
- :func:`moe_lib.moe_experts.routing.route_by_expert` with its kept expert ids routes as an argsort does.
"""

import random

import pytest
import torch

from moe_lib import validation
from moe_lib.moe_experts import choose as choose_module
from moe_lib.moe_experts import launch
from moe_lib.moe_experts.checks import BACKWARD_ARGUMENTS, INPUT_NAMES, SIZES_FROM
from moe_lib.moe_experts.config import LaunchConfig
from moe_lib.moe_experts.routing import expert_ids, route_by_expert
from moe_lib.moe_experts.runtime import Target
from moe_lib.swiglu_down.checks import LAYER_ARGUMENTS
from moe_lib.swiglu_down.checks import SIZES_FROM as P1_SIZES_FROM


def _outcome(table, values, sizes_from, *, compiling: bool, monkeypatch):
    """check_arguments' answer: ("sizes", dict) or (error type, message); ``compiling`` forces the step-by-step
    checks (as while torch.compile traces)."""
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: compiling)
        try:
            return "sizes", validation.check_arguments(table, values, sizes_from)
        except (TypeError, ValueError) as error:
            return type(error).__name__, str(error)


def _p2_values(rng: random.Random, dtype) -> dict:
    T, H, I, E, K = rng.randint(0, 6), rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 6), rng.randint(1, 3)
    shapes = ((T, H), (T, H), (T, K), (T, K), (E, I, H), (E, I, H), (E, H, I))
    values = {name: torch.randn(shape).to(dtype) for name, shape in zip(INPUT_NAMES, shapes, strict=True)}
    values["topk_indices"] = torch.randint(0, E, (T, K))
    if rng.random() < 0.5:
        values["topk_weights"] = values["topk_weights"].float()  # a router's fp32 weights beside 16-bit inputs
    return values


def _spoiled(rng: random.Random, values: dict) -> dict:
    """``values`` with one argument changed in one way the checks look at (or, at times, none)."""
    values = dict(values)
    name = rng.choice(list(values))
    t = values[name]
    change = rng.choice(["none", "dtype", "int", "shape", "rank", "device", "not a tensor", "half", "f64"])
    if change == "dtype":
        values[name] = t.to(torch.float16 if t.dtype != torch.float16 else torch.bfloat16)
    elif change == "int":
        values[name] = t.to(torch.int32 if t.dtype != torch.int32 else torch.int16)
    elif change == "shape" and t.dim():
        axis = rng.randrange(t.dim())
        values[name] = torch.cat([t, t.narrow(axis, 0, min(1, t.shape[axis]))], dim=axis) if t.numel() else t[None]
    elif change == "rank":
        values[name] = t[None] if rng.random() < 0.5 else t.reshape(-1)
    elif change == "device":
        values[name] = t.to("meta")
    elif change == "not a tensor":
        values[name] = t.tolist()
    elif change == "half":
        values[name] = t.half()
    elif change == "f64":
        values[name] = t.double()
    return values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_pass_acceptance_agrees_with_the_steps_on_p2(dtype, monkeypatch):
    rng = random.Random()
    for _ in range(150):
        values = _spoiled(rng, _p2_values(rng, dtype))
        eager = _outcome(BACKWARD_ARGUMENTS, values, SIZES_FROM, compiling=False, monkeypatch=monkeypatch)
        steps = _outcome(BACKWARD_ARGUMENTS, values, SIZES_FROM, compiling=True, monkeypatch=monkeypatch)
        assert eager == steps, {name: getattr(v, "shape", v) for name, v in values.items()}


def test_one_pass_acceptance_agrees_with_the_steps_on_leading_axes(monkeypatch):
    rng = random.Random()
    for _ in range(150):
        lead = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 3)))
        H, I = rng.randint(1, 8), rng.randint(1, 8)
        values = dict(x=torch.randn(*lead, H), gate_weight=torch.randn(I, H), up_weight=torch.randn(I, H))
        values["down_weight"] = torch.randn(H, I)
        values = _spoiled(rng, values)
        eager = _outcome(LAYER_ARGUMENTS, values, P1_SIZES_FROM, compiling=False, monkeypatch=monkeypatch)
        steps = _outcome(LAYER_ARGUMENTS, values, P1_SIZES_FROM, compiling=True, monkeypatch=monkeypatch)
        assert eager == steps


def test_a_table_made_anew_gets_its_own_plan(monkeypatch):
    """The plans are kept by the table's identity: a new table (even at a reused address) is planned anew."""
    values = dict(a=torch.randn(3, 4), b=torch.randn(4, 5))
    answers = []
    for first in ("n", "m"):  # b's first axis: n (valid), then m (3, not 4: refused)
        table = (validation.Argument("a", ("m", "n")), validation.Argument("b", (first, "p")))
        eager = _outcome(table, values, ("a", "b"), compiling=False, monkeypatch=monkeypatch)
        assert eager == _outcome(table, values, ("a", "b"), compiling=True, monkeypatch=monkeypatch)
        answers.append(eager[0])
    assert answers == ["sizes", "ValueError"]


CHOICES = [
    (T * K, E, H, I, dtype, target, dict(top_k=K))
    for (T, H, I, E, K) in ((8192, 1024, 512, 64, 8), (2048, 4096, 2048, 256, 8), (7, 64, 32, 8, 2), (0, 64, 32, 8, 2))
    for dtype in (torch.float32, torch.bfloat16)
    for target in (Target(capability=(9, 0)), Target(interpreter=True))
]


@pytest.mark.parametrize("args", CHOICES)
def test_kept_choices_and_plans_are_those_made_afresh(args):
    *positional, keywords = args
    afresh = choose_module._choose(*positional, None, True, keywords["top_k"], None)
    assert choose_module.choose(*positional, **keywords) == afresh
    assert choose_module.choose(*positional, **keywords) == afresh  # the kept one
    num_slots, E, H, I = positional[:4]
    K = keywords["top_k"]
    T = num_slots // K
    plan = launch.launch_plan(T, H, I, E, K, afresh, num_programs=132)
    assert plan == launch._launch_plan(T, H, I, E, K, afresh, 132, 2, False)
    plan.pop("A")  # the caller's own dict: the next call's plan is whole
    assert "A" in launch.launch_plan(T, H, I, E, K, afresh, num_programs=132)


def test_a_config_built_with_lists_is_chosen_and_planned_afresh():
    config = choose_module.launch_config(64, 8, input_bytes=2)
    listed = LaunchConfig(**{**config.__dict__, "grad_gate_up_tile": list(config.grad_gate_up_tile)})
    choice = choose_module.choose(64, 8, 128, 64, torch.bfloat16, Target(), config=listed, top_k=2)
    assert choice.config is listed
    assert launch.launch_plan(32, 128, 64, 8, 2, choice, num_programs=132)["A"].grid["experts"] == 8


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_route_by_expert_with_kept_ids_groups_slots_by_expert(dtype):
    for _ in range(5):
        T, E = torch.randint(0, 40, ()).item(), torch.randint(1, 9, ()).item()
        K = torch.randint(1, E + 1, ()).item()
        indices = torch.rand(T, E).argsort(dim=1)[:, :K].to(dtype)
        routing = route_by_expert(indices, E)
        flat = indices.reshape(-1).long()
        expected_order = torch.sort(flat, stable=True).indices
        assert torch.equal(routing.sorted_slot.long(), expected_order)
        counts = torch.bincount(flat, minlength=E)
        assert torch.equal(routing.counts.long(), counts)
        assert routing.expert_offsets.dtype == torch.int32 and routing.expert_offsets[-1] == T * K
    kept = expert_ids(E, indices)
    assert kept is expert_ids(E, indices) and torch.equal(kept, torch.arange(E + 1, dtype=dtype))


def test_tables_made_per_call_are_not_kept_without_bound():
    values = dict(a=torch.randn(2, 3))
    for _ in range(3 * validation.PLANS_KEPT):
        table = [validation.Argument("a", ("m", "n"))]  # a list, made anew each time
        assert validation.check_arguments(table, values, ["a"]) == {"m": 2, "n": 3}
    assert len(validation._PLANS) <= validation.PLANS_KEPT
