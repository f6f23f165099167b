"""The peers registry and the peers that run on CPU."""

import pytest
import torch
from conftest import rel_error

from moe_lib import problems, reference
from moe_lib.bench import peers

P1_SMALL = dict(hidden_size=256, intermediate_size=96)
P2_SMALL = dict(hidden_size=64, intermediate_size=32, num_experts=8, top_k=3)


def test_registry_lists_the_expected_labels():
    p1_labels = ["reference", "torch_eager", "torch_compile", "triton", "triton_fast"]
    assert peers.labels("swiglu_down_backward") == p1_labels
    assert peers.labels("moe_experts_backward") == [
        "reference",
        "grouped_mm",
        "liger",
        "triton",
        "triton_engine",
        "sonicmoe",
    ]
    assert peers.labels("moe_experts_backward_bf16") == peers.labels("moe_experts_backward")
    p1, p2 = peers.peers_for("swiglu_down_backward"), peers.peers_for("moe_experts_backward")
    assert p1["torch_eager"].capturable and p1["torch_compile"].capturable and p1["reference"].capturable
    assert not p2["reference"].capturable and not p2["grouped_mm"].capturable and not p2["liger"].capturable
    assert set(peers.BASELINE_LABELS) == {"reference", "torch_eager", "torch_compile", "grouped_mm", "liger"}
    assert peers.baseline_labels("swiglu_down_backward") == ["reference", "torch_eager", "torch_compile"]
    assert peers.baseline_labels("moe_experts_backward_bf16") == ["reference", "grouped_mm", "liger"]
    assert all(peers.labels(name) for name in problems.PROBLEM_NAMES)  # every op has its peers


def test_positional_follows_the_definition_order():
    inputs = problems.make_inputs("swiglu_down_backward", 2, **P1_SMALL)
    shuffled = dict(reversed(list(inputs.items())))
    assert [id(t) for t in peers.positional("swiglu_down_backward", shuffled)] == [id(t) for t in inputs.values()]


def test_registered_adds_and_restores():
    fake = peers.Peer("zeros", "swiglu_down_backward", lambda inputs: lambda: (), capturable=True, description="test")
    with peers.registered(fake):
        assert "zeros" in peers.labels("swiglu_down_backward")
    assert "zeros" not in peers.labels("swiglu_down_backward")
    original = peers.peers_for("swiglu_down_backward")["reference"]
    replacement = peers.Peer(
        "reference", "swiglu_down_backward", lambda inputs: None, capturable=False, description="test"
    )
    with peers.registered(replacement):
        assert peers.peers_for("swiglu_down_backward")["reference"] is replacement
    assert peers.peers_for("swiglu_down_backward")["reference"] is original
    with pytest.raises(ValueError, match="op"):
        peers.register(peers.Peer("x", "nope", lambda inputs: None, capturable=False, description=""))


def test_cuda_only_peers_say_why_on_cpu():
    cpu = torch.device("cpu")
    reason = peers.peers_for("moe_experts_backward")["liger"].unavailable(cpu)
    assert reason is not None and "CUDA" in reason
    assert "liger" not in peers.available_labels("moe_experts_backward", cpu)
    assert {"reference", "torch_eager"} <= set(peers.available_labels("swiglu_down_backward", cpu))


def _p1_reference64(inputs):
    return reference.swiglu_down_backward_reference(*(t.double() for t in inputs.values()))


def test_p1_torch_eager_matches_float64_reference(seed):
    inputs = problems.make_inputs("swiglu_down_backward", 200, seed=seed, **P1_SMALL)
    outputs = peers.peers_for("swiglu_down_backward")["torch_eager"].prepare(inputs)()
    expected = _p1_reference64(inputs)
    assert len(outputs) == 4
    for out, ref in zip(outputs, expected, strict=True):
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        assert rel_error(out, ref) < 1e-2


def test_p1_reference_peer_matches_float64_reference(seed):
    inputs = problems.make_inputs("swiglu_down_backward", 37, seed=seed, **P1_SMALL)
    outputs = peers.peers_for("swiglu_down_backward")["reference"].prepare(inputs)()
    for out, ref in zip(outputs, _p1_reference64(inputs), strict=True):
        assert rel_error(out, ref) < 1e-2


@pytest.mark.parametrize("problem", ["moe_experts_backward", "moe_experts_backward_bf16"])
def test_p2_grouped_mm_matches_float64_reference(problem, seed):
    peer = peers.peers_for(problem)["grouped_mm"]
    reason = peer.unavailable(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    inputs = problems.make_inputs(problem, 40, seed=seed, **P2_SMALL)
    outputs = peer.prepare(inputs)()
    hi = [t.double() if t.is_floating_point() else t for t in inputs.values()]
    expected = reference.moe_experts_backward_reference(*hi)
    for name, out, ref, spec in zip(
        problems.load(problem).outputs, outputs, expected, problems.load(problem).outputs.values(), strict=True
    ):
        assert out.shape == ref.shape, name
        assert out.dtype == problems.DTYPES[spec["dtype"]], name
        assert rel_error(out, ref) < 3e-2, name


def test_p2_reference_peer_is_the_reference(seed):
    inputs = problems.make_inputs("moe_experts_backward", 20, seed=seed, **P2_SMALL)
    outputs = peers.peers_for("moe_experts_backward")["reference"].prepare(inputs)()
    expected = reference.moe_experts_backward_reference(*inputs.values())
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, expected, strict=True))
