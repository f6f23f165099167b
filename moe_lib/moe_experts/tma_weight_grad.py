"""Kernel W as a persistent grouped "variable-K" GEMM whose operands arrive by TMA.

For expert e with rows o_e ≤ p < o_e + n_e of the expert-sorted order (``expert_offsets``), and
row-major operands whose row p is the p-th sorted slot:

    dWg_e = Σ_p dg[p]ᵀ x_s[p] = dg_eᵀ x_s,e      dWu_e = du_eᵀ x_s,e        [I, H]
    dWd_e = Σ_p dy_s[p]ᵀ aw[p] = dy_s,eᵀ aw_e                               [H, I]

where x_s = x[sorted_slot // K] and dy_s = dy[sorted_slot // K] are gathered once by the host
(:func:`gather_sorted_rows`; for fp32 inputs the bf16 hi half of x and dy, the operands kernel W
multiplies), and dg, du, aw are kernel A's [T·K, I] workspaces, already in sorted order. Every
operand of expert e is then the contiguous block of rows [o_e, o_e + n_e) of a row-major matrix, and
each output out_e = A_eᵀ B_e is a GEMM whose reduction length (n_e) varies per expert.

Products (``SPLIT``). Plain: one product of the 16-bit operands per step, out_e = A_eᵀ B_e. bf16×3 (fp32 inputs
whose weight gradients grow past the element rule's tolerance with bf16 operands, :mod:`.precision_rule`):
every operand also comes as its lo half, v = hi + lo with hi = bf16(v) and lo = bf16(v − hi) (x_s and dy_s
gathered from the split x and dy, dg, du and aw's lo halves stored by kernel A), and each step adds
A_loᵀ B_hi + A_hiᵀ B_lo, then A_hiᵀ B_hi: a term's error falls from about 2⁻⁸ of it (one rounding of each
operand) to about 2⁻¹⁶, for three times the tensor-core work and twice the operand tiles per step.

One persistent launch per GEMM family (``NUM_PROGRAMS`` programs, the number of SMs), its programs
split into G = ``EXPERT_GROUPS`` groups of P_g = NUM_PROGRAMS / G: group g takes the experts
e ≡ g (mod G) in order, numbers their tiles — (M-tile, N-tile) of the [size_m, size_n] output
out_e — one expert after the other, and deals them to its programs round-robin (tile number t to the
program of rank t mod P_g). So at any moment each group works on the tiles of one or two experts,
and the G experts in flight share their operand rows through L2 (G × n_e × (2·I + H) × 2 bytes for
dWg·dWu: 4 MB at G = 4 and 64 rows per expert). For each of its experts a program builds TMA tensor
descriptors on the device over the expert's rows (``shape=[n_e, cols]``, base at row o_e), so the
out-of-range rows of the last step of ``BLOCK_ROWS`` come back zero-filled by the hardware and add
nothing; then it reduces each of its tiles of that expert over n_e in steps of BLOCK_ROWS with
``tl.dot(aᵀ, b)`` (A read as a [BLOCK_ROWS, BLOCK_M] block and used transposed from shared memory).
An expert without rows takes no reduction step: its tiles are written as exact zeros without a
single load. The groups trade L2 footprint for fewer expert visits per program: each visit costs
the descriptors (three, made one after the other, each a write to global memory and a proxy fence)
and a pipeline that starts empty; with G groups a program visits E / G experts and does G times
more tiles in each (at T = 2048, 4 dWg·dWu tiles per visit with G = 1, 16 with G = 4). Routing that
loads some experts far more than others balances better with G = 1.

Two families, two launches of one kernel:
    gate/up: A = dg and A2 = du, B = x_s, two 128×128 fp32 accumulators per tile (x_s is loaded once
             for both products: the "two outputs in one launch" of the pointer-based kernel W);
    down:    A = dy_s, B = aw, one accumulator (128×256 tiles for 16-bit outputs, 128×128 for fp32).
With bf16×3 products a step of gate/up loads six tiles (dg, du, x_s, each hi and lo) and down four.
They differ in the number of operands, accumulators and tile shapes; one launch covering both would
compile both bodies into one loop (the registers and shared memory of the larger for every tile) and
would not warp-specialise, so the two families run back to back in the same stream (the first one's
tail imbalance is at most one tile per program).

Two loop forms (``WARP_SPECIALIZE``) inside a program's loop over the experts:
  - flat (default): one loop over the program's (tile, step) pairs of the expert, a tile stored and
    its accumulators cleared after its last step (as the pointer-based kernel W does), so the software
    pipeline (``num_stages``) fetches the next tile's first blocks while the current tile finishes: at
    ~64 rows per expert (T = 2048) a tile is a single step. Triton's own ``flatten=True`` does not
    apply here: it fuses only a nest of two loops whose inner trip count is invariant in the outer
    loop, and this nest has three (experts, tiles, steps) with a step count that varies per expert.
  - warp-specialised (refused on the GPU: there it leaves tiles unwritten, notes/p2/runs-design-04.md;
    kept for the compile checks): ``tl.range(..., warp_specialize=True)`` on the tile loop, the steps an inner
    loop; Triton splits a program into a producer warp group that issues the TMA loads (running ahead
    across tiles) and consumer warp groups that multiply and store. It takes effect only with
    ``num_warps=4`` (12 warps in all) and a tile loop that is not flattened.
In both, the pipeline starts afresh at each expert the program visits (new descriptors).

Outputs: written once, in the interface dtype (bf16, fp16 or fp32), by plain masked stores, or by
TMA stores (``tma_store``, refused on the GPU: there it wrote wrong tiles, notes/p2/runs-design-04.md; kept for
the interpreter tests and compile checks) through a descriptor over the expert's [size_m, size_n] output. Nothing
is accumulated across programs: no atomics, deterministic, no host synchronisation (the launcher
only reads shapes), so the launches can be captured in a CUDA graph.

Constraints of TMA: base addresses 16-byte aligned and row strides multiples of 16 bytes, so the
operand widths (H and I) must be multiples of 8 elements in 16-bit operands (and the output width a
multiple of 16 bytes for TMA stores); :func:`launch_weight_grads_tma` checks this, and the design
(:mod:`.designs.w_tma`) declares it, so that the chooser (:mod:`.choose`, which also picks the tiles) falls back
to the pointer-based kernel W elsewhere.

Interpreter (``TRITON_INTERPRET=1``, CPU): bf16 ``tl.dot`` is wrong there, so the operands are
upcast to fp32 (exact products, :func:`~.kernels.dot16`) and the fp32 → bf16 output cast rounds by
hand (:func:`~.kernels.round_to`); tiles of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..tma import install_tma_allocator
from .kernels import dot16, round_to

# --------------------------------------------------------------------------------------------------
# the kernel


@triton.jit
def store_tile(out_ptr, out_desc, acc, out_offset, m0, n0, size_m, size_n, TMA_STORE: tl.constexpr,
               INTERPRETER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes the fp32 tile ``acc`` at (m0, n0) of the [size_m, size_n] output at out_ptr + out_offset,
    rounded to the output dtype: by TMA (``out_desc``, which clips the edges) or by masked stores."""
    value = round_to(acc, out_ptr.dtype.element_ty, INTERPRETER)
    if TMA_STORE:
        out_desc.store([m0, n0], value)
    else:
        ms = m0 + tl.arange(0, BLOCK_M)
        ns = n0 + tl.arange(0, BLOCK_N)
        mask = (ms < size_m)[:, None] & (ns < size_n)[None, :]
        tl.store(out_ptr + out_offset + ms[:, None] * size_n + ns[None, :], value, mask=mask)


