"""Notebook 04: small teaching kernels, from a naive Triton kernel to the design the library uses.

Each step is one ``@triton.jit`` function and a host function that launches it. They compute the heart
of each problem on fp32 tensors (the Triton interpreter's bf16 ``tl.dot`` is wrong, so the steps stay in
fp32 there and on the GPU alike):

    P1, dA = dy · Wd and the dSwiGLU (dGate, dUp) of notebook 01, step 2:
        1. naive:  :func:`rowwise_matmul_kernel`, one program per row, no tensor cores; then
                   :func:`dswiglu_kernel`, an elementwise pass that reads dA back from memory
        2. tiled:  :func:`tiled_matmul_kernel`, one program per output tile, ``tl.dot`` over K; then the
                   same elementwise pass
        3. fused:  :func:`fused_dswiglu_kernel`, the tiled product with the dSwiGLU as its epilogue: dA
                   never leaves the chip (what ``moe_lib/swiglu_down/kernels.py`` does, without split-K)
    P2, the recomputed gate projection g_s = Wg_e x_t of every slot s (notebook 02), rows grouped by expert:
        1. per expert: a host loop that gathers each expert's rows with torch and launches
                   :func:`tiled_matmul_kernel` once per expert (the counts read back to the host)
        2. grouped: :func:`grouped_gather_matmul_kernel`, one launch for all experts; each program walks
                   its expert's rows and gathers them inside its loads (kernel A of
                   ``moe_lib/moe_experts/kernels.py`` does this, with transposed tiles)

:func:`kernel_source` returns a kernel's source as written in its module (notebook 04 shows the library's
kernels with it). Importing this module imports triton: set ``TRITON_INTERPRET`` before, if at all.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from ..moe_experts.routing import ExpertRouting, route_by_expert
from ..tiling import cdiv
from .derivations import relative_error

BLOCK = 16  # tile edge of every teaching launch: the smallest tl.dot takes, so tiny inputs have several tiles
SAVED = ("gate", "gate_sigmoid", "gate_silu", "up")  # P1's saved forward tensors the dSwiGLU reads


def kernel_source(kernel) -> str:
    """The source of a ``@triton.jit`` function (decorator included) as its module has it."""
    function = getattr(kernel, "fn", kernel)  # the JIT (or interpreter) wrapper keeps the Python function
    return inspect.getsource(function)


class SourceBlock:
    """Python source shown on a notebook page: highlighted HTML in a code font (JupyterLab, the report), the
    plain text elsewhere."""

    STYLE = ("font-family: var(--jp-code-font-family, monospace); font-size: var(--jp-code-font-size, 13px); "
             "background: var(--jp-cell-editor-background, #f7f7f7); border-left: 3px solid #0969da; "
             "padding: 0.4em 0.8em; overflow-x: auto")

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer

        return f'<div style="{self.STYLE}">{highlight(self.text, PythonLexer(), HtmlFormatter())}</div>'


def show_source(*kernels) -> SourceBlock:
    """The kernels' sources, as their modules have them, in one block for a notebook page."""
    return SourceBlock("\n\n\n".join(kernel_source(kernel).rstrip() for kernel in kernels))


def errors(outputs: dict, reference: dict) -> dict[str, float]:
    """{name: ‖out − ref‖ / ‖ref‖} for each output of a step against the reference's tensor of that name."""
    return {name: relative_error(out, reference[name]) for name, out in outputs.items()}


# ================================================================ P1 · step 1: naive


