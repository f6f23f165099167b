"""P2's host side: launch configs, the launch plan, workspaces and the launches of :mod:`.kernels`.

Workspace (freed when the call returns; outputs are freshly allocated and fully written):
    dg, du, aw        3 · T·K · I   in bf16 (the input dtype for 16-bit inputs)
    dX_slot           T·K · H       fp32
    x, dy sorted      2 · T·K · H   bf16 (the input dtype for 16-bit inputs): kernel W's operands by TMA
    x, dy halves      4 · T · H     bf16, fp32 inputs only
    topk partials     cdiv(I, BLOCK_I) · T·K   fp32
    routing           T·K int32 + E + 1 int32, and torch.sort's int64 outputs (2 · T·K)
At the benchmark's shape (H = 4096, I = 2048, E = 256, K = 8) and T = 8192 (T·K = 65536):
768 MiB + 1 GiB + 1 GiB + 256 MiB + 8 MiB + 1.3 MiB ≈ 3.0 GiB; at T = 2048, ≈ 0.75 GiB.

Predicted DRAM traffic at the benchmark's shape, T = 2048, with the weights read once per kernel:
fp32: A reads Wg, Wu, Wd (25.8 GB), W writes dWg, dWu, dWd (25.8 GB), D reads Wg, Wu (17.2 GB);
the workspaces and activations add ≈ 1 GB: ≈ 70 GB, 1.35× the floor (≈ 16.5 ms at 4.2 TB/s).
bf16: 12.9 + 12.9 + 8.6 + ≈ 0.6 GB ≈ 35 GB (≈ 8.3 ms). At T = 8192 in fp32 the 18·T·K·H·I FLOPs of
kernel A's split products plus 10·T·K·H·I in W and D (15.4 TFLOP) bound the time instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton.language as tl

from ..dispatch import interpreter_enabled
from ..precision import split_halves
from ..tiling import cdiv
from ..validation import fits_in_memory
from . import kernels
from .routing import route_by_expert
from .tma_slot_projection import (
    TmaSlotProjectionConfig,
    choose_tma_slot_projection_config,
    launch_slot_projection_tma,
    tma_slot_projection_fits,
)
from .tma_weight_grad import (
    TmaWeightGradConfig,
    choose_tma_weight_grad_config,
    gather_sorted_rows,
    launch_weight_grads_tma,
    tma_layout_fits,
)

# Every output and workspace is allocated through this function (tests replace it with one that
# fills the memory with NaN, to prove that every element the kernels read or return was written).
allocate = torch.empty


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of kernels A, W, D and C."""

    block_m: int  # rows (slots of one expert) per row block: the N side of kernels A and D
    block_i: int  # A: intermediate columns per program (the M side)
    block_h: int  # A: hidden columns per reduction step
    grad_gate_up_tile: tuple[int, int, int]  # W: (I, H, rows per step) of the dWg and dWu tiles
    grad_down_tile: tuple[int, int, int]  # W: (H, I, rows per step) of the dWd tiles
    n_tiles_per_program: int  # W: tiles along the second dimension one program writes in turn
    block_h_dx: int  # D: hidden columns per program (the M side)
    block_i_dx: int  # D: intermediate columns per reduction step
    block_h_sum: int  # C: hidden columns per program
    row_split: int  # R: programs per (expert, tile) in A and D that share its row blocks (and weights via L2)
    warps_a: int = 8  # num_warps of kernel A
    stages_a: int = 3  # num_stages (software pipelining depth) of kernel A
    warps_gu: int = 8  # kernel W's dWg, dWu launch
    stages_gu: int = 3
    warps_dn: int = 8  # kernel W's dWd launch
    stages_dn: int = 3
    warps_d: int = 8  # kernel D
    stages_d: int = 3
    # kernel W as a persistent TMA-fed grouped GEMM (:mod:`.tma_weight_grad`); None: the pointer-based kernel W
    tma_weight_grad: TmaWeightGradConfig | None = None
    # kernel D likewise (:mod:`.tma_slot_projection`); None: the pointer-based kernel D
    tma_slot_projection: TmaSlotProjectionConfig | None = None


