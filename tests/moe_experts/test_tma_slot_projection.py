"""The TMA-fed persistent kernel D (``moe_lib.moe_experts.tma_slot_projection``): per-slot projections.

backward: dX_slot[slot(p)] = Wg_eᵀ dg[p] + Wu_eᵀ du[p];  forward: y_slot[slot(p)] = Wd_e aw[p].

CPU: under the Triton interpreter (tests/conftest.py switches it on where there is no GPU) on tiny shapes
(16-wide tiles: several H-tiles, row blocks and reduction steps, clipped edges in H and I), with uniform,
skewed, all rows on one expert, empty-expert routings, one expert, T = 1 and T = 0; bf16, fp16 and fp32
interfaces (fp32: weights rounded to bf16 in the kernel, by TMA or by pointer loads), both uses, the
backward's two terms through one descriptor (their tensors in either address order, or in one buffer) or
paired, persistent grids smaller and larger than the tile count. Inputs are
fresh every run (the ``seed`` fixture); the output is NaN-poisoned before the call (every slot row must be
written); it is compared with a float64 product of the same bf16-rounded operands over the positions whose
slot the routing gave each expert.
GPU (``gpu`` marker): a medium shape with clipped edges against today's kernel D (``launch_slot_projection``)
and float64, repeatability and CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import rel_error

from moe_lib.dispatch import interpreter_enabled
from moe_lib.moe_experts.choose import choose_tma_slot_projection_config
from moe_lib.moe_experts.inputs import route_tokens
from moe_lib.moe_experts.routing import route_by_expert
from moe_lib.moe_experts.tma_slot_projection import (
    TmaSlotProjectionConfig,
    _term_axis_fits,
    launch_slot_projection_tma,
    tma_slot_projection_fits,
    two_term_form,
)

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)
OPERAND_DTYPE = {torch.float32: torch.bfloat16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}
# relative Frobenius error against float64 of the same (rounded) operands: fp32 accumulation only (the output
# is fp32 in every interface); the interpreter multiplies exactly in fp32
TOLERANCE = 1e-5
USES = ("backward", "forward")


def make_case(T, H, I, E, K, routing, dtype, seed, device="cpu") -> dict:
    """Kernel D's inputs: routing; Wg, Wu [E, I, H] and Wd [E, H, I] in the interface dtype; dg, du and aw as
    kernel A leaves them ([max(T·K, 1), I], rows in sorted order, the operand dtype)."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape, dtype):
        return torch.randn(shape, generator=generator, device=device).to(dtype)

    topk_indices = route_tokens(T, E, K, routing=routing, device=device, generator=generator)
    rows = max(T * K, 1)
    operand = OPERAND_DTYPE[dtype]
    return dict(
        T=T,
        H=H,
        I=I,
        E=E,
        K=K,
        dtype=dtype,
        topk_indices=topk_indices,
        routing=route_by_expert(topk_indices, E),
        gate=draw(E, I, H, dtype=dtype),
        up=draw(E, I, H, dtype=dtype),
        down=draw(E, H, I, dtype=dtype),
        dgate=draw(rows, I, dtype=operand),
        dup=draw(rows, I, dtype=operand),
        scaled_act=draw(rows, I, dtype=operand),
    )


def float64_slot_projection(case: dict, use: str) -> torch.Tensor:
    """[T·K, H] float64: per slot s = sorted_slot[p] routed to e, Wg_eᵀ dg[p] + Wu_eᵀ du[p] (backward) or
    Wd_e aw[p] (forward), with the weights rounded to the operand dtype as the kernel multiplies them."""
    E, H, K = case["E"], case["H"], case["K"]
    operand = OPERAND_DTYPE[case["dtype"]]
    slots = case["routing"].sorted_slot.long()
    expert_of_position = case["topk_indices"].reshape(-1)[slots]
    out = torch.zeros((case["T"] * K, H), dtype=torch.float64, device=slots.device)
    for e in range(E):
        where = (expert_of_position == e).nonzero().flatten()
        if use == "backward":
            value = case["dgate"][where].double() @ case["gate"][e].to(operand).double()
            value += case["dup"][where].double() @ case["up"][e].to(operand).double()
        else:
            value = case["scaled_act"][where].double() @ case["down"][e].to(operand).double().T
        out[slots[where]] = value
    return out


def run_tma(case: dict, use: str, config: TmaSlotProjectionConfig, num_programs: int) -> torch.Tensor:
    """One launch into a NaN-poisoned fp32 [max(T·K, 1), H] workspace."""
    out = torch.full((max(case["T"] * case["K"], 1), case["H"]), float("nan"), device=case["dgate"].device)
    if use == "backward":
        args = (case["gate"], case["up"], case["dgate"], case["dup"])
    else:
        args = (case["down"], None, case["scaled_act"], None)
    launch_slot_projection_tma(
        config, case["routing"], *args, out, transposed_weights=use == "backward", num_programs=num_programs
    )
    return out


