"""P1's public call on the Triton path: ``swiglu_down_backward(..., impl="triton")``, the ``swiglu_expert`` layer, the
layer's elementwise step, and what the designs share on the host (``runtime``).

CPU: the call under the Triton interpreter on small shapes (whatever the chooser picks there), from NaN-filled
allocations: the benchmark's element rule on the faithful path, the layer against autograd, double backward refused;
the split workspaces' counters for CUDA-graph captures; the Gluon program traces' context.
GPU (``gpu`` marker): every benchmark case plus odd token counts, and the models' shapes (H, I) at a few token
counts, in both precisions against the float64 reference, each output within its precision's rule; fp32 inputs;
inputs off a 16-byte boundary; determinism; CUDA-graph capture (no memset node) and replay with new inputs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import rel_error
from oracles import swiglu_expert_grads

import moe_lib
from moe_lib import problems
from moe_lib.bench.checks import compare_output
from moe_lib.dispatch import interpreter_enabled

from .helpers import DEVICE, ELEMENT_RULE, OUTPUTS, check_against_float64, check_small, float64_reference

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)
LEAVES = ("x", "gate_weight", "up_weight", "down_weight")


@needs_triton
@pytest.mark.parametrize(
    "T, H, I, dtype",
    [(0, 16, 8, torch.bfloat16), (5, 32, 16, torch.bfloat16), (37, 33, 19, torch.float16), (13, 40, 24, torch.float32)],
)
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_public_call_runs_triton_from_poisoned_memory(T, H, I, dtype, precision, seed, poisoned, monkeypatch):
    """impl="triton" runs the Triton call (a spy counts it; the reference would raise), whose outputs and workspaces
    come from NaN-filled memory: what comes back was written by the kernels, and two calls give the same bits."""
    from moe_lib.swiglu_down import api, backward

    calls, real = [], backward.swiglu_down_backward_triton

    def spy(*args, **kwargs):
        calls.append(kwargs.get("precision"))
        return real(*args, **kwargs)

    def no_reference(*args):
        raise AssertionError("impl='triton' ran the reference")

    monkeypatch.setattr(backward, "swiglu_down_backward_triton", spy)
    monkeypatch.setattr(api, "swiglu_down_backward_reference", no_reference)
    inputs = problems.make_inputs(
        "swiglu_down_backward", T, seed=seed, device=DEVICE, dtype=dtype, hidden_size=H, intermediate_size=I
    )
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton", precision=precision)
    again = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton", precision=precision)
    assert calls == [precision, precision]
    check_small(got, float64_reference(inputs), dtype, precision)
    for name, a, b in zip(OUTPUTS, got, again, strict=True):
        assert torch.equal(a, b), f"{name}: two calls differ"


@needs_triton
@pytest.mark.parametrize("T", [1, 37])
def test_faithful_path_passes_the_element_rule_at_the_harness_scale(T, seed):
    """Std-1 inputs (what the benchmark's harness draws): dGate and dUp rounded to bf16 fail the element rule on
    elements near zero; carried as hi/lo pairs they pass it, and the default is that path."""
    inputs = problems.make_inputs(
        "swiglu_down_backward",
        T,
        seed=seed,
        device=DEVICE,
        hidden_size=64,
        intermediate_size=48,
        distribution="harness",
    )
    want = float64_reference(inputs)
    faithful = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton")
    fast = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton", precision="fast")
    for name, f, q, w in zip(OUTPUTS, faithful, fast, want, strict=True):
        exact = compare_output(f, w, ELEMENT_RULE)
        assert exact["finite"] and exact["pass_fraction"] >= ELEMENT_RULE["required_fraction"], (name, exact)
        assert exact["rel_error"] <= compare_output(q, w, ELEMENT_RULE)["rel_error"] + 1e-7, name


@needs_triton
def test_layer_gradients_match_autograd(seed):
    inputs = problems.make_inputs(
        "swiglu_down_backward", 11, seed=seed, device=DEVICE, dtype=torch.float32, hidden_size=40, intermediate_size=24
    )
    leaves = [inputs[k].clone().requires_grad_() for k in LEAVES]
    y = moe_lib.swiglu_expert(*leaves, impl="triton")
    y.backward(inputs["grad_output"])
    want = swiglu_expert_grads(inputs["grad_output"], *leaves)
    for name, leaf, w in zip(LEAVES, leaves, want, strict=True):
        assert rel_error(leaf.grad, w) <= 1e-5, name


@needs_triton
def test_layer_runs_the_elementwise_step_in_one_launch_each_way(seed, monkeypatch):
    """The Triton layer's forward and backward each take σ, silu and the intermediate from the one launch, never
    from PyTorch's eager ops."""
    from moe_lib.swiglu_down import activation, api

    calls = []
    real = activation.swiglu_activation
    monkeypatch.setattr(activation, "swiglu_activation", lambda *a, **k: calls.append(k["with_saved"]) or real(*a, **k))

    def no_eager(*args):
        raise AssertionError("the Triton layer ran the eager elementwise ops")

    monkeypatch.setattr(api, "_swiglu_saved", no_eager)
    inputs = problems.make_inputs(
        "swiglu_down_backward", 7, seed=seed, device=DEVICE, dtype=torch.float32, hidden_size=40, intermediate_size=24
    )
    leaves = [inputs[k].clone().requires_grad_() for k in LEAVES]
    y = moe_lib.swiglu_expert(*leaves, impl="triton")
    y.backward(inputs["grad_output"])
    assert calls == [False, True]
    monkeypatch.undo()
    want = swiglu_expert_grads(inputs["grad_output"], *leaves)
    for name, leaf, w in zip(LEAVES, leaves, want, strict=True):
        assert rel_error(leaf.grad, w) <= 1e-5, name


# ---------------------------------------------------------------------------------------------
# the layer's elementwise step (activation.swiglu_activation)


def _activation_inputs(shape, dtype, seed, device):
    generator = torch.Generator(device=device).manual_seed(seed)
    gate = 4 * torch.randn(shape, generator=generator, device=device)
    edges = torch.tensor([-200.0, 200.0, 0.0, -0.0], device=device)  # exp(−gate) overflows; σ = 0, 1, ½
    gate.view(-1)[: min(4, gate.numel())] = edges[: gate.numel()]
    up = torch.randn(shape, generator=generator, device=device)
    return gate.to(dtype), up.to(dtype)


def check_activation(got, gate, up):
    """σ, silu and the intermediate against the layer's PyTorch ops (api._swiglu_saved): 16-bit outputs equal but on
    ≤ 0.1% of the elements, where σ and silu are one unit in the last place apart and the intermediate silu·u by that
    unit times |u| more (each side computes in fp32 with its own exp, CUDA's or NumPy's beside PyTorch's: one fp32
    unit apart, and a value that close to a 16-bit tie rounds to either neighbour); fp32 within 1e-6 relative."""
    from moe_lib.swiglu_down.api import _swiglu_saved

    wanted = _swiglu_saved(gate, up)
    silu_apart = (got[1].float() - wanted[1].float()).abs()
    for name, g, w in zip(("gate_sigmoid", "gate_silu", "intermediate"), got, wanted, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.isfinite(g).all(), f"{name}: NaN/Inf (an unwritten element?)"
        if g.dtype == torch.float32:
            assert rel_error(g, w) <= 1e-6, name
            continue
        ulp = torch.finfo(g.dtype).eps * w.float().abs().clamp_min(torch.finfo(g.dtype).tiny)
        if name == "intermediate":  # silu·u from a silu one unit apart: that unit times |u|, then its own rounding
            ulp = ulp + silu_apart * up.float().abs()
        differ = g != w
        assert differ.float().mean() <= 1e-3, name
        assert ((g.float() - w.float()).abs() <= ulp)[differ].all(), name


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (37, 53), (3, 1024), (5, 700)])
def test_activation_rounds_as_the_layers_forward(dtype, shape, seed, poisoned):
    from moe_lib.swiglu_down.activation import swiglu_activation

    gate, up = _activation_inputs(shape, dtype, seed, DEVICE)
    saved = swiglu_activation(gate, up, with_saved=True)
    check_activation(saved, gate, up)
    intermediate = swiglu_activation(gate, up, with_saved=False)
    assert torch.equal(intermediate, saved[2])