def launch_config(num_slots: int, num_experts: int, *, input_bytes: int = 4, interpreter: bool = False) -> LaunchConfig:
    """Tile sizes for T·K = ``num_slots`` slots over ``num_experts`` experts (the one place they are set).

    GPU (measured on the H200, data/results/NOTES.md): kernel A and D tiles are 128 weight rows ×
    64 expert rows (fp32 accumulators, 8 warps); kernel A reduces over 32 hidden columns per step in
    fp32 (its three weight tiles are split to hi/lo in registers) and 64 in 16-bit; kernel W writes
    128 × 128 tiles of dWg and dWu (one launch, x shared) and 128 × 256 tiles of dWd, 64 rows per
    step, each program a whole row of tiles in turn, 2 pipeline stages. 16-bit inputs with 512 or
    more rows per expert on average get 128-row blocks everywhere (A then takes 64 weight rows per
    program, so its accumulators still fit); with fp32 inputs those W tiles would need more shared
    memory than an SM has (fp32 output tiles), and A and D spill.
    Interpreter: small tiles (16 is the smallest ``tl.dot`` takes), so that tiny test shapes still
    have several row blocks, several tiles and masked edges.
    R, the row split, covers an expert with a few standard deviations more rows than the mean
    (uniform routing gives binomial counts): the rows of almost every expert are then worked on by
    R programs side by side, which read its weights from DRAM once; busier experts loop.
    """
    mean_rows = num_slots / max(num_experts, 1)
    likely_max_rows = mean_rows + 4.0 * math.sqrt(mean_rows) + 1.0
    tma = choose_tma_weight_grad_config(num_slots, num_experts, input_bytes, interpreter)
    tma_d = choose_tma_slot_projection_config(num_slots, num_experts, input_bytes, interpreter)
    if interpreter:
        row_split = min(max(1, math.ceil(likely_max_rows / 16)), 3)
        tiny = (16, 16, 16)
        return LaunchConfig(16, 16, 32, tiny, tiny, 2, 32, 16, 32, row_split, 1, 1, 1, 1, 1, 1, 1, 1, tma,
                            tma_d)  # fmt: skip
    block_h = 32 if input_bytes == 4 else 64
    if mean_rows >= 512 and input_bytes == 2:  # busy experts: 128-row blocks (measured at 1024 rows: −11%)
        row_split = min(max(1, math.ceil(likely_max_rows / 128)), 8)
        return LaunchConfig(128, 64, block_h, (128, 128, 128), (128, 256, 128), 32, 128, 64, 1024, row_split,
                            stages_gu=2, stages_dn=2, tma_weight_grad=tma, tma_slot_projection=tma_d)  # fmt: skip
    block_m = 64
    row_split = min(max(1, math.ceil(likely_max_rows / block_m)), 8)
    return LaunchConfig(block_m, 128, block_h, (128, 128, 64), (128, 256, 64), 32, 128, 64, 1024, row_split,
                        stages_gu=2, stages_dn=2, tma_weight_grad=tma, tma_slot_projection=tma_d)  # fmt: skip



@dataclass(frozen=True)
class KernelLaunch:
    """One launch of the backward: its grid as named factors and what one program does."""

    step: str  # "A", "W_gate_up", "W_down", "D", "C"
    grid: dict = field(default_factory=dict)  # factor name -> size; the programs are their product
    one_program: str = ""
    launched: bool = True  # False where the launch is skipped (A, D and C need T·K > 0)
    # a persistent launch's work items as named factors (its programs loop over them); empty: one tile per program
    tiles: dict = field(default_factory=dict)

    @property
    def programs(self) -> int:
        return math.prod(self.grid.values()) if self.launched else 0


