"""P2's chooser pinned by value at every boundary, each at its value and one off (``moe_lib.moe_experts.choose``).

Every number is a literal: the boundaries are where today's rules change their answer (mean rows per expert
T·K / E at 128 and 512, the ceilings of the row split, the fp32 guard on the 16-bit busy-expert tiles, the
interpreter's tiles, TMA's 16-byte rows and compute capability 9.0), never computed from the constants under test,
so that a moved threshold fails here.
"""

from __future__ import annotations

import pytest
import torch

from moe_lib.moe_experts.choose import choose, launch_config
from moe_lib.moe_experts.runtime import Target

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16
HOPPER, INTERPRETER = Target(), Target(interpreter=True)
D_FEW, D_BUSY, D_FP32 = ((256, 64, 64), 8), ((256, 128, 64), 16), ((128, 128, 64), 8)  # kernel D: tile, warps

# (T·K, E, input bytes, interpreter) -> block_m, row_split, block_h, W's expert groups, W's stages, D's tile and warps
CONFIGS = [
    # E = 256 in 16-bit: the row split's steps (R covers an expert 4 standard deviations busier than the mean)
    ((0, 256, 2, False), (64, 1, 64, 4, 3, D_FEW)),
    ((9794, 256, 2, False), (64, 1, 64, 4, 3, D_FEW)),
    ((9795, 256, 2, False), (64, 2, 64, 4, 3, D_FEW)),
    ((22839, 256, 2, False), (64, 2, 64, 4, 3, D_FEW)),
    ((22840, 256, 2, False), (64, 3, 64, 4, 3, D_FEW)),
    # mean 128 rows per expert: W in 2 expert groups, D's 256 × 128 tiles on 16 warps
    ((32767, 256, 2, False), (64, 3, 64, 4, 3, D_FEW)),
    ((32768, 256, 2, False), (64, 3, 64, 2, 3, D_BUSY)),
    ((32769, 256, 2, False), (64, 3, 64, 2, 3, D_BUSY)),
    ((36644, 256, 2, False), (64, 3, 64, 2, 3, D_BUSY)),
    ((36645, 256, 2, False), (64, 4, 64, 2, 3, D_BUSY)),
    ((50848, 256, 2, False), (64, 4, 64, 2, 3, D_BUSY)),
    ((50849, 256, 2, False), (64, 5, 64, 2, 3, D_BUSY)),
    ((65308, 256, 2, False), (64, 5, 64, 2, 3, D_BUSY)),
    ((65309, 256, 2, False), (64, 6, 64, 2, 3, D_BUSY)),
    ((79951, 256, 2, False), (64, 6, 64, 2, 3, D_BUSY)),
    ((79952, 256, 2, False), (64, 7, 64, 2, 3, D_BUSY)),
    ((94733, 256, 2, False), (64, 7, 64, 2, 3, D_BUSY)),
    ((94734, 256, 2, False), (64, 8, 64, 2, 3, D_BUSY)),
    # mean 512: busy experts, 128-row blocks, W in one group with 4 stages
    ((131071, 256, 2, False), (64, 8, 64, 2, 3, D_BUSY)),
    ((131072, 256, 2, False), (128, 5, 64, 1, 4, D_BUSY)),
    ((131073, 256, 2, False), (128, 5, 64, 1, 4, D_BUSY)),
    ((139665, 256, 2, False), (128, 5, 64, 1, 4, D_BUSY)),
    ((139666, 256, 2, False), (128, 6, 64, 1, 4, D_BUSY)),
    ((169966, 256, 2, False), (128, 6, 64, 1, 4, D_BUSY)),
    ((169967, 256, 2, False), (128, 7, 64, 1, 4, D_BUSY)),
    ((200465, 256, 2, False), (128, 7, 64, 1, 4, D_BUSY)),
    ((200466, 256, 2, False), (128, 8, 64, 1, 4, D_BUSY)),
    ((2097152, 256, 2, False), (128, 8, 64, 1, 4, D_BUSY)),  # the split's cap
    # fp32: 32-wide H steps, no busy-expert tiles (their W tiles and A, D would not fit), 3 stages, D 128 × 128
    ((32767, 256, 4, False), (64, 3, 32, 4, 3, D_FP32)),
    ((32768, 256, 4, False), (64, 3, 32, 2, 3, D_FP32)),
    ((131071, 256, 4, False), (64, 8, 32, 2, 3, D_FP32)),
    ((131072, 256, 4, False), (64, 8, 32, 1, 3, D_FP32)),
    ((131073, 256, 4, False), (64, 8, 32, 1, 3, D_FP32)),
    # E = 8: the same means at 8 × 128 and 8 × 512 slots
    ((1023, 8, 2, False), (64, 3, 64, 4, 3, D_FEW)),
    ((1024, 8, 2, False), (64, 3, 64, 2, 3, D_BUSY)),
    ((4095, 8, 2, False), (64, 8, 64, 2, 3, D_BUSY)),
    ((4096, 8, 2, False), (128, 5, 64, 1, 4, D_BUSY)),
    ((4097, 8, 2, False), (128, 5, 64, 1, 4, D_BUSY)),
]

