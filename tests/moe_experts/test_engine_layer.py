"""P2's layer on the grouped engine (``moe_lib/moe_experts/engine_layer.py``): forward and backward against float64.

CPU: the engine's plain-Triton twins under the interpreter, at small shapes with ragged and empty experts, every
output and workspace NaN-filled first, fresh inputs each run. GPU (``gpu``): the Gluon kernels at model-like shapes.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_error
from oracles import moe_experts_forward_dense, moe_experts_grads

from moe_lib import problems
from moe_lib.engine.gluon_gemm import GemmConfig
from moe_lib.moe_experts import engine_layer, runtime
from moe_lib.moe_experts.runtime import Target
from moe_lib.moe_experts.weights import split_gate_up

TOLERANCE = 2e-2  # bf16 operands and outputs against float64 (relative Frobenius error)

# name: (T, H, I, E, K, routing)
CASES = {
    "uniform": (13, 64, 64, 5, 2, "uniform"),
    "skewed": (24, 64, 128, 7, 3, "skewed"),  # some experts get no rows
    "hot": (20, 128, 64, 4, 2, "hot"),
    "K1": (9, 64, 64, 3, 1, "uniform"),
}


def bf16_inputs(T, H, I, E, K, routing, seed, device="cpu") -> dict:
    inputs = problems.make_inputs(
        "moe_experts_backward",
        T,
        seed=seed,
        device=device,
        routing=routing,
        hidden_size=H,
        intermediate_size=I,
        num_experts=E,
        top_k=K,
    )
    for name in ("grad_output", "hidden_states", "gate_weights", "up_weights", "down_weights"):
        inputs[name] = inputs[name].to(torch.bfloat16)
    return inputs


def args(inputs: dict) -> tuple:
    return tuple(
        inputs[name]
        for name in ("hidden_states", "topk_indices", "topk_weights", "gate_weights", "up_weights", "down_weights")
    )


def forward_float64(inputs: dict) -> torch.Tensor:
    return moe_experts_forward_dense(*(t.double() if t.is_floating_point() else t for t in args(inputs)))


def test_supports_names_what_it_cannot_take():
    hopper, ampere = Target(), Target(capability=(8, 0))
    assert engine_layer.supports(4096, 2048, torch.bfloat16, hopper) is None
    assert engine_layer.supports(64, 64, torch.bfloat16, Target(interpreter=True)) is None
    assert "bfloat16" in engine_layer.supports(4096, 2048, torch.float32, hopper)
    assert "Hopper" in engine_layer.supports(4096, 2048, torch.bfloat16, ampere)
    assert "hidden_size = 1000" in engine_layer.supports(1000, 2048, torch.bfloat16, hopper)
    assert "intermediate_size = 1400" in engine_layer.supports(4096, 1400, torch.bfloat16, hopper)


def test_gemm_config_by_rows_an_expert():
    assert engine_layer.gemm_config(8192 * 8, 256) == GemmConfig(64, 256, 64, 4, "pingpong")
    assert engine_layer.gemm_config(32768 * 8, 256) == GemmConfig(128, 256, 64, 3, "cooperative")
    assert engine_layer.gemm_config(4096 * 2, 8).consumers == "cooperative"
    assert engine_layer.gemm_config(0, 0).consumers == "pingpong"


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_against_float64(case, seed, nan_workspaces):
    T, H, I, E, K, routing = CASES[case]
    inputs = bf16_inputs(T, H, I, E, K, routing, seed)
    grads = engine_layer.backward(inputs["grad_output"], *args(inputs))
    expected = moe_experts_grads(inputs["grad_output"], *args(inputs))
    names = ("grad_hidden_states", "grad_topk_weights", "grad_gate", "grad_up", "grad_down")
    for name, out, ref in zip(names, grads, expected, strict=True):
        assert out.shape == ref.shape, name
        assert rel_error(out, ref) <= TOLERANCE, (name, rel_error(out, ref))
    chosen = torch.zeros(E, dtype=torch.bool)
    chosen[inputs["topk_indices"].reshape(-1).long()] = True
    for out in grads[2:]:  # experts without rows: exact zeros
        assert (out[~chosen] == 0).all()


@pytest.mark.parametrize("case", ["uniform", "skewed"])
def test_forward_and_saved_preactivations(case, seed, nan_workspaces):
    T, H, I, E, K, routing = CASES[case]
    inputs = bf16_inputs(T, H, I, E, K, routing, seed)
    y, preactivations = engine_layer.forward(*args(inputs), save_preactivations=True)
    assert rel_error(y, forward_float64(inputs)) <= TOLERANCE
    assert torch.equal(y, engine_layer.forward(*args(inputs)))
    saved = engine_layer.backward(inputs["grad_output"], *args(inputs), preactivations=preactivations)
    recomputed = engine_layer.backward(inputs["grad_output"], *args(inputs))
    for a, b in zip(saved, recomputed, strict=True):  # the same g and u, the same arithmetic after them
        assert torch.equal(a, b)


def kept_routing_and_fused_gradient(inputs: dict, preactivations=None) -> tuple:
    """The backward with the forward's kept routing and the gate/up gradient written into one NaN-filled [E, 2I, H]
    block (a model's ``gate_up_proj``): (its outputs, the block)."""
    gate = inputs["gate_weights"]
    E, I, H = gate.shape
    routing = engine_layer.saved_routing(inputs["topk_indices"], inputs["topk_weights"], E)
    assert routing.dtype == torch.int32 and routing.numel() == E + 1 + 3 * inputs["topk_indices"].numel()
    assert torch.equal(engine_layer.forward(*args(inputs), routing=routing), engine_layer.forward(*args(inputs)))
    block = torch.full((E, 2 * I, H), float("nan"), dtype=gate.dtype, device=gate.device)
    outs = (*split_gate_up(block), torch.full_like(inputs["down_weights"], float("nan")))
    grads = engine_layer.backward(
        inputs["grad_output"], *args(inputs), preactivations=preactivations, weight_grads_out=outs, routing=routing
    )
    return grads, block


@pytest.mark.parametrize("case", ["uniform", "skewed", "K1"])
def test_kept_routing_and_fused_gate_up_gradient_change_no_bit(case, seed, nan_workspaces):
    """One product [dg | du]ᵀ·x_s writes the fused block: the same sums in the same order as the pair's."""
    T, H, I, E, K, routing = CASES[case]
    inputs = bf16_inputs(T, H, I, E, K, routing, seed)
    grads, block = kept_routing_and_fused_gradient(inputs)
    for name, got, want in zip(
        ("grad_hidden_states", "grad_topk_weights", "grad_gate", "grad_up", "grad_down"),
        grads,
        engine_layer.backward(inputs["grad_output"], *args(inputs)),
        strict=True,
    ):
        assert torch.equal(got, want), name
    assert torch.equal(block, torch.cat(grads[2:4], dim=1))
    assert grads[2].data_ptr() == block.data_ptr()  # written in place, not copied in


def test_no_tokens(nan_workspaces):
    inputs = bf16_inputs(0, 64, 64, 4, 2, "uniform", 0)
    grads = engine_layer.backward(inputs["grad_output"], *args(inputs))
    assert [tuple(g.shape) for g in grads] == [(0, 64), (0, 2), (4, 64, 64), (4, 64, 64), (4, 64, 64)]
    assert all((g == 0).all() for g in grads)
    assert engine_layer.forward(*args(inputs)).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512, 2048, 768, 128, 8), (300, 4096, 1024, 8, 2), (64, 1024, 512, 64, 6)])