@needs_triton
def test_activation_of_no_elements():
    from moe_lib.swiglu_down.activation import swiglu_activation

    empty = torch.empty((0, 16), dtype=torch.bfloat16, device=DEVICE)
    assert [t.shape for t in swiglu_activation(empty, empty, with_saved=True)] == [(0, 16)] * 3


# ---------------------------------------------------------------------------------------------
# what the designs share on the host (runtime.py, moe_lib/tma.py, designs/gluon.py's traces)


def test_a_capture_takes_counters_an_eager_call_made_ready(monkeypatch):
    """A CUDA graph's capture cannot zero memory outside the graph: it takes the zeroed spare counters the last eager
    call of the slot made ready, and keeps them (no later call shares them); with none ready, zeros of its own. The
    eager calls keep their own counters, whatever the captures took."""
    from moe_lib.swiglu_down import runtime
    from moe_lib.swiglu_down.runtime import SplitWorkspace

    monkeypatch.setattr(SplitWorkspace, "_counters", {})
    monkeypatch.setattr(SplitWorkspace, "_spares", {})
    monkeypatch.setattr(SplitWorkspace, "_graph_owned", [])
    device = torch.device("cpu")
    capturing = [False]
    monkeypatch.setattr(runtime, "capturing", lambda _: capturing[0])

    def counters(size=10):
        return SplitWorkspace.counters("slot", 2, size, device)

    eager = counters()
    eager.add_(2)  # a call's arrivals
    assert counters().data_ptr() == eager.data_ptr()
    capturing[0] = True
    first_graph = counters()
    assert first_graph.data_ptr() != eager.data_ptr() and not first_graph.any()
    second_graph = counters()  # no eager call since: zeros of its own
    assert second_graph.data_ptr() not in (eager.data_ptr(), first_graph.data_ptr()) and not second_graph.any()
    assert SplitWorkspace._graph_owned == [first_graph]
    capturing[0] = False
    assert counters().data_ptr() == eager.data_ptr() and eager[0] == 2  # the eager counts untouched
    capturing[0] = True
    third_graph = counters()
    assert third_graph.data_ptr() not in (eager.data_ptr(), first_graph.data_ptr()) and not third_graph.any()
    assert counters(size=4096).numel() >= 4096  # a spare too small is not taken