@triton.jit
def step_product(a_desc, a_lo_desc, b, b_lo, row, m0, acc, SPLIT: tl.constexpr, INTERPRETER: tl.constexpr):
    """acc + Aᵀ·B over the step of rows from ``row``, A's [BLOCK_ROWS, BLOCK_M] block at column m0 used transposed;
    with SPLIT as bf16×3, the two small cross terms A_loᵀ·B_hi and A_hiᵀ·B_lo first."""
    a = a_desc.load([row, m0]).T
    if SPLIT:
        acc = dot16(a_lo_desc.load([row, m0]).T, b, acc, INTERPRETER)
        acc = dot16(a, b_lo, acc, INTERPRETER)
    return dot16(a, b, acc, INTERPRETER)


@triton.jit
def grouped_weight_grad_kernel(
    a_ptr,  # [T·K, size_m] A, row p = p-th sorted slot: dg (gate/up family) or dy_s (down), 16-bit
    a2_ptr,  # [T·K, size_m] A2 = du (TWO_OUTPUTS), else unused
    b_ptr,  # [T·K, size_n] B, row p = p-th sorted slot: x_s (gate/up) or aw (down), like A
    a_lo_ptr,  # [T·K, size_m] A's lo half (SPLIT), else unused
    a2_lo_ptr,  # [T·K, size_m] A2's lo half (SPLIT and TWO_OUTPUTS), else unused
    b_lo_ptr,  # [T·K, size_n] B's lo half (SPLIT), else unused
    out_ptr,  # out [E, size_m, size_n]: out_e = A_eᵀ B_e over the expert's rows, output dtype
    out2_ptr,  # out [E, size_m, size_n]: A2_eᵀ B_e (TWO_OUTPUTS), else unused
    expert_offsets_ptr,  # [E + 1] int32: first sorted position of each expert, then T·K
    num_experts,  # E
    size_m,  # columns of A: rows of each expert's output (I for gate/up, H for down)
    size_n,  # columns of B: columns of each expert's output (H for gate/up, I for down)
    TWO_OUTPUTS: tl.constexpr,  # also out2 = A2ᵀ B, with B loaded once for both
    SPLIT: tl.constexpr,  # bf16×3 products of the hi and lo halves: A_loᵀ B_hi + A_hiᵀ B_lo + A_hiᵀ B_hi
    NUM_PROGRAMS: tl.constexpr,  # programs of the launch (a multiple of EXPERT_GROUPS)
    EXPERT_GROUPS: tl.constexpr,  # G: groups of NUM_PROGRAMS / G programs, each on its own experts e ≡ g (mod G)
    WARP_SPECIALIZE: tl.constexpr,  # tile loop with Triton's producer/consumer warp groups (num_warps=4)
    TMA_STORE: tl.constexpr,  # output tiles by TMA stores instead of masked pointer stores
    INTERPRETER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    pid = tl.program_id(0)
    group = pid % EXPERT_GROUPS  # this program's group of programs, and its rank r among the group's P_g
    rank = pid // EXPERT_GROUPS
    GROUP_PROGRAMS: tl.constexpr = NUM_PROGRAMS // EXPERT_GROUPS
    num_n_tiles = tl.cdiv(size_n, BLOCK_N)
    tiles_per_expert = tl.cdiv(size_m, BLOCK_M) * num_n_tiles  # the same for every expert
    for expert in range(group, num_experts, EXPERT_GROUPS):
        row_begin = tl.load(expert_offsets_ptr + expert)
        num_rows = tl.load(expert_offsets_ptr + expert + 1) - row_begin
        num_steps = tl.cdiv(num_rows, BLOCK_ROWS)  # 0 for an expert without rows: no loads at all
        # The expert's rows as [n_e, cols] tensors: TMA zero-fills the rows past n_e in the last step.
        # An expert without rows gets a 1-row shape (a TMA dimension must be positive): never read.
        desc_rows = tl.maximum(num_rows, 1)
        first_row = row_begin.to(tl.int64)
        a_desc = tl.make_tensor_descriptor(a_ptr + first_row * size_m, shape=[desc_rows, size_m],
                                           strides=[size_m, 1], block_shape=[BLOCK_ROWS, BLOCK_M])
        if TWO_OUTPUTS:
            a2_desc = tl.make_tensor_descriptor(a2_ptr + first_row * size_m, shape=[desc_rows, size_m],
                                                strides=[size_m, 1], block_shape=[BLOCK_ROWS, BLOCK_M])
        else:
            a2_desc = a_desc  # unused
        b_desc = tl.make_tensor_descriptor(b_ptr + first_row * size_n, shape=[desc_rows, size_n],
                                           strides=[size_n, 1], block_shape=[BLOCK_ROWS, BLOCK_N])
        if SPLIT:  # the lo halves, over the same rows
            a_lo_desc = tl.make_tensor_descriptor(a_lo_ptr + first_row * size_m, shape=[desc_rows, size_m],
                                                  strides=[size_m, 1], block_shape=[BLOCK_ROWS, BLOCK_M])
            if TWO_OUTPUTS:
                a2_lo_desc = tl.make_tensor_descriptor(a2_lo_ptr + first_row * size_m, shape=[desc_rows, size_m],
                                                       strides=[size_m, 1], block_shape=[BLOCK_ROWS, BLOCK_M])
            else:
                a2_lo_desc = a_lo_desc  # unused
            b_lo_desc = tl.make_tensor_descriptor(b_lo_ptr + first_row * size_n, shape=[desc_rows, size_n],
                                                  strides=[size_n, 1], block_shape=[BLOCK_ROWS, BLOCK_N])
        else:  # unused
            a_lo_desc = a_desc
            a2_lo_desc = a2_desc
            b_lo_desc = b_desc
        out_offset = tl.cast(expert, tl.int64) * size_m * size_n
        if TMA_STORE:  # the expert's [size_m, size_n] outputs
            out_desc = tl.make_tensor_descriptor(out_ptr + out_offset, shape=[size_m, size_n], strides=[size_n, 1],
                                                 block_shape=[BLOCK_M, BLOCK_N])
            out2_desc = tl.make_tensor_descriptor(out2_ptr + out_offset, shape=[size_m, size_n],
                                                  strides=[size_n, 1], block_shape=[BLOCK_M, BLOCK_N])
        else:  # plain stores: no descriptors
            out_desc = out_ptr
            out2_desc = out2_ptr

        # This program's tiles of the expert. The group numbers the tiles of its experts one after the
        # other (expert by expert, from first_tile = (e // G) · tiles_per_expert on) and deals them to its
        # programs round-robin: rank r takes the numbers ≡ r (mod P_g), so the extra tile of an expert whose
        # tile count P_g does not divide goes to a different program each time. The local tile number
        # t − first_tile is (M-tile, N-tile) in row-major order: neighbours share A's M-slice.
        first_tile = expert // EXPERT_GROUPS * tiles_per_expert
        my_first = (rank + GROUP_PROGRAMS - first_tile % GROUP_PROGRAMS) % GROUP_PROGRAMS  # a local tile number
        if WARP_SPECIALIZE:
            # one tile per iteration, its reduction an inner loop (empty for an expert without rows):
            # the producer warps issue the TMA loads of the coming tiles while the consumers multiply
            for tile in tl.range(my_first, tiles_per_expert, GROUP_PROGRAMS, warp_specialize=True):
                m0 = tile // num_n_tiles * BLOCK_M
                n0 = tile % num_n_tiles * BLOCK_N
                acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                for step in range(0, num_steps):
                    # [BLOCK_ROWS, BLOCK_N] block of B, [BLOCK_ROWS, BLOCK_M] blocks of A used transposed
                    b = b_desc.load([step * BLOCK_ROWS, n0])
                    if SPLIT:
                        b_lo = b_lo_desc.load([step * BLOCK_ROWS, n0])
                    else:
                        b_lo = b  # unused
                    acc = step_product(a_desc, a_lo_desc, b, b_lo, step * BLOCK_ROWS, m0, acc, SPLIT, INTERPRETER)
                    if TWO_OUTPUTS:
                        acc2 = step_product(a2_desc, a2_lo_desc, b, b_lo, step * BLOCK_ROWS, m0, acc2, SPLIT,
                                            INTERPRETER)
                store_tile(out_ptr, out_desc, acc, out_offset, m0, n0, size_m, size_n, TMA_STORE, INTERPRETER,
                           BLOCK_M, BLOCK_N)
                if TWO_OUTPUTS:
                    store_tile(out2_ptr, out2_desc, acc2, out_offset, m0, n0, size_m, size_n, TMA_STORE,
                               INTERPRETER, BLOCK_M, BLOCK_N)
        elif num_rows == 0:  # exact zeros, no loads
            zeros = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for tile in range(my_first, tiles_per_expert, GROUP_PROGRAMS):
                m0 = tile // num_n_tiles * BLOCK_M
                n0 = tile % num_n_tiles * BLOCK_N
                store_tile(out_ptr, out_desc, zeros, out_offset, m0, n0, size_m, size_n, TMA_STORE, INTERPRETER,
                           BLOCK_M, BLOCK_N)
                if TWO_OUTPUTS:
                    store_tile(out2_ptr, out2_desc, zeros, out_offset, m0, n0, size_m, size_n, TMA_STORE,
                               INTERPRETER, BLOCK_M, BLOCK_N)
        else:
            # One flat loop over (tile, step) pairs, so that the software pipeline (num_stages) fetches
            # the next tile's first blocks while the current tile finishes: at ~64 rows per expert a
            # tile is a single step. A tile is stored, and its accumulators cleared, after its last step.
            num_my_tiles = tl.cdiv(tiles_per_expert - my_first, GROUP_PROGRAMS)
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for it in range(0, num_my_tiles * num_steps):
                tile = my_first + it // num_steps * GROUP_PROGRAMS
                step = it % num_steps
                m0 = tile // num_n_tiles * BLOCK_M
                n0 = tile % num_n_tiles * BLOCK_N
                b = b_desc.load([step * BLOCK_ROWS, n0])
                if SPLIT:
                    b_lo = b_lo_desc.load([step * BLOCK_ROWS, n0])
                else:
                    b_lo = b  # unused
                acc = step_product(a_desc, a_lo_desc, b, b_lo, step * BLOCK_ROWS, m0, acc, SPLIT, INTERPRETER)
                if TWO_OUTPUTS:
                    acc2 = step_product(a2_desc, a2_lo_desc, b, b_lo, step * BLOCK_ROWS, m0, acc2, SPLIT, INTERPRETER)
                if step == num_steps - 1:  # the tile is complete: write it once
                    store_tile(out_ptr, out_desc, acc, out_offset, m0, n0, size_m, size_n, TMA_STORE, INTERPRETER,
                               BLOCK_M, BLOCK_N)
                    if TWO_OUTPUTS:
                        store_tile(out2_ptr, out2_desc, acc2, out_offset, m0, n0, size_m, size_n, TMA_STORE,
                                   INTERPRETER, BLOCK_M, BLOCK_N)
                    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                    acc2 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)