def weight_grad_grid(size_m: int, size_n: int, tile: tuple[int, int, int], n_tiles_per_program: int) -> dict:
    """Kernel W's grid factors for one expert weight gradient [size_m, size_n] in ``tile``s (M, N, rows)."""
    n_tiles = cdiv(size_n, tile[1])
    per_program = min(n_tiles_per_program, n_tiles)
    return {"M-tiles": cdiv(size_m, tile[0]), "N-groups": cdiv(n_tiles, per_program), "_n_tiles": n_tiles,
            "_per_program": per_program}  # fmt: skip


def launch_plan(num_tokens: int, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                config: LaunchConfig, *, num_programs: int | None = None,
                weight_bytes: int = 2) -> dict[str, KernelLaunch]:  # fmt: skip
    """P2's backward under ``config``: kernels A, W (twice), D and C, by step, in launch order.

    Kernels W and D run persistent (``num_programs`` programs looping over their tiles: one per SM, by
    default :func:`default_persistent_programs`) where the config has their TMA-fed form and TMA can address
    the rows (``weight_bytes``: the weights' element size, 4 for the fp32 interface); else one program per
    tile (group)."""
    T, H, I, E, K = num_tokens, hidden_size, intermediate_size, num_experts, top_k
    launched = T * K > 0
    R = config.row_split
    programs = {"programs (one per SM)": num_programs or default_persistent_programs()}
    plan = {}
    plan["A"] = KernelLaunch(
        "A", {"experts": E, "I-tiles": cdiv(I, config.block_i), "row split": R},
        f"gᵀ, uᵀ, (Wdᵀdy)ᵀ on an I-tile of {config.block_i} (M side) for row blocks r, r+R, … of "
        f"{config.block_m} rows (N side), over H in steps of {config.block_h}; dSwiGLU and ⟨Wdᵀdy, a⟩ in the "
        "epilogue", launched)  # fmt: skip
    tma_w = config.tma_weight_grad if tma_layout_fits(H, I) else None
    for step, size_m, size_n, tile, outputs, dims in (
        ("W_gate_up", I, H, config.grad_gate_up_tile, "dWg and dWu", "I×H"),
        ("W_down", H, I, config.grad_down_tile, "dWd", "H×I"),
    ):  # fmt: skip
        if tma_w is not None:
            tile = tma_w.gate_up_tile if step == "W_gate_up" else tma_w.down_tile
            plan[step] = KernelLaunch(
                step, programs,
                f"{outputs} tiles of {tile[0]}×{tile[1]} ({dims}), dealt round-robin expert by expert, each reduced "
                f"over all the expert's rows (gathered into expert order once) in steps of {tile[2]} that arrive "
                "by TMA; exact zeros for an expert with no rows",
                tiles={"experts": E, "M-tiles": cdiv(size_m, tile[0]), "N-tiles": cdiv(size_n, tile[1])})  # fmt: skip
            continue
        grid = weight_grad_grid(size_m, size_n, tile, config.n_tiles_per_program)
        n, up_to = grid["_per_program"], "up to " if grid["_n_tiles"] % grid["_per_program"] else ""
        tiles = f"one tile of {tile[0]}×{tile[1]} ({dims})" if n == 1 else \
            f"{up_to}{n} tiles of {tile[0]}×{tile[1]} ({dims}) in turn"  # fmt: skip
        plan[step] = KernelLaunch(
            step, {"experts": E, "M-tiles": grid["M-tiles"], "N-groups": grid["N-groups"]},
            f"{outputs} on {tiles}, each reduced over all the expert's rows in steps of {tile[2]}; exact zeros for "
            "an expert with no rows")  # fmt: skip
    tma_d = config.tma_slot_projection if tma_slot_projection_fits(H, I, weight_bytes) else None
    if tma_d is not None:
        block_h, block_rows, block_i = tma_d.backward_tile
        plan["D"] = KernelLaunch(
            "D", programs,
            f"dX_slotᵀ = Wgᵀdgᵀ + Wuᵀduᵀ on tiles of {block_h} weight rows (an H-tile, M side) × {block_rows} of "
            f"the expert's rows (N side), expert by expert, over I in steps of {block_i} that arrive by TMA",
            launched, tiles={"experts": E, "H-tiles": cdiv(H, block_h)})  # fmt: skip
    else:
        plan["D"] = KernelLaunch(
            "D", {"experts": E, "H-tiles": cdiv(H, config.block_h_dx), "row split": R},
            f"dX_slotᵀ = Wgᵀdgᵀ + Wuᵀduᵀ on an H-tile of {config.block_h_dx} (M side) for row blocks r, r+R, … of "
            f"{config.block_m} rows (N side), over I in steps of {config.block_i_dx}", launched)  # fmt: skip
    plan["C"] = KernelLaunch(
        "C", {"tokens": T, "H-tiles": cdiv(H, config.block_h_sum)},
        f"grad_hidden_states[t] = Σ_k dX_slot[t·K + k] on {config.block_h_sum} columns; grad_topk_weights "
        "summed over the I-tiles' partials", launched)  # fmt: skip
    return plan


