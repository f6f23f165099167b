"""The Triton path of P2: ``moe_experts_backward(..., impl="triton")``.

CPU: the kernels run under the Triton interpreter, which must be switched on (TRITON_INTERPRET=1)
before triton is first imported — other test files import it without — so one subprocess runs this
file as a script over every small case and prints JSON; the tests below assert on it. Inside, every
output and workspace the kernels allocate is filled with NaN first (an unwritten element shows up
as NaN), each case runs twice (the results must be bitwise equal), and each output is compared with
the float64 reference computed from the same (rounded) inputs.
Cases named ``…-bf16x3`` have kernel W multiply bf16×3 products (the chooser's precise form for fp32 inputs
with many rows per expert) and must match float64 far more closely than the plain products of the same case.
GPU (``gpu`` marker): the same small cases on the device, the benchmark's full shape against the
fp32 reference with the element rule, bf16, all tokens on K experts, and CUDA-graph capture; Mixtral-8x7B's
shape in fp32 within the element rule, and a scaled-down shape with as many rows per expert where plain
products leave it and bf16×3 products keep it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import rel_error
from oracles import moe_experts_grads

import moe_lib
from moe_lib import problems, reference
from moe_lib.bench.checks import compare_output
from moe_lib.moe_experts.inputs import route_tokens

OUTPUT_NAMES = ("grad_hidden_states", "grad_topk_weights", "grad_gate_weights", "grad_up_weights", "grad_down_weights")
REPO_ROOT = Path(__file__).resolve().parents[2]

# Relative Frobenius error against float64. fp32 interface: grad_topk_weights comes from bf16×3
# products (≈1e-5); the other outputs from plain bf16 products with fp32 accumulation (≈2e-3).
# bf16 inputs: bf16 products and bf16 outputs (≈5e-3).
FP32_TOLERANCE = dict.fromkeys(OUTPUT_NAMES, 5e-3) | {"grad_topk_weights": 1e-4}
BF16_TOLERANCE = dict.fromkeys(OUTPUT_NAMES, 2e-2)  # also used for fp16
# fp32 with kernel W's bf16×3 products: the weight gradients' operands exact to ≈2⁻¹⁶ (≈1e-5 from kernel A's g, u)
WEIGHT_GRAD_NAMES = ("grad_gate_weights", "grad_up_weights", "grad_down_weights")
SPLIT_TOLERANCE = FP32_TOLERANCE | dict.fromkeys(WEIGHT_GRAD_NAMES, 5e-5)

# name: (T, H, I, E, K, routing, float dtype, topk_weights dtype, index dtype, LaunchConfig overrides or None)
SMALL_CASES = {
    "odd": (13, 40, 24, 5, 2, "uniform", "float32", "float32", "int64", None),
    "hot-looping": (40, 40, 24, 5, 2, "hot", "float32", "float32", "int64", {"row_split": 2}),
    "skewed": (24, 24, 40, 7, 3, "skewed", "float32", "float32", "int64", None),
    "K1": (9, 16, 12, 5, 1, "uniform", "float32", "float32", "int64", None),
    "K=E": (11, 24, 16, 4, 4, "uniform", "float32", "float32", "int32", None),
    "T0": (0, 16, 8, 4, 2, "uniform", "float32", "float32", "int64", None),
    "bf16": (13, 40, 24, 5, 2, "uniform", "bfloat16", "float32", "int64", None),
    "bf16-int32-bf16-topk": (10, 24, 40, 6, 3, "skewed", "bfloat16", "bfloat16", "int32", None),
    "fp16": (7, 24, 16, 3, 2, "uniform", "float16", "float16", "int64", None),
    "hot-bf16x3": (64, 40, 24, 5, 2, "hot", "float32", "float32", "int64", None),  # 64 rows on each of 2 experts
    "skewed-bf16x3-pointer": (30, 24, 40, 6, 3, "skewed", "float32", "float32", "int64", {"tma_weight_grad": None}),
}
# kernel W's products where a case sets them (the others: the chooser's, plain at these sizes)
PRODUCTS = {"hot-bf16x3": "bf16x3", "skewed-bf16x3-pointer": "bf16x3"}


def small_case_inputs(case: str, seed: int, device="cpu") -> dict:
    T, H, I, E, K, routing, dtype, topk_dtype, index_dtype, _ = SMALL_CASES[case]
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
        inputs[name] = inputs[name].to(getattr(torch, dtype))
    inputs["topk_weights"] = inputs["topk_weights"].to(getattr(torch, topk_dtype))
    inputs["topk_indices"] = inputs["topk_indices"].to(getattr(torch, index_dtype))
    return inputs


def nan_filled(size, *, dtype, device):
    """Stands in for torch.empty: memory a kernel forgets to write stays NaN."""
    return torch.full(size, float("nan"), dtype=dtype, device=device)


def run_triton(inputs: dict, overrides=None, products=None):
    """The public entry point, or the kernel function itself when config fields or kernel W's products are given."""
    from moe_lib.moe_experts import launch
    from moe_lib.moe_experts.choose import launch_config

    if overrides is None and products is None:
        return moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    config = None
    if overrides is not None:
        interpreter = inputs["hidden_states"].device.type != "cuda"
        T, K = inputs["topk_indices"].shape
        config = launch_config(
            T * K,
            inputs["gate_weights"].shape[0],
            interpreter=interpreter,
            input_bytes=inputs["hidden_states"].element_size(),
            split_weight_grads=products == "bf16x3",
        )
        config = dataclasses.replace(config, **overrides)
    return launch.moe_experts_backward_triton(*inputs.values(), config=config, products=products)