def test_split_workspace_refuses_a_split_that_is_no_power_of_two():
    from moe_lib.swiglu_down.runtime import SplitWorkspace

    with pytest.raises(ValueError, match="^config: SPLIT must be a power of two, got 3"):
        SplitWorkspace.for_tiles("slot", 4, 3, 16, 16, torch.device("cpu"))


def test_tma_needs_every_input_to_start_on_a_16_byte_boundary():
    from moe_lib.tma import aligned, rows_fit

    storage = torch.zeros(64, dtype=torch.bfloat16)
    assert aligned(storage, storage[8:])
    assert not aligned(storage, storage[1:]) and not aligned(storage[4:])
    assert rows_fit(2048, 768, element_bytes=2) and rows_fit(1000, element_bytes=2)
    assert not rows_fit(2048, 300, element_bytes=2) and rows_fit(300, element_bytes=4)


def test_traced_programs_collects_only_gluon_launches_and_does_not_nest():
    """The program-tracing context: calls of designs without Gluon launches (here, on the CPU) append nothing, and it
    refuses to be entered twice."""
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton
    from moe_lib.swiglu_down.designs.gluon import traced_programs

    inputs = problems.make_inputs("swiglu_down_backward", 3, seed=0, hidden_size=32, intermediate_size=16)
    with traced_programs() as traces:
        if not torch.cuda.is_available():
            swiglu_down_backward_triton(*inputs.values())
            assert traces == []
        with pytest.raises(RuntimeError, match="already inside"), traced_programs():
            pass
    with traced_programs() as again:  # usable again after the first has ended
        assert again == []


# ---------------------------------------------------------------------------------------------
# GPU: the public call


def odd_token_counts():
    return [3, 100, 999, 5000, 12288]


# the models' (H, I): the benchmark's, Mixtral's and Llama's, DeepSeek's, gpt-oss's, Qwen's and DeepSeek-V2-Lite's
# experts, and one whose rows TMA cannot address (I = 300: 600 bytes)
MODEL_SHAPES = [
    (2048, 768),
    (4096, 1536),
    (7168, 2048),
    (4096, 14336),
    (2880, 2880),
    (2048, 1024),
    (2048, 1408),
    (1000, 300),
]


@pytest.mark.gpu
@pytest.mark.parametrize("T", problems.load("swiglu_down_backward").suite + odd_token_counts())
@pytest.mark.parametrize("distribution", ["forward", "harness"])
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_accuracy_at_both_input_scales(T, distribution, precision, seed):
    from moe_lib.bench.timing import poison_allocator

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution=distribution)
    poison_allocator("cuda", 256 * 2**20)
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton", validate=False, precision=precision)
    check_against_float64(inputs, got, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 64, 256, 1024, 3000])