@triton.jit
def rowwise_matmul_kernel(
    a_ptr, b_ptr, c_ptr,  # A [M, K], B [K, N], C [M, N]: fp32, row-major
    M, N, K,
    BLOCK_N: tl.constexpr,  # at least N: a program holds a whole row of C
    BLOCK_K: tl.constexpr,
):
    """C = A · B, one program per row of C: broadcast products summed over K, no tensor cores.
    Every program reads all of B."""
    m = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + m * K + ks, mask=ks < K, other=0.0)  # [BLOCK_K]: a piece of row m of A
        b = tl.load(b_ptr + ks[:, None] * N + cols[None, :],
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.sum(a[:, None] * b, axis=0)
    tl.store(c_ptr + m * N + cols, acc, mask=cols < N)


@triton.jit
def dswiglu_kernel(
    d_a_ptr,  # dA [T·I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr,  # the saved G, S, Z, U [T·I]
    d_gate_ptr, d_up_ptr,  # out: dGate, dUp [T·I]
    numel,  # T·I
    BLOCK: tl.constexpr,
):
    """Elementwise: dUp = dA ⊙ Z and dGate = dA ⊙ U ⊙ S ⊙ (1 + G ⊙ (1 − S)), BLOCK elements per program."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < numel
    d_a = tl.load(d_a_ptr + offsets, mask=ok)
    s = tl.load(gate_sigmoid_ptr + offsets, mask=ok)
    g = tl.load(gate_ptr + offsets, mask=ok)
    tl.store(d_up_ptr + offsets, d_a * tl.load(gate_silu_ptr + offsets, mask=ok), mask=ok)
    tl.store(d_gate_ptr + offsets, d_a * tl.load(up_ptr + offsets, mask=ok) * s * (1.0 + g * (1.0 - s)), mask=ok)


# ================================================================ P1 · step 2: tiled


@triton.jit
def tiled_matmul_kernel(
    a_ptr, b_ptr, c_ptr,  # A [M, K], B [K, N], C [M, N]: fp32, row-major
    M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C = A · B, one program per [BLOCK_M, BLOCK_N] tile of C: a loop over K that multiplies a tile of A
    by a tile of B on the tensor cores (tl.dot) into an fp32 accumulator. Masks zero the edges."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        b = tl.load(b_ptr + ks[:, None] * N + cols[None, :], mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


# ================================================================ P1 · step 3: fused


@triton.jit
def fused_dswiglu_kernel(
    dy_ptr,  # dy [T, H]
    down_weight_ptr,  # Wd [H, I]
    gate_ptr, gate_sigmoid_ptr, gate_silu_ptr, up_ptr,  # the saved G, S, Z, U [T, I]
    d_gate_ptr, d_up_ptr,  # out: dGate, dUp [T, I]
    T, H, I,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The tiled dA = dy · Wd, then the dSwiGLU on the tile while it is still in registers (the epilogue):
    dA is never written to memory, and the saved tensors are read once, tile by tile."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # tokens
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # intermediate features
    d_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        dy = tl.load(dy_ptr + rows[:, None] * H + ks[None, :], mask=(rows[:, None] < T) & (ks[None, :] < H), other=0.0)
        wd = tl.load(down_weight_ptr + ks[:, None] * I + cols[None, :], mask=(ks[:, None] < H) & (cols[None, :] < I),
                     other=0.0)
        d_a = tl.dot(dy, wd, d_a, input_precision="ieee")
    # epilogue: the saved tensors' tiles at the same [tokens, features] place as d_a
    offsets = rows[:, None] * I + cols[None, :]
    ok = (rows[:, None] < T) & (cols[None, :] < I)
    s = tl.load(gate_sigmoid_ptr + offsets, mask=ok, other=0.0)
    g = tl.load(gate_ptr + offsets, mask=ok, other=0.0)
    tl.store(d_up_ptr + offsets, d_a * tl.load(gate_silu_ptr + offsets, mask=ok, other=0.0), mask=ok)
    d_gate = d_a * tl.load(up_ptr + offsets, mask=ok, other=0.0) * s * (1.0 + g * (1.0 - s))
    tl.store(d_gate_ptr + offsets, d_gate, mask=ok)


# ================================================================ P1 · host side


def _fp32(inputs: dict, names) -> list[torch.Tensor]:
    tensors = [inputs[name] for name in names]
    for name, tensor in zip(names, tensors, strict=True):
        if tensor.dtype != torch.float32 or not tensor.is_contiguous():
            raise TypeError(f"{name}: the teaching kernels take contiguous float32 tensors, got {tensor.dtype}")
    return tensors


def matmul_naive(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · b by :func:`rowwise_matmul_kernel`: M programs."""
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=torch.float32, device=a.device)
    rowwise_matmul_kernel[(M,)](a, b, c, M, N, K, BLOCK_N=triton.next_power_of_2(N), BLOCK_K=BLOCK)
    return c