# --------------------------------------------------------------------------------------------------
# host side


@dataclass(frozen=True)
class TmaWeightGradConfig:
    """Tile sizes and launch parameters of the two families of :func:`grouped_weight_grad_kernel` (the measured
    ones: :func:`~.choose.choose_tma_weight_grad_config`)."""

    gate_up_tile: tuple[int, int, int] = (128, 128, 64)  # dWg, dWu: (I, H, rows per step)
    down_tile: tuple[int, int, int] = (128, 256, 64)  # dWd: (H, I, rows per step)
    warps_gate_up: int = 8  # num_warps (4 where warp_specialize: Triton adds the producer/consumer groups)
    stages_gate_up: int = 3  # num_stages: TMA blocks in flight per operand
    warps_down: int = 8
    stages_down: int = 3
    warp_specialize: bool = False  # Triton's automatic Hopper warp specialisation of the tile loop
    expert_groups: int = 1  # G: experts worked on at once, each by num_programs / G programs
    tma_store: bool = False  # output tiles by TMA stores (plain masked stores otherwise)

    def __post_init__(self):
        if self.expert_groups < 1:
            raise ValueError(f"expert_groups: expected at least 1, got {self.expert_groups}")
        if self.warp_specialize and (self.warps_gate_up, self.warps_down) != (4, 4):
            raise ValueError("warp_specialize: Triton specialises warps only with num_warps=4 in both launches")


