"""The TMA-fed kernel W (``moe_lib.moe_experts.tma_weight_grad``): dWg, dWu and dWd per expert.

CPU: under the Triton interpreter (tests/conftest.py switches it on where there is no GPU) on tiny shapes
(16-wide tiles, so several tiles, several reduction steps and clipped edges), with uniform, skewed, all
tokens on one expert and empty-expert routings, bf16, fp16 and fp32 interfaces, each form of the kernel
(the flat pipelined loop, the warp-specialised tile loop, TMA stores) and persistent grids smaller and larger
than an expert's tile count. Inputs are fresh every run (the ``seed`` fixture); outputs are NaN-poisoned
before the call; each gradient is compared with a float64 sum of the same (already rounded) operands over
the positions whose slot the routing gave that expert; experts without rows must be exact zeros.
bf16×3 products (fp32 interfaces whose weight gradients outgrow the element rule): fp32 operands split into bf16
hi and lo halves, both designs of kernel W in every form against float64 of the unsplit fp32 operands, far closer
than the plain products of the hi halves alone (which a silent fall-back to them would give).
GPU (``gpu`` marker): a medium shape with clipped edge tiles against today's kernel W
(``launch_weight_grads``) and float64, every form, repeatability and CUDA-graph replay; bf16×3 at the medium shape.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import rel_error

from moe_lib.dispatch import interpreter_enabled
from moe_lib.moe_experts.choose import choose_tma_weight_grad_config, launch_config
from moe_lib.moe_experts.designs.w_pointer import launch_weight_grads
from moe_lib.moe_experts.inputs import route_tokens
from moe_lib.moe_experts.routing import route_by_expert
from moe_lib.moe_experts.tma_weight_grad import (
    TmaWeightGradConfig,
    gather_sorted_rows,
    launch_weight_grads_tma,
)
from moe_lib.precision import split_halves

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)
OUTPUT_NAMES = ("grad_gate", "grad_up", "grad_down")
# relative Frobenius error against float64 of the same products: fp32 accumulation only (fp32 outputs), plus the
# rounding of each output element (≤ 2⁻⁹ relative in bf16, 2⁻¹¹ in fp16)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-3, torch.float16: 1.5e-3}
OPERAND_DTYPE = {torch.float32: torch.bfloat16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}


def make_case(T, H, I, E, K, routing, dtype, seed, device="cpu") -> dict:
    """Kernel W's inputs: routing; x and dy as its operands (bf16(x) for fp32 interfaces); dg, du and aw as
    kernel A leaves them ([max(T·K, 1), I], rows in sorted order, the operand dtype)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    operand_dtype = OPERAND_DTYPE[dtype]

    def draw(*shape):
        return torch.randn(shape, generator=generator, device=device).to(operand_dtype)

    topk_indices = route_tokens(T, E, K, routing=routing, device=device, generator=generator)
    rows = max(T * K, 1)
    return dict(
        T=T,
        H=H,
        I=I,
        E=E,
        K=K,
        dtype=dtype,
        topk_indices=topk_indices,
        routing=route_by_expert(topk_indices, E),
        x=draw(T, H),
        dy=draw(T, H),
        dgate=draw(rows, I),
        dup=draw(rows, I),
        scaled_act=draw(rows, I),
    )


def float64_weight_grads(case: dict) -> tuple[torch.Tensor, ...]:
    """dWg_e = Σ dg[p]ᵀ x[t(p)], dWu_e, dWd_e = Σ dy[t(p)]ᵀ aw[p] in float64, over the sorted positions p whose
    slot s = sorted_slot[p] was routed to e (topk_indices.flatten()[s] == e), t(p) = s // K."""
    E, I, H, K = case["E"], case["I"], case["H"], case["K"]
    device = case["x"].device
    slots = case["routing"].sorted_slot.long()
    expert_of_position = case["topk_indices"].reshape(-1)[slots]
    token_of_position = slots // max(K, 1)
    grads = [torch.zeros((E, I, H), dtype=torch.float64, device=device) for _ in range(2)]
    grads.append(torch.zeros((E, H, I), dtype=torch.float64, device=device))
    for e in range(E):
        where = (expert_of_position == e).nonzero().flatten()
        x_rows = case["x"][token_of_position[where]].double()
        dy_rows = case["dy"][token_of_position[where]].double()
        grads[0][e] = case["dgate"][where].double().T @ x_rows
        grads[1][e] = case["dup"][where].double().T @ x_rows
        grads[2][e] = dy_rows.T @ case["scaled_act"][where].double()
    return tuple(grads)