def test_gpu_against_float64(shape, seed, nan_workspaces):
    from moe_lib.moe_experts.reference import moe_experts_backward_reference, moe_experts_forward_reference

    T, H, I, E, K = shape
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    exact = {name: t.double() if t.is_floating_point() else t for name, t in inputs.items()}
    y, preactivations = engine_layer.forward(*args(inputs), save_preactivations=True)
    assert rel_error(y, moe_experts_forward_reference(*args(exact))) <= TOLERANCE
    grads = engine_layer.backward(inputs["grad_output"], *args(inputs), preactivations=preactivations)
    expected = moe_experts_backward_reference(exact["grad_output"], *args(exact))
    for out, ref in zip(grads, expected, strict=True):
        assert rel_error(out, ref) <= TOLERANCE
    again = engine_layer.backward(inputs["grad_output"], *args(inputs))
    for a, b in zip(grads, again, strict=True):
        assert torch.equal(a, b)


def test_weight_gradients_read_aligned_rows_through_the_routing():
    from moe_lib.engine.gathered import Gathered

    routed = engine_layer._Routed.of(torch.tensor([[1, 0], [0, 2], [2, 1]]), torch.rand(3, 2), 3)
    x = torch.randn(3, 64).to(torch.bfloat16)
    rows = routed.rows(x)
    assert isinstance(rows, Gathered) and rows.index.dtype == torch.int32
    assert torch.equal(rows.materialise(), routed.gather(x))
    odd = torch.randn(3 * 64 + 1).to(torch.bfloat16)[1:].view(3, 64)  # 2 bytes past an aligned start
    assert torch.equal(routed.rows(odd), routed.gather(odd))


