"""The layers under torch.compile: one graph, no break, forward and backward equal to eager; the registered ops pass
torch.library.opcheck; the checks that read values still run (inside the ops) with eager's messages.

On the CPU the ops run the reference (impl="auto"), or the Triton kernels under the interpreter (impl="triton");
the tests marked gpu run the Triton path on CUDA, the issue's targets.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import rel_error
from oracles import moe_experts_grads, swiglu_expert_grads
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_lib
import moe_lib.nn
from moe_lib import problems
from moe_lib.dispatch import interpreter_enabled

P1, P2, _ = problems.PROBLEM_NAMES
LAYER_ARGUMENTS = {
    "swiglu_expert": ("x", "gate_weight", "up_weight", "down_weight"),
    "moe_experts": ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights"),
    "moe_experts_gate_up": ("hidden_states", "topk_weights", "gate_up_weights", "down_weights"),
}
PARALLEL_OPS = {"moe_experts_parallel", "moe_experts_parallel_backward"}
needs_interpreter = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (the CPU runs)")


@pytest.fixture(autouse=True)
def fresh_compiler():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def layer_case(layer: str, T: int, seed: int, device="cpu", dtype=torch.float32, **options):
    """(function of the differentiable leaves, the leaves, grad_output, float64 gradients of the same math)."""
    if layer == "swiglu_expert":
        inputs = problems.make_inputs(
            P1, T, seed=seed, device=device, dtype=dtype, hidden_size=32, intermediate_size=16
        )
        want = swiglu_expert_grads(*[inputs[n].double() for n in ("grad_output", *LAYER_ARGUMENTS[layer])])

        def call(x, gate, up, down):
            return moe_lib.swiglu_expert(x, gate, up, down, **options)
    else:
        inputs = problems.make_inputs(
            P2, T, seed=seed, device=device, hidden_size=32, intermediate_size=16, num_experts=6, top_k=2
        )
        inputs = {name: t.to(dtype) if t.is_floating_point() else t for name, t in inputs.items()}
        indices = inputs["topk_indices"]
        want = moe_experts_grads(*[t.double() if t.is_floating_point() else t for t in inputs.values()])

        def call(x, w, gate, up, down):
            return moe_lib.moe_experts(x, indices, w, gate, up, down, **options)

        if layer == "moe_experts_gate_up":  # the gate and up weights as one block, and so their gradient
            inputs["gate_up_weights"] = torch.cat((inputs["gate_weights"], inputs["up_weights"]), dim=1)
            want = (*want[:2], torch.cat(want[2:4], dim=1), want[4])

            def call(x, w, gate_up, down):
                return moe_lib.moe_experts_gate_up(x, indices, w, gate_up, down, **options)

    leaves = [inputs[name].clone().requires_grad_() for name in LAYER_ARGUMENTS[layer]]
    return call, leaves, inputs["grad_output"], want


def run(function, leaves, grad_output):
    y = function(*leaves)
    return y, torch.autograd.grad(y, leaves, grad_output)


def assert_compiles_whole(function, leaves) -> None:
    explained = torch._dynamo.explain(function)(*leaves)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


# ------------------------------------------------------------------------------------------------
# the layers, compiled (CPU: the reference behind the ops)


@pytest.mark.parametrize(
    "layer,options",
    [
        pytest.param("swiglu_expert", {}, id="swiglu_expert"),
        pytest.param("moe_experts", {}, id="moe_experts"),
        pytest.param("moe_experts", dict(save_activations=True, validate=False), id="moe_experts-saved"),
        pytest.param("moe_experts_gate_up", {}, id="moe_experts_gate_up"),
    ],
)
def test_layers_compile_whole_and_match_eager(layer, options, seed):
    function, leaves, grad_output, want = layer_case(layer, 9, seed, **options)
    assert_compiles_whole(function, leaves)
    eager_y, eager_grads = run(function, leaves, grad_output)
    compiled_y, compiled_grads = run(torch.compile(function, fullgraph=True), leaves, grad_output)
    assert torch.equal(compiled_y, eager_y)
    for name, got, eager, exact in zip(
        LAYER_ARGUMENTS[layer], compiled_grads, eager_grads, want[-len(leaves) :], strict=True
    ):
        assert torch.equal(got, eager), name
        assert rel_error(got, exact) <= 1e-5, name


def test_choosing_the_implementation_looks_nothing_up_at_call_time(monkeypatch):
    """On CUDA the layers resolve ``impl`` inside the traced code; torch 2.11's Dynamo refuses to trace importlib
    (a graph break in every layer), so whether triton is installed is looked up once, at import."""
    import importlib.util

    from moe_lib import dispatch

    def refused(*args, **kwargs):
        raise AssertionError("importlib.util.find_spec called at call time")

    monkeypatch.setattr(importlib.util, "find_spec", refused)
    cuda = torch.device("cuda")
    expected = "triton" if dispatch.TRITON_IMPORTABLE else "reference"
    assert dispatch.resolve_impl("auto", cuda, torch.bfloat16) == expected
    if dispatch.TRITON_IMPORTABLE:
        assert dispatch.resolve_impl("triton", cuda, torch.bfloat16) == "triton"


def test_moe_experts_gradients_against_float64_include_the_routing_weights(seed):
    """The P2 oracle's order is (dx, dw, dWg, dWu, dWd): the same as the layer's leaves."""
    function, leaves, grad_output, want = layer_case("moe_experts", 7, seed)
    _, grads = run(torch.compile(function, fullgraph=True), leaves, grad_output)
    assert [rel_error(g, w) <= 1e-5 for g, w in zip(grads, want, strict=True)] == [True] * 5


def test_token_counts_share_one_compiled_graph(seed):
    """dynamic=True: a second token count reuses the graph (the fake implementations are symbolic in T)."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(moe_lib.moe_experts, backend=counter, fullgraph=True, dynamic=True)
    for T in (5, 11):
        inputs = problems.make_inputs(
            P2, T, seed=seed + T, hidden_size=32, intermediate_size=16, num_experts=6, top_k=2
        )
        leaves = [inputs[name].clone().requires_grad_() for name in LAYER_ARGUMENTS["moe_experts"]]
        y = compiled(leaves[0], inputs["topk_indices"], *leaves[1:])
        grads = torch.autograd.grad(y, leaves, inputs["grad_output"])
        want = moe_experts_grads(*[t.double() if t.is_floating_point() else t for t in inputs.values()])
        assert all(rel_error(g, w) <= 1e-5 for g, w in zip(grads, want, strict=True)), T
    assert counter.frame_count == 1