# the interpreter: 16-wide tiles, a row split of at most 3 by 16-row blocks
INTERPRETER_SPLITS = [
    ((1424, 256), 1),
    ((1425, 256), 2),
    ((3925, 256), 2),
    ((3926, 256), 3),
    ((2097152, 256), 3),
    ((44, 8), 1),
    ((45, 8), 2),
    ((122, 8), 2),
    ((123, 8), 3),
]


def _as_values(config) -> tuple:
    w, d = config.tma_weight_grad, config.tma_slot_projection
    assert (w.stages_gate_up, d.forward_tile, d.forward_warps) == (w.stages_down, d.backward_tile, d.backward_warps)
    return (
        config.block_m,
        config.row_split,
        config.block_h,
        w.expert_groups,
        w.stages_gate_up,
        (d.backward_tile, d.backward_warps),
    )


@pytest.mark.parametrize("arguments, expected", CONFIGS, ids=lambda v: "-".join(map(str, v))[:40])
def test_launch_config_at_each_boundary(arguments, expected):
    num_slots, num_experts, input_bytes, interpreter = arguments
    assert (
        _as_values(launch_config(num_slots, num_experts, input_bytes=input_bytes, interpreter=interpreter)) == expected
    )


@pytest.mark.parametrize("input_bytes", [2, 4])
@pytest.mark.parametrize("arguments, row_split", INTERPRETER_SPLITS, ids=str)
def test_interpreter_row_split_at_each_boundary(arguments, row_split, input_bytes):
    config = launch_config(*arguments, input_bytes=input_bytes, interpreter=True)
    assert (config.block_m, config.block_i, config.row_split, config.block_h) == (16, 16, row_split, 32)
    assert config.tma_weight_grad.gate_up_tile == config.tma_slot_projection.backward_tile == (16, 16, 16)


# (H, I, dtype, target) -> designs of kernel W, kernel D in the backward, kernel D in the forward
DESIGNS = [
    # rows of H: 16 bytes are 8 bf16 or fp16 elements (x, dy, the weights), 4 fp32 weights (and 8 bf16 workspaces)
    ((1000, 2048, BF16, HOPPER), ("tma", "tma", "tma")),
    ((999, 2048, BF16, HOPPER), ("pointer", "pointer", "tma")),
    ((1001, 2048, BF16, HOPPER), ("pointer", "pointer", "tma")),
    ((1008, 2048, F16, HOPPER), ("tma", "tma", "tma")),
    ((1007, 2048, F16, HOPPER), ("pointer", "pointer", "tma")),
    ((1009, 2048, F16, HOPPER), ("pointer", "pointer", "tma")),
    ((1000, 2048, F32, HOPPER), ("tma", "tma", "tma")),
    ((1003, 2048, F32, HOPPER), ("pointer", "pointer", "tma")),
    ((1004, 2048, F32, HOPPER), ("pointer", "tma", "tma")),  # fp32 weights aligned, bf16 x and dy not
    ((1005, 2048, F32, HOPPER), ("pointer", "pointer", "tma")),
    # rows of I: every kernel reads some (the forward's D reads Wd's)
    ((4096, 2048, BF16, HOPPER), ("tma", "tma", "tma")),
    ((4096, 2047, BF16, HOPPER), ("pointer", "pointer", "pointer")),
    ((4096, 2049, BF16, HOPPER), ("pointer", "pointer", "pointer")),
    ((4096, 2056, BF16, HOPPER), ("tma", "tma", "tma")),
    ((4096, 2052, F32, HOPPER), ("pointer", "pointer", "pointer")),  # bf16 workspaces of I: 4104 bytes
    ((4096, 2056, F32, HOPPER), ("tma", "tma", "tma")),
    # TMA from compute capability 9.0
    ((4096, 2048, BF16, Target(capability=(8, 9))), ("pointer", "pointer", "pointer")),
    ((4096, 2048, BF16, Target(capability=(9, 0))), ("tma", "tma", "tma")),
    ((4096, 2048, BF16, Target(capability=(9, 1))), ("tma", "tma", "tma")),
    ((4096, 2048, F32, Target(capability=(8, 9))), ("pointer", "pointer", "pointer")),
]


@pytest.mark.parametrize("arguments, designs", DESIGNS, ids=lambda v: "-".join(map(str, v)).replace("torch.", ""))
def test_designs_at_each_boundary(arguments, designs):
    hidden_size, intermediate_size, dtype, target = arguments
    choice = choose(16384, 256, hidden_size, intermediate_size, dtype, target)
    assert (choice.weight_grad.name, choice.slot_projection.name, choice.slot_projection_forward.name) == designs


@pytest.mark.parametrize("rows_per_rank, chunks", [(65535, 1), (65536, 2), (65537, 2)])
def test_the_parallel_layer_takes_two_chunks_from_65536_rows_per_rank(rows_per_rank, chunks, monkeypatch):
    """The mean rows per rank (T_r·K) over the group; one rank here, its arguments exchange stood in for."""
    import torch.distributed as dist

    from moe_lib.moe_experts import parallel

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_gather", lambda gathered, row, group=None: gathered[0].copy_(row))
    sizes = dict(hidden_size=64, intermediate_size=32, top_k=1, local_experts=4, num_tokens=rows_per_rank)
    hidden, weights = torch.empty(0, 64), torch.empty(0, 1)
    assert parallel._agree_on_arguments(sizes, None, None, hidden, weights, None, None) == (4, chunks)