def backward_peak(inputs, spend: bool = False) -> tuple[int, tuple]:
    """(the bytes the engine's backward adds at its peak, after a forward keeping g and u; its gradients); ``spend``:
    the backward may write [dg | du] over g and u."""
    _, preactivations = engine_layer.forward(*args(inputs), save_preactivations=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = engine_layer.backward(
        inputs["grad_output"], *args(inputs), preactivations=preactivations, spend_preactivations=spend
    )
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, grads


def peaks_off_and_on(inputs, switch: str, monkeypatch, spend: bool = False) -> list[int]:
    """:func:`backward_peak`'s bytes with engine_layer's ``switch`` off, then on."""
    peaks = []
    for on in (False, True):
        monkeypatch.setattr(engine_layer, switch, on)
        peaks.append(backward_peak(inputs, spend)[0])
    return peaks


@pytest.mark.gpu
def test_gpu_backward_peak_keeps_one_routed_copy_at_most_beside_the_weight_gradients(seed):
    """The backward's peak (pre-activations saved): the larger of (dWg, dWu, [dg | du], aw, x_s) and (dW, aw), with
    its other outputs; no second [T·K, H] workspace (dy_s) beside them: Wd's gradient reads dy through the routing."""
    T, H, I, E, K = 4096, 2048, 1024, 32, 8
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    added, grads = backward_peak(inputs)
    slots, weight = T * K, 2 * E * I * H
    others = 2 * (T * H + T * K)
    gate_up_phase = 2 * weight + 2 * (2 * slots * I + slots * I + slots * H)  # dWg, dWu; [dg | du], aw, x_s
    down_phase = 3 * weight + 2 * slots * I  # dW; aw
    expected = others + max(gate_up_phase, down_phase) + 2**23  # 8 MiB: the routing's indices, the rounding
    assert added <= expected < others + gate_up_phase + 2 * slots * H, (added, expected)  # dy_s would not fit
    assert all(torch.isfinite(g).all() for g in grads)


def test_the_public_calls_take_the_engine_where_preferred(seed, nan_workspaces):
    from moe_lib.moe_experts import moe_experts, moe_experts_backward
    from moe_lib.moe_experts.structure import preferred

    T, H, I, E, K, routing = CASES["skewed"]
    inputs = bf16_inputs(T, H, I, E, K, routing, seed)
    engine = engine_layer.backward(inputs["grad_output"], *args(inputs))
    with preferred("engine"):
        public = moe_experts_backward(inputs["grad_output"], *args(inputs), impl="triton")
        leaves = [
            inputs[n].detach().requires_grad_()
            for n in ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")
        ]
        x, w, wg, wu, wd = leaves
        y = moe_experts(x, inputs["topk_indices"], w, wg, wu, wd, impl="triton", save_activations=True)
    layer = torch.autograd.grad(y, leaves, inputs["grad_output"])  # outside: the forward's preference holds
    for a, b, c in zip(engine, public, layer, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(y, engine_layer.forward(*args(inputs)))
    kernels = moe_experts_backward(inputs["grad_output"], *args(inputs), impl="triton")  # not preferred: A-W-D-C
    assert not all(torch.equal(a, b) for a, b in zip(engine, kernels, strict=True))


def test_preferred_names_a_bad_structure():
    from moe_lib.moe_experts.structure import preferred

    with pytest.raises(ValueError, match="structure: expected one of"), preferred("fast"):
        pass
    with preferred("engine"), pytest.raises(ValueError, match="structure: 'engine' was asked for, but dtype"):
        engine_layer.structure(64, 1, 64, 64, torch.float32, Target(interpreter=True))
    with preferred("kernels"):
        assert engine_layer.structure(10**6, 1, 64, 64, torch.bfloat16, Target(interpreter=True)) == "kernels"


def test_the_default_structure_by_rows_an_expert():
    hopper = Target()
    # P2's shape from 2048 tokens (64 rows an expert), not DeepSeek-V3's at 512 (16)
    assert engine_layer.structure(2048 * 8, 256, 4096, 2048, torch.bfloat16, hopper) == "engine"
    assert engine_layer.structure(2047 * 8, 256, 4096, 2048, torch.bfloat16, hopper) == "kernels"
    assert engine_layer.structure(512 * 8, 256, 7168, 2048, torch.bfloat16, hopper) == "kernels"
    assert engine_layer.structure(32768 * 2, 8, 4096, 14336, torch.bfloat16, hopper) == "engine"
    for dtype in (torch.float32, torch.float16):  # the engine takes bf16 only
        assert engine_layer.structure(32768 * 8, 256, 4096, 2048, dtype, hopper) == "kernels"
    assert engine_layer.structure(32768 * 8, 256, 1000, 2048, torch.bfloat16, hopper) == "kernels"
    assert engine_layer.structure(32768 * 8, 256, 4096, 2048, torch.bfloat16, Target(capability=(8, 0))) == "kernels"


@pytest.mark.parametrize("path", ["eager", "op"])
def test_the_layer_backward_gets_no_zeros_for_its_saved_preactivations(path, seed, monkeypatch):
    """[g | u] is an output of the layer's op that no loss reaches: autograd must not hand its backward [T·K, 2I]
    zeros for it (2 · T·K·I bf16 bytes at the backward's peak), on the eager path (``_EagerLayer``) and through
    the op (as ``torch.compile`` runs it)."""
    import importlib

    api = importlib.import_module("moe_lib.moe_experts.api")
    from moe_lib.moe_experts import moe_experts

    received = []
    backward = api._backward

    def spy(ctx, grad_output, grad_preactivations, grad_routing):
        received.append((grad_preactivations, grad_routing))
        return backward(ctx, grad_output, grad_preactivations, grad_routing)

    T, H, I, E, K, routing = CASES["uniform"]
    inputs = bf16_inputs(T, H, I, E, K, routing, seed)
    leaves = [inputs[n].detach().requires_grad_() for n in ("hidden_states", "topk_weights")]
    weights = [inputs[n] for n in ("gate_weights", "up_weights", "down_weights")]
    if path == "eager":
        monkeypatch.setattr(api, "_backward", spy)
        y = moe_experts(leaves[0], inputs["topk_indices"], leaves[1], *weights, impl="triton", save_activations=True)
        torch.autograd.grad(y, leaves, inputs["grad_output"])
    else:
        torch.library.register_autograd("moe_lib::moe_experts", spy, setup_context=api._save_for_backward)
        try:
            y = torch.ops.moe_lib.moe_experts(leaves[0], inputs["topk_indices"], leaves[1], *weights, "triton", True,
                                              False, True)[0]  # fmt: skip
            torch.autograd.grad(y, leaves, inputs["grad_output"])
        finally:
            torch.library.register_autograd("moe_lib::moe_experts", backward, setup_context=api._save_for_backward)
    assert received == [(None, None)]


@pytest.mark.parametrize("structure", ["engine", "kernels"])
@pytest.mark.parametrize("path", ["eager", "op"])
def test_a_second_backward_of_a_saving_forward_is_refused_by_name(path, structure, seed, nan_workspaces):
    """save_activations=True: the backward may write [dg | du] over the saved [g | u], so a second backward through
    the same forward (retain_graph=True) is refused, saying why; without saved activations it runs, the same bits."""
    from moe_lib.moe_experts import moe_experts
    from moe_lib.moe_experts.structure import preferred

    T, H, I, E, K, routing = CASES["uniform"]
    inputs = bf16_inputs(T, H, I, E, K, routing, seed)
    weights = [inputs[n] for n in ("gate_weights", "up_weights", "down_weights")]
    for save in (True, False):
        x = inputs["hidden_states"].detach().requires_grad_()
        with preferred(structure):
            if path == "eager":
                y = moe_experts(x, inputs["topk_indices"], inputs["topk_weights"], *weights, impl="triton",
                                save_activations=save)  # fmt: skip
            else:
                y = torch.ops.moe_lib.moe_experts(x, inputs["topk_indices"], inputs["topk_weights"], *weights,
                                                  "triton", True, False, save)[0]  # fmt: skip
        (first,) = torch.autograd.grad(y, [x], inputs["grad_output"], retain_graph=True)
        assert torch.isfinite(first).all()
        if save:
            with pytest.raises(RuntimeError, match="save_activations=True runs one backward a forward"):
                torch.autograd.grad(y, [x], inputs["grad_output"])
        else:
            (second,) = torch.autograd.grad(y, [x], inputs["grad_output"])
            assert torch.equal(first, second)


@pytest.mark.parametrize("case", ["skewed", "hot"])  # hot: H = 2I, dX's B [E, 2I, H] square per expert
def test_fused_gate_up_halves_are_read_as_one_block(case, seed, nan_workspaces, monkeypatch):
    """Gate and up weights that are the row halves of one [E, 2I, H] block (Hugging Face's gate_up_proj) reach the
    swiglu and dX products as that block, not copied, with results bit-equal to separate contiguous weights; through
    the public layer too (kernels A-W-D-C copy the halves instead)."""
    from moe_lib.moe_experts import moe_experts
    from moe_lib.moe_experts.structure import preferred
    from moe_lib.moe_experts.weights import split_gate_up

    T, H, I, E, K, routing = CASES[case]
    inputs = bf16_inputs(T, H, I, E, K, routing, seed)
    fused = torch.cat([inputs["gate_weights"], inputs["up_weights"]], dim=1)
    gate, up = split_gate_up(fused)
    separate = args(inputs)
    halves = (*separate[:3], gate, up, separate[5])
    weights_read = []
    gemm = engine_layer._Launches.gemm

    def spy(self, a, b, offsets, **kwargs):
        weights_read.append((kwargs.get("epilogue", "none"), b))
        return gemm(self, a, b, offsets, **kwargs)

    monkeypatch.setattr(engine_layer._Launches, "gemm", spy)
    y = engine_layer.forward(*halves)
    grads = engine_layer.backward(inputs["grad_output"], *halves)
    swiglu_and_dx = [b for epilogue, b in weights_read if epilogue in ("swiglu", "none")]
    assert len(swiglu_and_dx) == 3  # the forward's swiglu, the backward's recomputed swiglu, dX
    assert all(isinstance(b, torch.Tensor) and b.data_ptr() == fused.data_ptr() for b in swiglu_and_dx)
    assert torch.equal(y, engine_layer.forward(*separate))
    for a, b in zip(grads, engine_layer.backward(inputs["grad_output"], *separate), strict=True):
        assert torch.equal(a, b)

    monkeypatch.setattr(engine_layer._Launches, "gemm", gemm)
    for structure in ("engine", "kernels"):
        x, w, wd = (inputs[n].detach().requires_grad_() for n in ("hidden_states", "topk_weights", "down_weights"))
        gate_up = fused.detach().clone().requires_grad_()
        wg, wu = (inputs[n].detach().requires_grad_() for n in ("gate_weights", "up_weights"))
        with preferred(structure):
            y_fused = moe_experts(x, inputs["topk_indices"], w, *split_gate_up(gate_up), wd, impl="triton")
            y = moe_experts(x, inputs["topk_indices"], w, wg, wu, wd, impl="triton")
        assert torch.equal(y_fused, y), structure
        d_x, d_w, d_down, d_gate_up = torch.autograd.grad(y_fused, [x, w, wd, gate_up], inputs["grad_output"])
        e_x, e_w, e_down, e_gate, e_up = torch.autograd.grad(y, [x, w, wd, wg, wu], inputs["grad_output"])
        for a, b in ((d_x, e_x), (d_w, e_w), (d_down, e_down), (d_gate_up, torch.cat([e_gate, e_up], dim=1))):
            assert torch.equal(a, b), structure


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 1024, 512, 64, 8), (300, 2048, 768, 16, 4)])
def test_gpu_fused_gate_up_halves_equal_separate_weights(shape, seed, nan_workspaces):
    from moe_lib.moe_experts.weights import split_gate_up

    T, H, I, E, K = shape
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    separate = args(inputs)
    fused = torch.cat([inputs["gate_weights"], inputs["up_weights"]], dim=1)
    halves = (*separate[:3], *split_gate_up(fused), separate[5])
    y, preactivations = engine_layer.forward(*halves, save_preactivations=True)
    y_separate, preactivations_separate = engine_layer.forward(*separate, save_preactivations=True)
    assert torch.equal(y, y_separate)
    grads = engine_layer.backward(inputs["grad_output"], *halves, preactivations=preactivations)
    expected = engine_layer.backward(inputs["grad_output"], *separate, preactivations=preactivations_separate)
    for a, b in zip(grads, expected, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_weights_at_an_odd_offset_are_copied_aligned_for_tma(seed, nan_workspaces, monkeypatch):
    """The engine's launches skip their argument checks: a weight view starting off a 16-byte boundary reaches them
    as an aligned copy (results as with the weights themselves), never as it lies."""
    from moe_lib.tma import aligned

    T, H, I, E, K, routing = CASES["uniform"]
    inputs = bf16_inputs(T, H, I, E, K, routing, seed)
    misaligned = dict(inputs)
    for name in ("gate_weights", "up_weights", "down_weights"):
        weight = inputs[name]
        flat = torch.empty(weight.numel() + 1, dtype=weight.dtype)
        misaligned[name] = flat[1:].view(weight.shape).copy_(weight)  # 2 bytes past an aligned start
        assert not aligned(misaligned[name])
    weights_read = []
    gemm = engine_layer._Launches.gemm

    def spy(self, a, b, offsets, **kwargs):
        weights_read.extend(b if isinstance(b, tuple) else (b,))
        return gemm(self, a, b, offsets, **kwargs)

    monkeypatch.setattr(engine_layer._Launches, "gemm", spy)
    y = engine_layer.forward(*args(misaligned))
    grads = engine_layer.backward(misaligned["grad_output"], *args(misaligned))
    assert weights_read and all(aligned(w) and w.is_contiguous() for w in weights_read)
    assert torch.equal(y, engine_layer.forward(*args(inputs)))
    for a, b in zip(grads, engine_layer.backward(inputs["grad_output"], *args(inputs)), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_weights_at_an_odd_offset_equal_aligned_ones(seed, nan_workspaces):
    T, H, I, E, K = 512, 1024, 512, 16, 4
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    misaligned = dict(inputs)
    for name in ("gate_weights", "up_weights", "down_weights"):
        weight = inputs[name]
        flat = torch.empty(weight.numel() + 1, dtype=weight.dtype, device="cuda")
        misaligned[name] = flat[1:].view(weight.shape).copy_(weight)
    assert torch.equal(engine_layer.forward(*args(misaligned)), engine_layer.forward(*args(inputs)))
    grads = engine_layer.backward(misaligned["grad_output"], *args(misaligned))
    for a, b in zip(grads, engine_layer.backward(inputs["grad_output"], *args(inputs)), strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512, 2048, 768, 128, 8), (300, 4096, 1024, 8, 2)])