class Block(torch.nn.Module):
    """A MoE block as models write it: norm, a softmax top-k router, the experts, the residual."""

    def __init__(self, hidden_size=32, intermediate_size=16, num_experts=6, top_k=2):
        super().__init__()
        self.norm = torch.nn.RMSNorm(hidden_size)
        self.router = torch.nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = moe_lib.nn.MoEExperts(num_experts, hidden_size, intermediate_size, validate=False)
        self.top_k = top_k

    def forward(self, x):
        h = self.norm(x)
        probabilities = self.router(h).softmax(dim=-1)
        weights, indices = probabilities.topk(self.top_k, dim=-1)
        return x + self.experts(h, indices, weights / weights.sum(dim=-1, keepdim=True))


def test_a_whole_block_compiles_and_trains_as_eager(seed):
    torch.manual_seed(seed)
    block = Block()
    x = torch.randn(3, 5, 32)
    assert_compiles_whole(block, [x])
    compiled = torch.compile(block, fullgraph=True)
    results = []
    for forward in (block, compiled):
        block.zero_grad()
        y = forward(x)
        y.square().mean().backward()
        results.append((y.detach(), {name: p.grad.clone() for name, p in block.named_parameters()}))
    (eager_y, eager_grads), (compiled_y, compiled_grads) = results
    assert rel_error(compiled_y, eager_y) <= 1e-6
    for name, grad in eager_grads.items():  # router included: its gradient flows through topk_weights
        assert grad.abs().sum() > 0 and rel_error(compiled_grads[name], grad) <= 1e-5, name


