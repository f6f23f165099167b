"""The expert-parallel layer's last step on the token's rank: each token's K rows summed where the combine left them.

The combine exchange returns a rank's rows in send order (grouped by the expert's rank and chunk), not in slot
order. With ``row_of_slot[t·K + k]`` the position of slot (t, k)'s row in that buffer:

    out[t] = Σ_{k = 0..K−1} rows[row_of_slot[t·K + k]]        accumulated in fp32 in slot order, rounded once

One Triton kernel reads each row once and writes each token's sum once (programs: token t, H-tile). The readable
form, :func:`sum_slot_rows_reference`, gathers the rows into slot order and sums them with torch; it serves
float64 and the CPU, and the tests compare the two. The engine layer's backward sums dX's rows here, and in the
same launch its routing-weight gradient from dswiglu's per-column-tile partials [J, S]:

    grad_topk[t, k] = Σ_{j = 0..J−1} partial[j, row_of_slot[t·K + k]]   in fp32, j in order, rounded once
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
    out_ptr,  # out [T, H]: out[t] = Σ_k rows[row_of_slot[t·K + k]], input dtype, rows out_stride apart
    out_stride,  # out's row stride (elements): H, or more where out is a column slice of a wider tensor
    top_k,  # K
    hidden_size,  # H
    partial_ptr,  # WITH_TOPK: [J, S] fp32, row j the per-row parts of column tile j; else any pointer, unread
    grad_topk_ptr,  # WITH_TOPK: out [T·K]: grad_topk[t·K + k] = Σ_j partial[j, row_of_slot[t·K + k]]; else unused
    num_partials,  # J
    num_rows,  # S: partial's row stride
    WITH_TOPK: tl.constexpr,
    INTERPRETER: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if WITH_TOPK and tl.program_id(1) == 0:  # the token's K routing-weight gradients, once (its first H-tile)
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < top_k
        slot_rows = tl.load(row_of_slot_ptr + token * top_k + ks, mask=k_ok, other=0).to(tl.int64)
        grad_w = tl.zeros((BLOCK_K,), tl.float32)
        for j in range(0, num_partials):
            grad_w += tl.load(partial_ptr + j * num_rows + slot_rows, mask=k_ok, other=0.0)
        tl.store(
            grad_topk_ptr + token * top_k + ks, round_to(grad_w, grad_topk_ptr.dtype.element_ty, INTERPRETER), mask=k_ok
        )
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = hs < hidden_size
    total = tl.zeros((BLOCK_H,), tl.float32)
    for k in range(0, top_k):
        row = tl.load(row_of_slot_ptr + token * top_k + k).to(tl.int64)
        total += tl.load(rows_ptr + row * hidden_size + hs, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * out_stride + hs, round_to(total, out_ptr.dtype.element_ty, INTERPRETER), mask=h_ok)


def sum_slot_rows_reference(rows: torch.Tensor, row_of_slot: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T, H]: each token's K rows gathered into slot order and summed in the references' compute dtype (fp32 for
    16-bit rows, the rows' own dtype otherwise), rounded to the rows' dtype."""
    by_slot = rows[row_of_slot].view(num_tokens, top_k, *rows.shape[1:])
    return by_slot.sum(dim=1, dtype=compute_dtype(rows.dtype)).to(rows.dtype)


def gathered_partials_reference(
    partial: torch.Tensor, row_of_slot: torch.Tensor, num_tokens: int, top_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """[T, K] in ``dtype``: Σ_j partial[j, row_of_slot[t·K + k]] (partial [J, S] fp32, summed in its dtype)."""
    return partial.sum(dim=0)[row_of_slot].view(num_tokens, top_k).to(dtype)


def sum_slot_rows(
    rows: torch.Tensor,
    row_of_slot: torch.Tensor,
    num_tokens: int,
    top_k: int,
    partial: torch.Tensor | None = None,
    topk_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
):
    """[T, H]: out[t] = Σ_k rows[row_of_slot[t·K + k]] for rows [S, H] (contiguous) and row_of_slot [T·K] (int32
    or int64): :func:`sum_slot_rows_triton` for fp32 and 16-bit rows on the GPU, the reference otherwise. With
    ``partial`` [J, S] fp32 (contiguous): (out, grad_topk [T, K] in ``topk_dtype``), grad_topk[t, k] = Σ_j
    partial[j, row_of_slot[t·K + k]], in the same launch. ``out``: written there where given ([T, H] in the rows'
    dtype, its columns contiguous: a column slice of a wider tensor may be), else allocated."""
    if out is not None and (out.shape != (num_tokens, rows.shape[1]) or out.dtype != rows.dtype or out.stride(1) != 1):
        raise ValueError(
            f"out: expected [{num_tokens}, {rows.shape[1]}] {rows.dtype} with contiguous columns, got "
            f"{list(out.shape)} {out.dtype} with strides {out.stride()}"
        )
    if rows.is_cuda and rows.dtype in KERNEL_DTYPES and num_tokens * top_k > 0 and rows.shape[1] > 0:
        return sum_slot_rows_triton(rows, row_of_slot, num_tokens, top_k, partial, topk_dtype, out)
    summed = sum_slot_rows_reference(rows, row_of_slot, num_tokens, top_k)
    if out is not None:
        summed = out.copy_(summed)
    if partial is None:
        return summed
    return summed, gathered_partials_reference(partial, row_of_slot, num_tokens, top_k, topk_dtype)


def sum_slot_rows_triton(
    rows: torch.Tensor,
    row_of_slot: torch.Tensor,
    num_tokens: int,
    top_k: int,
    partial: torch.Tensor | None = None,
    topk_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
):
    """The kernel's launch (T·K > 0, H > 0; the interpreter runs it on CPU tensors)."""
    hidden_size = rows.shape[1]
    if out is None:
        out = allocate((num_tokens, hidden_size), dtype=rows.dtype, device=rows.device)
    grad_topk = None
    if partial is not None:
        grad_topk = allocate((num_tokens, top_k), dtype=topk_dtype, device=rows.device)
    block_h = INTERPRETER_BLOCK_H if interpreter_enabled() else BLOCK_H
    slot_rows_sum_kernel[(num_tokens, cdiv(hidden_size, block_h))](
        rows,
        row_of_slot,
        out,
        out.stride(0),
        top_k,
        hidden_size,
        partial if partial is not None else out,
        grad_topk if grad_topk is not None else out,
        0 if partial is None else partial.shape[0],
        0 if partial is None else partial.shape[1],
        WITH_TOPK=partial is not None,
        INTERPRETER=interpreter_enabled(),
        BLOCK_H=block_h,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4,
    )
    return out if partial is None else (out, grad_topk)