def gather_sorted_rows(v: torch.Tensor, sorted_slot: torch.Tensor, top_k: int) -> torch.Tensor:
    """v's rows in expert-sorted order: row p of the result is v[sorted_slot[p] // K] ([T·K, cols], v's dtype)."""
    tokens = torch.div(sorted_slot, max(top_k, 1), rounding_mode="floor")
    return v.index_select(0, tokens)


def _check_tma_layout(operands: dict, outputs: dict, tma_store: bool) -> None:
    """The kernel reads every operand as a row-major [rows, cols] matrix by TMA, which needs a 16-byte
    aligned base and a row stride of a multiple of 16 bytes; it writes row-major [E, size_m, size_n] outputs."""
    for name, t in (operands | outputs).items():
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous (row-major) tensor")
    for name, t in operands.items():
        if t.shape[1] * t.element_size() % 16 or t.data_ptr() % 16:
            raise ValueError(f"{name}: rows of {t.shape[1]} × {t.element_size()} B, or its base, are not "
                             "16-byte aligned (TMA)")
    if tma_store:
        for name, t in outputs.items():
            if t.shape[2] * t.element_size() % 16:
                raise ValueError(f"{name}: rows of {t.shape[2]} × {t.element_size()} B are not a multiple of 16 B")


def _at_least_one_row(t: torch.Tensor) -> torch.Tensor:
    """Kernels take no zero-size buffers: a [0, cols] operand (no slots at all) becomes one zero row, never read."""
    return t if t.shape[0] > 0 else t.new_zeros((1, t.shape[1]))


