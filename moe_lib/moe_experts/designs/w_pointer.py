"""Kernel W, pointer-based (:func:`~..kernels.expert_weight_grad_kernel`): the readable form, and the fallback.

One program per (expert, M-tile, group of N-tiles), each tile reduced over all the expert's rows, which it
gathers inside its loads through ``sorted_slot`` (for bf16×3 products their lo halves too). Runs on any H and I,
on any GPU and under the interpreter.
"""

from __future__ import annotations

import torch

from ...dispatch import interpreter_enabled
from ...tiling import cdiv
from .. import kernels
from ..config import KernelLaunch, LaunchConfig
from ..runtime import PLAIN_PRODUCTS, Target, dtype_reason, products_text


def weight_grad_grid(size_m: int, size_n: int, tile: tuple[int, int, int], n_tiles_per_program: int) -> dict:
    """Kernel W's grid factors for one expert weight gradient [size_m, size_n] in ``tile``s (M, N, rows)."""
    n_tiles = cdiv(size_n, tile[1])
    per_program = min(n_tiles_per_program, n_tiles)
    return {
        "M-tiles": cdiv(size_m, tile[0]),
        "N-groups": cdiv(n_tiles, per_program),
        "_n_tiles": n_tiles,
        "_per_program": per_program,
    }


def launch_weight_grads(
    config: LaunchConfig,
    routing,
    sorted_slot,
    top_k,
    x_operand,
    dy_operand,
    dgate,
    dup,
    scaled_act,
    grad_gate,
    grad_up,
    grad_down,
    lo_halves: tuple | None = None,
) -> None:
    """Kernel W twice: dWg, dWu = Σ dgᵀ x, Σ duᵀ x (one launch, x shared), then dWd = Σ dyᵀ aw; ``lo_halves``:
    the lo halves of x, dy, dg, du and aw (laid out as their hi halves) for bf16×3 products (None: plain)."""
    E, I, H = grad_gate.shape
    split = lo_halves is not None
    x_lo, dy_lo, dgate_lo, dup_lo, scaled_act_lo = (
        lo_halves if split else (x_operand, dy_operand, dgate, dup, scaled_act)  # unused without the split
    )
    for a, a2, b, lo, out, out2, size_m, size_n, a_by_token, b_by_token, tile, warps, stages in (
        (
            dgate,
            dup,
            x_operand,
            (dgate_lo, dup_lo, x_lo),
            grad_gate,
            grad_up,
            I,
            H,
            False,
            True,
            config.grad_gate_up_tile,
            config.warps_gu,
            config.stages_gu,
        ),
        (
            dy_operand,
            dy_operand,
            scaled_act,
            (dy_lo, dy_lo, scaled_act_lo),
            grad_down,
            grad_down,
            H,
            I,
            True,
            False,
            config.grad_down_tile,
            config.warps_dn,
            config.stages_dn,
        ),
    ):
        grid = weight_grad_grid(size_m, size_n, tile, config.n_tiles_per_program)
        programs = E * grid["M-tiles"] * grid["N-groups"]  # one per (expert, M-tile, group of N-tiles)
        kernels.expert_weight_grad_kernel[(programs,)](
            a,
            a2,
            b,
            *lo,
            out,
            out2,
            sorted_slot,
            routing.expert_offsets,
            max(top_k, 1),
            size_m,
            size_n,
            grid["M-tiles"],
            grid["_n_tiles"],
            grid["_per_program"],
            A_BY_TOKEN=a_by_token,
            B_BY_TOKEN=b_by_token,
            TWO_OUTPUTS=out2 is not out,
            SPLIT=split,
            INTERPRETER=interpreter_enabled(),
            BLOCK_M=tile[0],
            BLOCK_N=tile[1],
            BLOCK_ROWS=tile[2],
            num_warps=warps,
            num_stages=stages,
        )


class PointerWeightGrad:
    """Kernel W by pointer loads of the gathered rows."""

    name = "pointer"
    needs = "inputs in float32, bfloat16 or float16; any H and I, any CUDA GPU or the interpreter"

    def supports(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, target: Target) -> str | None:
        return dtype_reason(dtype)

    def workspace_bytes(self, num_slots: int, hidden_size: int, workspace_item: int, *, split: bool = False) -> int:
        return 0  # reads x and dy (and their lo halves) where they lie

    def plan(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        config: LaunchConfig,
        num_programs: int,
        *,
        products: str = PLAIN_PRODUCTS,
    ) -> dict[str, KernelLaunch]:
        split = products_text(products)
        plan = {}
        for step, size_m, size_n, tile, outputs, dims in (
            ("W_gate_up", intermediate_size, hidden_size, config.grad_gate_up_tile, "dWg and dWu", "I×H"),
            ("W_down", hidden_size, intermediate_size, config.grad_down_tile, "dWd", "H×I"),
        ):
            grid = weight_grad_grid(size_m, size_n, tile, config.n_tiles_per_program)
            n, up_to = grid["_per_program"], "up to " if grid["_n_tiles"] % grid["_per_program"] else ""
            tiles = (
                f"one tile of {tile[0]}×{tile[1]} ({dims})"
                if n == 1
                else f"{up_to}{n} tiles of {tile[0]}×{tile[1]} ({dims}) in turn"
            )
            plan[step] = KernelLaunch(
                step,
                {"experts": num_experts, "M-tiles": grid["M-tiles"], "N-groups": grid["N-groups"]},
                f"{outputs} on {tiles}, each reduced over all the expert's rows in steps of {tile[2]}{split}; exact "
                "zeros for an expert with no rows",
            )
        return plan

    def run(
        self,
        config: LaunchConfig,
        routing,
        top_k: int,
        x,
        dy,
        dgate,
        dup,
        scaled_act,
        grad_gate,
        grad_up,
        grad_down,
        *,
        num_programs: int,
        lo_halves: tuple | None = None,
    ) -> None:
        # kernels take no zero-size buffers: with no slots the sorted order is one never-read entry
        sorted_slot = (
            routing.sorted_slot if routing.sorted_slot.numel() else torch.zeros(1, dtype=torch.int32, device=x.device)
        )
        launch_weight_grads(
            config, routing, sorted_slot, top_k, x, dy, dgate, dup, scaled_act, grad_gate, grad_up, grad_down, lo_halves
        )


DESIGN = PointerWeightGrad()