def check_small_case(case: str, seed: int, device="cpu") -> dict:
    """Runs one small case twice with NaN-filled allocations; returns what the tests assert on."""
    from moe_lib.moe_experts import launch, runtime

    inputs = small_case_inputs(case, seed, device)
    upcast = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
    want = reference.moe_experts_backward_reference(*upcast.values())
    overrides, products = SMALL_CASES[case][-1], PRODUCTS.get(case)
    runtime.allocate = nan_filled
    try:
        start = time.perf_counter()
        got = run_triton(inputs, overrides, products)
        seconds = time.perf_counter() - start
        again = run_triton(inputs, overrides, products)
        plain = run_triton(inputs, overrides, "plain") if products == "bf16x3" else got
        forward = launch.moe_experts_forward_triton(*list(inputs.values())[1:])
    finally:
        runtime.allocate = torch.empty
    chosen = torch.zeros(inputs["gate_weights"].shape[0], dtype=torch.bool, device=device)
    chosen[inputs["topk_indices"].reshape(-1).long()] = True
    weight_grads = got[2:]
    return dict(
        seed=seed,
        seconds=seconds,
        shapes={n: list(g.shape) == list(w.shape) for n, g, w in zip(OUTPUT_NAMES, got, want, strict=True)},
        dtypes={n: str(g.dtype) for n, g in zip(OUTPUT_NAMES, got, strict=True)},
        finite={n: bool(torch.isfinite(g).all()) for n, g in zip(OUTPUT_NAMES, got, strict=True)},
        rel_errors={n: rel_error(g, w) for n, g, w in zip(OUTPUT_NAMES, got, want, strict=True)},
        plain_rel_errors={n: rel_error(g, w) for n, g, w in zip(OUTPUT_NAMES, plain, want, strict=True)},
        bitwise_repeatable=all(torch.equal(a, b) for a, b in zip(got, again, strict=True)),
        unchosen_experts_zero=all(int(torch.count_nonzero(g[~chosen])) == 0 for g in weight_grads),
        chosen_experts_nonzero=all(bool((g[chosen].flatten(1) != 0).any(dim=1).all()) for g in weight_grads),
        num_unchosen=int((~chosen).sum()),
        forward_dtype=str(forward.dtype),
        forward_rel_error=rel_error(forward, reference.moe_experts_forward_reference(*list(upcast.values())[1:])),
    )


def expected_dtypes(case: str) -> dict:
    dtype, topk_dtype = SMALL_CASES[case][6:8]
    return dict.fromkeys(OUTPUT_NAMES, f"torch.{dtype}") | {"grad_topk_weights": f"torch.{topk_dtype}"}


