"""The roofline model: FLOPs and bytes checked by hand, T_sol, the score, the GPU table."""

import math

import pytest
import torch

from moe_lib import roofline

T, H, I = 8192, 2048, 768  # P1 at 8192 tokens
BF16 = 2


def test_p1_flops_at_8192_tokens():
    flops, _ = roofline.cost("swiglu_down_backward", T)
    assert flops == 12 * T * H * I == 154_618_822_656  # 154.6 GFLOP: six GEMMs of T·H·I multiply-adds


def test_p1_bytes_at_8192_tokens():
    inputs = 2 * T * H + 3 * I * H + 5 * T * I  # grad_output, x; Wg, Wu, Wd; the five saved [T, I]
    outputs = T * H + 3 * I * H  # grad_x; grad_gate_weight, grad_up_weight, grad_down_weight
    _, traffic = roofline.cost("swiglu_down_backward", T)
    assert traffic == (inputs + outputs) * BF16 == 182_452_224


def test_p2_fp32_bytes_at_2048_tokens():
    t, h, i, e, k = 2048, 4096, 2048, 256, 8
    fp32, int64 = 4, 8
    weights_and_grads = 6 * e * i * h * fp32  # three weight tensors read, three gradients written
    activations = 3 * t * h * fp32  # grad_output, hidden_states read; grad_hidden_states written
    routing = t * k * int64 + 2 * t * k * fp32  # indices, weights read; their gradient written
    flops, traffic = roofline.cost("moe_experts_backward", t)
    assert traffic == weights_and_grads + activations + routing
    assert traffic / 1e9 == pytest.approx(51.6, abs=0.05)
    assert flops == 16 * t * k * h * i


def test_dtype_override_and_bf16_variant():
    fp32 = roofline.minimal_bytes("moe_experts_backward", 2048)
    bf16 = roofline.minimal_bytes("moe_experts_backward", 2048, dtype=torch.bfloat16)
    variant = roofline.minimal_bytes("moe_experts_backward_bf16", 2048)
    assert bf16 == pytest.approx(fp32 / 2, rel=1e-3)
    assert variant == pytest.approx(bf16, rel=1e-3)  # the variant keeps fp32 routing weights
    assert roofline.minimal_bytes("swiglu_down_backward", T, dtype="float32") == 2 * roofline.minimal_bytes(
        "swiglu_down_backward", T
    )
    with pytest.raises(ValueError, match="dtype"):
        roofline.minimal_bytes("swiglu_down_backward", T, dtype=torch.int32)


def test_axes_overrides():
    flops, _ = roofline.cost("swiglu_down_backward", 4, hidden_size=64, intermediate_size=32)
    assert flops == 12 * 4 * 64 * 32
    with pytest.raises(ValueError, match="hiden_size"):
        roofline.cost("swiglu_down_backward", 4, hiden_size=64)


def test_sol_time_takes_the_larger_term():
    h200 = roofline.GPUS["H200"]
    # P1 at 8192 tokens is compute-bound: 154.6 GFLOP at 989 TFLOP/s = 156 µs > 182 MB at 4.8 TB/s = 38 µs
    compute = 154_618_822_656 / h200.bf16_dense_flops
    assert roofline.sol_time("swiglu_down_backward", T, "H200") == pytest.approx(compute)
    assert compute > 182_452_224 / h200.dram_bandwidth
    # P2 fp32 at 2048 tokens is memory-bound: 51.6 GB at 4.8 TB/s = 10.8 ms > 2.2 PFLOP... at 989 = 2.2 ms
    memory = roofline.minimal_bytes("moe_experts_backward", 2048) / h200.dram_bandwidth
    assert roofline.sol_time("moe_experts_backward", 2048, "H200") == pytest.approx(memory)
    assert memory == pytest.approx(10.75e-3, rel=1e-2)
    # a spec object works as well as a key
    slow_memory = roofline.GPUSpec.from_measured(copy_bandwidth=1e9, bf16_rate=1e15, name="slow memory")
    assert roofline.sol_time("swiglu_down_backward", T, slow_memory) == pytest.approx(182_452_224 / 1e9)
    with pytest.raises(ValueError, match="gpu"):
        roofline.sol_time("swiglu_down_backward", T, "A100")


def test_sol_score():
    assert roofline.sol_score(t_kernel=10.0, t_baseline=10.0, t_sol=2.0) == pytest.approx(0.5)
    assert roofline.sol_score(t_kernel=2.0, t_baseline=10.0, t_sol=2.0) == pytest.approx(1.0)
    assert 0.5 < roofline.sol_score(5.0, 10.0, 2.0) < 1.0
    assert roofline.sol_score(20.0, 10.0, 2.0) < 0.5
    with pytest.raises(ValueError):
        roofline.sol_score(1.0, 1.0, 2.0)


def test_gpu_table():
    assert set(roofline.GPUS) == {"H100-SXM", "H100-PCIe", "H200", "B200"}
    for key, spec in roofline.GPUS.items():
        assert spec.source, key
        assert spec.bf16_dense_flops > 5e14 and spec.dram_bandwidth > 1e12, key
        assert spec.l2_bytes and spec.sms and spec.memory_bytes and spec.fp32_flops and spec.tf32_dense_flops
    assert roofline.GPUS["H200"].bf16_dense_flops == roofline.GPUS["H100-SXM"].bf16_dense_flops == 989e12
    assert roofline.GPUS["H200"].dram_bandwidth == 4.8e12
    with pytest.raises(ValueError):
        roofline.GPUSpec.from_measured(0.0, 1e12)


def test_measure_ceilings_on_cpu_is_labelled_rough():
    ceilings = roofline.measure_ceilings("cpu", reps=1)
    assert ceilings["rough"] is True and "ROUGH" in ceilings["method"]
    assert ceilings["copy_bandwidth"] > 0 and ceilings["bf16_matmul_flops"] > 0
    spec = roofline.GPUSpec.from_measured(ceilings["copy_bandwidth"], ceilings["bf16_matmul_flops"])
    assert math.isfinite(roofline.sol_time("swiglu_down_backward", 16, spec))
