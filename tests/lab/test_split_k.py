"""Notebook 04's split-K demonstration (moe_lib.lab.kernels.split_demo_*): the split sum differs from the unsplit one
by rounding only, and on a GPU, where programs arrive in any order, every run gives the same bits."""

import pytest
import torch

import moe_lib
from moe_lib import problems
from moe_lib.dispatch import interpreter_enabled
from moe_lib.lab import derivations, kernels

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)


def _inputs(split, steps, seed, device):
    size = kernels.split_demo_size(split, steps)
    return problems.make_inputs(
        "swiglu_down_backward",
        5,
        seed=seed,
        device=device,
        dtype=torch.float32,
        hidden_size=size,
        intermediate_size=size,
    )


@needs_triton
def test_the_split_sum_differs_from_the_unsplit_one_by_rounding(seed):
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

    inputs = _inputs(4, 2, seed, "cuda" if torch.cuda.is_available() else "cpu")
    split = swiglu_down_backward_triton(*inputs.values(), config=kernels.split_demo_config(4))
    unsplit = swiglu_down_backward_triton(*inputs.values(), config=kernels.split_demo_config(1))
    reference = moe_lib.swiglu_down_backward(*[t.double() for t in inputs.values()], impl="reference")
    table = kernels.split_differences(split, unsplit, derivations.P1_OUTPUTS)
    assert table.loc["grad_x", "relative difference"] > 0  # dx's 2I reduction: four steps a split, regrouped
    assert (table["relative difference"] < 1e-5).all()
    for got, want in zip(split, reference, strict=True):
        assert derivations.relative_error(got, want) < 1e-5


def test_the_demonstration_gives_each_split_several_steps():
    config = kernels.split_demo_config(4)
    assert config.d_intermediate[3] == config.grad_x[3] == 4 and config.grad_down[3] == config.grad_gate_up[3] == 1
    size = kernels.split_demo_size(4, 3)
    assert size // 4 // kernels.SPLIT_DEMO_BLOCK_K == 3


@pytest.mark.gpu
def test_gpu_split_runs_agree_bit_for_bit(seed):
    from moe_lib.swiglu_down.backward import swiglu_down_backward_triton

    inputs = _inputs(8, 4, seed, "cuda")
    config = kernels.split_demo_config(8)
    first = swiglu_down_backward_triton(*inputs.values(), config=config)
    for _ in range(20):
        again = swiglu_down_backward_triton(*inputs.values(), config=config)
        assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
