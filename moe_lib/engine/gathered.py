"""An operand read through a row index: row r of the [M_total, C] operand is source[index[r]], gathered by the
kernel's loads instead of a copy in memory (the MoE layer's x_s and dy_s: each routed slot's token row).

    Gathered(source [T, C], index [M_total] int32)    operand[r] = source[index[r]]

The kernels check nothing about the index's values on the device (no host sync): the caller's routing puts every
index in 0 ≤ index[r] < T.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

GATHER_WARPS = 4  # a loading partition's warps where an operand is gathered (16-byte copies by every thread)


class Gathered(NamedTuple):
    """The rows source[index[r]] as an operand of :mod:`.grouped_wgrad` (and its tl twin)."""

    source: torch.Tensor  # [T, C]: the rows gathered from (their row stride and start 16-byte aligned)
    index: torch.Tensor  # [M_total] int32 on source's device: the source row of each operand row

    @property
    def shape(self) -> tuple[int, int]:
        return (self.index.shape[0], self.source.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.source.dtype

    @property
    def device(self) -> torch.device:
        return self.source.device

    def materialise(self) -> torch.Tensor:
        """The operand as a tensor (for references and tests)."""
        return self.source.index_select(0, self.index.long())


def check_gathered(name: str, operand: Gathered) -> None:
    """TypeError/ValueError naming ``name`` where the index cannot address the source's rows: a 2-D source, a 1-D
    contiguous int32 index on the same device."""
    source, index = operand
    if not isinstance(source, torch.Tensor) or not isinstance(index, torch.Tensor):
        raise TypeError(
            f"{name}: expected Gathered(source, index) of two tensors, got "
            f"({type(source).__name__}, {type(index).__name__})"
        )
    if source.dim() != 2:
        raise ValueError(f"{name}.source: expected a 2-D tensor [T, columns], got shape {tuple(source.shape)}")
    if index.dtype != torch.int32:
        raise TypeError(f"{name}.index: expected torch.int32, got {index.dtype}")
    if index.dim() != 1 or not index.is_contiguous():
        raise ValueError(
            f"{name}.index: expected a contiguous 1-D tensor [M_total], got shape "
            f"{tuple(index.shape)} and strides {tuple(index.stride())}"
        )
    if index.device != source.device:
        raise ValueError(f"{name}.index: expected the device of its source ({source.device}), got {index.device}")


# --- in Gluon: a loading partition's threads copy a gathered tile's rows by cp.async ---------------------------------


@gluon.constexpr_function
def gather_layout(C, WARPS):
    """The loading threads over a gathered tile's [R, C]: 16 bytes (8 elements) a thread in a row."""
    column_threads = 32 if C >= 256 else C // 8
    return gl.BlockedLayout([1, 8], [32 // column_threads, column_threads], [WARPS, 1], [1, 0])


@gluon.jit
def step_indices(index_ptr, rows_left, gather, R: gl.constexpr, C: gl.constexpr, WARPS: gl.constexpr):
    """The source rows index[r] of one step's R rows as the threads of :func:`gather_layout` hold them (0 past
    rows_left, and none loaded where not ``gather``)."""
    layout: gl.constexpr = gather_layout(C, WARPS)
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    return gl.load(index_ptr + rows, mask=(rows < rows_left) & (gather != 0), other=0)


@gluon.jit
def gather_sources(source_row, src_ptr, src_stride, rows_left, col0, n_cols, C: gl.constexpr, WARPS: gl.constexpr):
    """(pointers, mask) of the tile source[source_row[r], col0 + c]; the mask is off for r ≥ rows_left and
    col0 + c ≥ n_cols, where a copy of no bytes writes zeros, as TMA fills past a descriptor's edge."""
    R: gl.constexpr = source_row.type.shape[0]
    layout: gl.constexpr = gather_layout(C, WARPS)
    rows = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    col_ok = gl.expand_dims(gl.max_constancy(cols < n_cols, 8), 0)  # N a multiple of 8 (checked on the host)
    starts = gl.multiple_of(source_row.to(gl.int64) * src_stride, 8)  # rows 16 bytes apart (checked on the host)
    return src_ptr + gl.expand_dims(starts, 1) + gl.expand_dims(cols, 0), gl.expand_dims(rows < rows_left, 1) & col_ok
