"""The host's tile arithmetic (moe_lib.tiling, used by the launch plans and notebook 04) is the kernels' own.

A probe kernel calls the ``@triton.jit`` helpers for every program and stores what they return; the
interpreter (CPU) or the GPU runs it, and the host functions must give the same numbers.
"""

import pytest
import torch

from moe_lib import tiling
from moe_lib.dispatch import interpreter_enabled

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and not interpreter_enabled(), reason="needs CUDA or the Triton interpreter"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from moe_lib.moe_experts.kernels import expert_tile  # noqa: E402
from moe_lib.swiglu_down.kernels import grouped_tile, split_range  # noqa: E402


@triton.jit
def probe_kernel(
    out_ptr,
    length,
    num_tiles_m,
    num_tiles_n,
    num_tiles,
    row_split,
    SPLIT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Row pid of out: what the kernels' helpers return for program pid."""
    pid = tl.program_id(0)
    k_start, k_end = split_range(pid % SPLIT, length, SPLIT, BLOCK_K)
    tile_m, tile_n = grouped_tile(pid, num_tiles_m, num_tiles_n, GROUP_M)
    expert, tile, r = expert_tile(pid, num_tiles, row_split)
    row = out_ptr + pid * 7
    tl.store(row, k_start)
    tl.store(row + 1, k_end)
    tl.store(row + 2, tile_m)
    tl.store(row + 3, tile_n)
    tl.store(row + 4, expert)
    tl.store(row + 5, tile)
    tl.store(row + 6, r)


@pytest.mark.parametrize(
    "length, split, block_k, tiles_m, tiles_n, group_m, num_tiles, row_split",
    [
        (100, 4, 16, 5, 3, 2, 3, 2),
        (1536, 8, 128, 7, 4, 8, 16, 3),
        (5, 4, 16, 1, 9, 4, 1, 1),
    ],
)
def test_host_tile_math_matches_the_kernels(length, split, block_k, tiles_m, tiles_n, group_m, num_tiles, row_split):
    programs = tiles_m * tiles_n
    out = torch.full((programs, 7), -1, dtype=torch.int32, device=DEVICE)
    probe_kernel[(programs,)](out, length, tiles_m, tiles_n, num_tiles, row_split, split, block_k, group_m)
    got = out.cpu().tolist()
    ranges = tiling.split_ranges(length, split, block_k)
    seen = set()
    for pid, (k_start, k_end, tile_m, tile_n, expert, tile, r) in enumerate(got):
        want_start, want_end = ranges[pid % split]
        assert max(k_end - k_start, 0) == want_end - want_start
        if want_end > want_start:
            assert (k_start, k_end) == (want_start, want_end)
        assert (tile_m, tile_n) == tiling.grouped_tile(pid, tiles_m, tiles_n, group_m)
        assert (expert, tile, r) == tiling.expert_tile(pid, num_tiles, row_split)
        seen.add((tile_m, tile_n))
    assert len(seen) == programs  # the grouped order visits every tile once
    assert sum(b - a for a, b in ranges) == length


def test_launch_plans_cover_every_output_tile():
    from moe_lib.moe_experts.choose import launch_config
    from moe_lib.moe_experts.launch import launch_plan
    from moe_lib.swiglu_down.designs.triton_launches import grid_sizes, tiles_for
    from moe_lib.swiglu_down.designs.triton_launches import launch_plan as p1_plan

    for T in (1, 16, 200, 8192):
        plan = p1_plan(T, 2048, 768, tiles_for(T, with_lo=False))
        for kind in plan:
            assert kind.tiles == tiling.cdiv(kind.M, kind.block_m) * tiling.cdiv(kind.N, kind.block_n)
        sizes = grid_sizes(plan)
        assert sizes[1] == sum(k.programs for k in plan if k.launch == 1) > 0
    plan = launch_plan(2048, 4096, 2048, 256, 8, launch_config(2048 * 8, 256, input_bytes=2))
    assert list(plan) == ["A", "W_gate_up", "W_down", "D", "C"]
    assert plan["C"].programs == 2048 * tiling.cdiv(4096, 1024)
    assert launch_plan(0, 64, 32, 4, 2, launch_config(0, 4))["A"].programs == 0