@pytest.mark.parametrize("H, I", MODEL_SHAPES)
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_models_shapes(H, I, T, precision, seed):
    """Whatever design the chooser takes for the shape (few tokens, Gluon forms by the generic rule, cuBLAS, the
    faithful path's design for rows TMA cannot address), from poisoned memory at the harness's scale."""
    from moe_lib.bench.timing import poison_allocator

    inputs = problems.make_inputs(
        "swiglu_down_backward", T, seed=seed, device="cuda", distribution="harness", hidden_size=H, intermediate_size=I
    )
    poison_allocator("cuda", 256 * 2**20)
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton", precision=precision)
    check_against_float64(inputs, got, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 13, 300, 3000])
def test_gpu_fp32_inputs(T, seed):
    """fp32 inputs: exact fp32 products on the portable design, within 1e-5 of float64."""
    from moe_lib.bench.timing import poison_allocator

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", dtype=torch.float32)
    poison_allocator("cuda", 256 * 2**20)
    got = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton")
    for name, g, w in zip(OUTPUTS, got, float64_reference(inputs), strict=True):
        assert g.dtype == torch.float32 and rel_error(g, w) <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 128, 1087, 8192])
def test_gpu_deterministic(T, seed):
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    first = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton")
    second = moe_lib.swiglu_down_backward(*inputs.values(), impl="triton")
    for name, a, b in zip(OUTPUTS, first, second, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [4, 512, 3089])
def test_gpu_cuda_graph_replay_with_new_inputs(T, seed):
    from moe_lib.bench.timing import capture

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    static = {k: v.clone() for k, v in inputs.items()}
    graph, outputs = capture(lambda: moe_lib.swiglu_down_backward(*static.values(), impl="triton", validate=False))
    fresh = problems.make_inputs("swiglu_down_backward", T, seed=seed + 1, device="cuda")
    for name, tensor in fresh.items():
        static[name].copy_(tensor)
    graph.replay()
    torch.cuda.synchronize()
    eager = moe_lib.swiglu_down_backward(*fresh.values(), impl="triton")
    for name, g, e in zip(OUTPUTS, outputs, eager, strict=True):
        assert torch.equal(g, e), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 16, 128, 300])  # the few-token launches, the Gluon launches' split counters
@pytest.mark.parametrize("precision", ["faithful", "fast"])
def test_gpu_captured_graph_zeroes_no_counters(T, precision, seed, tmp_path):
    """Captured after an eager call on another stream (as :func:`moe_lib.bench.timing.capture` does), the graph holds
    the call's kernels and no memset (its counters are the ones that call zeroed), and its replays give the eager
    call's bits."""
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # (its nodes kept for debug_dump)
    graph.enable_debug_mode()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        moe_lib.swiglu_down_backward(*inputs.values(), precision=precision)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        outputs = moe_lib.swiglu_down_backward(*inputs.values(), precision=precision)
    graph.debug_dump(str(tmp_path / "graph.dot"))
    nodes = (tmp_path / "graph.dot").read_text().upper()
    assert "KERNEL" in nodes and "MEMSET" not in nodes, nodes[:2000]
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    eager = moe_lib.swiglu_down_backward(*inputs.values(), precision=precision)
    for name, g, e in zip(OUTPUTS, outputs, eager, strict=True):
        assert torch.equal(g, e), name


@pytest.mark.gpu
@pytest.mark.parametrize("T", [100, 1321])
def test_gpu_graph_in_eager_calls_back_to_back_each_with_its_own_inputs(T, seed):
    """The default's calls issued one after another with no synchronisation between them, each on inputs of its own:
    the kept executable graph is brought up to a call's arguments while the one before may still run (CUDA applies an
    update to later launches only), so every call's outputs must match float64 on its own inputs."""
    from moe_lib.bench.timing import poison_allocator

    calls = [
        problems.make_inputs("swiglu_down_backward", T, seed=seed + i, device="cuda", distribution="harness")
        for i in range(4)
    ]
    moe_lib.swiglu_down_backward(*calls[0].values())  # compiled before the calls under test
    torch.cuda.synchronize()
    poison_allocator("cuda", 256 * 2**20)
    outputs = [moe_lib.swiglu_down_backward(*inputs.values()) for inputs in calls]
    torch.cuda.synchronize()
    for inputs, got in zip(calls, outputs, strict=True):
        check_against_float64(inputs, got, "faithful")