# ------------------------------------------------------------------------------------------------
# checks that read values: inside the ops, in compiled code too


def test_index_checks_raise_in_compiled_code_as_in_eager(seed):
    function, leaves, _, _ = layer_case("moe_experts", 6, seed)
    inputs = problems.make_inputs(P2, 6, seed=seed, hidden_size=32, intermediate_size=16, num_experts=6, top_k=2)
    out_of_range, repeated = inputs["topk_indices"].clone(), inputs["topk_indices"].clone()
    out_of_range[4, 1] = 6
    repeated[2, 1] = repeated[2, 0]
    for indices, pattern in (
        (out_of_range, r"^topk_indices: expert index 6 out of range \[0, 6\)"),
        (repeated, "^topk_indices: token 2 lists the same expert twice"),
    ):

        def layer(x, w, gate, up, down, indices=indices):
            return moe_lib.moe_experts(x, indices, w, gate, up, down)

        with pytest.raises(ValueError, match=pattern):
            layer(*leaves)
        with pytest.raises(ValueError, match=pattern):
            torch.compile(layer, backend="aot_eager", fullgraph=True)(*leaves)
    unchecked = torch.compile(
        lambda *a: moe_lib.moe_experts(a[0], repeated, *a[1:], validate=False), backend="aot_eager", fullgraph=True
    )
    assert torch.isfinite(unchecked(*leaves)).all()


def test_check_finite_raises_in_compiled_code_forward_and_backward(seed):
    function, leaves, grad_output, _ = layer_case("swiglu_expert", 5, seed, check_finite=True)
    compiled = torch.compile(function, backend="aot_eager", fullgraph=True)
    poisoned = leaves[0].detach().clone()
    poisoned[3, 7] = math.nan
    with pytest.raises(ValueError, match="^x: holds NaN or Inf"):
        compiled(poisoned, *leaves[1:])
    y = compiled(*leaves)
    with pytest.raises(ValueError, match="^grad_output: holds NaN or Inf"):
        y.backward(torch.full_like(y, math.inf))


@needs_interpreter
def test_the_triton_layer_refuses_strided_weights_before_any_work(seed):
    """The kernels address the weights by row-major strides: a strided one is named in the forward, as the backward
    named it before the layer was an op."""
    _, leaves, _, _ = layer_case("swiglu_expert", 4, seed)
    x, gate, up, down = (leaf.detach() for leaf in leaves)
    with pytest.raises(ValueError, match="^down_weight: expected a contiguous tensor"):
        moe_lib.swiglu_expert(x, gate, up, down.T.contiguous().T, impl="triton")