def assert_matches_float64(case: dict, use: str, got: torch.Tensor, where: str) -> None:
    num_slots = case["T"] * case["K"]
    got = got[:num_slots]
    assert torch.isfinite(got).all(), f"{where}: NaN/Inf (unwritten slot rows?)"
    error = rel_error(got, float64_slot_projection(case, use))
    assert error <= TOLERANCE, f"{where}: relative error {error:.3g}"


def variant(config: TmaSlotProjectionConfig, name: str) -> TmaSlotProjectionConfig:
    if name == "default":
        return config
    if name == "h_tiles_inner":  # an expert's tiles numbered H-tile inner
        return dataclasses.replace(config, row_blocks_inner=False)
    if name == "pointer_weights":  # fp32 weights by pointer loads (16-bit weights: TMA regardless)
        return dataclasses.replace(config, weight_tma=False)
    if name == "paired":  # the backward's two terms through their own descriptors, both in every step
        return dataclasses.replace(config, concat_terms=False)
    if name == "paired_pointer_weights":
        return dataclasses.replace(config, concat_terms=False, weight_tma=False)
    if name == "other_loop_form":  # nested loops where the default flattens them (16-bit), flattened for fp32
        return dataclasses.replace(config, flatten=not config.flatten)
    if name == "wide":  # 32-wide weight tiles and row blocks, one step covering I = 32
        return dataclasses.replace(config, backward_tile=(32, 32, 32), forward_tile=(32, 32, 32))
    raise ValueError(name)


# --------------------------------------------------------------------------------------------------
# CPU, under the interpreter

# name: (T, H, I, E, K, routing, interface dtype, persistent programs)
SMALL_CASES = {
    "uniform-bf16": (37, 40, 48, 5, 2, "uniform", torch.bfloat16, 3),
    "uniform-fp32": (29, 48, 40, 4, 3, "uniform", torch.float32, 7),
    "skewed-fp16": (23, 40, 32, 5, 3, "skewed", torch.float16, 4),
    "one-expert-bf16": (40, 32, 40, 3, 1, "hot", torch.bfloat16, 5),  # all 40 rows on one expert: 3 row blocks
    "empty-experts-fp32": (17, 40, 32, 5, 2, "hot", torch.float32, 2),  # 3 of 5 experts without rows
    "T1-bf16": (1, 32, 48, 3, 2, "uniform", torch.bfloat16, 9),  # more programs than tiles
    "E1-fp32": (6, 24, 24, 1, 1, "uniform", torch.float32, 2),  # one expert: no search at all
    "T0-bf16": (0, 32, 32, 3, 2, "uniform", torch.bfloat16, 3),  # no slots: nothing to write, no launch
}


@needs_triton
@pytest.mark.parametrize("use", USES)
@pytest.mark.parametrize("case_name", list(SMALL_CASES))
def test_small_cases_against_float64(case_name, use, seed):
    T, H, I, E, K, routing, dtype, programs = SMALL_CASES[case_name]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(T, H, I, E, K, routing, dtype, seed, device)
    config = choose_tma_slot_projection_config(T * K, E, dtype.itemsize, interpreter=device == "cpu")
    got = run_tma(case, use, config, programs)
    assert_matches_float64(case, use, got, f"[{case_name}, {use}, seed={seed}]")
    if routing == "hot":  # the cases meant to have experts without rows do
        assert int((case["routing"].counts == 0).sum()) == E - K