@pytest.mark.gpu
@pytest.mark.parametrize("T", [100, 1087])
def test_gpu_inputs_off_a_16_byte_boundary(T, seed):
    """An input starting off a 16-byte boundary (a view into a larger tensor) cannot be a TMA operand: the chooser
    takes a design of pointer-based loads (few tokens; the chained launch at 1087), within the rule of float64; a
    Gluon form asked for by ``config`` is refused with the reason."""
    from moe_lib.bench.timing import poison_allocator
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton
    from moe_lib.swiglu_down.designs.gluon import FORMS

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution="harness")
    for name in ("x", "gate_silu"):
        tensor = inputs[name]
        shifted = torch.empty(tensor.numel() + 1, dtype=tensor.dtype, device="cuda")[1:].view(tensor.shape)
        inputs[name] = shifted.copy_(tensor)
        assert inputs[name].data_ptr() % 16 != 0
    poison_allocator("cuda", 256 * 2**20)
    got = swiglu_down_backward_triton(*inputs.values(), precision="faithful")
    torch.cuda.synchronize()
    check_against_float64(inputs, got, "faithful")
    with pytest.raises(ValueError, match="TMA needs every operand to start on a 16-byte boundary"):
        swiglu_down_backward_triton(*inputs.values(), config=FORMS["wide"])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [40, 300, 2447])  # the fast path's few-token launch, Gluon launches, cuBLAS design
def test_gpu_layer_bf16_against_autograd(T, seed):
    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda")
    leaves = [inputs[k].clone().requires_grad_() for k in LEAVES]
    y = moe_lib.swiglu_expert(*leaves)
    y.backward(inputs["grad_output"])
    want = swiglu_expert_grads(inputs["grad_output"], *leaves)
    for name, leaf, w in zip(LEAVES, leaves, want, strict=True):
        assert rel_error(leaf.grad, w) <= 3e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_activation_at_the_layers_sizes(dtype, seed):
    from moe_lib.bench.timing import poison_allocator
    from moe_lib.swiglu_down.activation import swiglu_activation

    poison_allocator("cuda", 256 * 2**20)
    gate, up = _activation_inputs((8192, 768), dtype, seed, "cuda")
    check_activation(swiglu_activation(gate, up, with_saved=True), gate, up)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [128, 2447])
def test_gpu_traced_programs_record_every_program_and_keep_the_results(T, seed):
    """Under traced_programs the chosen Gluon launches record one row per program (start ≤ proceed ≤ end on the
    GPU's clock, an SM, a tile kind counted as the programs are), and the call still matches float64."""
    from moe_lib.bench.timing import poison_allocator
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton
    from moe_lib.swiglu_down.choose import choose_design
    from moe_lib.swiglu_down.designs.gluon import traced_programs
    from moe_lib.swiglu_down.gluon_launch2 import TRACE_FIELDS
    from moe_lib.swiglu_down.runtime import device_of

    inputs = problems.make_inputs("swiglu_down_backward", T, seed=seed, device="cuda", distribution="harness")
    H, I = inputs["x"].shape[1], inputs["gate_weight"].shape[0]
    design = choose_design(T, H, I, dtype=torch.bfloat16, precision="faithful", device=device_of(inputs["x"]))
    assert design.name == "gluon_launches"
    with traced_programs() as traces:
        for _ in range(2):  # the first call compiles the traced build
            poison_allocator("cuda", 256 * 2**20)
            got = swiglu_down_backward_triton(*inputs.values())
        torch.cuda.synchronize()
    check_against_float64(inputs, got, "faithful")
    assert len(traces) == 2 and set(traces[-1]) == {"launch 1", "launch 2"}
    first, second = design.first, design.second
    assert first.grad_down_tiles  # dWd's tiles in launch 1 at these token counts: there a weight-gradient kind
    expected = {
        "launch 1": (first, H * I // (first.block_m * first.grad_down_block_n)),
        "launch 2": (second, second.weight_grad_programs_for(H, I)),
    }  # one row a weight-gradient program
    for name, rows in traces[-1].items():
        launch, weight_tiles = expected[name]
        rows = rows.cpu()
        fields = {field: rows[:, i] for i, field in enumerate(TRACE_FIELDS)}
        assert rows.shape[0] == launch.programs(T, H, I), name
        assert (fields["start_ns"] > 0).all() and (fields["proceed_ns"] >= fields["start_ns"]).all(), name
        assert (fields["end_ns"] >= fields["proceed_ns"]).all(), name
        assert ((fields["sm"] >= 0) & (fields["sm"] < 256)).all(), name
        assert int((fields["kind"] == 0).sum()) == weight_tiles, name
