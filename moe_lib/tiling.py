"""Tile arithmetic on the host, the same the kernels do on the device.

The launch plans (each kernel family's ``launch_plan()``) and notebook 04's diagrams use these; the
tests check them against the ``@triton.jit`` versions under the interpreter, so that one description
of a launch serves the launcher, the pictures and the reader.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for non-negative a and positive b."""
    return -(-a // b)


def split_ranges(length: int, split: int, block_k: int) -> list[tuple[int, int]]:
    """[k_start, k_end) of each of ``split`` pieces of a reduction of ``length`` (P1's ``split_range``):
    BLOCK_K-aligned pieces of ⌈⌈length / split⌉ / block_k⌉ · block_k; trailing ones may be empty."""
    per_split = cdiv(cdiv(length, split), block_k) * block_k
    return [(min(s * per_split, length), min((s + 1) * per_split, length)) for s in range(split)]


def grouped_tile(tile: int, num_tiles_m: int, num_tiles_n: int, group_m: int) -> tuple[int, int]:
    """(tile_m, tile_n) of linear tile ``tile`` when ``group_m`` row tiles go together, column by column,
    so that they reuse each column tile from L2 (P1's ``grouped_tile``)."""
    tiles_per_group = group_m * num_tiles_n
    first_m = (tile // tiles_per_group) * group_m
    group_rows = min(num_tiles_m - first_m, group_m)
    return first_m + (tile % tiles_per_group) % group_rows, (tile % tiles_per_group) // group_rows


def expert_tile(program: int, num_tiles: int, row_split: int) -> tuple[int, int, int]:
    """(expert, tile, r) of a P2 program: the R programs of one (expert, tile) are adjacent, and the tiles
    of one expert follow each other (P2's ``expert_tile``)."""
    return program // (row_split * num_tiles), (program // row_split) % num_tiles, program % row_split