def test_gpu_kept_routing_and_fused_gate_up_gradient_change_no_bit(shape, seed, nan_workspaces):
    T, H, I, E, K = shape
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    _, preactivations = engine_layer.forward(*args(inputs), save_preactivations=True)
    grads, block = kept_routing_and_fused_gradient(inputs, preactivations)
    want = engine_layer.backward(inputs["grad_output"], *args(inputs), preactivations=preactivations)
    for got, expected in zip(grads, want, strict=True):
        assert torch.equal(got, expected)
    assert torch.equal(block, torch.cat(want[2:4], dim=1))


def forward_and_backward(inputs, save):
    """The layer's y, then its five gradients (with the saved pre-activations where ``save``)."""
    y, preactivations = engine_layer.forward(*args(inputs), save_preactivations=True)
    grads = engine_layer.backward(inputs["grad_output"], *args(inputs), preactivations=preactivations if save else None)
    return (y, *grads)


# the gate and up gradients' x: written out (x_s), gathered as their B operand, gathered as their A operand (against dg
# and du, or against [dg | du] as one B whose output is dWg's and dWu's column parts)
WEIGHT_GRAD_X = {
    "x_s_written": (False, False, False),
    "x_gathered_everywhere": (True, False, False),
    "x_gathered_as_a": (True, True, False),
    "x_gathered_as_a_one_product": (True, True, True),
}


