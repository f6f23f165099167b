"""The expert-parallel layer's last step on the token's rank: each token's K rows summed where the combine left them.

The combine exchange returns a rank's rows in send order (grouped by the expert's rank and chunk), not in slot
order. With ``row_of_slot[t·K + k]`` the position of slot (t, k)'s row in that buffer:

    out[t] = Σ_{k = 0..K−1} rows[row_of_slot[t·K + k]]        accumulated in fp32 in slot order, rounded once

One Triton kernel reads each row once and writes each token's sum once (programs: token t, H-tile). The readable
form, :func:`sum_slot_rows_reference`, gathers the rows into slot order and sums them with torch; it serves
float64 and the CPU, and the tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..precision import compute_dtype
from ..rounding import round_to
from ..tiling import cdiv

# the output is allocated through this function (tests replace it with one that fills the memory with NaN)
allocate = torch.empty
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_H = 1024  # hidden columns per program
INTERPRETER_BLOCK_H = 16  # small, so that tiny test shapes have several H-tiles and a masked edge


@triton.jit
def slot_rows_sum_kernel(
    rows_ptr,  # [S, H] the rows as the combine left them, input dtype
    row_of_slot_ptr,  # [T·K] int32 or int64: the row of slot t·K + k in rows
    out_ptr,  # out [T, H]: out[t] = Σ_k rows[row_of_slot[t·K + k]], input dtype
    top_k,  # K
    hidden_size,  # H
    INTERPRETER: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < hidden_size
    total = tl.zeros((BLOCK_H,), tl.float32)
    for k in range(0, top_k):
        row = tl.load(row_of_slot_ptr + token * top_k + k).to(tl.int64)
        total += tl.load(rows_ptr + row * hidden_size + hs, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden_size + hs, round_to(total, out_ptr.dtype.element_ty, INTERPRETER), mask=h_ok)


def sum_slot_rows_reference(rows: torch.Tensor, row_of_slot: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T, H]: each token's K rows gathered into slot order and summed in the references' compute dtype (fp32 for
    16-bit rows, the rows' own dtype otherwise), rounded to the rows' dtype."""
    by_slot = rows[row_of_slot].view(num_tokens, top_k, *rows.shape[1:])
    return by_slot.sum(dim=1, dtype=compute_dtype(rows.dtype)).to(rows.dtype)


def sum_slot_rows(rows: torch.Tensor, row_of_slot: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T, H]: out[t] = Σ_k rows[row_of_slot[t·K + k]] for rows [S, H] (contiguous) and row_of_slot [T·K] (int32
    or int64): :func:`sum_slot_rows_triton` for fp32 and 16-bit rows on the GPU, the reference otherwise."""
    if rows.is_cuda and rows.dtype in KERNEL_DTYPES and num_tokens * top_k > 0 and rows.shape[1] > 0:
        return sum_slot_rows_triton(rows, row_of_slot, num_tokens, top_k)
    return sum_slot_rows_reference(rows, row_of_slot, num_tokens, top_k)


def sum_slot_rows_triton(rows: torch.Tensor, row_of_slot: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """The kernel's launch (T·K > 0, H > 0; the interpreter runs it on CPU tensors)."""
    hidden_size = rows.shape[1]
    out = allocate((num_tokens, hidden_size), dtype=rows.dtype, device=rows.device)
    block_h = INTERPRETER_BLOCK_H if interpreter_enabled() else BLOCK_H
    slot_rows_sum_kernel[(num_tokens, cdiv(hidden_size, block_h))](
        rows, row_of_slot, out, top_k, hidden_size, INTERPRETER=interpreter_enabled(), BLOCK_H=block_h,
        num_warps=4,
    )
    return out