def matmul_tiled(a: torch.Tensor, b: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """a · b by :func:`tiled_matmul_kernel`: one program per block×block tile of the output."""
    (M, K), N = a.shape, b.shape[1]
    c = torch.empty((M, N), dtype=torch.float32, device=a.device)
    tiled_matmul_kernel[(cdiv(M, block), cdiv(N, block))](a, b, c, M, N, K, BLOCK_M=block, BLOCK_N=block,
                                                          BLOCK_K=block)
    return c


def dswiglu(d_a: torch.Tensor, inputs: dict) -> dict:
    """dGate and dUp from dA and the saved tensors by :func:`dswiglu_kernel`."""
    gate, gate_sigmoid, gate_silu, up = _fp32(inputs, SAVED)
    d_gate, d_up = torch.empty_like(d_a), torch.empty_like(d_a)
    dswiglu_kernel[(cdiv(d_a.numel(), 4 * BLOCK),)](d_a, gate, gate_sigmoid, gate_silu, up, d_gate, d_up, d_a.numel(),
                                                    BLOCK=4 * BLOCK)
    return {"d_gate": d_gate, "d_up": d_up}


def p1_naive(inputs: dict) -> dict:
    """Step 1: dA by :func:`rowwise_matmul_kernel` (written to memory), then :func:`dswiglu_kernel`."""
    dy, down_weight = _fp32(inputs, ("grad_output", "down_weight"))
    d_a = matmul_naive(dy, down_weight)
    return {"d_intermediate": d_a, **dswiglu(d_a, inputs)}


def p1_tiled(inputs: dict, block: int = BLOCK) -> dict:
    """Step 2: dA by :func:`tiled_matmul_kernel` (written to memory), then :func:`dswiglu_kernel`."""
    dy, down_weight = _fp32(inputs, ("grad_output", "down_weight"))
    d_a = matmul_tiled(dy, down_weight, block)
    return {"d_intermediate": d_a, **dswiglu(d_a, inputs)}


def p1_fused(inputs: dict, block: int = BLOCK) -> dict:
    """Step 3: dGate and dUp by :func:`fused_dswiglu_kernel`, one launch, dA kept on chip."""
    dy, down_weight, *saved = _fp32(inputs, ("grad_output", "down_weight", *SAVED))
    T, H = dy.shape
    I = down_weight.shape[1]
    d_gate = torch.empty((T, I), dtype=torch.float32, device=dy.device)
    d_up = torch.empty_like(d_gate)
    fused_dswiglu_kernel[(cdiv(T, block), cdiv(I, block))](dy, down_weight, *saved, d_gate, d_up, T, H, I,
                                                           BLOCK_M=block, BLOCK_N=block, BLOCK_K=block)
    return {"d_gate": d_gate, "d_up": d_up}


def p1_reference(inputs: dict) -> dict:
    """dA, dGate and dUp in float64 with torch, as notebook 01 derives them (the steps' yardstick)."""
    dy, down_weight, gate, s, gate_silu, up = (inputs[name].double() for name in ("grad_output", "down_weight",
                                                                                  *SAVED))
    d_a = dy @ down_weight
    return {"d_intermediate": d_a, "d_gate": d_a * up * s * (1 + gate * (1 - s)), "d_up": d_a * gate_silu}


# ================================================================ P2 · step 2: grouped (step 1 is a host loop)


@triton.jit
def grouped_gather_matmul_kernel(
    x_ptr,  # x [T, H]: the tokens' hidden states
    weights_ptr,  # W [E, N, H]: one [N, H] matrix per expert (Wg or Wu), row-major
    sorted_slot_ptr,  # [T·K] int32: slot ids s = t·K + k, grouped by expert
    expert_offsets_ptr,  # [E + 1] int32: expert e's rows are the sorted positions offsets[e] ≤ p < offsets[e+1]
    out_ptr,  # out [T·K, N]: row p = W_e x_t for the slot at sorted position p
    top_k, H, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Every expert's product in one launch. Program (expert e, N-tile) walks e's rows BLOCK_M at a time;
    the rows of x are gathered inside the loads through sorted_slot, never copied. An expert without
    rows runs no iteration."""
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_begin = tl.load(expert_offsets_ptr + expert)
    row_end = tl.load(expert_offsets_ptr + expert + 1)
    weights = weights_ptr + expert.to(tl.int64) * N * H  # this expert's [N, H] matrix
    for m0 in range(row_begin, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)  # sorted positions
        row_ok = rows < row_end
        tokens = tl.load(sorted_slot_ptr + rows, mask=row_ok, other=0) // top_k
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            # [BLOCK_M, BLOCK_K]: the expert's token rows, gathered; [BLOCK_K, BLOCK_N]: a tile of W_eᵀ
            x = tl.load(x_ptr + tokens[:, None] * H + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < H), other=0.0)
            w_t = tl.load(weights + cols[None, :] * H + ks[:, None], mask=(ks[:, None] < H) & (cols[None, :] < N),
                          other=0.0)
            acc = tl.dot(x, w_t, acc, input_precision="ieee")
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc, mask=row_ok[:, None] & (cols[None, :] < N))


# ================================================================ P2 · host side


def p2_per_expert(x: torch.Tensor, weights: torch.Tensor, routing: ExpertRouting, top_k: int) -> torch.Tensor:
    """Step 1: per expert, its token rows gathered into a copy with torch and :func:`tiled_matmul_kernel` on
    them: E launches, and the row counts read back to the host first. Rows in sorted order, [T·K, N]."""
    _fp32({"x": x, "weights": weights}, ("x", "weights"))
    offsets = routing.expert_offsets.tolist()  # a host synchronisation
    out = torch.zeros((routing.sorted_slot.numel(), weights.shape[1]), dtype=torch.float32, device=x.device)
    for expert, (begin, end) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
        if end > begin:
            rows = x[routing.sorted_slot[begin:end].long() // top_k]  # the gathered copy [rows, H]
            out[begin:end] = matmul_tiled(rows, weights[expert].T.contiguous())
    return out


def p2_grouped(x: torch.Tensor, weights: torch.Tensor, routing: ExpertRouting, top_k: int,
               block: int = BLOCK) -> torch.Tensor:
    """Step 2: :func:`grouped_gather_matmul_kernel`, one launch of E × N-tiles programs. Rows in sorted order."""
    _fp32({"x": x, "weights": weights}, ("x", "weights"))
    E, N, H = weights.shape
    out = torch.empty((routing.sorted_slot.numel(), N), dtype=torch.float32, device=x.device)
    grouped_gather_matmul_kernel[(E, cdiv(N, block))](x, weights, routing.sorted_slot, routing.expert_offsets, out,
                                                      top_k, H, N, BLOCK_M=block, BLOCK_N=block,
                                                      BLOCK_K=block)
    return out


def p2_reference(x: torch.Tensor, weights: torch.Tensor, topk_indices: torch.Tensor) -> torch.Tensor:
    """W_e x_t per slot in float64, rows in the kernels' sorted order (the steps' yardstick)."""
    routing = route_by_expert(topk_indices, weights.shape[0])
    slots = routing.sorted_slot.long()
    experts = topk_indices.reshape(-1)[slots]
    tokens = slots // topk_indices.shape[1]
    return torch.einsum("pnh,ph->pn", weights.double()[experts], x.double()[tokens])