def test_the_public_functions_give_fake_outputs_of_the_right_shapes_and_dtypes():
    """Under FakeTensorMode (what the compiler traces with): shapes, dtypes and row-major strides, no values read;
    the routing-weight gradient in topk_weights' dtype."""
    p1 = problems.make_inputs(P1, 7, seed=0, dtype=torch.bfloat16, hidden_size=32, intermediate_size=16)
    p2 = problems.make_inputs(P2, 7, seed=0, hidden_size=32, intermediate_size=16, num_experts=6, top_k=2)
    p2 = {n: t.to(torch.bfloat16) if t.is_floating_point() and n != "topk_weights" else t for n, t in p2.items()}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake1 = {name: mode.from_tensor(t) for name, t in p1.items()}
        fake2 = {name: mode.from_tensor(t) for name, t in p2.items()}
        grads1 = moe_lib.swiglu_down_backward(*fake1.values())
        grads2 = moe_lib.moe_experts_backward(*fake2.values())
        y = moe_lib.moe_experts(*list(fake2.values())[1:], save_activations=True)
    want1 = [p1[n] for n in ("x", "gate_weight", "up_weight", "down_weight")]
    want2 = [p2[n] for n in ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")]
    for got, like in zip((*grads1, *grads2, y), (*want1, *want2, p2["hidden_states"]), strict=True):
        assert (got.shape, got.dtype, got.stride()) == (like.shape, like.dtype, like.stride())
    assert grads2[1].dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# opcheck on every registered op


def op_cases(device="cpu", dtype=torch.float32, impl="auto", T=6):
    """(op, arguments) for each registered op, on small fresh inputs."""
    p1 = problems.make_inputs(P1, T, seed=T, device=device, dtype=dtype, hidden_size=32, intermediate_size=16)
    p2 = problems.make_inputs(
        P2, T, seed=T, device=device, hidden_size=32, intermediate_size=16, num_experts=4, top_k=2
    )
    p2 = {name: t.to(dtype) if t.is_floating_point() else t for name, t in p2.items()}
    ops = torch.ops.moe_lib
    p1_weights = [p1[n] for n in ("gate_weight", "up_weight", "down_weight")]
    p2_forward = list(p2.values())[1:]
    gate_up = torch.cat((p2["gate_weights"], p2["up_weights"]), dim=1)
    p2_gate_up = (*p2_forward[:3], gate_up, p2["down_weights"])
    return [
        (ops.swiglu_down_backward.default, (*p1.values(), impl, "fast", False)),
        (ops.swiglu_expert.default, (p1["x"], *p1_weights, impl, "fast", False)),
        (
            ops.swiglu_expert_backward.default,
            (p1["grad_output"], p1["x"], *p1_weights, p1["gate"], p1["up"], impl, "fast", False),
        ),
        (ops.moe_experts_backward.default, (*p2.values(), impl, True, False, None, None)),
        (ops.moe_experts.default, (*p2_forward, impl, True, False, False)),
        (ops.moe_experts.default, (*p2_forward, impl, False, False, True)),
        (ops.moe_experts_gate_up.default, (*p2_gate_up, impl, True, False, False)),
        (
            ops.moe_experts_backward_gate_up.default,
            (p2["grad_output"], *p2_gate_up, impl, True, False, None, None),
        ),
    ]


def op_id(case) -> str:
    op, arguments = case
    name = op.name().split("::")[1]
    return f"{name}-saved" if name == "moe_experts" and arguments[-1] is True else name


OP_IDS = [op_id(case) for case in op_cases()]


def test_every_registered_op_is_checked():
    """Every moe_lib op but the expert-parallel ones, which need a process group
    (tests/moe_experts/test_parallel.py)."""
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("moe_lib::")}
    assert {op.name().split("::")[1] for op, _ in op_cases()} == registered - PARALLEL_OPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(op_cases())), ids=OP_IDS)
def test_opcheck_reference(case, dtype):
    op, arguments = op_cases(dtype=dtype)[case]
    torch.library.opcheck(op, arguments)


@needs_interpreter
@pytest.mark.parametrize("case", range(len(op_cases())), ids=OP_IDS)
def test_opcheck_triton_under_the_interpreter(case):
    op, arguments = op_cases(dtype=torch.bfloat16, impl="triton", T=3)[case]
    torch.library.opcheck(op, arguments)


# ------------------------------------------------------------------------------------------------
# the GPU: the Triton path behind the same ops (the targets)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layer,T,options",
    [
        pytest.param("swiglu_expert", 16, {}, id="swiglu_expert-16"),  # one launch
        pytest.param("swiglu_expert", 512, {}, id="swiglu_expert-512"),  # the Gluon launches on Hopper
        pytest.param("swiglu_expert", 4096, {}, id="swiglu_expert-4096"),  # cuBLAS's GEMMs around one Triton pass
        pytest.param("moe_experts", 512, {}, id="moe_experts"),
        pytest.param("moe_experts", 512, dict(save_activations=True), id="moe_experts-saved"),
        pytest.param("moe_experts", 512, dict(validate=False), id="moe_experts-unvalidated"),
    ],
)
def test_gpu_layers_compile_whole_and_match_eager(layer, T, options, seed):
    function, leaves, grad_output, want = layer_case(layer, T, seed, device="cuda", dtype=torch.bfloat16, **options)
    assert_compiles_whole(function, leaves)
    eager_y, eager_grads = run(function, leaves, grad_output)
    compiled_y, compiled_grads = run(torch.compile(function, fullgraph=True), leaves, grad_output)
    assert rel_error(compiled_y, eager_y) <= 1e-3
    for name, got, eager, exact in zip(
        LAYER_ARGUMENTS[layer], compiled_grads, eager_grads, want[-len(leaves) :], strict=True
    ):
        assert rel_error(got, eager) <= 1e-3, name  # the same kernels: run-to-run differences only
        assert rel_error(got, exact) <= 2e-2, name