OPERAND_DTYPES = {torch.float32: tl.bfloat16, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
WORKSPACE_DTYPES = {torch.float32: torch.bfloat16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}


def operand_halves(v: torch.Tensor, split_precision: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel A's (hi, lo) view of x or dy: bf16 halves for fp32 inputs, the 16-bit tensor itself twice otherwise."""
    return split_halves(v, dtype) if split_precision else (v, v)


# what kernel A does with the pre-activations g and u (its PREACT)
PREACT_COMPUTED, PREACT_STORED, PREACT_READ = 0, 1, 2


def launch_swiglu_grad(config, plan, routing, x_halves, dy_halves, topk_weights, gate_weights, up_weights,
                       down_weights, dgate, dup, scaled_act, topk_partial, *, forward_only: bool,
                       preactivations=None, preact=PREACT_COMPUTED):  # fmt: skip
    """Kernel A over every (expert, I-tile, row split); ``forward_only`` stores aw alone (dy unused);
    ``preactivations`` (g, u), each [T·K, I] by sorted position, written (PREACT_STORED) or read
    instead of recomputed (PREACT_READ)."""
    H = x_halves[0].shape[1]
    I = gate_weights.shape[1]
    num_slots, top_k = topk_weights.numel(), topk_weights.shape[1]
    gate_pre, up_pre = preactivations if preactivations is not None else (scaled_act, scaled_act)
    kernels.swiglu_grad_kernel[(plan["A"].programs,)](
        *x_halves, *dy_halves, topk_weights, gate_weights, up_weights, down_weights,
        routing.sorted_slot, routing.expert_offsets, dgate, dup, scaled_act, topk_partial, gate_pre, up_pre,
        num_slots, top_k, H, I, plan["A"].grid["I-tiles"], config.row_split,
        OPERAND_DTYPE=OPERAND_DTYPES[x_halves[0].dtype], SPLIT_PRECISION=gate_weights.dtype == torch.float32,
        FORWARD_ONLY=forward_only, PREACT=preact,
        INTERPRETER=interpreter_enabled(),
        BLOCK_I=config.block_i, BLOCK_M=config.block_m, BLOCK_H=config.block_h,
        num_warps=config.warps_a, num_stages=config.stages_a,
    )  # fmt: skip


def launch_weight_grads(config, routing, sorted_slot, top_k, x_operand, dy_operand, dgate, dup, scaled_act,
                        grad_gate, grad_up, grad_down):  # fmt: skip
    """Kernel W twice: dWg, dWu = Σ dgᵀ x, Σ duᵀ x (one launch, x shared), then dWd = Σ dyᵀ aw."""
    E, I, H = grad_gate.shape
    for a, a2, b, out, out2, size_m, size_n, a_by_token, b_by_token, tile, warps, stages in (
        (dgate, dup, x_operand, grad_gate, grad_up, I, H, False, True, config.grad_gate_up_tile,
         config.warps_gu, config.stages_gu),
        (dy_operand, dy_operand, scaled_act, grad_down, grad_down, H, I, True, False,
         config.grad_down_tile, config.warps_dn, config.stages_dn),
    ):  # fmt: skip
        grid = weight_grad_grid(size_m, size_n, tile, config.n_tiles_per_program)
        programs = E * grid["M-tiles"] * grid["N-groups"]  # one per (expert, M-tile, group of N-tiles)
        kernels.expert_weight_grad_kernel[(programs,)](
            a, a2, b, out, out2, sorted_slot, routing.expert_offsets,
            max(top_k, 1), size_m, size_n, grid["M-tiles"], grid["_n_tiles"], grid["_per_program"],
            A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, TWO_OUTPUTS=out2 is not out,
            INTERPRETER=interpreter_enabled(), BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_ROWS=tile[2],
            num_warps=warps, num_stages=stages,
        )  # fmt: skip


def launch_slot_projection(config, routing, weights1, weights2, rows1, rows2, out_slot, stride_h, stride_i):
    """Kernel D over every (expert, H-tile, row split): out_slot = W1_e v1 (+ W2_e v2 when given twice)."""
    H, I = out_slot.shape[1], rows1.shape[1]
    E, h_tiles = weights1.shape[0], cdiv(H, config.block_h_dx)
    kernels.slot_projection_kernel[(E * h_tiles * config.row_split,)](
        weights1, weights2, routing.sorted_slot, routing.expert_offsets, rows1, rows2, out_slot,
        H, I, stride_h, stride_i, h_tiles, config.row_split,
        TWO_TERMS=weights2 is not weights1, OPERAND_DTYPE=OPERAND_DTYPES[rows1.dtype],
        INTERPRETER=interpreter_enabled(),
        BLOCK_H=config.block_h_dx, BLOCK_M=config.block_m, BLOCK_I=config.block_i_dx,
        num_warps=config.warps_d, num_stages=config.stages_d,
    )  # fmt: skip


def project_slots(config, routing, weights1, weights2, rows1, rows2, out_slot, *, transposed_weights: bool) -> None:
    """Kernel D: out_slot = W1_eᵀ v1 + W2_eᵀ v2 (backward: Wg, Wu, dg, du, ``transposed_weights``) or W1_e v1
    (forward: Wd, aw), by the TMA-fed kernel where the config has one and TMA can address the rows, else the
    pointer-based one."""
    H, I = out_slot.shape[1], rows1.shape[1]
    weight_bytes = weights1.element_size()
    if config.tma_slot_projection is not None and tma_slot_projection_fits(H, I, weight_bytes, transposed_weights):
        programs = persistent_programs(out_slot.device)
        launch_slot_projection_tma(config.tma_slot_projection, routing, weights1, weights2, rows1, rows2, out_slot,
                                   transposed_weights=transposed_weights, num_programs=programs)  # fmt: skip
        return
    strides = (1, H) if transposed_weights else (I, 1)  # (stride over H, stride over I) of one expert's weights
    two = weights2 if weights2 is not None else weights1
    launch_slot_projection(config, routing, weights1, two, rows1, rows2 if rows2 is not None else rows1,
                           out_slot, *strides)  # fmt: skip


def launch_token_sum(config, plan, out_slot, topk_indices, num_experts, out, topk_partial=None, grad_topk=None):
    """Kernel C: out[t] = Σ_k out_slot[t·K + k] over the slots routed to an expert in [0, E); with
    ``grad_topk``, also the routing-weight sums."""
    T, H = out.shape
    top_k = topk_indices.shape[1]
    with_topk = grad_topk is not None
    kernels.token_sum_kernel[tuple(plan["C"].grid.values())](
        out_slot, topk_partial if with_topk else out_slot, topk_indices, out, grad_topk if with_topk else out,
        T * top_k, top_k, num_experts, H, topk_partial.shape[0] if with_topk else 1,
        WITH_TOPK=with_topk, INTERPRETER=interpreter_enabled(), BLOCK_H=config.block_h_sum,
        BLOCK_K=max(1, 1 << (top_k - 1).bit_length()), num_warps=4,
    )  # fmt: skip


def allocation_bytes(hidden_states, topk_indices, topk_weights, gate_weights, config: LaunchConfig,
                     *, forward_only: bool = False, save_preactivations: bool = False) -> int:  # fmt: skip
    """Bytes of the outputs and workspaces one call allocates (the table in this module's docstring; a
    forward that saves the pre-activations adds 2 · T·K · I in the hidden dtype)."""
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    slots = max(T * K, 1)
    item = hidden_states.element_size()
    workspace_item = torch.empty((), dtype=WORKSPACE_DTYPES[hidden_states.dtype]).element_size()
    halves = 2 * T * H * workspace_item if hidden_states.dtype == torch.float32 else 0  # per split operand
    routing = 4 * slots + 4 * (E + 1) + 16 * slots
    if forward_only:  # y; aw; y per slot; x's halves; g and u where they are saved
        saved = 2 * slots * I * item if save_preactivations else 0
        return T * H * item + slots * I * workspace_item + slots * H * 4 + halves + routing + saved
    outputs = (T * H + 3 * E * I * H) * item + T * K * topk_weights.element_size()
    workspaces = 3 * slots * I * workspace_item + cdiv(I, config.block_i) * slots * 4 + slots * H * 4 + 2 * halves
    if config.tma_weight_grad is not None:  # x and dy gathered into expert order for the TMA-fed kernel W
        workspaces += 2 * slots * H * workspace_item
    return outputs + workspaces + routing


def check_memory(hidden_states, topk_indices, topk_weights, gate_weights, config, *, forward_only=False,
                 save_preactivations=False) -> None:  # fmt: skip
    """Refuses, before anything is allocated, a call whose outputs and workspaces exceed the device's memory."""
    T, K = topk_indices.shape
    nbytes = allocation_bytes(hidden_states, topk_indices, topk_weights, gate_weights, config,
                              forward_only=forward_only, save_preactivations=save_preactivations)  # fmt: skip
    fits_in_memory("num_tokens", nbytes, hidden_states.device,
                   f"the outputs and workspaces of {T} tokens ({T * K} routed slots)")


def check_weight_grads_out(weight_grads_out, gate_weights, down_weights) -> tuple:
    """``weight_grads_out`` as (grad_gate, grad_up, grad_down) when each is a contiguous tensor of its weight's
    shape, dtype and device; a ValueError naming the first that is not."""
    expected = (gate_weights, gate_weights, down_weights)
    if not isinstance(weight_grads_out, (tuple, list)) or len(weight_grads_out) != 3:
        raise ValueError(f"weight_grads_out: expected three tensors (gate, up, down), got {type(weight_grads_out)}")
    for name, out, weights in zip(("gate", "up", "down"), weight_grads_out, expected, strict=True):
        if not (isinstance(out, torch.Tensor) and out.shape == weights.shape and out.dtype == weights.dtype
                and out.device == weights.device and out.is_contiguous()):  # fmt: skip
            got = (f"{tuple(out.shape)} {out.dtype} on {out.device}, contiguous={out.is_contiguous()}"
                   if isinstance(out, torch.Tensor) else type(out).__name__)  # fmt: skip
            raise ValueError(f"weight_grads_out: the {name} gradient must be a contiguous {tuple(weights.shape)} "
                             f"{weights.dtype} tensor on {weights.device}, got {got}")  # fmt: skip
    return tuple(weight_grads_out)


def default_persistent_programs() -> int:
    """Programs of a persistent launch where no device is at hand: a few under the interpreter, else the
    132 SMs of an H100 or H200."""
    return 3 if interpreter_enabled() else 132


def persistent_programs(device: torch.device) -> int:
    """Programs of a persistent launch: one per SM on the GPU, a few under the interpreter."""
    if device.type != "cuda" or interpreter_enabled():
        return default_persistent_programs()
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(hidden_states: torch.Tensor, num_slots: int, num_experts: int) -> LaunchConfig:
    return launch_config(num_slots, num_experts, input_bytes=hidden_states.element_size(),
                         interpreter=interpreter_enabled())  # fmt: skip


def moe_experts_backward_triton(
    grad_output, hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
    *, config: LaunchConfig | None = None, preactivations=None, weight_grads_out=None,
):  # fmt: skip
    """P2 with the Triton kernels; inputs already validated and contiguous (see :mod:`.api`).

    Returns freshly allocated (grad_hidden_states [T, H], grad_topk_weights [T, K],
    grad_gate_weights [E, I, H], grad_up_weights [E, I, H], grad_down_weights [E, H, I]); the
    routing-weight gradient in topk_weights' dtype, the rest in the hidden dtype.
    ``weight_grads_out``: three contiguous tensors of those shapes and dtype (e.g. views of a larger
    set of experts' gradients) that the weight gradients are written into and returned as. ``config``
    overrides the tile sizes (default: :func:`launch_config`); ``preactivations`` (g, u) saved by
    :func:`moe_experts_forward_triton` on the same routing are read instead of recomputed (kernel A then does
    one product of three).
    """
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    dtype, device = hidden_states.dtype, hidden_states.device
    num_slots = T * K
    config = config or default_config(hidden_states, num_slots, E)
    plan = launch_plan(T, H, I, E, K, config, num_programs=persistent_programs(device),
                       weight_bytes=gate_weights.element_size())  # fmt: skip
    split_precision = dtype == torch.float32
    check_memory(hidden_states, topk_indices, topk_weights, gate_weights, config)

    if weight_grads_out is None:
        grad_gate = allocate((E, I, H), dtype=dtype, device=device)
        grad_up = allocate((E, I, H), dtype=dtype, device=device)
        grad_down = allocate((E, H, I), dtype=dtype, device=device)
    else:
        grad_gate, grad_up, grad_down = check_weight_grads_out(weight_grads_out, gate_weights, down_weights)
    grad_hidden = allocate((T, H), dtype=dtype, device=device)
    grad_topk = allocate((T, K), dtype=topk_weights.dtype, device=device)

    routing = route_by_expert(topk_indices, E)
    ws_rows = max(num_slots, 1)  # kernels take no zero-size buffers
    workspace_dtype = WORKSPACE_DTYPES[dtype]
    dgate = allocate((ws_rows, I), dtype=workspace_dtype, device=device)
    dup = allocate((ws_rows, I), dtype=workspace_dtype, device=device)
    scaled_act = allocate((ws_rows, I), dtype=workspace_dtype, device=device)
    topk_partial = allocate((plan["A"].grid["I-tiles"], ws_rows), dtype=torch.float32, device=device)
    dx_slot = allocate((ws_rows, H), dtype=torch.float32, device=device)
    sorted_slot = routing.sorted_slot if num_slots > 0 else torch.zeros(1, dtype=torch.int32, device=device)
    x_halves = operand_halves(hidden_states, split_precision, workspace_dtype)
    dy_halves = operand_halves(grad_output, split_precision, workspace_dtype)
    # kernel W fed by TMA reads x and dy rows in expert order: every operand of an expert contiguous
    tma_w = config.tma_weight_grad is not None and tma_layout_fits(H, I)

    if num_slots > 0:
        launch_swiglu_grad(config, plan, routing, x_halves, dy_halves, topk_weights, gate_weights, up_weights,
                           down_weights, dgate, dup, scaled_act, topk_partial, forward_only=False,
                           preactivations=preactivations,
                           preact=PREACT_COMPUTED if preactivations is None else PREACT_READ)  # fmt: skip
    if tma_w:  # one gather each
        x_sorted = gather_sorted_rows(x_halves[0], sorted_slot[:num_slots], K)
        dy_sorted = gather_sorted_rows(dy_halves[0], sorted_slot[:num_slots], K)
        launch_weight_grads_tma(config.tma_weight_grad, routing.expert_offsets, x_sorted, dy_sorted, dgate, dup,
                                scaled_act, grad_gate, grad_up, grad_down, num_programs=persistent_programs(device))
    else:
        launch_weight_grads(config, routing, sorted_slot, K, x_halves[0], dy_halves[0], dgate, dup, scaled_act,
                            grad_gate, grad_up, grad_down)  # fmt: skip
    if num_slots > 0:
        # dX_slot = Wg_eᵀ dg + Wu_eᵀ du: Wg[e][i, h] at i·H + h
        project_slots(config, routing, gate_weights, up_weights, dgate, dup, dx_slot, transposed_weights=True)
        launch_token_sum(config, plan, dx_slot, topk_indices, E, grad_hidden, topk_partial, grad_topk)
    else:  # no slots at all (T = 0 or K = 0): nothing reaches grad_hidden_states
        grad_hidden.zero_()
    return grad_hidden, grad_topk, grad_gate, grad_up, grad_down


def moe_experts_forward_triton(
    hidden_states, topk_indices, topk_weights, gate_weights, up_weights, down_weights,
    *, config: LaunchConfig | None = None, save_preactivations: bool = False,
):  # fmt: skip
    """The layer's forward y [T, H] (hidden dtype), y_t = Σ_k w_tk · Wd_e (silu(Wg_e x_t) ⊙ Wu_e x_t),
    with the backward's kernels: A without dy (aw = w·a only), D with Wd in place of Wgᵀ and Wuᵀ
    (y per slot), C without the routing-weight gradient. Same precision as the backward: fp32 inputs
    get bf16×3 products for g and u, and a plain bf16 product (aw and Wd rounded) for Wd·aw.
    With ``save_preactivations`` returns (y, (g, u)): the pre-activations, [T·K, I] each in the hidden
    dtype, rows in expert order, for :func:`moe_experts_backward_triton`'s ``preactivations``.
    """
    T, H = hidden_states.shape
    E, I, _ = gate_weights.shape
    K = topk_indices.shape[1]
    dtype, device = hidden_states.dtype, hidden_states.device
    num_slots = T * K
    config = config or default_config(hidden_states, num_slots, E)
    check_memory(hidden_states, topk_indices, topk_weights, gate_weights, config, forward_only=True,
                 save_preactivations=save_preactivations)  # fmt: skip
    y = allocate((T, H), dtype=dtype, device=device)
    preactivations = None
    if save_preactivations:
        preactivations = tuple(allocate((max(num_slots, 1), I), dtype=dtype, device=device) for _ in range(2))
    if num_slots == 0:
        y.zero_()
        return (y, preactivations) if save_preactivations else y
    plan = launch_plan(T, H, I, E, K, config, num_programs=persistent_programs(device),
                       weight_bytes=gate_weights.element_size())  # fmt: skip
    routing = route_by_expert(topk_indices, E)
    workspace_dtype = WORKSPACE_DTYPES[dtype]
    scaled_act = allocate((num_slots, I), dtype=workspace_dtype, device=device)
    y_slot = allocate((num_slots, H), dtype=torch.float32, device=device)
    x_halves = operand_halves(hidden_states, dtype == torch.float32, workspace_dtype)
    # kernel A without dy: the dy, dg, du and top-k partial arguments are never touched
    launch_swiglu_grad(config, plan, routing, x_halves, x_halves, topk_weights, gate_weights, up_weights,
                       down_weights, scaled_act, scaled_act, scaled_act, y_slot, forward_only=True,
                       preactivations=preactivations,
                       preact=PREACT_STORED if save_preactivations else PREACT_COMPUTED)  # fmt: skip
    # y_slot = Wd_e · aw: Wd[e][h, i] at h·I + i
    project_slots(config, routing, down_weights, None, scaled_act, None, y_slot, transposed_weights=False)
    launch_token_sum(config, plan, y_slot, topk_indices, E, y)
    return (y, preactivations) if save_preactivations else y