def poisoned_outputs(case: dict) -> tuple[torch.Tensor, ...]:
    E, I, H, dtype, device = case["E"], case["I"], case["H"], case["dtype"], case["x"].device
    return (
        torch.full((E, I, H), float("nan"), dtype=dtype, device=device),
        torch.full((E, I, H), float("nan"), dtype=dtype, device=device),
        torch.full((E, H, I), float("nan"), dtype=dtype, device=device),
    )


def run_tma(case: dict, config: TmaWeightGradConfig, num_programs: int, lo_halves=None) -> tuple[torch.Tensor, ...]:
    """Gather + the two launches into NaN-poisoned outputs of the interface dtype (``lo_halves``: the lo halves of
    x, dy, dg, du, aw for bf16×3 products, x and dy by token)."""
    outputs = poisoned_outputs(case)
    sorted_slot = case["routing"].sorted_slot
    x_sorted = gather_sorted_rows(case["x"], sorted_slot, case["K"])
    dy_sorted = gather_sorted_rows(case["dy"], sorted_slot, case["K"])
    if lo_halves is not None:
        x_lo, dy_lo, *workspaces_lo = lo_halves
        lo_halves = (*(gather_sorted_rows(v, sorted_slot, case["K"]) for v in (x_lo, dy_lo)), *workspaces_lo)
    launch_weight_grads_tma(
        config,
        case["routing"].expert_offsets,
        x_sorted,
        dy_sorted,
        case["dgate"],
        case["dup"],
        case["scaled_act"],
        *outputs,
        num_programs=num_programs,
        lo_halves=lo_halves,
    )
    return outputs


def assert_matches_float64(case: dict, got, where: str) -> None:
    want = float64_weight_grads(case)
    empty = case["routing"].counts == 0
    for name, g, w in zip(OUTPUT_NAMES, got, want, strict=True):
        assert g.dtype == case["dtype"], f"{where} {name}: dtype {g.dtype}"
        assert torch.isfinite(g).all(), f"{where} {name}: NaN/Inf (unwritten elements?)"
        assert int(torch.count_nonzero(g[empty])) == 0, f"{where} {name}: an expert without rows is not exact zeros"
        error = rel_error(g, w)
        assert error <= TOLERANCE[case["dtype"]], f"{where} {name}: relative error {error:.3g}"


def variant(config: TmaWeightGradConfig, name: str) -> TmaWeightGradConfig:
    """The kernel's forms: the flat pipelined (tile, step) loop, the warp-specialised tile loop, TMA stores, and
    programs in two groups, each on its own experts."""
    if name == "flat":
        return config
    if name == "warp_specialized":
        return dataclasses.replace(config, warps_gate_up=4, warps_down=4, warp_specialize=True)
    if name == "tma_store":
        return dataclasses.replace(config, tma_store=True)
    if name == "expert_groups":
        return dataclasses.replace(config, expert_groups=2)
    raise ValueError(name)


# --------------------------------------------------------------------------------------------------
# CPU, under the interpreter

# name: (T, H, I, E, K, routing, interface dtype, persistent programs)
SMALL_CASES = {
    "uniform-bf16": (37, 40, 48, 5, 2, "uniform", torch.bfloat16, 3),
    "uniform-fp32": (29, 48, 32, 4, 3, "uniform", torch.float32, 7),
    "skewed-fp16": (23, 40, 40, 5, 3, "skewed", torch.float16, 4),
    "one-expert-bf16": (40, 32, 40, 3, 1, "hot", torch.bfloat16, 5),  # all rows on one expert, 3 steps of 16
    "empty-experts-fp32": (17, 40, 32, 5, 2, "hot", torch.float32, 2),
    "T1-bf16": (1, 32, 48, 3, 1, "uniform", torch.bfloat16, 9),  # more programs than tiles per expert
    "T0-fp32": (0, 32, 32, 3, 2, "uniform", torch.float32, 3),  # no slots: every output all zeros
}