@pytest.mark.gpu
def test_gpu_block_compiles_whole(seed):
    torch.manual_seed(seed)
    block = Block(hidden_size=256, intermediate_size=128, num_experts=8).to("cuda", torch.bfloat16)
    x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
    assert_compiles_whole(block, [x])
    compiled = torch.compile(block, fullgraph=True)
    losses = []
    for forward in (block, compiled):
        block.zero_grad()
        loss = forward(x).float().square().mean()
        loss.backward()
        losses.append((loss.item(), block.experts.gate_up_proj.grad.clone()))
    assert abs(losses[0][0] - losses[1][0]) <= 1e-2 * abs(losses[0][0])
    assert rel_error(losses[1][1], losses[0][1]) <= 2e-2


@pytest.mark.gpu
def test_gpu_layers_under_cuda_graphs(seed):
    """mode="reduce-overhead" replays the step as a CUDA graph: the layers must run without a host sync
    (validate=False: the index check is the one that reads values back)."""
    function, leaves, grad_output, want = layer_case(
        "moe_experts", 512, seed, device="cuda", dtype=torch.bfloat16, validate=False
    )
    compiled = torch.compile(function, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, recording, replay
        _, grads = run(compiled, leaves, grad_output)
    for name, got, exact in zip(LAYER_ARGUMENTS["moe_experts"], grads, want, strict=True):
        assert rel_error(got, exact) <= 2e-2, name
    function, leaves, grad_output, want = layer_case("swiglu_expert", 512, seed, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(function, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        _, grads = run(compiled, leaves, grad_output)
    for name, got, exact in zip(LAYER_ARGUMENTS["swiglu_expert"], grads, want, strict=True):
        assert rel_error(got, exact) <= 2e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(op_cases())), ids=OP_IDS)
def test_gpu_opcheck(case):
    op, arguments = op_cases(device="cuda", dtype=torch.bfloat16, T=64)[case]
    torch.library.opcheck(op, arguments)


# ------------------------------------------------------------------------------------------------
# the expert-parallel layer: two gloo ranks on the CPU, each compiling its step

JOIN_TIMEOUT_S = 240  # two ranks compiling on a shared CPU


def parallel_rank_main(rank: int, init_file: str, out_dir: str, seed: int, device: str = "cpu", ranks: int = 2) -> None:
    """This rank's (of ``ranks``) eager and compiled forward and backward of the parallel layer (same inputs), its
    explain numbers and opcheck of both parallel ops; saved for the parent (on the CPU). gloo on the CPU, NCCL on
    CUDA."""
    import traceback
    from pathlib import Path

    import torch.distributed as dist

    from moe_lib.distributed import expert_partition, moe_experts_parallel

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(
        "gloo" if device == "cpu" else "nccl", init_method=f"file://{init_file}", rank=rank, world_size=ranks
    )
    try:
        inputs = problems.make_inputs(P2, 10, seed=seed, hidden_size=32, intermediate_size=16, num_experts=6, top_k=2)
        inputs = {name: t.to(device) for name, t in inputs.items()}  # the parent's values, on this rank's device
        tokens = slice(0, 10) if ranks == 1 else slice(0, 4) if rank == 0 else slice(4, 10)
        experts = expert_partition(6, ranks)[rank]
        leaves = [
            inputs["hidden_states"][tokens].clone().requires_grad_(),
            inputs["topk_weights"][tokens].clone().requires_grad_(),
            *[
                inputs[name][experts.start : experts.stop].clone().requires_grad_()
                for name in ("gate_weights", "up_weights", "down_weights")
            ],
        ]
        indices = inputs["topk_indices"][tokens]

        def layer(x, w, gate, up, down):
            return moe_experts_parallel(x, indices, w, gate, up, down, num_experts=6, chunks=2)

        explained = torch._dynamo.explain(layer)(*leaves)
        torch._dynamo.reset()
        results = {"explain": (explained.graph_count, explained.graph_break_count)}
        for name, function in (("eager", layer), ("compiled", torch.compile(layer, fullgraph=True))):
            y = function(*leaves)
            grads = torch.autograd.grad(y, leaves, inputs["grad_output"][tokens])
            results[name] = [t.cpu() for t in (y.detach(), *grads)]
        arguments = (
            leaves[0].detach(),
            indices,
            *[t.detach() for t in leaves[1:]],
            dist.group.WORLD.group_name,
            "auto",
            6,
            2,
            False,
            0,
            "",
        )
        torch.library.opcheck(torch.ops.moe_lib.moe_experts_parallel.default, arguments)
        y, *saved = torch.ops.moe_lib.moe_experts_parallel(*arguments)
        torch.library.opcheck(
            torch.ops.moe_lib.moe_experts_parallel_backward.default,
            (
                inputs["grad_output"][tokens],
                *saved,
                *[t.detach() for t in leaves[2:]],
                2,
                dist.group.WORLD.group_name,
                "auto",
                0,
            ),
        )
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears its gloo connections down while a peer still uses them (gloo aborts)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_parallel_ranks(tmp_path, seed: int, device: str, ranks: int = 2) -> list[dict]:
    import multiprocessing

    from conftest import join_ranks

    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=parallel_rank_main, args=(rank, str(tmp_path / "init"), str(tmp_path), seed, device, ranks)
        )
        for rank in range(ranks)
    ]
    join_ranks(processes, JOIN_TIMEOUT_S)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(ranks)]


