"""An operand read through a row index: row r of the [M_total, C] operand is source[index[r]], gathered by the
kernel's loads instead of a copy in memory (the MoE layer's x_s and dy_s: each routed slot's token row).

    Gathered(source [T, C], index [M_total] int32)    operand[r] = source[index[r]]

The kernels check nothing about the index's values on the device (no host sync): the caller's routing puts every
index in 0 ≤ index[r] < T.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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