def assert_small_case(case: str, result: dict) -> None:
    split = PRODUCTS.get(case) == "bf16x3"
    tolerance = FP32_TOLERANCE if SMALL_CASES[case][6] == "float32" else BF16_TOLERANCE
    tolerance = SPLIT_TOLERANCE if split else tolerance
    where = f"[{case}, seed={result['seed']}]"
    assert all(result["shapes"].values()), f"{where} shapes {result['shapes']}"
    assert result["dtypes"] == expected_dtypes(case), where
    assert all(result["finite"].values()), f"{where} unwritten (NaN) or non-finite outputs: {result['finite']}"
    for name, error in result["rel_errors"].items():
        assert error <= tolerance[name], f"{where} {name}: relative error {error:.3g} > {tolerance[name]:g}"
    assert result["bitwise_repeatable"], f"{where} two calls gave different bits"
    assert result["unchosen_experts_zero"], f"{where} an expert no token chose got nonzero weight gradients"
    assert result["chosen_experts_nonzero"], f"{where} an expert with tokens got an all-zero weight gradient"
    assert result["forward_dtype"] == f"torch.{SMALL_CASES[case][6]}", where
    assert result["forward_rel_error"] <= tolerance["grad_hidden_states"], f"{where} forward: {result}"
    if split:  # far closer than the same case's plain products: not a silent fall-back to bf16 operands
        for name in WEIGHT_GRAD_NAMES:
            error, plain = result["rel_errors"][name], result["plain_rel_errors"][name]
            assert 20 * error <= plain, f"{where} {name}: bf16×3 {error:.3g} against plain {plain:.3g}"


# --------------------------------------------------------------------------------------------------
# CPU, under the interpreter (in a subprocess)


@pytest.fixture(scope="module")
def interpreter_results():
    seed = int(os.environ.get("MOE_TEST_SEED", int.from_bytes(os.urandom(4), "little") % 2**31))
    print(f"seed={seed}")
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    )
    completed = subprocess.run(
        [sys.executable, __file__, str(seed)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent,
    )
    assert completed.returncode == 0, f"interpreter run failed (seed={seed}):\n{completed.stderr[-6000:]}"
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_interpreter_small_cases(case, interpreter_results):
    """Odd sizes (masked edges), skew, K = 1, K = E, T = 0, bf16, int32 indices; NaN-poisoned
    allocations; bitwise-repeatable; exact zeros for experts without tokens."""
    assert_small_case(case, interpreter_results[case])


def test_interpreter_cases_cover_empty_experts(interpreter_results):
    assert interpreter_results["hot-looping"]["num_unchosen"] == 3
    assert interpreter_results["T0"]["num_unchosen"] == 4
    assert interpreter_results["hot-bf16x3"]["num_unchosen"] == 3


def test_routing_groups_slots_by_expert(seed):
    from moe_lib.moe_experts.routing import route_by_expert

    generator = torch.Generator().manual_seed(seed)
    for T, E, K in ((0, 4, 2), (1, 3, 3), (37, 9, 4)):
        for dtype in (torch.int64, torch.int32):
            indices = route_tokens(T, E, K, routing="skewed", generator=generator).to(dtype)
            routing = route_by_expert(indices, E)
            flat = indices.reshape(-1).tolist()
            want_order = [s for e in range(E) for s in range(T * K) if flat[s] == e]
            assert routing.sorted_slot.dtype == torch.int32 and routing.expert_offsets.dtype == torch.int32
            assert routing.sorted_slot.tolist() == want_order
            assert routing.counts.tolist() == [flat.count(e) for e in range(E)]
            assert routing.expert_offsets[0] == 0 and routing.expert_offsets[-1] == T * K


def test_row_split_follows_the_mean_rows_per_expert():
    from moe_lib.moe_experts.choose import launch_config

    # the benchmark's shape: 64 rows per expert at T = 2048, 256 at T = 8192 (K = 8, E = 256)
    assert launch_config(2048 * 8, 256).row_split == 2
    assert launch_config(8192 * 8, 256).row_split == 6
    assert launch_config(0, 256).row_split == 1
    assert launch_config(10**7, 4).row_split == 8


# --------------------------------------------------------------------------------------------------
# GPU

CUDA = "cuda"


ELEMENT_RULE = dict(atol=0.11, rtol=1e-5)  # the benchmark's, as reported for P2 fp32


def poison_cuda_cache(num_bytes: int) -> None:
    """Fill a block of that size with NaN and free it: the caching allocator hands it out next."""
    block = torch.full((num_bytes // 4 + 1,), float("nan"), device=CUDA)
    del block


def full_size_inputs(num_tokens: int, seed: int, routing="uniform") -> dict:
    return problems.make_inputs("moe_experts_backward", num_tokens, seed=seed, device=CUDA, routing=routing)


def to_bf16(inputs: dict) -> dict:
    return {k: (v.bfloat16() if v.is_floating_point() and k != "topk_weights" else v) for k, v in inputs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(SMALL_CASES))
def test_gpu_small_cases(case, seed):
    assert_small_case(case, check_small_case(case, seed, device=CUDA))


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "hot"])
def test_gpu_full_size_fp32_passes_the_element_rule(routing, seed):
    inputs = full_size_inputs(2048, seed, routing)
    with reference.tf32_disabled():
        want = reference.moe_experts_backward_reference(*inputs.values())
    poison_cuda_cache(sum(w.numel() * w.element_size() for w in want) + (2 << 30))
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        stats = compare_output(g, w, ELEMENT_RULE)
        assert stats["finite"], f"{name}: NaN/Inf (unwritten elements?)"
        assert stats["pass_fraction"] >= 0.99, f"{name}: element rule {stats}"
        assert stats["rel_error"] <= FP32_TOLERANCE[name], f"{name}: {stats}"
    del want
    again = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), "two calls gave different bits"