def assert_gathering_changes_no_bit(inputs, save, weight_grads, monkeypatch):
    """The layer step with x's and dy's rows gathered in the loads (and, by ``weight_grads`` of
    :data:`WEIGHT_GRAD_X`, in the gate and up gradients' too, as their B or their A operand) gives the bits of the
    step reading x_s and dy_s written out first; no NaN. With x as A the gate and up gradients are the transposed
    products, x_sᵀ·dg, whose fp32 sums may round apart from dgᵀ·x_s's (the interpreter's fp32 dot does): those two
    within a few bf16 roundings."""
    gathered_x, x_as_a, one_product = WEIGHT_GRAD_X[weight_grads]
    monkeypatch.setattr(engine_layer, "GATHER_X_IN_WEIGHT_GRADS", gathered_x)
    monkeypatch.setattr(engine_layer, "X_AS_A_IN_WEIGHT_GRADS", x_as_a)
    monkeypatch.setattr(engine_layer, "X_AS_A_ONE_PRODUCT", one_product)
    gathered = forward_and_backward(inputs, save)
    monkeypatch.setattr(engine_layer, "GATHER_IN_LOADS", False)
    written = forward_and_backward(inputs, save)
    for name, got, want in zip(("y", "dx", "dtopk", "dWg", "dWu", "dWd"), gathered, written, strict=True):
        assert torch.isfinite(got).all(), name
        if x_as_a and name in ("dWg", "dWu"):
            assert rel_error(got, want) < 1e-3, name
        else:
            assert torch.equal(got, want), name


