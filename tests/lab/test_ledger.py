"""The P2 ledger (moe_lib/lab/ledger.py): its steps agree with the problem's counts and with the kernels' design."""

import math

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch

from moe_lib import problems, roofline
from moe_lib.lab import ledger
from moe_lib.moe_experts.choose import choose
from moe_lib.moe_experts.runtime import Target

matplotlib.use("Agg")

SPEC = roofline.GPUSpec.from_measured(4.2e12, 780e12, name="test ceilings")


def _sizes(num_tokens):
    return problems.load("moe_experts_backward").sizes(num_tokens)


@pytest.mark.parametrize("dtype, coefficient", [("bfloat16", 16), ("float16", 16), ("float32", 28)])
@pytest.mark.parametrize("num_tokens", [1, 2048, 8192])
def test_the_steps_do_the_problems_tensor_work(dtype, coefficient, num_tokens):
    # 16·T·K·H·I as lab.json counts it; the fp32 interface's bf16×3 products for g, u and Wdᵀdy make it 28
    s = _sizes(num_tokens)
    work = coefficient * num_tokens * s["top_k"] * s["hidden_size"] * s["intermediate_size"]
    assert sum(step.flops for step in ledger.p2_backward_steps(num_tokens, dtype)) == work
    if coefficient == 16:
        assert work == problems.load("moe_experts_backward_bf16").flops(num_tokens)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_eight_weight_passes_where_the_problem_has_six(dtype):
    s = _sizes(2048)
    weight_bytes = s["num_experts"] * s["intermediate_size"] * s["hidden_size"] * (4 if dtype == "float32" else 2)
    steps = ledger.p2_backward_steps(2048, dtype)
    assert sum(step.weight_passes for step in steps) == 8
    shared = ledger.p2_backward_steps(2048, dtype, weights_shared_by_a_and_d=True)
    assert sum(step.weight_passes for step in shared) == 6
    moved = sum(step.read_bytes + step.written_bytes for step in steps)
    assert moved - sum(step.read_bytes + step.written_bytes for step in shared) == 2 * weight_bytes
    # the weight-sized passes alone are at least that many weight tensors' bytes
    assert moved >= 8 * weight_bytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("num_tokens", [16, 2048, 32768])
def test_the_decomposition_never_beats_the_problems_floor(dtype, num_tokens):
    problem = "moe_experts_backward" if dtype == "float32" else "moe_experts_backward_bf16"
    steps = ledger.p2_backward_steps(num_tokens, dtype)
    assert sum(s.read_bytes + s.written_bytes for s in steps) > roofline.minimal_bytes(problem, num_tokens, dtype)
    floor_ms = 1e3 * roofline.sol_time(problem, num_tokens, SPEC, dtype)
    assert sum(s.floor_ms(SPEC) for s in steps) >= floor_ms * (1 - 1e-12)


def test_only_fp32_inputs_are_split():
    assert [s.name for s in ledger.p2_backward_steps(2048, "bfloat16")][0] == "A"
    assert [s.name for s in ledger.p2_backward_steps(2048, "float32")][0] == "split x, dy"


def test_a_step_is_bound_by_the_larger_of_its_two_times():
    step = ledger.Step("x", "", read_bytes=2.1e12, written_bytes=2.1e12, flops=0.0)
    assert step.bound(SPEC) == "memory" and math.isclose(step.floor_ms(SPEC), 1e3)
    step = ledger.Step("y", "", read_bytes=0.0, written_bytes=0.0, flops=780e12)
    assert step.bound(SPEC) == "tensor" and math.isclose(step.floor_ms(SPEC), 1e3)


def test_the_table_totals_its_steps():
    table = ledger.ledger_table(4096, "float32", SPEC)
    steps = table.drop(index="total")
    for column in ("read (GB)", "written (GB)", "TFLOP", "weight passes", "floor (ms)"):
        assert math.isclose(table.loc["total", column], steps[column].sum())
    assert set(steps["bound by"]) <= {"memory", "tensor"}


def test_summary_and_figure_without_measurements():
    cases = [("bfloat16", 2048), ("float32", 2048)]
    summary = ledger.summary_table(cases, SPEC, {})
    assert summary["measured (ms)"].isna().all()
    assert summary.loc[("float32", 2048), "target (ms)"] == 15.3  # the problems' case targets (lab.json)
    assert summary.loc[("bfloat16", 2048), "target (ms)"] == 7.5
    assert np.isnan(ledger.case_target_ms("moe_experts_backward_bf16", 8192))  # none set there
    # at 32768 tokens the target is the layer's (forward + backward), not the backward's: no case time
    assert np.isnan(ledger.case_target_ms("moe_experts_backward_bf16", 32768))
    row = summary.loc[("float32", 2048)]
    assert row["problem floor (ms)"] <= row["… D sharing A's weight read (ms)"] <= row["decomposition floor (ms)"]
    fig = ledger.ledger_figure(cases, SPEC, summary)
    assert len(fig.axes) == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(num_tokens=2048, dtype="float64"), "dtype"), (dict(num_tokens=0, dtype="float32"), "num_tokens")],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ledger.p2_backward_steps(**kwargs)