def launch_weight_grads_tma(config: TmaWeightGradConfig, expert_offsets, x_sorted, dy_sorted, dgate, dup,
                            scaled_act, grad_gate, grad_up, grad_down, *, num_programs: int,
                            lo_halves: tuple | None = None) -> None:
    """dWg = Σ dgᵀ x_s, dWu = Σ duᵀ x_s (one launch), then dWd = Σ dy_sᵀ aw, each expert over its rows.

    ``expert_offsets`` [E + 1] int32 (:mod:`.routing`); ``x_sorted``, ``dy_sorted`` [T·K, H] and
    ``dgate``, ``dup``, ``scaled_act`` [≥ T·K, I], rows in sorted order, all in one 16-bit dtype;
    ``grad_gate``, ``grad_up`` [E, I, H] and ``grad_down`` [E, H, I] are written fully (any dtype of
    bf16, fp16, fp32), exact zeros for experts without rows. ``lo_halves``: the lo halves of the five
    operands, in that order and each of its hi half's shape and dtype, for bf16×3 products (None: plain
    products). ``num_programs``: the persistent grid (the number of SMs on the GPU; rounded down to a multiple
    of ``config.expert_groups``). No host synchronisation: capturable in a CUDA graph. On CUDA it installs a
    torch-backed Triton allocator (``triton.set_allocator``) for the descriptors the kernel builds on the device.
    """
    E, I, H = grad_gate.shape
    x_sorted, dy_sorted = _at_least_one_row(x_sorted), _at_least_one_row(dy_sorted)
    operands = dict(x_sorted=x_sorted, dy_sorted=dy_sorted, dgate=dgate, dup=dup, scaled_act=scaled_act)
    if len({t.dtype for t in operands.values()}) != 1 or x_sorted.element_size() != 2:
        raise TypeError(f"operands: expected one 16-bit dtype, got { {k: t.dtype for k, t in operands.items()} }")
    split = lo_halves is not None
    if split:
        if not isinstance(lo_halves, (tuple, list)) or len(lo_halves) != 5:
            raise ValueError("lo_halves: expected five tensors, the lo halves of x_sorted, dy_sorted, dgate, dup and "
                             "scaled_act")
        lo = {f"{name}_lo": _at_least_one_row(t) for name, t in zip(operands, lo_halves, strict=True)}
        for (name, t), hi in zip(lo.items(), operands.values(), strict=True):
            if t.shape != hi.shape or t.dtype != hi.dtype or t.device != hi.device:
                raise ValueError(f"lo_halves: {name} must be a {tuple(hi.shape)} {hi.dtype} tensor on {hi.device}, "
                                 f"as its hi half, got {tuple(t.shape)} {t.dtype} on {t.device}")
        operands |= lo
    else:  # unused
        lo = dict(x_sorted_lo=x_sorted, dy_sorted_lo=dy_sorted, dgate_lo=dgate, dup_lo=dup, scaled_act_lo=scaled_act)
    if tuple(grad_up.shape) != (E, I, H) or tuple(grad_down.shape) != (E, H, I) or expert_offsets.numel() != E + 1:
        raise ValueError("grad_gate, grad_up [E, I, H], grad_down [E, H, I] and expert_offsets [E + 1] disagree")
    _check_tma_layout(operands, dict(grad_gate=grad_gate, grad_up=grad_up, grad_down=grad_down), config.tma_store)
    interpreter = interpreter_enabled()
    if config.warp_specialize and x_sorted.is_cuda and not interpreter:
        raise NotImplementedError("config.warp_specialize: on the GPU (triton 3.6, H200) the warp-specialised form "
                                  "leaves output tiles unwritten (notes/p2/runs-design-04.md); use the flat form")
    if config.tma_store and x_sorted.is_cuda and not interpreter:
        raise NotImplementedError("config.tma_store: on the GPU (triton 3.6, H200) TMA stores of the dW tiles gave "
                                  "wrong tiles (a store still reading the descriptor the next expert rewrites; "
                                  "notes/p2/runs-design-04.md); use plain stores")
    if x_sorted.is_cuda and not interpreter:
        install_tma_allocator(x_sorted.device)
    groups = min(config.expert_groups, num_programs)
    num_programs = num_programs // groups * groups  # G groups of equal size
    for a, a2, b, a_lo, a2_lo, b_lo, out, out2, size_m, size_n, tile, warps, stages in (
        (dgate, dup, x_sorted, lo["dgate_lo"], lo["dup_lo"], lo["x_sorted_lo"], grad_gate, grad_up, I, H,
         config.gate_up_tile, config.warps_gate_up, config.stages_gate_up),
        (dy_sorted, dy_sorted, scaled_act, lo["dy_sorted_lo"], lo["dy_sorted_lo"], lo["scaled_act_lo"], grad_down,
         grad_down, H, I, config.down_tile, config.warps_down, config.stages_down),
    ):
        grouped_weight_grad_kernel[(num_programs,)](
            a, a2, b, a_lo, a2_lo, b_lo, out, out2, expert_offsets, E, size_m, size_n,
            TWO_OUTPUTS=out2 is not out, SPLIT=split, NUM_PROGRAMS=num_programs, EXPERT_GROUPS=groups,
            WARP_SPECIALIZE=bool(config.warp_specialize),
            TMA_STORE=bool(config.tma_store), INTERPRETER=interpreter,
            BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_ROWS=tile[2], num_warps=warps, num_stages=stages,
        )