@needs_triton
@pytest.mark.parametrize(
    "form", ["h_tiles_inner", "pointer_weights", "paired", "paired_pointer_weights", "other_loop_form", "wide"]
)
@pytest.mark.parametrize("use", USES)
def test_config_forms_against_float64(form, use, seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(31, 40, 48, 4, 2, "skewed", torch.float32, seed, device)
    config = variant(choose_tma_slot_projection_config(62, 4, 4, interpreter=device == "cpu"), form)
    assert_matches_float64(case, use, run_tma(case, use, config, 4), f"[{form}, {use}, seed={seed}]")


@needs_triton
@pytest.mark.parametrize("order", ["weights_reversed", "rows_reversed", "one_buffer"])
def test_terms_at_any_distance_and_order(order, seed):
    """The backward's two terms share one descriptor whose term axis runs from the lower address up: term 1's
    tensors may lie below term 0's (the weights, or the rows, or neither), or both in one buffer."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(19, 32, 48, 3, 2, "uniform", torch.bfloat16, seed, device)
    weights = torch.stack([case["gate"], case["up"]])
    rows = torch.stack([case["dgate"], case["dup"]])
    if order == "weights_reversed":  # Wu at the lower address
        weights = torch.stack([case["up"], case["gate"]])
        case["gate"], case["up"] = weights[1], weights[0]
    if order == "rows_reversed":  # du at the lower address
        rows = torch.stack([case["dup"], case["dgate"]])
        case["dgate"], case["dup"] = rows[1], rows[0]
    if order == "one_buffer":
        case["gate"], case["up"], case["dgate"], case["dup"] = weights[0], weights[1], rows[0], rows[1]
    config = choose_tma_slot_projection_config(38, 3, 2, interpreter=device == "cpu")
    assert_matches_float64(case, "backward", run_tma(case, "backward", config, 3), f"[{order}, seed={seed}]")


@needs_triton
def test_two_calls_give_the_same_bits(seed):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(21, 32, 48, 4, 2, "skewed", torch.float32, seed, device)
    config = choose_tma_slot_projection_config(42, 4, 4, interpreter=device == "cpu")
    assert torch.equal(run_tma(case, "backward", config, 3), run_tma(case, "backward", config, 3))


def test_config_rules():
    """16-wide tiles under the interpreter; on the GPU 256 weight rows × 64 expert rows for few rows per
    16-bit expert, 256 × 128 on 16 warps for busier ones, 128 × 128 for fp32 weights; flattened loops except for
    fp32 weights (ptxas serialises the wgmma of that form); the paired backward gets half the stages; tiles TMA can box.
    (Shared memory, registers and serialisation: scripts/p2/p2_tma_d_compile_check.py.)"""
    assert choose_tma_slot_projection_config(40, 3, 2, interpreter=True).backward_tile == (16, 16, 16)
    bf16_small = choose_tma_slot_projection_config(2048 * 8, 256, 2, interpreter=False)
    bf16_busy = choose_tma_slot_projection_config(32768 * 8, 256, 2, interpreter=False)
    fp32 = choose_tma_slot_projection_config(2048 * 8, 256, 4, interpreter=False)
    assert bf16_small.backward_tile == bf16_small.forward_tile == (256, 64, 64)
    assert bf16_busy.backward_tile == bf16_busy.forward_tile == (256, 128, 64) and bf16_busy.backward_warps == 16
    assert fp32.backward_tile == fp32.forward_tile == (128, 128, 64)
    assert bf16_small.flatten and bf16_busy.flatten and not fp32.flatten
    assert bf16_small.concat_terms and bf16_small.weight_tma and fp32.weight_tma
    tile, _, stages = bf16_small.launch_params(two_terms=True, paired=True)
    assert stages == bf16_small.backward_stages // 2 and tile == bf16_small.backward_tile
    with pytest.raises(ValueError, match="powers of two"):
        TmaSlotProjectionConfig(backward_tile=(128, 48, 64))
    with pytest.raises(ValueError, match="256"):
        TmaSlotProjectionConfig(forward_tile=(512, 64, 64))
    assert tma_slot_projection_fits(4096, 2048, 4) and not tma_slot_projection_fits(36, 32)
    # the backward's two terms share a descriptor where their distance is a TMA stride (< 2⁴⁰ B, 16 B multiple)
    both = torch.zeros((2, 4, 32), dtype=torch.bfloat16)
    assert two_term_form(bf16_small, both[0], both[1], both[1], both[0]) == "concat"
    assert (
        two_term_form(dataclasses.replace(bf16_small, concat_terms=False), both[0], both[1], both[0], both[1])
        == "paired"
    )
    assert two_term_form(bf16_small, both[0, 0], both[0, 1, 4:], both[0], both[1]) == "paired"  # 72 bytes apart
    assert _term_axis_fits(-(2**39), interpreter=False) and not _term_axis_fits(2**40, interpreter=False)
    assert not tma_slot_projection_fits(32, 36, transposed_weights=False)


@needs_triton
def test_rejects_what_tma_cannot_address_and_mismatched_terms():
    """A row of 36 bf16 values (72 bytes) is no multiple of 16 bytes: TMA cannot stride over it."""
    E, I, H, K = 2, 32, 36, 1
    routing = route_by_expert(torch.zeros((4, K), dtype=torch.int64), E)
    rows = torch.zeros((4, I), dtype=torch.bfloat16)
    weights = torch.zeros((E, I, H), dtype=torch.bfloat16)
    out = torch.empty((4, H))
    config = choose_tma_slot_projection_config(4, E, 2, interpreter=True)
    with pytest.raises(ValueError, match="16 bytes"):
        launch_slot_projection_tma(
            config, routing, weights, weights, rows, rows, out, transposed_weights=True, num_programs=2
        )
    weights, out = torch.zeros((E, I, 48), dtype=torch.bfloat16), torch.empty((4, 48))
    with pytest.raises(ValueError, match="both"):
        launch_slot_projection_tma(
            config, routing, weights, weights.clone(), rows, None, out, transposed_weights=True, num_programs=2
        )
    with pytest.raises(ValueError, match=r"expected \[2, 48, 32\]"):  # [E, I, H] given where [E, H, I] is due
        launch_slot_projection_tma(
            config, routing, weights, None, rows, None, out, transposed_weights=False, num_programs=2
        )


# --------------------------------------------------------------------------------------------------
# GPU

MEDIUM = dict(T=3001, H=520, I=392, E=16, K=4)  # edge tiles clipped in both H and I


def existing_kernel_d(case: dict, use: str) -> torch.Tensor:
    """Today's kernel D (pointer loads, row split) on the same workspaces."""
    from moe_lib.moe_experts.choose import launch_config
    from moe_lib.moe_experts.designs.d_pointer import launch_slot_projection

    T, H, I, E, K, dtype = (case[k] for k in ("T", "H", "I", "E", "K", "dtype"))
    config = launch_config(T * K, E, input_bytes=dtype.itemsize)
    out = torch.full((T * K, H), float("nan"), device="cuda")
    if use == "backward":
        launch_slot_projection(config, case["routing"], case["gate"], case["up"], case["dgate"], case["dup"], out, 1, H)
    else:
        launch_slot_projection(
            config, case["routing"], case["down"], case["down"], case["scaled_act"], case["scaled_act"], out, I, 1
        )
    return out


def num_sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def gpu_config(dtype: torch.dtype, form: str = "default") -> TmaSlotProjectionConfig:
    """The GPU config of the medium shape (≈ 750 rows per expert), or with ``few_rows`` the one picked for
    64 rows per expert (the benchmark's 2048 tokens: 64-row blocks for 16-bit inputs) on the same inputs."""
    slots = 64 * MEDIUM["E"] if form == "few_rows" else MEDIUM["T"] * MEDIUM["K"]
    config = choose_tma_slot_projection_config(slots, MEDIUM["E"], dtype.itemsize, interpreter=False)
    return config if form == "few_rows" else variant(config, form)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "form", ["default", "few_rows", "h_tiles_inner", "pointer_weights", "paired", "other_loop_form"]
)
@pytest.mark.parametrize("routing", ["uniform", "skewed", "hot"])
@pytest.mark.parametrize("use", USES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_medium_against_existing_kernel_and_float64(dtype, use, routing, form, seed):
    case = make_case(**MEDIUM, routing=routing, dtype=dtype, seed=seed, device="cuda")
    got = run_tma(case, use, gpu_config(dtype, form), num_sms())
    torch.cuda.synchronize()
    where = f"[{dtype}, {use}, {routing}, {form}, seed={seed}]"
    assert_matches_float64(case, use, got, where)
    want = existing_kernel_d(case, use)
    assert rel_error(got, want) <= 2 * TOLERANCE, f"{where}: against launch_slot_projection"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{where}: rows written differ"


@pytest.mark.gpu
@pytest.mark.parametrize("use", USES)
def test_gpu_busy_experts_with_wide_row_blocks(use, seed):
    """≥ 512 rows per expert on average with 16-bit inputs: the wide-row-block configuration."""
    sizes = dict(T=4099, H=264, I=136, E=4, K=2)
    config = choose_tma_slot_projection_config(4099 * 2, 4, 2, interpreter=False)
    assert config.backward_tile[1] >= 128
    case = make_case(**sizes, routing="uniform", dtype=torch.bfloat16, seed=seed, device="cuda")
    assert_matches_float64(case, use, run_tma(case, use, config, num_sms()), f"[{use}, seed={seed}]")


@pytest.mark.gpu
@pytest.mark.parametrize("use", USES)
def test_gpu_repeatable_and_graph_capturable(use, seed):
    """Bitwise-equal results from two calls, and from a CUDA-graph replay after the inputs changed in place."""
    case = make_case(**MEDIUM, routing="skewed", dtype=torch.bfloat16, seed=seed, device="cuda")
    config = gpu_config(torch.bfloat16)
    assert torch.equal(run_tma(case, use, config, num_sms()), run_tma(case, use, config, num_sms()))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_tma(case, use, config, num_sms())  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_tma(case, use, config, num_sms())
    for name in ("gate", "up", "down", "dgate", "dup", "scaled_act"):
        case[name].copy_(torch.randn_like(case[name], dtype=torch.float32).to(case[name].dtype))
    graph.replay()
    torch.cuda.synchronize()
    fresh = run_tma(case, use, config, num_sms())
    assert torch.equal(captured, fresh)
    assert_matches_float64(case, use, captured, f"[graph replay, {use}, seed={seed}]")