@pytest.mark.parametrize("case", ["uniform", "skewed", "K1"])
@pytest.mark.parametrize("save", [True, False], ids=["saved", "recomputed"])
@pytest.mark.parametrize("weight_grads", list(WEIGHT_GRAD_X))
def test_gathering_x_and_dy_in_the_loads_changes_no_bit(case, save, weight_grads, seed, nan_workspaces, monkeypatch):
    """x's and dy's rows read through the routing by the first product and dswiglu's (and, with
    GATHER_X_IN_WEIGHT_GRADS, by the gate and up gradients' too), or from x_s and dy_s written out first: the same
    products of the same rows."""
    assert_gathering_changes_no_bit(bf16_inputs(*CASES[case], seed), save, weight_grads, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512, 2048, 768, 128, 8), (300, 4096, 1024, 8, 2), (2048, 2048, 1408, 64, 6)])
@pytest.mark.parametrize("save", [True, False], ids=["saved", "recomputed"])
@pytest.mark.parametrize("weight_grads", list(WEIGHT_GRAD_X))
def test_gpu_gathering_x_and_dy_in_the_loads_changes_no_bit(shape, save, weight_grads, seed, nan_workspaces,
                                                            monkeypatch):  # fmt: skip
    T, H, I, E, K = shape
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    assert_gathering_changes_no_bit(inputs, save, weight_grads, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["GATHER_X_IN_WEIGHT_GRADS", "X_AS_A_IN_WEIGHT_GRADS"])
def test_gpu_x_gathered_in_the_weight_gradients_writes_no_x_s(switch, seed, monkeypatch):
    """With x gathered in the gate and up gradients (as B, or as A where I is a multiple of their tiles' 256
    columns, as here) the backward's peak (pre-activations saved) drops by x_s's [T·K, H] (written whole)."""
    T, H, I, E, K = 4096, 2048, 768, 32, 8
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    for off in ("GATHER_X_IN_WEIGHT_GRADS", "X_AS_A_IN_WEIGHT_GRADS", "X_S_IN_COLUMN_SLICES"):
        monkeypatch.setattr(engine_layer, off, False)
    peaks = peaks_off_and_on(inputs, switch, monkeypatch)
    x_s = 2 * T * K * H
    assert peaks[1] <= peaks[0] - x_s + 2**23, (peaks, x_s)


def test_dx_column_slices_no_wider_than_dg_du_and_whole_tiles(monkeypatch):
    monkeypatch.setattr(engine_layer, "DX_IN_COLUMN_SLICES", True)
    as_pairs = lambda slices: [(s.start, s.stop) for s in slices]  # noqa: E731
    assert as_pairs(engine_layer.dx_column_slices(2048, 768, 256)) == [(0, 1024), (1024, 2048)]  # Qwen3-30B-A3B
    assert as_pairs(engine_layer.dx_column_slices(2048, 1408, 256)) == [(0, 2048)]  # DeepSeek-V2-Lite: 2I ≥ H
    assert as_pairs(engine_layer.dx_column_slices(4096, 2048, 256)) == [(0, 4096)]  # P2
    assert as_pairs(engine_layer.dx_column_slices(320, 64, 64)) == [(0, 128), (128, 256), (256, 320)]
    assert as_pairs(engine_layer.dx_column_slices(7168, 256, 256)) == [(i, i + 512) for i in range(0, 7168, 512)]
    assert as_pairs(engine_layer.dx_column_slices(0, 64, 64)) == [(0, 0)]
    monkeypatch.setattr(engine_layer, "DX_IN_COLUMN_SLICES", False)
    assert as_pairs(engine_layer.dx_column_slices(2048, 768, 256)) == [(0, 2048)]


