"""Training-step modes of the benchmark (moe_lib.bench.modes), and the SonicMoE peer's mapping of our
layout."""

import types

import pytest
import torch
from conftest import rel_error

from moe_lib import problems
from moe_lib.bench import cli, harness, modes, peers
from moe_lib.bench.peers import moe_experts as p2_peers

P2_SMALL = dict(hidden_size=32, intermediate_size=16, num_experts=6, top_k=2)


def fake_sonicmoe(x, scores, token_idx, expert_idx, w1, b1, w2, b2, num_experts, stream_id, activation):
    """SonicMoE's layer as its documentation states it, in PyTorch: w1 [2I, H, E] with row 2i the gate's
    and 2i + 1 the up projection's, w2 [H, I, E]; per slot, score · w2_e (silu(gate) ⊙ up); (o, frequency)."""
    assert activation == "swiglu" and b1 is None and b2 is None and w1.shape[-1] == num_experts
    output = torch.zeros_like(x, dtype=torch.float32)
    for e in range(num_experts):
        slots = (expert_idx == e).nonzero(as_tuple=True)[0]
        rows = x[token_idx[slots].long()].float()
        gate, up = rows @ w1[0::2, :, e].float().T, rows @ w1[1::2, :, e].float().T
        out = (torch.nn.functional.silu(gate) * up) @ w2[:, :, e].float().T
        output = output.index_add(0, token_idx[slots].long(), scores[slots, None] * out)
    return output.to(x.dtype), torch.bincount(expert_idx, minlength=num_experts)


@pytest.fixture
def with_fake_sonicmoe(monkeypatch):
    monkeypatch.setattr(p2_peers, "_sonicmoe", lambda: (fake_sonicmoe, types.SimpleNamespace(SWIGLU="swiglu")))


def test_sonicmoe_is_unavailable_with_a_reason_where_it_cannot_run():
    reason = peers.peers_for("moe_experts_backward_bf16")["sonicmoe"].unavailable(torch.device("cpu"))
    assert reason and "CUDA" in reason
    assert peers.layer_peers_for("moe_experts_backward_bf16")["sonicmoe"].unavailable(torch.device("cpu"))


def test_sonicmoe_mapping_of_weights_routing_and_gradients(with_fake_sonicmoe, seed):
    inputs = problems.make_inputs("moe_experts_backward_bf16", 9, seed=seed, dtype=torch.float64, **P2_SMALL)
    inputs = {k: v.bfloat16() if v.dtype == torch.float64 and k != "topk_weights" else v for k, v in inputs.items()}
    inputs["topk_weights"] = inputs["topk_weights"].float()
    got = peers.peers_for("moe_experts_backward_bf16")["sonicmoe"].prepare(inputs)()
    upcast = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    want = problems.load("moe_experts_backward_bf16").spec.reference(*upcast.values())
    for name, g, w in zip(problems.load("moe_experts_backward_bf16").output_names, got, want, strict=True):
        assert g.shape == w.shape and rel_error(g, w) <= 2e-2, name


def test_sonicmoe_refuses_other_dtypes_with_a_clear_error(with_fake_sonicmoe):
    inputs = problems.make_inputs("moe_experts_backward", 3, **P2_SMALL)
    with pytest.raises(ValueError, match="hidden_states: SonicMoE runs bf16 inputs only"):
        peers.peers_for("moe_experts_backward")["sonicmoe"].prepare(inputs)


@pytest.mark.parametrize("mode", ["forward", "forward_backward"])
def test_layer_steps_match_the_reference_layer(mode, with_fake_sonicmoe, seed):
    problem = problems.load("moe_experts_backward_bf16")
    inputs = problem.make_inputs(7, seed=seed, **P2_SMALL)
    want = modes.reference_outputs(problem, inputs, mode, torch.float64)
    assert len(want) == len(modes.output_names(problem, mode))
    for label in ("grouped_mm", "sonicmoe"):
        got = modes.mode_peers(problem.name, mode)[label].prepare(inputs)()
        for name, g, w in zip(modes.output_names(problem, mode), got, want, strict=True):
            assert rel_error(g, w) <= 3e-2, (label, name)


def test_layer_flops_and_bytes_of_a_step():
    problem = problems.load("swiglu_down_backward")
    inputs = problem.make_inputs(4, **problem.small_axes)
    references = modes.reference_outputs(problem, inputs, "forward_backward", torch.float64)
    flops, traffic = modes.cost(problem, "forward_backward", inputs, references, **problem.small_axes)
    assert flops == 18 * 4 * 256 * 96
    weights = 3 * 256 * 96 * 2
    activation = 4 * 256 * 2
    assert traffic == (2 * activation + weights) + (2 * activation + weights)  # x, dy, W read; y, dx, dW written
    with pytest.raises(ValueError, match="mode: expected one of"):
        modes.output_names(problem, "train")


def test_cli_runs_a_training_step_on_cpu(tmp_path):
    args = cli.parse_args(
        [
            "--problem",
            "swiglu_down_backward",
            "--mode",
            "forward_backward",
            "--impl",
            "reference,torch_eager",
            "--tokens",
            "3",
            "--out",
            str(tmp_path),
            "--reps",
            "1",
            "--warmup",
            "0",
        ]
    )
    result = harness.run(args, log=lambda message: None)
    frame = result["frame"]
    assert set(frame["mode"]) == {"forward_backward"} and list(frame["status"]) == ["ok", "ok"]
    assert {"peak_mem_gb", "rel_error_grad_x", "rel_error_output"} <= set(frame.columns)
    assert "-forward_backward-" in result["csv"].name
    with pytest.raises(SystemExit):
        cli.parse_args(["--problem", "swiglu_down_backward", "--mode", "forward", "--impl", "triton_fast"])
