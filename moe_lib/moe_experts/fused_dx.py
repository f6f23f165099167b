"""A set-aside P2 design: kernel G, dWg and dWu per (expert, H-tile) with the expert's dX in the same pass.

For the experts with at most one row block (most of them while T·K/E is small), programs
(expert e, H-tile) write dWg_e, dWu_e and those experts' dX on that H-tile in one walk over I, so that
dg and du are read once for both; kernel W (its dWg·dWu launch) and kernel D skip those experts and do
the busier ones. Measured on the H200 no faster than W + D (``data/results/NOTES.md``: 10.38 against
9.88 ms in fp32 at 2048 tokens, slower at 8192), so it runs only when asked for:
``moe_experts_backward_triton(..., fused_dx=FusedDxConfig())``.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..tiling import cdiv
from .kernels import dot16, operand, round_to
from .launch import OPERAND_DTYPES


@triton.jit
def gate_up_grad_kernel(
    dgate_ptr,  # [T·K, I] dg from kernel A, row = sorted position, OPERAND_DTYPE
    dup_ptr,  # [T·K, I] du, likewise
    x_ptr,  # [T, H] x as an operand (fp32 inputs: bf16(x); 16-bit inputs: x itself)
    gate_weights_ptr,  # [E, I, H] Wg
    up_weights_ptr,  # [E, I, H] Wu
    sorted_slot_ptr,  # [T·K] int32: slot ids in expert order
    expert_offsets_ptr,  # [E + 1] int32: first sorted position of each expert
    grad_gate_ptr,  # out [E, I, H] dWg, output dtype
    grad_up_ptr,  # out [E, I, H] dWu
    dx_slot_ptr,  # out [T·K, H] fp32: Wgᵀ dg + Wuᵀ du per slot, row = slot id
    top_k,  # K
    hidden_size,  # H
    inter_size,  # I
    num_h_tiles,  # cdiv(H, BLOCK_H)
    OPERAND_DTYPE: tl.constexpr,  # dtype of the tensor-core operands (bf16 or fp16)
    INTERPRETER: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):  # fmt: skip
    # Program (expert, H-tile), for the experts with at most BLOCK_ROWS rows (most of them while
    # T·K/E is small; kernels W and D skip them): the expert's x rows [rows, H-tile] stay on chip while
    # the program walks I once: per I-step it loads dg, du [rows, I-step] and the weight tiles Wg, Wu
    # [I-step, H-tile], writes the finished dWg, dWu tiles (dgᵀ x, duᵀ x: the whole reduction over the
    # rows at once) and adds dg·Wg + du·Wu to the expert's dX rows, stored at the end. dg and du are
    # read once for both. Programs of busier experts do nothing: kernel W writes their dWg, dWu and
    # kernel D their dX.
    pid = tl.program_id(0)
    h_tile = pid % num_h_tiles
    expert = pid // num_h_tiles  # an expert's programs are adjacent: its rows of dg, du, x stay in L2
    row_begin = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    expert_offset = expert.to(tl.int64) * inter_size * hidden_size
    gate_w = gate_weights_ptr + expert_offset
    up_w = up_weights_ptr + expert_offset
    out_dtype = grad_gate_ptr.dtype.element_ty
    hs = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < hidden_size
    if row_end - row_begin <= BLOCK_ROWS:  # one row block (also an expert with no rows: zeros written)
        rows = row_begin + tl.arange(0, BLOCK_ROWS)
        row_ok = rows < row_end
        slots = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0)
        tokens = (slots // top_k).to(tl.int64)
        x_rows = tl.load(x_ptr + tokens[:, None] * hidden_size + hs[None, :], mask=row_ok[:, None] & h_ok[None, :],
                         other=0.0)  # fmt: skip
        dx = tl.zeros((BLOCK_ROWS, BLOCK_H), tl.float32)
        for i0 in range(0, inter_size, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            col_ok = cols < inter_size
            ws_offsets = rows[:, None].to(tl.int64) * inter_size + cols[None, :]
            ws_mask = row_ok[:, None] & col_ok[None, :]
            dg = tl.load(dgate_ptr + ws_offsets, mask=ws_mask, other=0.0)  # [rows, I-step]
            du = tl.load(dup_ptr + ws_offsets, mask=ws_mask, other=0.0)
            w_offsets = cols[:, None] * hidden_size + hs[None, :]  # [I-step, H-tile] of Wg[e], Wu[e], dWg[e], dWu[e]
            w_mask = col_ok[:, None] & h_ok[None, :]
            wg = tl.load(gate_w + w_offsets, mask=w_mask, other=0.0)
            wu = tl.load(up_w + w_offsets, mask=w_mask, other=0.0)
            grad_g = dot16(tl.trans(dg), x_rows, tl.zeros((BLOCK_I, BLOCK_H), tl.float32), INTERPRETER)
            grad_u = dot16(tl.trans(du), x_rows, tl.zeros((BLOCK_I, BLOCK_H), tl.float32), INTERPRETER)
            tl.store(grad_gate_ptr + expert_offset + w_offsets, round_to(grad_g, out_dtype, INTERPRETER), mask=w_mask)
            tl.store(grad_up_ptr + expert_offset + w_offsets, round_to(grad_u, out_dtype, INTERPRETER), mask=w_mask)
            dx = dot16(dg, operand(wg, OPERAND_DTYPE, INTERPRETER), dx, INTERPRETER)
            dx = dot16(du, operand(wu, OPERAND_DTYPE, INTERPRETER), dx, INTERPRETER)
        tl.store(dx_slot_ptr + slots[:, None].to(tl.int64) * hidden_size + hs[None, :], dx,
                 mask=row_ok[:, None] & h_ok[None, :])  # fmt: skip


@dataclass(frozen=True)
class FusedDxConfig:
    """Kernel G's tile: I-columns per step, H-columns per program, rows (the busiest expert it takes)."""

    block_i: int = 32
    block_h: int = 128
    block_rows: int = 128
    warps: int = 8
    stages: int = 3

    @classmethod
    def for_interpreter(cls) -> FusedDxConfig:
        return cls(16, 16, 32, 1, 1)

    def launch(self, routing, sorted_slot, dgate, dup, x_operand, gate_weights, up_weights, grad_gate, grad_up,
               dx_slot, top_k) -> int:  # fmt: skip
        """Kernel G over every (expert, H-tile); returns the row count up to which it did the experts."""
        E, I, H = gate_weights.shape
        num_h_tiles = cdiv(H, self.block_h)
        gate_up_grad_kernel[(E * num_h_tiles,)](
            dgate, dup, x_operand, gate_weights, up_weights, sorted_slot, routing.expert_offsets,
            grad_gate, grad_up, dx_slot, top_k, H, I, num_h_tiles,
            OPERAND_DTYPE=OPERAND_DTYPES[dgate.dtype], INTERPRETER=interpreter_enabled(),
            BLOCK_I=self.block_i, BLOCK_H=self.block_h, BLOCK_ROWS=self.block_rows,
            num_warps=self.warps, num_stages=self.stages,
        )  # fmt: skip
        return self.block_rows