def test_x_s_column_slices_each_no_larger_than_a_weight_gradient(monkeypatch):
    monkeypatch.setattr(engine_layer, "X_S_IN_COLUMN_SLICES", True)
    as_pairs = lambda slices: [(s.start, s.stop) for s in slices]  # noqa: E731
    slices = engine_layer.x_s_column_slices
    # Qwen3-30B-A3B's and DeepSeek-V2-Lite's 32768 tokens: T·K over E·I, so x_s in three slices, each ≤ dWd's size
    assert as_pairs(slices(32768 * 8, 2048, 768, 128, 256)) == [(0, 768), (768, 1536), (1536, 2048)]
    assert as_pairs(slices(32768 * 6, 2048, 1408, 64, 256)) == [(0, 768), (768, 1536), (1536, 2048)]
    for num_slots, H, I, E in ((8192 * 8, 2048, 768, 128), (8192 * 8, 4096, 2048, 256), (0, 64, 64, 4)):
        assert as_pairs(slices(num_slots, H, I, E, 256)) == [(0, H)]  # x_s no larger than a weight's gradient
    assert as_pairs(slices(10**6, 320, 64, 5, 64)) == [(i, i + 64) for i in range(0, 320, 64)]  # one tile each at most
    monkeypatch.setattr(engine_layer, "X_S_IN_COLUMN_SLICES", False)
    assert as_pairs(slices(32768 * 8, 2048, 768, 128, 256)) == [(0, 2048)]


def layer_step_with_dx_slices(inputs, save, fused, slices, monkeypatch, switch="DX_IN_COLUMN_SLICES"):
    """y and the five gradients of a layer step with dX (or, ``switch`` X_S_IN_COLUMN_SLICES, x_s and the gate and
    up gradients) made in column slices or not; gate and up as the two halves of one fused block where ``fused``."""
    from moe_lib.moe_experts.weights import split_gate_up

    monkeypatch.setattr(engine_layer, switch, slices)
    monkeypatch.setattr(engine_layer, "X_AS_A_IN_WEIGHT_GRADS", False)  # x_s written, so that its slices are made
    layer_args = list(args(inputs))
    if fused:
        layer_args[3:5] = split_gate_up(torch.cat([inputs["gate_weights"], inputs["up_weights"]], dim=1))
    y, preactivations = engine_layer.forward(*layer_args, save_preactivations=True)
    grads = engine_layer.backward(inputs["grad_output"], *layer_args, preactivations=preactivations if save else None)
    return (y, *grads)


@pytest.mark.parametrize("switch", ["DX_IN_COLUMN_SLICES", "X_S_IN_COLUMN_SLICES"])
@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused_block"])
@pytest.mark.parametrize("save", [True, False], ids=["saved", "recomputed"])
def test_dx_in_column_slices_changes_no_bit(fused, save, switch, seed, nan_workspaces, monkeypatch):
    """dX made and summed three column slices at a time (H 320 > 2I 128, 64-wide tiles, the last slice narrower), or
    x_s and the gate and up gradients in slices (192 slots over E·I 128: two of 192 and 128 columns): the same
    products and sums as all columns at once, so the same bits; no NaN left in grad_x or the weight gradients."""
    tokens, experts = (13, 5) if switch == "DX_IN_COLUMN_SLICES" else (96, 2)
    inputs = bf16_inputs(tokens, 320, 64, experts, 2, "skewed", seed)
    sliced = layer_step_with_dx_slices(inputs, save, fused, True, monkeypatch, switch)
    whole = layer_step_with_dx_slices(inputs, save, fused, False, monkeypatch, switch)
    for name, got, want in zip(("y", "dx", "dtopk", "dWg", "dWu", "dWd"), sliced, whole, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want), name


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(512, 2048, 768, 128, 8), (300, 1024, 192, 8, 2)])
@pytest.mark.parametrize("fused", [False, True], ids=["pair", "fused_block"])
@pytest.mark.parametrize("switch", ["DX_IN_COLUMN_SLICES", "X_S_IN_COLUMN_SLICES"])
def test_gpu_dx_in_column_slices_changes_no_bit(shape, fused, switch, seed, nan_workspaces, monkeypatch):
    inputs = bf16_inputs(*shape, "uniform", seed, device="cuda")
    sliced = layer_step_with_dx_slices(inputs, True, fused, True, monkeypatch, switch)
    whole = layer_step_with_dx_slices(inputs, True, fused, False, monkeypatch, switch)
    for name, got, want in zip(("y", "dx", "dtopk", "dWg", "dWu", "dWd"), sliced, whole, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want), name


@pytest.mark.gpu
def test_gpu_dx_in_column_slices_lowers_the_peak_without_x_s(seed, monkeypatch):
    """Without x_s (GATHER_X_IN_WEIGHT_GRADS) at a fine-grained shape (H = 2048 > 2I = 1536) with few experts (their
    gate and up gradients, 2·E·I·H, under dX_s's [T·K, H]) the backward's peak is at dX's product; in two column
    slices its workspace is half of dX_s's."""
    T, H, I, E, K = 4096, 2048, 768, 8, 8
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    monkeypatch.setattr(engine_layer, "GATHER_X_IN_WEIGHT_GRADS", True)
    peaks = peaks_off_and_on(inputs, "DX_IN_COLUMN_SLICES", monkeypatch)
    half_dx_s = T * K * H  # bytes: half of [T·K, H] bf16
    assert peaks[1] <= peaks[0] - half_dx_s + 2**23, (peaks, half_dx_s)


