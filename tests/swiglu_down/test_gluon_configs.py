"""The Gluon launches' host side on the CPU: their descriptors match their kernels' arguments, their grids count
every tile once, and their configs refuse what the kernels do not do (the kernels themselves run on a Hopper GPU:
test_gpu_gluon_* in test_designs.py; they compile for sm_90 in test_compile_sm90.py)."""

import dataclasses

import pytest
import torch

from moe_lib.swiglu_down.gluon_launch1 import GluonFirstLaunchConfig, first_launch_kernel
from moe_lib.swiglu_down.gluon_launch2 import GluonSecondLaunchConfig, second_launch_kernel

T, H, I = 300, 512, 384  # every tile kind with a partial tile along T


def descriptor_arguments(kernel):
    return [name for name in kernel.arg_names if name.endswith("_desc")]


def bf16(*shape):
    return torch.empty(shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("grad_down_block_n", [128, 64])
@pytest.mark.parametrize("halves", [1, 2])
def test_first_launch_descriptors_in_the_kernels_order(grad_down_block_n, halves):
    config = GluonFirstLaunchConfig(grad_down_block_n=grad_down_block_n)
    grad_output, down_weight, saved, intermediate = bf16(T, H), bf16(H, I), bf16(T, I), bf16(T, I)
    d_gate, d_up, grad_down_weight = bf16(halves, T, I), bf16(halves, T, I), bf16(H, I)
    descriptors = config.descriptors(
        grad_output, down_weight, saved, saved, saved, saved, intermediate, d_gate, d_up, grad_down_weight
    )
    names = descriptor_arguments(first_launch_kernel)
    assert len(descriptors) == len(names) == 13
    by_name = dict(zip(names, descriptors, strict=True))
    bm, bn, bk, dn = config.block_m, config.block_n, config.block_k, grad_down_block_n
    assert by_name["dy_t_desc"].base is grad_output and list(by_name["dy_t_desc"].block_shape) == [bk, bm]
    assert by_name["dy_desc"].base is grad_output and list(by_name["dy_desc"].block_shape) == [bm, bk]
    assert list(by_name["intermediate_desc"].block_shape) == [bk, dn]
    assert list(by_name["dwd_desc"].block_shape) == [bm, dn] and by_name["dwd_desc"].base is grad_down_weight
    assert list(by_name["dg_desc"].block_shape) == [bm, bn] and list(by_name["gate_desc"].block_shape) == [bm, bn]
    assert by_name["dg_desc"].base.data_ptr() == d_gate[0].data_ptr()
    assert by_name["dg_lo_desc"].base.data_ptr() == d_gate[halves - 1].data_ptr()
    assert by_name["du_lo_desc"].base.data_ptr() == d_up[halves - 1].data_ptr()
    assert (by_name["dg_lo_desc"] is by_name["dg_desc"]) == (halves == 1)  # no lo halves: one descriptor for both
    # without dWd's tiles (launch 2 takes them) their three descriptors, unused, repeat others instead of being made
    unused = dict(
        zip(
            names,
            dataclasses.replace(config, grad_down_tiles=False).descriptors(
                grad_output, down_weight, saved, saved, saved, saved, intermediate, d_gate, d_up, grad_down_weight
            ),
            strict=True,
        )
    )
    assert unused["dy_t_desc"] is unused["dy_desc"] and unused["intermediate_desc"] is unused["wd_desc"]
    assert unused["dwd_desc"] is unused["dg_desc"]


@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("weight_block_n", [256, 128])
def test_second_launch_descriptors_in_the_kernels_order(weight_block_n, block_m):
    config = GluonSecondLaunchConfig(
        weight_block_n=weight_block_n, block_m=block_m, warps=block_m // 16, grad_down_tiles=True
    )
    x, weight, halves = bf16(T, H), bf16(I, H), bf16(2, T, I)
    intermediate, grad_down_weight = bf16(T, I), bf16(H, I)
    descriptors = config.descriptors(
        x, weight, weight, halves, halves, x, weight, weight, x, intermediate, grad_down_weight
    )
    names = descriptor_arguments(second_launch_kernel)
    assert len(descriptors) == len(names) == 17
    by_name = dict(zip(names, descriptors, strict=True))
    bm, bn, bk, wn = config.block_m, config.block_n, config.block_k, weight_block_n
    # dWd's tiles, where launch 2 takes them, in its weight-gradient tiles' shape: [BLOCK_M of H, WEIGHT_N of I]
    assert by_name["dy_t_desc"].base is x and list(by_name["dy_t_desc"].block_shape) == [bk, bm]
    assert by_name["intermediate_desc"].base is intermediate
    assert list(by_name["intermediate_desc"].block_shape) == [bk, wn]
    assert by_name["dwd_desc"].base is grad_down_weight and list(by_name["dwd_desc"].block_shape) == [bm, wn]
    assert list(by_name["x_desc"].block_shape) == [bk, wn] and list(by_name["dwg_desc"].block_shape) == [bm, wn]
    assert list(by_name["wg_desc"].block_shape) == [bk, bn] and list(by_name["dx_desc"].block_shape) == [bm, bn]
    assert list(by_name["dg_t_desc"].block_shape) == [bk, bm] and list(by_name["dg_desc"].block_shape) == [bm, bk]
    # without dWd's tiles their three descriptors, unused, repeat others instead of being made each call
    unused = dict(
        zip(
            names,
            dataclasses.replace(config, grad_down_tiles=False).descriptors(
                x, weight, weight, halves, halves, x, weight, weight, x, intermediate, grad_down_weight
            ),
            strict=True,
        )
    )
    assert unused["dy_t_desc"] is unused["dg_t_desc"] and unused["intermediate_desc"] is unused["x_desc"]
    assert unused["dwd_desc"] is unused["dwg_desc"]


def test_grids_count_every_tile_once():
    # launch 1: dWd tiles of [128 of H, 128 or 64 of I], then dA tiles of [128 of T, 128 of I]
    assert GluonFirstLaunchConfig().programs(2447, 2048, 768) == 16 * 6 + 20 * 6
    assert GluonFirstLaunchConfig(grad_down_block_n=64).programs(2447, 2048, 768) == 16 * 12 + 20 * 6
    assert GluonFirstLaunchConfig(d_a_block_n=256).programs(2447, 2048, 768) == 16 * 6 + 20 * 3
    # launch 2: dWg and dWu tiles of [128 or 64 of I, 256 of H], then dx tiles of [128 or 64 of T, 256 of H]
    assert GluonSecondLaunchConfig().programs(1087, 2048, 768) == 2 * 6 * 8 + 9 * 8
    assert GluonSecondLaunchConfig(block_m=64, warps=4).programs(1087, 2048, 768) == 2 * 12 * 8 + 17 * 8
    # launch 2: dWg and dWu tiles of [128 of I, 256 or 128 of H], then dx tiles of [128 of T, 256 of H]
    assert GluonSecondLaunchConfig().programs(2447, 2048, 768) == 2 * 6 * 8 + 20 * 8
    assert GluonSecondLaunchConfig(weight_block_n=128).programs(2447, 2048, 768) == 2 * 6 * 16 + 20 * 8
    assert GluonSecondLaunchConfig().programs(1, 2048, 768) == 2 * 6 * 8 + 8


def test_grad_down_tiles_counted_in_the_launch_that_takes_them():
    # dWd in launch 2: launch 1 is dA's tiles alone, launch 2 has dWd's [128 of H, 256 of I] tiles first
    assert GluonFirstLaunchConfig(grad_down_tiles=False).programs(2447, 2048, 768) == 20 * 6
    assert GluonSecondLaunchConfig(grad_down_tiles=True).programs(2447, 2048, 768) == 16 * 3 + 2 * 6 * 8 + 20 * 8
    assert GluonSecondLaunchConfig(block_m=64, warps=4, grad_down_tiles=True).programs(1087, 2048, 768) == (
        32 * 3 + 2 * 12 * 8 + 17 * 8
    )


def test_grad_down_tiles_in_exactly_one_launch():
    from moe_lib.swiglu_down.designs.gluon import FORMS, GluonLaunches

    for first, second in (
        (GluonFirstLaunchConfig(grad_down_tiles=False), GluonSecondLaunchConfig()),
        (GluonFirstLaunchConfig(), GluonSecondLaunchConfig(grad_down_tiles=True)),
    ):
        with pytest.raises(ValueError, match="dWd's tiles go in exactly one launch"):
            GluonLaunches(first, second)
    for form in FORMS.values():  # every form puts them in one place
        assert form.first.grad_down_tiles != form.second.grad_down_tiles


def test_wide_grad_down_tiles_a_divisor_of_block_n_or_two_or_four_times_it():
    assert GluonFirstLaunchConfig(block_n=64, d_a_block_n=64, grad_down_block_n=128).programs(128, 2048, 768) == (
        16 * 6 + 1 * 12
    )
    with pytest.raises(ValueError, match="grad_down_block_n"):
        GluonFirstLaunchConfig(block_n=64, d_a_block_n=64, grad_down_block_n=192)
    assert GluonFirstLaunchConfig(block_n=32, d_a_block_n=32, grad_down_block_n=128).programs(128, 2048, 768) == (
        16 * 6 + 1 * 24
    )
    # launch 2's dWd tiles narrower than its weight-gradient tiles: 128 wide, twice as many
    narrow = GluonSecondLaunchConfig(grad_down_tiles=True, grad_down_block_n=128)
    assert narrow.programs(8192, 2048, 768) == 16 * 6 + 2 * 6 * 8 + 64 * 8
    with pytest.raises(ValueError, match="grad_down_block_n"):
        GluonSecondLaunchConfig(grad_down_tiles=True, grad_down_block_n=96)


def test_first_launch_dA_tiles_one_or_two_halves_wide():
    with pytest.raises(ValueError, match="d_a_block_n"):
        GluonFirstLaunchConfig(d_a_block_n=192)


def test_split_tiles_count_one_program_a_split():
    # launch 2 at 64 rows, 128 tokens: dWg and dWu tiles 12 × 8 each, then 2 × 8 dx tiles, each 2 programs
    config = GluonSecondLaunchConfig(block_m=64, warps=4, grad_x_splits=2)
    assert config.programs(128, 2048, 768) == 2 * 12 * 8 + 2 * 8 * 2 and config.grad_x_tiles(128, 2048) == 16
    # launch 1 at 64 rows, 128 tokens: dWd tiles 32 × 6, then 2 × 6 dA tiles, one program each
    assert GluonFirstLaunchConfig(block_m=64, warps=4).programs(128, 2048, 768) == 32 * 6 + 2 * 6
    assert GluonFirstLaunchConfig(block_m=64, warps=4).d_a_tiles(128, 768) == 12


def test_weight_grad_programs_take_the_tiles_in_turn():
    # launch 2 at 64 rows, 128 tokens: 2 × 12 × 8 weight-gradient tiles on at most 68 programs, dx's 16 tiles in 4
    config = GluonSecondLaunchConfig(block_m=64, warps=4, grad_x_splits=4, weight_grad_programs=68)
    assert config.weight_grad_programs_for(2048, 768) == 68 and config.programs(128, 2048, 768) == 68 + 16 * 4
    assert GluonSecondLaunchConfig(weight_grad_programs=500).weight_grad_programs_for(2048, 768) == 2 * 6 * 8
    assert GluonSecondLaunchConfig().weight_grad_programs_for(2048, 768) == 2 * 6 * 8  # 0: one a tile
    with pytest.raises(ValueError, match="weight_grad_programs"):
        GluonSecondLaunchConfig(weight_grad_programs=-1)


def test_inputs_before_the_wait_need_a_wait():
    # the loading warps' early x, Wg, Wu tiles go out before the wait for launch 1: only where launch 2 waits at all
    assert GluonSecondLaunchConfig(programmatic=True, inputs_before_wait=True).constexprs(True)["INPUTS_BEFORE_WAIT"]
    with pytest.raises(ValueError, match="^config: inputs_before_wait needs programmatic"):
        GluonSecondLaunchConfig(inputs_before_wait=True)


@pytest.mark.parametrize("splits", [0, 3, 6])
def test_splits_are_powers_of_two(splits):
    with pytest.raises(ValueError, match="grad_x_splits"):
        GluonSecondLaunchConfig(grad_x_splits=splits)


def test_saved_tiles_early_only_on_dA_tiles_block_n_wide():
    with pytest.raises(ValueError, match="saved_tiles_early"):
        GluonFirstLaunchConfig(saved_tiles_early=True, d_a_block_n=256)
    assert GluonFirstLaunchConfig(saved_tiles_early=True).saved_tiles_early


@pytest.mark.parametrize(
    "config",
    [
        GluonFirstLaunchConfig(block_m=64, warps=4, buffers=8, d_a_first=True),
        GluonSecondLaunchConfig(grad_x_splits=2, weight_grad_programs=68),
    ],
)
def test_constexprs_follow_the_kernels_arguments(config):
    """What the host passes after T and I is the kernel's compile-time arguments in their order (num_warps aside)."""
    from moe_lib.swiglu_down import gluon_launch1, gluon_launch2

    kernel = (
        gluon_launch1.first_launch_kernel
        if isinstance(config, GluonFirstLaunchConfig)
        else gluon_launch2.second_launch_kernel
    )
    names = kernel.arg_names
    assert list(config.constexprs(True, traced=True)) == names[names.index("I") + 1 : names.index("num_warps")]
    assert config.constexprs(False)["WITH_LO"] is False and config.constexprs(True)["TRACE"] is False