@needs_triton
@pytest.mark.parametrize("form", ["flat", "warp_specialized", "tma_store", "expert_groups"])
@pytest.mark.parametrize("case_name", list(SMALL_CASES))
def test_small_cases_against_float64(case_name, form, seed):
    T, H, I, E, K, routing, dtype, programs = SMALL_CASES[case_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(T, H, I, E, K, routing, dtype, seed, device)
    config = variant(choose_tma_weight_grad_config(T * K, E, dtype.itemsize, interpreter=device == "cpu"), form)
    got = run_tma(case, config, programs)
    assert_matches_float64(case, got, f"[{case_name}, {form}, seed={seed}]")
    if routing == "hot":  # the cases meant to have experts without rows do
        assert int((case["routing"].counts == 0).sum()) == E - K


OPERANDS = ("x", "dy", "dgate", "dup", "scaled_act")


def make_split_case(T, H, I, E, K, routing, seed, device="cpu") -> tuple[dict, dict, tuple]:
    """An fp32 interface's kernel W inputs as bf16×3 takes them: fp32 operands (x, dy, dg, du, aw), the case of their
    bf16 hi halves (what plain products multiply), and the lo halves (x, dy by token; the workspaces sorted)."""
    case = make_case(T, H, I, E, K, routing, torch.float32, seed, device)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    exact = {name: torch.randn(case[name].shape, generator=generator, device=device) for name in OPERANDS}
    halves = {name: split_halves(v, torch.bfloat16) for name, v in exact.items()}
    case |= {name: hi for name, (hi, _) in halves.items()}
    return case, exact, tuple(lo for _, lo in halves.values())


def run_pointer(case: dict, lo_halves=None) -> tuple[torch.Tensor, ...]:
    """The pointer-based kernel W (x and dy read by token) into NaN-poisoned outputs."""
    interpreter = case["x"].device.type == "cpu"
    config = launch_config(case["T"] * case["K"], case["E"], input_bytes=4, interpreter=interpreter)
    outputs = poisoned_outputs(case)
    routing = case["routing"]
    launch_weight_grads(
        config, routing, routing.sorted_slot, case["K"], *(case[n] for n in OPERANDS), *outputs, lo_halves
    )
    return outputs


def assert_split_beats_plain(case: dict, exact: dict, split, plain, where: str, limit: float = 3e-5) -> None:
    """bf16×3 products within ``limit`` of float64 over the fp32 operands, and at least 50 times closer than the plain
    products of the hi halves, whose bf16 rounding shows (≈ 2.3e-3)."""
    want = float64_weight_grads(case | exact)
    empty = case["routing"].counts == 0
    for name, s, p, w in zip(OUTPUT_NAMES, split, plain, want, strict=True):
        assert torch.isfinite(s).all(), f"{where} {name}: NaN/Inf (unwritten elements?)"
        assert int(torch.count_nonzero(s[empty])) == 0, f"{where} {name}: an expert without rows is not exact zeros"
        split_error, plain_error = rel_error(s, w), rel_error(p, w)
        assert plain_error >= 1e-3, f"{where} {name}: plain products {plain_error:.3g}, bf16 rounding not visible"
        assert split_error <= limit, f"{where} {name}: bf16×3 products {split_error:.3g} > {limit:g}"
        assert split_error * 50 <= plain_error, f"{where} {name}: bf16×3 {split_error:.3g}, plain {plain_error:.3g}"


# name: (T, H, I, E, K, routing, persistent programs); many rows per expert: several steps of 16 in each reduction
SPLIT_CASES = {
    "hot-many-rows": (96, 48, 32, 3, 2, "hot", 4),  # 96 rows on two experts, one expert without rows
    "uniform-edges": (45, 40, 48, 4, 2, "uniform", 3),  # clipped edge tiles in both H and I
}


@needs_triton
@pytest.mark.parametrize("form", ["flat", "warp_specialized", "tma_store", "expert_groups", "pointer"])
@pytest.mark.parametrize("case_name", list(SPLIT_CASES))
def test_split_products_against_float64(case_name, form, seed):
    T, H, I, E, K, routing, programs = SPLIT_CASES[case_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case, exact, lo = make_split_case(T, H, I, E, K, routing, seed, device)
    where = f"[{case_name}, {form}, seed={seed}]"
    if form == "pointer":
        split, plain = run_pointer(case, lo), run_pointer(case)
    else:
        interpreter = device == "cpu"
        config = choose_tma_weight_grad_config(T * K, E, 4, interpreter=interpreter, split=True)
        split = run_tma(case, variant(config, form), programs, lo)
        plain = run_tma(
            case, variant(choose_tma_weight_grad_config(T * K, E, 4, interpreter=interpreter), form), programs
        )
    assert_split_beats_plain(case, exact, split, plain, where)


@needs_triton
def test_lo_halves_that_do_not_fit_are_refused_naming_them(seed):
    case, _, lo = make_split_case(17, 32, 32, 3, 2, "uniform", seed)
    config = choose_tma_weight_grad_config(34, 3, 4, interpreter=True, split=True)
    with pytest.raises(ValueError, match="^lo_halves: expected five tensors"):
        run_tma(case, config, 2, lo[:4])
    with pytest.raises(ValueError, match="^lo_halves: dgate_lo must be a"):
        run_tma(case, config, 2, (lo[0], lo[1], lo[2].float(), lo[3], lo[4]))


@needs_triton
def test_two_calls_give_the_same_bits(seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(21, 32, 48, 4, 2, "skewed", torch.float32, seed, device)
    config = choose_tma_weight_grad_config(42, 4, 4, interpreter=device == "cpu")
    first, second = run_tma(case, config, 3), run_tma(case, config, 3)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_gather_sorted_rows_follows_the_routing(seed):
    generator = torch.Generator().manual_seed(seed)
    T, E, K = 19, 6, 3
    topk_indices = route_tokens(T, E, K, routing="skewed", generator=generator)
    routing = route_by_expert(topk_indices, E)
    v = torch.randn((T, 8), generator=generator).bfloat16()
    got = gather_sorted_rows(v, routing.sorted_slot, K)
    slots = routing.sorted_slot.tolist()
    assert torch.equal(got, torch.stack([v[s // K] for s in slots]))
    flat = topk_indices.reshape(-1).tolist()
    assert [flat[s] for s in slots] == sorted(flat)  # row p belongs to the expert the offsets assign it
    assert gather_sorted_rows(v, routing.sorted_slot[:0], K).shape == (0, 8)


def test_config_rules():
    """Warp specialisation needs num_warps=4; a deeper pipeline only for busy experts with 16-bit inputs;
    expert groups by rows per expert; 16-wide tiles under the interpreter. (Shared memory and registers:
    scripts/p2/p2_tma_compile_check.py.)"""
    with pytest.raises(ValueError, match="num_warps=4"):
        TmaWeightGradConfig(warp_specialize=True)
    few, many = (choose_tma_weight_grad_config(t * 8, 256, 2, interpreter=False) for t in (2048, 32768))
    assert few.gate_up_tile == many.gate_up_tile == (128, 128, 64)
    assert (few.stages_gate_up, many.stages_gate_up, few.expert_groups, many.expert_groups) == (3, 4, 4, 1)
    assert choose_tma_weight_grad_config(8192 * 8, 256, 2, interpreter=False).expert_groups == 2
    fp32 = choose_tma_weight_grad_config(32768 * 8, 256, 4, interpreter=False)
    assert fp32.down_tile == (128, 128, 64) and fp32.stages_down == 3
    assert choose_tma_weight_grad_config(40, 3, 2, interpreter=True).down_tile == (16, 16, 16)


@needs_triton
def test_rejects_rows_tma_cannot_address():
    """A row of 36 bf16 values (72 bytes) is no multiple of 16 bytes: TMA cannot stride over it."""
    E, I, H, K = 2, 32, 36, 1
    routing = route_by_expert(torch.zeros((4, K), dtype=torch.int64), E)
    x = torch.zeros((4, H), dtype=torch.bfloat16)
    ws = torch.zeros((4, I), dtype=torch.bfloat16)
    grads = torch.empty((E, I, H)), torch.empty((E, I, H)), torch.empty((E, H, I))
    config = choose_tma_weight_grad_config(4, E, 2, interpreter=True)
    with pytest.raises(ValueError, match="16-byte"):
        launch_weight_grads_tma(config, routing.expert_offsets, x, x, ws, ws, ws, *grads, num_programs=2)


# --------------------------------------------------------------------------------------------------
# GPU

MEDIUM = dict(T=3001, H=520, I=392, E=16, K=4)  # edge tiles clipped in both H and I


def existing_kernel_w(case: dict) -> tuple[torch.Tensor, ...]:
    """Today's kernel W (gathered-row pointer loads) on the same workspaces."""
    T, H, I, E, K, dtype = (case[k] for k in ("T", "H", "I", "E", "K", "dtype"))
    config = launch_config(T * K, E, input_bytes=dtype.itemsize)
    outputs = (
        torch.empty((E, I, H), dtype=dtype, device="cuda"),
        torch.empty((E, I, H), dtype=dtype, device="cuda"),
        torch.empty((E, H, I), dtype=dtype, device="cuda"),
    )
    launch_weight_grads(
        config,
        case["routing"],
        case["routing"].sorted_slot,
        K,
        case["x"],
        case["dy"],
        case["dgate"],
        case["dup"],
        case["scaled_act"],
        *outputs,
    )
    return outputs


def num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["flat", "expert_groups"])
@pytest.mark.parametrize("routing", ["uniform", "skewed", "hot"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_medium_against_existing_kernel_and_float64(dtype, routing, form, seed):
    case = make_case(**MEDIUM, routing=routing, dtype=dtype, seed=seed, device="cuda")
    config = variant(
        choose_tma_weight_grad_config(MEDIUM["T"] * MEDIUM["K"], MEDIUM["E"], dtype.itemsize, interpreter=False), form
    )
    got = run_tma(case, config, num_sms())
    torch.cuda.synchronize()
    where = f"[{dtype}, {routing}, {form}, seed={seed}]"
    assert_matches_float64(case, got, where)
    for name, g, w in zip(OUTPUT_NAMES, got, existing_kernel_w(case), strict=True):
        assert rel_error(g, w) <= 2 * TOLERANCE[dtype], f"{where} {name}: against launch_weight_grads"
        assert torch.equal(g == 0, w == 0), f"{where} {name}: zeros where the existing kernel has none, or the reverse"


@pytest.mark.gpu
@pytest.mark.parametrize("rows_per_step", [64, 128])
def test_gpu_busy_experts(rows_per_step, seed):
    """≥ 512 rows per expert on average: the 4-stage configuration of 16-bit inputs, and 128-row steps."""
    sizes = dict(T=4099, H=264, I=136, E=4, K=2)
    config = choose_tma_weight_grad_config(4099 * 2, 4, 2, interpreter=False)
    assert config.stages_gate_up == 4
    if rows_per_step == 128:
        config = dataclasses.replace(
            config, gate_up_tile=(128, 128, 128), down_tile=(128, 256, 128), stages_gate_up=2, stages_down=2
        )
    case = make_case(**sizes, routing="uniform", dtype=torch.bfloat16, seed=seed, device="cuda")
    assert_matches_float64(case, run_tma(case, config, num_sms()), f"[{rows_per_step} rows, seed={seed}]")


@pytest.mark.gpu
@pytest.mark.parametrize("form, field", [("warp_specialized", "warp_specialize"), ("tma_store", "tma_store")])
def test_gpu_refuses_the_forms_that_write_wrong_tiles(form, field, seed):
    """Those forms leave tiles unwritten or wrong on the GPU (notes/p2/runs-design-04.md): refused there, not run."""
    case = make_case(**MEDIUM, routing="uniform", dtype=torch.bfloat16, seed=seed, device="cuda")
    config = variant(choose_tma_weight_grad_config(MEDIUM["T"] * MEDIUM["K"], MEDIUM["E"], 2, interpreter=False), form)
    with pytest.raises(NotImplementedError, match=field):
        run_tma(case, config, num_sms())


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["flat", "expert_groups", "pointer"])
def test_gpu_medium_split_products_against_float64(form, seed):
    """bf16×3 at the medium shape: the chooser's tiles for it compile and launch, and give fp32's precision."""
    sizes = dict(MEDIUM, routing="skewed")
    case, exact, lo = make_split_case(**sizes, seed=seed, device="cuda")
    where = f"[bf16×3, {form}, seed={seed}]"
    if form == "pointer":
        split, plain = run_pointer(case, lo), run_pointer(case)
    else:
        slots, E = MEDIUM["T"] * MEDIUM["K"], MEDIUM["E"]
        split = run_tma(
            case, variant(choose_tma_weight_grad_config(slots, E, 4, False, split=True), form), num_sms(), lo
        )
        plain = run_tma(case, variant(choose_tma_weight_grad_config(slots, E, 4, False), form), num_sms())
    torch.cuda.synchronize()
    assert_split_beats_plain(case, exact, split, plain, where)


@pytest.mark.gpu
def test_gpu_repeatable_and_graph_capturable(seed):
    """Bitwise-equal results from two calls, and from a CUDA-graph replay after the inputs changed in place."""
    case = make_case(**MEDIUM, routing="skewed", dtype=torch.bfloat16, seed=seed, device="cuda")
    config = choose_tma_weight_grad_config(MEDIUM["T"] * MEDIUM["K"], MEDIUM["E"], 2, interpreter=False)
    first, second = run_tma(case, config, num_sms()), run_tma(case, config, num_sms())
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_tma(case, config, num_sms())  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_tma(case, config, num_sms())
    for name in ("x", "dy", "dgate", "dup", "scaled_act"):
        case[name].copy_(torch.randn_like(case[name], dtype=torch.float32).to(case[name].dtype))
    graph.replay()
    torch.cuda.synchronize()
    fresh = run_tma(case, config, num_sms())
    assert all(torch.equal(a, b) for a, b in zip(captured, fresh, strict=True))
    assert_matches_float64(case, captured, f"[graph replay, seed={seed}]")