def test_halves_of_one_views_g_and_u_as_one_buffer_only_where_they_are():
    g, u = runtime.allocate_preactivations(6, 64, torch.bfloat16, "cpu")  # as both forwards keep them
    together = g.as_strided((6, 128), (128, 1))
    view = engine_layer.halves_of_one(g, u)
    assert view is not None and view.data_ptr() == together.data_ptr() and view.shape == (6, 128)
    assert engine_layer.halves_of_one(u, g) is None  # the halves swapped
    assert engine_layer.halves_of_one(g[:4], u[:4]).shape == (4, 128)  # the forward's rows past num_slots left out
    apart = torch.zeros(6, 64, dtype=torch.bfloat16), torch.zeros(6, 64, dtype=torch.bfloat16)
    assert engine_layer.halves_of_one(*apart) is None


def layer_step_over_saved(inputs, spend):
    """y and the five gradients of a layer step (g and u saved), the backward told it may spend g and u or not; the
    saved g and u as the forward left them and as the backward left them."""
    y, preactivations = engine_layer.forward(*args(inputs), save_preactivations=True)
    kept = tuple(p.clone() for p in preactivations)
    grads = engine_layer.backward(
        inputs["grad_output"], *args(inputs), preactivations=preactivations, spend_preactivations=spend
    )
    return (y, *grads), kept, preactivations


@pytest.mark.parametrize("case", ["uniform", "skewed", "K1"])
def test_grads_over_the_saved_preactivations_change_no_bit(case, seed, nan_workspaces):
    """g and u kept as the halves of one buffer and, where the backward may spend them, [dg | du] written over them
    (dswiglu reads a tile of g and u before it writes dg and du there): the same six outputs, bit for bit, as with a
    workspace of its own; the spent buffer then holds the backward's dg and du, no longer g and u."""
    inputs = bf16_inputs(*CASES[case], seed)
    over, kept, spent = layer_step_over_saved(inputs, True)
    apart, _, untouched = layer_step_over_saved(inputs, False)
    for name, got, want in zip(("y", "dx", "dtopk", "dWg", "dWu", "dWd"), over, apart, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want), name
    assert engine_layer.halves_of_one(*spent) is not None and engine_layer.halves_of_one(*untouched) is not None
    slots = inputs["topk_indices"].numel()
    assert not torch.equal(spent[0][:slots], kept[0][:slots])  # dg over g
    assert all(torch.equal(p[:slots], k[:slots]) for p, k in zip(untouched, kept, strict=True))  # not spent: kept


# many slots beside few experts' weights, so that the backward's peak falls in the gate and up gradients' phase, where
# [dg | du] is alive beside x_s written whole (test_gpu_backward_peak_keeps_one_routed_copy_at_most_beside_the_weight_
# gradients's two phases); without x_s the peak moves to another launch
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8192, 1024, 512, 8, 4), (4096, 2048, 768, 16, 8)])
def test_gpu_grads_over_the_saved_preactivations_change_no_bit_and_lower_the_peak(shape, seed, monkeypatch):
    """On the GPU (dswiglu through the ring, 128 × 256 tiles): the same bits as with a [dg | du] workspace, and the
    backward's peak lower by that workspace's [T·K, 2I]."""
    monkeypatch.setattr(engine_layer, "X_AS_A_IN_WEIGHT_GRADS", False)
    monkeypatch.setattr(engine_layer, "X_S_IN_COLUMN_SLICES", False)
    T, H, I, E, K = shape
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    over, _, _ = layer_step_over_saved(inputs, True)
    apart, _, _ = layer_step_over_saved(inputs, False)
    for name, got, want in zip(("y", "dx", "dtopk", "dWg", "dWu", "dWd"), over, apart, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want), name
    peaks = [backward_peak(inputs, spend)[0] for spend in (False, True)]
    workspace = 2 * T * K * 2 * I
    assert peaks[1] <= peaks[0] - workspace + 2**23, (peaks, workspace)


@pytest.mark.gpu
def test_gpu_x_s_in_column_slices_lowers_the_peak_by_the_rest_of_x_s(seed, monkeypatch):
    """g and u spent and dX in slices, at a fine-grained shape with few experts: the backward's peak is in the gate
    and up gradients' launch, x_s beside them; in slices (T·K 32768 over E·I 6144: four of 512 columns, at the
    weight gradients' 256-column tiles) it holds one slice of x_s at a time, so the peak drops by x_s less its
    widest slice."""
    T, H, I, E, K = 4096, 2048, 768, 8, 8
    inputs = bf16_inputs(T, H, I, E, K, "uniform", seed, device="cuda")
    monkeypatch.setattr(engine_layer, "DX_IN_COLUMN_SLICES", True)
    monkeypatch.setattr(engine_layer, "X_AS_A_IN_WEIGHT_GRADS", False)  # x_s written
    peaks = peaks_off_and_on(inputs, "X_S_IN_COLUMN_SLICES", monkeypatch, spend=True)
    x_s, widest_slice = 2 * T * K * H, 2 * T * K * 512
    assert peaks[1] <= peaks[0] - (x_s - widest_slice) + 2**23, (peaks, x_s)