def fp32_model_case(num_tokens: int, seed: int, **axes):
    """The problem's fp32 inputs at a model's axes on the GPU, the fp32 reference's outputs (TF32 off), and the
    products the chooser picks for kernel W there."""
    from moe_lib.moe_experts.launch import choose_for

    inputs = problems.make_inputs("moe_experts_backward", num_tokens, seed=seed, device=CUDA, **axes)
    with reference.tf32_disabled():
        want = reference.moe_experts_backward_reference(*inputs.values())
    names = ("hidden_states", "topk_indices", "gate_weights", "up_weights", "down_weights")
    products = choose_for(*(inputs[name] for name in names), None).weight_grad_products
    return inputs, want, products


def element_rule_shares(got, want) -> dict:
    shares = {}
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        stats = compare_output(g, w, ELEMENT_RULE)
        assert stats["finite"], f"{name}: NaN/Inf (unwritten elements?)"
        shares[name] = stats["pass_fraction"]
    return shares


@pytest.mark.gpu
def test_gpu_mixtral_fp32_passes_the_element_rule(seed):
    """Mixtral-8x7B's experts (E 8, K 2, H 4096, I 14336) at 4096 tokens: 1024 rows per expert, where plain bf16
    products in kernel W left 98.4% of the weight gradients' elements within the rule; the chooser takes bf16×3."""
    axes = dict(hidden_size=4096, intermediate_size=14336, num_experts=8, top_k=2)
    inputs, want, products = fp32_model_case(4096, seed, **axes)
    assert products == "bf16x3"
    poison_cuda_cache(sum(w.numel() * w.element_size() for w in want) + (4 << 30))
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    shares = element_rule_shares(got, want)
    assert min(shares.values()) >= 0.99, shares
    for name in WEIGHT_GRAD_NAMES:
        assert rel_error(got[OUTPUT_NAMES.index(name)], want[OUTPUT_NAMES.index(name)]) <= 1e-4, name


@pytest.mark.gpu
def test_gpu_as_many_rows_per_expert_fail_with_plain_products_and_pass_with_bf16x3(seed):
    """Mixtral's rows per expert, H and K with I = 1024 (I sets how many elements, not how large: the same margin,
    z ≈ 2.5): plain products leave the element rule, as they did at Mixtral's shape; the chooser's bf16×3 keep it."""
    from moe_lib.moe_experts import launch

    axes = dict(hidden_size=4096, intermediate_size=1024, num_experts=8, top_k=2)
    inputs, want, products = fp32_model_case(4096, seed, **axes)
    assert products == "bf16x3"
    plain = element_rule_shares(launch.moe_experts_backward_triton(*inputs.values(), products="plain"), want)
    assert min(plain[name] for name in WEIGHT_GRAD_NAMES) < 0.99, plain
    poison_cuda_cache(4 << 30)
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    shares = element_rule_shares(got, want)
    assert min(shares.values()) >= 0.99, shares
    for name in WEIGHT_GRAD_NAMES:
        error = rel_error(got[OUTPUT_NAMES.index(name)], want[OUTPUT_NAMES.index(name)])
        assert error <= 1e-4, f"{name}: {error:.3g}"
    again = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), "two calls gave different bits"


