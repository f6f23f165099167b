"""moe_lib.nn: the modules compute the functional layers on their parameters (against float64 autograd), in the
documented layout, and behave as modules: reset_parameters, extra_repr, state_dict, .to(), bad arguments named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_error

import moe_lib
from moe_lib.dispatch import interpreter_enabled
from moe_lib.nn import MoEExperts, SwiGLUExpert

needs_interpreter = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (the CPU runs)")


def dense_expert(x, gate_up, down):
    """y = Wd (silu(Wg x) ⊙ Wu x) with [Wg; Wu] = gate_up, in float64."""
    gate, up = (x.double() @ gate_up.double().T).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.double().T


def dense_experts(x, indices, weights, gate_up, down):
    """Σ_k w_k · expert_{e_k}(x) per token, in float64 (x [T, H], indices and weights [T, K])."""
    per_slot = torch.stack(
        [torch.stack([dense_expert(x[t], gate_up[e], down[e]) for e in indices[t].tolist()]) for t in range(x.shape[0])]
    )
    return (weights.double()[..., None] * per_slot).sum(dim=1)


def test_swiglu_expert_module_matches_float64(seed):
    torch.manual_seed(seed)
    module = SwiGLUExpert(24, 12)
    x = torch.randn(2, 5, 24, requires_grad=True)
    y = module(x)
    want = dense_expert(x.detach().reshape(-1, 24), module.gate_up_proj.detach(), module.down_proj.detach())
    assert y.shape == x.shape and rel_error(y.reshape(-1, 24), want) <= 1e-6
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, module.gate_up_proj, module.down_proj], dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, module.gate_up_proj, module.down_proj)]
    exact = torch.autograd.grad(
        dense_expert(leaves[0].reshape(-1, 24), *leaves[1:]).reshape(2, 5, 24), leaves, dy.double()
    )
    assert [rel_error(g, w) <= 1e-5 for g, w in zip(got, exact, strict=True)] == [True] * 3


def test_moe_experts_module_matches_float64(seed):
    torch.manual_seed(seed)
    E, H, I, K = 5, 16, 8, 2
    module = MoEExperts(E, H, I)
    x = torch.randn(3, 4, H, requires_grad=True)
    indices = torch.rand(3, 4, E).argsort(dim=-1)[..., :K]
    weights = torch.rand(3, 4, K, requires_grad=True)
    y = module(x, indices, weights)
    assert y.shape == x.shape
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, weights, module.gate_up_proj, module.down_proj], dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, weights, module.gate_up_proj, module.down_proj)]
    want_y = dense_experts(leaves[0].reshape(-1, H), indices.reshape(-1, K), leaves[1].reshape(-1, K), *leaves[2:])
    exact = torch.autograd.grad(want_y.reshape(3, 4, H), leaves, dy.double())
    assert rel_error(y.reshape(-1, H), want_y.detach()) <= 1e-6
    assert [rel_error(g, w) <= 1e-5 for g, w in zip(got, exact, strict=True)] == [True] * 4


def test_the_functional_layer_gets_the_parameters_as_they_lie(monkeypatch):
    """No copy between the module and the layer: it passes gate_up_proj whole (its gradient comes back as one block)."""
    seen = {}

    def spy(hidden_states, topk_indices, topk_weights, gate_up, down, **options):
        seen.update(gate_up=gate_up, down=down, options=options)
        return hidden_states.clone()

    monkeypatch.setattr("moe_lib.nn.moe_experts_gate_up", spy)
    module = MoEExperts(3, 8, 4, save_activations=True, validate=False)
    module(torch.randn(2, 8), torch.tensor([[0, 1], [2, 0]]), torch.rand(2, 2))
    assert seen["gate_up"] is module.gate_up_proj
    assert seen["down"] is module.down_proj
    assert seen["options"] == dict(impl="auto", validate=False, save_activations=True)


@pytest.mark.parametrize(
    "make", [lambda: SwiGLUExpert(32, 16), lambda: MoEExperts(4, 32, 16)], ids=["SwiGLUExpert", "MoEExperts"]
)
def test_reset_parameters_draws_like_linear(make, seed):
    torch.manual_seed(seed)
    module = make()
    first = {name: p.detach().clone() for name, p in module.named_parameters()}
    module.reset_parameters()
    for name, p in module.named_parameters():
        fan_in = p.shape[-1]
        assert p.abs().max() <= 1 / fan_in**0.5 and p.std() > 0.4 / fan_in**0.5, name  # uniform: std = bound / √3
        assert not torch.equal(p, first[name]), name


def test_extra_repr_names_the_sizes_and_options():
    assert "hidden_size=32, intermediate_size=16, impl='auto', precision='fast'" in repr(SwiGLUExpert(32, 16))
    text = repr(MoEExperts(4, 32, 16, impl="reference", validate=False, save_activations=True))
    assert (
        "num_experts=4, hidden_size=32, intermediate_size=16, impl='reference', validate=False, "
        "save_activations=True" in text
    )


def test_parameter_layout_and_state_dict_round_trip(seed):
    torch.manual_seed(seed)
    module = MoEExperts(4, 32, 16)
    assert {n: tuple(p.shape) for n, p in module.named_parameters()} == {
        "gate_up_proj": (4, 32, 32),
        "down_proj": (4, 32, 16),
    }
    other = MoEExperts(4, 32, 16)
    other.load_state_dict(module.state_dict())
    x, indices, weights = torch.randn(6, 32), torch.rand(6, 4).argsort(dim=1)[:, :2], torch.rand(6, 2)
    assert torch.equal(other(x, indices, weights), module(x, indices, weights))
    single = SwiGLUExpert(32, 16)
    assert {n: tuple(p.shape) for n, p in single.named_parameters()} == {
        "gate_up_proj": (32, 32),
        "down_proj": (32, 16),
    }
    copy = SwiGLUExpert(32, 16)
    copy.load_state_dict(single.state_dict())
    assert torch.equal(copy(x), single(x))


def test_to_dtype_moves_the_parameters_and_the_outputs_follow(seed):
    torch.manual_seed(seed)
    module = MoEExperts(4, 32, 16).to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    indices, weights = torch.rand(6, 4).argsort(dim=1)[:, :2], torch.rand(6, 2)
    y = module(x, indices, weights)  # fp32 routing weights with bf16 experts, as DeepSeek-V3's router gives
    want = dense_experts(x, indices, weights, module.gate_up_proj.detach(), module.down_proj.detach())
    assert y.dtype == torch.bfloat16 and rel_error(y, want) <= 1e-2
    single = SwiGLUExpert(32, 16).to(dtype=torch.float64)
    assert single(torch.randn(3, 32, dtype=torch.float64)).dtype == torch.float64


@needs_interpreter
def test_save_activations_on_the_triton_path_gives_the_same_gradients(seed):
    torch.manual_seed(seed)
    module = MoEExperts(4, 32, 16, impl="triton")
    x, indices, weights = torch.randn(6, 32), torch.rand(6, 4).argsort(dim=1)[:, :2], torch.rand(6, 2)
    grads = []
    for save in (False, True):
        module.save_activations = save
        module.zero_grad()
        module(x, indices, weights).square().sum().backward()
        grads.append(module.gate_up_proj.grad.clone())
    assert rel_error(grads[1], grads[0]) <= 1e-2 and grads[0].abs().sum() > 0


def test_validate_and_bad_arguments_are_named():
    module = MoEExperts(4, 32, 16)
    with pytest.raises(ValueError, match=r"^topk_indices: expert index 4 out of range \[0, 4\)"):
        module(torch.randn(2, 32), torch.tensor([[0, 4], [1, 2]]), torch.rand(2, 2))
    with pytest.raises(ValueError, match="^topk_weights: expected shape"):
        module(torch.randn(2, 32), torch.tensor([[0, 3], [1, 2]]), torch.rand(3, 2))
    with pytest.raises(TypeError, match="^hidden_states: expected a torch.Tensor"):
        module([1.0], torch.tensor([[0, 3]]), torch.rand(1, 2))
    for make, pattern in [
        (lambda: MoEExperts(0, 32, 16), "^num_experts: expected a positive integer, got 0"),
        (lambda: MoEExperts(4, 32.0, 16), "^hidden_size: expected a positive integer"),
        (lambda: SwiGLUExpert(32, True), "^intermediate_size: expected a positive integer"),
        (lambda: SwiGLUExpert(32, 16, impl="cuda"), "^impl: expected one of"),
        (lambda: SwiGLUExpert(32, 16, precision="exact"), "^precision: expected one of"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            make()
    with pytest.raises(TypeError, match="^save_activations: expected True or False"):
        MoEExperts(4, 32, 16, save_activations=1)


def test_the_modules_are_the_layers():
    """The module's forward is the functional layer's: same numbers, bit for bit."""
    torch.manual_seed(0)
    module = SwiGLUExpert(16, 8)
    x = torch.randn(4, 16)
    I = module.intermediate_size
    assert torch.equal(
        module(x), moe_lib.swiglu_expert(x, module.gate_up_proj[:I], module.gate_up_proj[I:], module.down_proj)
    )


@pytest.mark.gpu
def test_to_cuda_runs_the_triton_path(seed):
    torch.manual_seed(seed)
    module = MoEExperts(8, 256, 128).to("cuda", torch.bfloat16)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    indices = torch.rand(64, 8, device="cuda").argsort(dim=1)[:, :2]
    weights = torch.rand(64, 2, device="cuda", dtype=torch.bfloat16)
    y = module(x, indices, weights)
    want = dense_experts(
        x.cpu(), indices.cpu(), weights.cpu(), module.gate_up_proj.detach().cpu(), module.down_proj.detach().cpu()
    )
    assert y.device.type == "cuda" and rel_error(y.cpu(), want) <= 1e-2
