"""Kernel W's precision rule: ``moe_lib.moe_experts.choose.weight_grad_products`` and its error model
(``moe_lib.moe_experts.precision_rule``).

- Which products every model shape of the suite takes at each token count, pinned by value, and the model's margin z
  at the shapes near the border (the sweep behind them: notes/p2/fp32-precision-rule.md).
- The model against the problem's own inputs, fresh each run: the weight gradients' RMS per √(rows of the expert),
  and the relative error of bf16 operands (√2·δ).
- The chooser, the launch plan and the workspace accounting carry the choice; products a caller names are checked
  before any work.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_lib import problems, reference
from moe_lib.bench.models import MODEL_SHAPES
from moe_lib.moe_experts.choose import (
    BF16_MARGIN,
    choose,
    choose_tma_weight_grad_config,
    launch_config,
    weight_grad_products,
)
from moe_lib.moe_experts.precision_rule import (
    BF16_ROUNDING,
    bf16_error_rms,
    bf16_margin,
    operand_rms,
    predicted_pass_share,
)
from moe_lib.moe_experts.runtime import Target
from moe_lib.precision import silu_grad

F32, BF16 = torch.float32, torch.bfloat16
HOPPER = Target()
TOKENS = (512, 2048, 4096, 8192, 32768)
# model -> the token counts (of TOKENS) at which kernel W multiplies bf16×3 in fp32; plain products at the others
SPLIT_AT = {
    "Qwen3-30B-A3B": (),
    "Qwen3-235B-A22B": (),
    "DeepSeek-V3": (),
    "Mixtral-8x7B": (2048, 4096, 8192, 32768),
    "gpt-oss-20b": (32768,),
    "OLMoE-1B-7B": (),
    "DeepSeek-V2-Lite": (),
}
# (model, tokens) -> z, the tolerance in predicted error RMS of bf16 operands, near the border of BF16_MARGIN
MARGINS = {
    ("Mixtral-8x7B", 512): 6.99,
    ("Mixtral-8x7B", 2048): 3.50,
    ("Mixtral-8x7B", 4096): 2.47,
    ("gpt-oss-20b", 32768): 3.26,
    ("DeepSeek-V3", 32768): 4.49,
    ("Qwen3-235B-A22B", 32768): 5.79,
}
MODELS = {m.name: m for m in MODEL_SHAPES if m.num_experts}


def products_at(model, tokens: int, dtype=F32) -> str:
    return weight_grad_products(tokens * model.top_k, model.num_experts, model.hidden_size, dtype, top_k=model.top_k)


def test_the_rule_at_the_model_shapes():
    assert set(SPLIT_AT) == set(MODELS)
    for name, model in MODELS.items():
        got = {tokens: products_at(model, tokens) for tokens in TOKENS}
        want = {tokens: "bf16x3" if tokens in SPLIT_AT[name] else "plain" for tokens in TOKENS}
        assert got == want, name
        assert {products_at(model, tokens, BF16) for tokens in TOKENS} == {"plain"}, name


def test_the_problems_shape_keeps_plain_products():
    """The benchmark's shape (its speed must not change): plain products at every token count, far from the border."""
    sizes = problems.load("moe_experts_backward").sizes(1)
    H, E, K = sizes["hidden_size"], sizes["num_experts"], sizes["top_k"]
    for tokens in (*TOKENS, 16384):
        assert weight_grad_products(tokens * K, E, H, F32, top_k=K) == "plain", tokens
        assert bf16_margin(tokens * K / E, H, K) >= 2 * BF16_MARGIN, tokens


@pytest.mark.parametrize("model, tokens", list(MARGINS))
def test_the_margin_near_the_border(model, tokens):
    shape = MODELS[model]
    z = bf16_margin(tokens * shape.top_k / shape.num_experts, shape.hidden_size, shape.top_k)
    assert z == pytest.approx(MARGINS[model, tokens], abs=0.02)
    assert products_at(shape, tokens) == ("plain" if z >= BF16_MARGIN else "bf16x3")


def test_the_predicted_share_falls_below_the_rule_at_mixtrals_shape():
    """Mixtral-8x7B at 4096 tokens: 1024 rows per expert, the weight gradients' RMS ≈ 19, ≈ 98.7% within 0.11."""
    shares = predicted_pass_share(1024, 4096, 2)
    assert set(shares) == {"grad_gate_weights", "grad_up_weights", "grad_down_weights"}
    assert 0.98 < min(shares.values()) < 0.99
    assert math.sqrt(1024) * operand_rms(4096, 2)["grad_gate_weights"] == pytest.approx(19.0, rel=0.02)
    assert predicted_pass_share(0, 4096, 2) == dict.fromkeys(shares, 1.0)
    assert bf16_margin(0, 4096, 2) == math.inf