def test_p1_floors_order_the_arithmetics_and_end_in_geomeans():
    table = ledger.p1_floor_table(SPEC, None, launch_floor_us=3.0, tokens=[1, 128, 8192])
    assert list(table.index) == [1, 128, 8192, "geomean"]
    fast, fp8, hi_lo = (table[name] for name in ledger.P1_ARITHMETIC)
    assert (fast <= fp8).all() and (fp8 <= hi_lo).all()
    # at 8192 tokens all three are tensor-bound: their floors stand as their work, 12 : 16 : 20
    assert (hi_lo[8192] - 3.0) / (fast[8192] - 3.0) == pytest.approx(20 / 12)
    # at 1 token all three are the weights' traffic, plus the launch
    bytes_1 = roofline.minimal_bytes("swiglu_down_backward", 1)
    assert fast[1] == hi_lo[1] == pytest.approx(1e6 * bytes_1 / SPEC.dram_bandwidth + 3.0)
    assert table["measured fast"].isna().all()
    assert table.loc["geomean", "fast (bf16 dGate, dUp)"] == pytest.approx(float(np.exp(np.log(fast[:3]).mean())))


def test_fp8_lo_table_adds_the_products_and_the_copies():
    """The committed probe's 8192-token row by hand: both lo products' µs summed per way, the copies x → fp8 xᵀ and
    [Wg; Wu] → fp8 at 2 + 1 bytes an element over the bandwidth; what notes/p1/design-24.md read off it."""
    table = ledger.p1_fp8_lo_table(SPEC, None)
    assert list(table.index) == [1087, 1571, 2447, 2767, 4093, 7168, 8192]
    row = table.loc[8192]
    assert row["bf16_us"] == pytest.approx(72.816 + 69.328, abs=0.01)
    assert row["fp8_us"] == pytest.approx(49.376 + 49.456, abs=0.01)
    assert row["copies_us"] == pytest.approx(1e6 * 3 * (8192 * 2048 + 2 * 768 * 2048) / SPEC.dram_bandwidth)
    assert row["net_us"] == pytest.approx(row["fp8_us"] + row["copies_us"] - row["bf16_us"])
    assert table["share"].isna().all()  # no measured faithful path given
    # fp8 pays only from 4093 tokens: below, its products alone are no faster than bf16's
    assert (table.loc[[4093, 7168, 8192], "net_us"] < -10).all() and (table.loc[[1087, 1571, 2447], "net_us"] > 0).all()


def test_geomean_change_counts_the_unchanged_cases_and_no_slower_one():
    shares = pd.Series({8192: -0.08, 7168: -0.09, 1087: 0.05})  # the slower case would not be used: unchanged
    expected = math.exp((math.log(0.92) + math.log(0.91)) / 16) - 1
    assert ledger.geomean_change(shares, 16) == pytest.approx(expected)
    assert ledger.geomean_change(pd.Series({1: 0.1}), 16) == 0.0


def test_kernel_w_multiplies_bf16x3_where_the_rule_says():
    """Mixtral-8x7B's shape in fp32 at 4096 tokens: kernel W's bf16×3 products (three per GEMM, 40·T·K·H·I in all)
    read hi and lo halves, and kernel A writes dg, du, aw's lo halves; the problem's shape keeps plain products."""
    axes = dict(hidden_size=4096, intermediate_size=14336, num_experts=8, top_k=2)
    T, H, I, K = 4096, 4096, 14336, 2
    S = T * K
    steps = {s.name: s for s in ledger.p2_backward_steps(T, "float32", **axes)}
    plain = {s.name: s for s in ledger.p2_backward_steps(T, "bfloat16", **axes)}
    assert sum(s.flops for s in steps.values()) == 40 * S * H * I
    assert steps["W"].flops == 3 * plain["W"].flops
    assert steps["W"].read_bytes == 2 * plain["W"].read_bytes
    i_tiles = -(-I // choose(S, 8, H, I, torch.float32, Target(), top_k=K).config.block_i)
    assert steps["A"].written_bytes == 2 * 3 * S * I * 2 + i_tiles * S * 4  # dg, du, aw: hi and lo; the partials
    assert steps["gather"].written_bytes == 2 * plain["gather"].written_bytes