def check_parallel_ranks(per_rank: list[dict], seed: int, *, same_bits: bool, tolerance: float) -> None:
    inputs = problems.make_inputs(P2, 10, seed=seed, hidden_size=32, intermediate_size=16, num_experts=6, top_k=2)
    exact = moe_experts_grads(*[t.double() if t.is_floating_point() else t for t in inputs.values()])
    names = ("y", "grad_hidden_states", "grad_topk_weights", "grad_gate", "grad_up", "grad_down")
    for rank, results in enumerate(per_rank):
        assert results["explain"] == (1, 0), rank
        for name, compiled, eager in zip(names, results["compiled"], results["eager"], strict=True):
            assert torch.equal(compiled, eager) if same_bits else rel_error(compiled, eager) <= 1e-3, (rank, name)
    gathered = [torch.cat([results["compiled"][i] for results in per_rank]) for i in range(1, 6)]
    assert [rel_error(g, w) <= tolerance for g, w in zip(gathered, exact, strict=True)] == [True] * 5


def test_the_expert_parallel_layer_compiles_whole_and_matches_eager(tmp_path, seed):
    check_parallel_ranks(run_parallel_ranks(tmp_path, seed, "cpu"), seed, same_bits=True, tolerance=1e-5)


@pytest.mark.gpu
def test_gpu_the_expert_parallel_layer_compiles_whole_on_one_gpu(tmp_path, seed):
    """One NCCL rank holding every expert: the Triton path inside the parallel ops, compiled whole (the exchange
    itself between GPUs: the two-GPU test below)."""
    check_parallel_ranks(run_parallel_ranks(tmp_path, seed, "cuda", ranks=1), seed, same_bits=False, tolerance=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_the_expert_parallel_layer_compiles_whole_over_nccl(tmp_path, seed, monkeypatch):
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
        monkeypatch.setenv(name, value)  # NVLink multicast off, as the benchmark runs
    # fp32 inputs on the Triton path: g and u from bf16×3 products, Wd·a from bf16 ones
    check_parallel_ranks(run_parallel_ranks(tmp_path, seed, "cuda"), seed, same_bits=False, tolerance=1e-2)