def test_16_bit_inputs_and_empty_calls_take_plain_products():
    for dtype in (BF16, torch.float16):
        assert weight_grad_products(10**7, 8, 4096, dtype, top_k=2) == "plain"
    assert weight_grad_products(0, 8, 4096, F32, top_k=2) == "plain"
    assert weight_grad_products(10**7, 0, 4096, F32, top_k=2) == "plain"


def test_an_unknown_k_takes_the_largest_routing_weights():
    """K unknown: every routing weight taken as 1, so the margin is the smallest any K gives."""
    for rows in (64, 256, 1024):
        unknown = bf16_margin(rows, 4096, 1)
        assert all(unknown <= bf16_margin(rows, 4096, k) for k in (2, 4, 8))
        assert weight_grad_products(rows * 8, 8, 4096, F32) == weight_grad_products(rows * 8, 8, 4096, F32, top_k=1)
    assert weight_grad_products(256 * 256, 256, 4096, F32) == "bf16x3"  # T·K = 65536 with K unknown
    assert weight_grad_products(256 * 256, 256, 4096, F32, top_k=8) == "plain"  # the problem's 8192 tokens


def test_bad_sizes_are_refused_naming_them():
    with pytest.raises(ValueError, match="^hidden_size, top_k: expected positive sizes"):
        operand_rms(4096, 0)


def expert_operands(seed: int) -> tuple[dict, int, int, int]:
    """The problem's inputs at a moderate shape (≈ 512 rows per expert), float64; one expert's operands of the three
    weight gradients: (dg, x), (du, x), (dy, w·a)."""
    T, H, I, E, K = 768, 512, 48, 3, 2
    inputs = problems.make_inputs(
        "moe_experts_backward", T, seed=seed, hidden_size=H, intermediate_size=I, num_experts=E, top_k=K
    )
    inputs = {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}
    token, slot = (inputs["topk_indices"] == 0).nonzero().unbind(1)
    x, dy = inputs["hidden_states"][token], inputs["grad_output"][token]
    w = inputs["topk_weights"][token, slot][:, None]
    g, u = x @ inputs["gate_weights"][0].T, x @ inputs["up_weights"][0].T
    dap = dy @ inputs["down_weights"][0]
    silu = g * torch.sigmoid(g)
    operands = dict(
        grad_gate_weights=(w * dap * u * silu_grad(g), x),
        grad_up_weights=(w * dap * silu, x),
        grad_down_weights=(dy, w * silu * u),
    )
    return dict(inputs=inputs, operands=operands), H, K, len(token)


def test_the_models_rms_is_that_of_the_problems_inputs(seed):
    """Each weight gradient's RMS over its elements, per √(rows of the expert), against the model's rms(a)·rms(b)."""
    drawn, H, K, _ = expert_operands(seed)
    inputs = drawn["inputs"]
    want = reference.moe_experts_backward_reference(*inputs.values())
    counts = torch.bincount(inputs["topk_indices"].flatten(), minlength=3)
    for name, grad in zip(("grad_gate_weights", "grad_up_weights", "grad_down_weights"), want[2:], strict=True):
        for e in range(3):
            per_row = grad[e].square().mean().sqrt().item() / math.sqrt(counts[e].item())
            assert per_row == pytest.approx(operand_rms(H, K)[name], rel=0.15), (name, e)


def test_bf16_operands_err_as_the_model_says(seed):
    """Rounding both operands to bf16: a relative error of √2·δ (δ = 2⁻⁷/√(32 ln 2)), the model's error RMS."""
    drawn, H, K, rows = expert_operands(seed)
    assert BF16_ROUNDING == pytest.approx(1.659e-3, rel=1e-3)
    for name, (a, b) in drawn["operands"].items():
        exact = a.T @ b
        plain = a.to(BF16).double().T @ b.to(BF16).double()
        error = (plain - exact).norm().item() / exact.norm().item()
        assert error == pytest.approx(math.sqrt(2) * BF16_ROUNDING, rel=0.1), name
        error_rms = (plain - exact).square().mean().sqrt().item()
        assert error_rms == pytest.approx(bf16_error_rms(rows, H, K)[name], rel=0.2), name


