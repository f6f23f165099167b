"""Kernel W, TMA-fed and persistent (:mod:`..tma_weight_grad`): the backward's default where TMA can run.

x and dy are gathered once into expert order (for bf16×3 products their lo halves too), so that every operand of
an expert is a contiguous block of rows that TMA copies; one program per SM loops over the (expert, M-tile, N-tile)
tiles dealt to it. Needs Hopper (or the interpreter) and rows of H and I in whole multiples of 16 bytes.
"""

from __future__ import annotations

import torch

from ...tiling import cdiv
from ..config import KernelLaunch, LaunchConfig
from ..runtime import PLAIN_PRODUCTS, WORKSPACE_DTYPES, Target, dtype_reason, products_text, tma_reason
from ..tma_weight_grad import gather_sorted_rows, launch_weight_grads_tma


class TmaWeightGrad:
    """Kernel W as a persistent grouped GEMM over rows gathered into expert order, fed by TMA."""

    name = "tma"
    needs = (
        "inputs in float32, bfloat16 or float16; rows of H and I 16-bit elements in whole multiples of "
        "16 bytes; a GPU of compute capability 9.0 or later, or the interpreter"
    )

    def supports(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, target: Target) -> str | None:
        if reason := dtype_reason(dtype):
            return reason
        operand = WORKSPACE_DTYPES[dtype]  # x, dy gathered and dg, du, aw: all 16-bit, also for fp32 inputs
        return tma_reason(target, {"rows of H": (hidden_size, operand), "rows of I": (intermediate_size, operand)})

    def workspace_bytes(self, num_slots: int, hidden_size: int, workspace_item: int, *, split: bool = False) -> int:
        halves = 2 if split else 1  # x and dy gathered into expert order (bf16×3: their hi and lo halves)
        return 2 * halves * num_slots * hidden_size * workspace_item

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
        tma = config.tma_weight_grad
        split = products_text(products)
        plan = {}
        for step, size_m, size_n, tile, outputs, dims in (
            ("W_gate_up", intermediate_size, hidden_size, tma.gate_up_tile, "dWg and dWu", "I×H"),
            ("W_down", hidden_size, intermediate_size, tma.down_tile, "dWd", "H×I"),
        ):
            plan[step] = KernelLaunch(
                step,
                {"programs (one per SM)": num_programs},
                f"{outputs} tiles of {tile[0]}×{tile[1]} ({dims}), dealt round-robin expert by expert, each reduced "
                f"over all the expert's rows (gathered into expert order once) in steps of {tile[2]} that arrive "
                f"by TMA{split}; exact zeros for an expert with no rows",
                tiles={"experts": num_experts, "M-tiles": cdiv(size_m, tile[0]), "N-tiles": cdiv(size_n, tile[1])},
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
        x_sorted = gather_sorted_rows(x, routing.sorted_slot, top_k)
        dy_sorted = gather_sorted_rows(dy, routing.sorted_slot, top_k)
        if lo_halves is not None:  # x's and dy's lo halves gathered likewise; dg, du, aw's are in sorted order
            x_lo, dy_lo, *workspaces_lo = lo_halves
            gathered = (gather_sorted_rows(v, routing.sorted_slot, top_k) for v in (x_lo, dy_lo))
            lo_halves = (*gathered, *workspaces_lo)
        launch_weight_grads_tma(
            config.tma_weight_grad,
            routing.expert_offsets,
            x_sorted,
            dy_sorted,
            dgate,
            dup,
            scaled_act,
            grad_gate,
            grad_up,
            grad_down,
            num_programs=num_programs,
            lo_halves=lo_halves,
        )


DESIGN = TmaWeightGrad()