@pytest.mark.gpu
def test_gpu_full_size_bf16_against_fp32_reference(seed):
    inputs = to_bf16(full_size_inputs(2048, seed))
    upcast = {k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()}
    with reference.tf32_disabled():
        want = reference.moe_experts_backward_reference(*upcast.values())
    del upcast
    poison_cuda_cache(sum(w.numel() * 2 for w in want) + (2 << 30))
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32] + [torch.bfloat16] * 3
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        stats = compare_output(g, w, ELEMENT_RULE)
        assert stats["finite"], f"{name}: NaN/Inf (unwritten elements?)"
        assert stats["rel_error"] <= BF16_TOLERANCE[name], f"{name}: {stats}"


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["uniform", "hot"])
def test_gpu_busy_experts_bf16_against_float64(routing, seed):
    """512+ rows per expert on average: the 128-row-block configuration of 16-bit inputs."""
    from moe_lib.moe_experts.choose import launch_config

    sizes = dict(hidden_size=512, intermediate_size=384, num_experts=8, top_k=2)
    inputs = to_bf16(
        problems.make_inputs("moe_experts_backward", 3001, seed=seed, device=CUDA, routing=routing, **sizes)
    )
    assert launch_config(3001 * 2, 8, input_bytes=2).block_m == 128
    upcast = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
    want = reference.moe_experts_backward_reference(*upcast.values())
    poison_cuda_cache(64 << 20)
    got = moe_lib.moe_experts_backward(*inputs.values(), impl="triton")
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        assert torch.isfinite(g).all(), f"{name}: NaN/Inf (unwritten elements?)"
        assert rel_error(g, w) <= BF16_TOLERANCE[name], f"{name}: {rel_error(g, w):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_layer_gradients_match_autograd_of_the_reference(dtype, seed):
    """moe_lib.moe_experts(impl="triton"): its gradients against float64 autograd of the dense forward."""
    sizes = dict(hidden_size=256, intermediate_size=128, num_experts=16, top_k=4)
    inputs = problems.make_inputs("moe_experts_backward", 300, seed=seed, device=CUDA, routing="skewed", **sizes)
    if dtype == torch.bfloat16:
        inputs = to_bf16(inputs)
    names = ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")
    leaves = [inputs[n].detach().clone().requires_grad_() for n in names]
    x, w, wg, wu, wd = leaves
    y = moe_lib.moe_experts(x, inputs["topk_indices"], w, wg, wu, wd, impl="triton")
    got = torch.autograd.grad(y, leaves, inputs["grad_output"])
    want = moe_experts_grads(*inputs.values())
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    upcast = [inputs[n].double() if inputs[n].is_floating_point() else inputs[n] for n in list(inputs)[1:]]
    y_want = reference.moe_experts_forward_reference(*upcast)
    assert y.dtype == dtype and rel_error(y, y_want) <= tolerance["grad_hidden_states"], rel_error(y, y_want)
    for name, g, ref in zip(OUTPUT_NAMES, got, want, strict=True):
        assert g.dtype == inputs[names[OUTPUT_NAMES.index(name)]].dtype, name
        assert torch.isfinite(g).all(), name
        assert rel_error(g, ref) <= tolerance[name], f"{name}: {rel_error(g, ref):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_cuda_graph_replay_matches_eager(dtype, seed):
    sizes = dict(hidden_size=1024, intermediate_size=512, num_experts=64, top_k=8)

    def draw(s, routing):
        inputs = problems.make_inputs("moe_experts_backward", 1000, seed=s, device=CUDA, routing=routing, **sizes)
        return to_bf16(inputs) if dtype == torch.bfloat16 else inputs

    static = draw(seed, "uniform")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
        moe_lib.moe_experts_backward(*static.values(), impl="triton", validate=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_lib.moe_experts_backward(*static.values(), impl="triton", validate=False)

    fresh = draw(seed + 1, "skewed")  # other values and another routing, same shapes
    for name, tensor in fresh.items():
        static[name].copy_(tensor)
    graph.replay()
    torch.cuda.synchronize()
    eager = moe_lib.moe_experts_backward(*fresh.values(), impl="triton")
    for name, a, b in zip(OUTPUT_NAMES, captured, eager, strict=True):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------------------------------
# the interpreter subprocess: `TRITON_INTERPRET=1 python tests/moe_experts/test_backward_triton.py SEED`

if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    torch.set_num_threads(1)
    results = {case: check_small_case(case, int(sys.argv[1])) for case in SMALL_CASES}
    print(json.dumps(results))


@pytest.mark.parametrize("bad_index", [4, -1, 10**12])
def test_out_of_range_slots_contribute_nothing_without_validation(bad_index, seed):
    """validate=False skips the index checks; a slot whose expert lies outside [0, E) then belongs to
    no expert and contributes nothing, as in the reference (never uninitialised workspace)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs(
        "moe_experts_backward",
        6,
        seed=seed,
        device=device,
        hidden_size=32,
        intermediate_size=16,
        num_experts=4,
        top_k=2,
    )
    inputs["topk_indices"][0, 0] = bad_index
    want = moe_lib.moe_experts_backward(*inputs.values(), impl="reference", validate=False)
    for _ in range(2):  # the second call reuses memory the first one freed
        got = moe_lib.moe_experts_backward(*inputs.values(), impl="triton", validate=False)
        for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
            assert rel_error(g, w) <= 1e-2, name
        assert got[1][0, 0] == 0


def test_zero_experts_per_token_gives_zero_gradients(seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = problems.make_inputs(
        "moe_experts_backward",
        5,
        seed=seed,
        device=device,
        hidden_size=32,
        intermediate_size=16,
        num_experts=4,
        top_k=2,
    )
    inputs["topk_indices"] = inputs["topk_indices"][:, :0].contiguous()
    inputs["topk_weights"] = inputs["topk_weights"][:, :0].contiguous()
    for impl in ("reference", "triton"):
        for validate in (True, False):
            grads = moe_lib.moe_experts_backward(*inputs.values(), impl=impl, validate=validate)
            assert [tuple(g.shape) for g in grads] == [(5, 32), (5, 0), (4, 16, 32), (4, 16, 32), (4, 32, 16)]
            assert all(torch.count_nonzero(g) == 0 for g in grads), (impl, validate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("save_activations", [False, True])
def test_layer_with_and_without_saved_activations_against_float64(dtype, save_activations, seed):
    """moe_experts(save_activations=True) keeps g and u from the forward and its backward reads them: the
    same gradients as the recomputing backward (bitwise in fp32, where they are stored exactly), both
    within the rule against float64 autograd of the reference layer."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    T, H, I, E, K = (300, 256, 128, 8, 2) if device == "cuda" else (13, 32, 16, 4, 2)
    inputs = problems.make_inputs(
        "moe_experts_backward",
        T,
        seed=seed,
        device=device,
        dtype=dtype,
        hidden_size=H,
        intermediate_size=I,
        num_experts=E,
        top_k=K,
    )
    names = ("hidden_states", "topk_weights", "gate_weights", "up_weights", "down_weights")

    def step(impl, save, convert=lambda t: t):
        leaves = [convert(inputs[name]).detach().requires_grad_() for name in names]
        y = moe_lib.moe_experts(leaves[0], inputs["topk_indices"], *leaves[1:], impl=impl, save_activations=save)
        return (y.detach(), *torch.autograd.grad(y, leaves, convert(inputs["grad_output"]).to(y.dtype)))

    got = step("triton", save_activations)
    want = step("reference", False, lambda t: t.double())
    tolerance = FP32_TOLERANCE if dtype == torch.float32 else BF16_TOLERANCE
    for name, g, w in zip(("output", *names), got, want, strict=True):
        limit = tolerance["grad_hidden_states" if name in ("output", "hidden_states") else f"grad_{name}"]
        assert torch.isfinite(g).all() and rel_error(g, w) <= limit, (name, rel_error(g, w))
    if dtype == torch.float32 and save_activations:  # g and u are stored exactly: the same numbers, but for
        # grad_topk_weights' sum over I, which the two compiled variants of kernel A may add in another order
        recomputed = step("triton", False)
        for name, a, b in zip(("output", *names), got, recomputed, strict=True):
            assert torch.equal(a, b) or (name == "topk_weights" and rel_error(a, b) <= 1e-6), name


@pytest.mark.parametrize("bad", ["shape", "dtype", "strides", "count"])
def test_weight_grads_out_that_does_not_fit_is_refused_before_any_work(bad, seed):
    from moe_lib.moe_experts import launch, runtime

    inputs = small_case_inputs("odd", seed)
    gate, down = inputs["gate_weights"], inputs["down_weights"]
    out = [torch.empty_like(gate), torch.empty_like(gate), torch.empty_like(down)]
    if bad == "shape":
        out[1] = torch.empty_like(gate[1:])
    elif bad == "dtype":
        out[2] = torch.empty_like(down, dtype=torch.float64)
    elif bad == "strides":
        out[0] = torch.empty_like(gate).transpose(1, 2).contiguous().transpose(1, 2)
    else:
        out = out[:2]
    allocated = []
    with pytest.MonkeyPatch.context() as patch:  # nothing may be allocated (or launched) before the refusal
        patch.setattr(runtime, "allocate", lambda *a, **k: allocated.append(a) or torch.empty(*a, **k))
        with pytest.raises(ValueError, match="^weight_grads_out: "):
            launch.moe_experts_backward_triton(
                *(inputs[name] for name in problems.load("moe_experts_backward").input_names), weight_grads_out=out
            )
    assert allocated == []