def test_the_chooser_carries_the_rule():
    """Mixtral-8x7B at 4096 tokens: bf16×3 and kernel W's tiles for it; the problem's shape: plain, today's tiles."""
    choice = choose(8192, 8, 4096, 14336, F32, HOPPER, top_k=2)
    assert choice.weight_grad_products == "bf16x3"
    assert choice.config.tma_weight_grad == choose_tma_weight_grad_config(8192, 8, 4, False, split=True)
    assert choice.config.grad_gate_up_tile[2] == choice.config.grad_down_tile[2] == 32
    assert choice.weight_grad.name == "tma" and choice.slot_projection.name == "tma"
    plain = choose(16384, 256, 4096, 2048, F32, HOPPER, top_k=8)
    assert plain.weight_grad_products == "plain" and plain.config == launch_config(16384, 256, input_bytes=4)
    forced = choose(16384, 256, 4096, 2048, F32, HOPPER, top_k=8, products="bf16x3")
    assert forced.weight_grad_products == "bf16x3" and forced.config.tma_weight_grad.gate_up_tile[2] == 32


def test_products_a_caller_names_are_checked():
    with pytest.raises(ValueError, match=r"^products: expected one of \('plain', 'bf16x3'\), got 'tf32'$"):
        choose(64, 4, 64, 32, F32, HOPPER, products="tf32")
    with pytest.raises(ValueError, match="^products: bf16x3 splits fp32 operands"):
        choose(64, 4, 64, 32, BF16, HOPPER, products="bf16x3")


def test_a_call_with_bad_products_is_refused_before_any_work(monkeypatch, seed):
    from moe_lib.moe_experts import launch, runtime

    inputs = problems.make_inputs(
        "moe_experts_backward", 6, seed=seed, hidden_size=32, intermediate_size=16, num_experts=4, top_k=2
    )
    allocated = []
    monkeypatch.setattr(runtime, "allocate", lambda *a, **k: allocated.append(a) or torch.empty(*a, **k))
    with pytest.raises(ValueError, match="^products: "):
        launch.moe_experts_backward_triton(*inputs.values(), products="bf16x2")
    assert allocated == []


def meta_inputs(T, H, I, E, K) -> tuple:
    """Tensors of a shape without memory: what the chooser and the accounting read is their shape and dtype."""
    empty = dict(device="meta")
    return (
        torch.empty((T, H), **empty),
        torch.empty((T, K), dtype=torch.int64, **empty),
        torch.empty((T, K), **empty),
        torch.empty((E, I, H), **empty),
    )


def test_choose_for_reads_k_from_the_routing():
    from moe_lib.moe_experts.launch import choose_for

    x, indices, _, gate = meta_inputs(4096, 4096, 14336, 8, 2)
    down = torch.empty((8, 4096, 14336), device="meta")
    assert choose_for(x, indices, gate, gate, down, None).weight_grad_products == "bf16x3"
    x, indices, _, gate = meta_inputs(8192, 4096, 2048, 256, 8)
    down = torch.empty((256, 4096, 2048), device="meta")
    assert choose_for(x, indices, gate, gate, down, None).weight_grad_products == "plain"


def test_the_plan_and_the_workspaces_count_the_lo_halves():
    from moe_lib.moe_experts.launch import allocation_bytes, launch_plan

    T, H, I, E, K = 4096, 4096, 14336, 8, 2
    config = launch_config(T * K, E, input_bytes=4)
    plan = launch_plan(T, H, I, E, K, config, num_programs=132, weight_bytes=4)  # the rule: bf16×3 here
    assert "lo halves" in plan["A"].one_program
    assert all("bf16×3" in plan[step].one_program for step in ("W_gate_up", "W_down"))
    plain_plan = launch_plan(2048, 4096, 2048, 256, 8, launch_config(16384, 256), num_programs=132, weight_bytes=4)
    assert "lo halves" not in plain_plan["A"].one_program and "bf16×3" not in plain_plan["W_gate_up"].one_program

    inputs = meta_inputs(T, H, I, E, K)
    slots = T * K
    for target, gathered in ((HOPPER, True), (Target(capability=(8, 0)), False)):  # TMA-fed W, pointer-based W
        split, plain = (choose(slots, E, H, I, F32, target, top_k=K, products=p) for p in ("bf16x3", "plain"))
        assert split.weight_grad.name == ("tma" if gathered else "pointer")
        extra = 3 * slots * I * 2 + (2 * slots * H * 2 if gathered else 0)  # dg, du, aw lo; x, dy lo gathered
        assert allocation_bytes(*inputs, split) - allocation_bytes(*inputs, plain) == extra
