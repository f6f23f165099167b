"""The designs of P2's kernels W and D, each kernel's behind one interface, and their registries.

    kernel W (weight gradients: dWg = Σ dgᵀ x, dWu = Σ duᵀ x, dWd = Σ dyᵀ aw per expert; both designs multiply
              plain or bf16×3 products, as the chooser says)
        w_tma.py        persistent, TMA-fed, over x and dy gathered into expert order   the default
        w_pointer.py    one program per tile, rows gathered inside the loads              the fallback
    kernel D (slot projection: dX_slot = Wgᵀ dg + Wuᵀ du in the backward, y_slot = Wd aw in the forward)
        d_tma.py        persistent, TMA-fed                                               the default
        d_pointer.py    one program per (expert, H-tile, row split)                       the fallback

A design says what it needs (``needs``) and answers ``supports(...)``: why it cannot run on operands of that
shape and dtype on that target, or None. :mod:`..choose` picks among them; nothing else decides.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..config import KernelLaunch, LaunchConfig
from ..runtime import PLAIN_PRODUCTS, Target
from . import d_pointer, d_tma, w_pointer, w_tma


@runtime_checkable
class WeightGradDesign(Protocol):
    """Kernel W: every element of dWg, dWu [E, I, H] and dWd [E, H, I] written once (zeros for an expert
    without rows), from kernel A's dg, du, aw [T·K, I] (rows in expert order) and x, dy [T, H]."""

    name: str  # "tma" or "pointer"
    needs: str  # what it needs to run, in words

    def supports(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, target: Target) -> str | None:
        """Why it cannot run on inputs of that shape and dtype on ``target`` (None: it can)."""

    def workspace_bytes(self, num_slots: int, hidden_size: int, workspace_item: int, *, split: bool = False) -> int:
        """Bytes of the workspaces it allocates beyond kernel A's (``split``: for bf16×3 products)."""

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
        """Its two launches, "W_gate_up" and "W_down" (``num_programs``: a persistent launch's grid; ``products``:
        "plain" or "bf16x3")."""

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
        """Writes grad_gate, grad_up, grad_down (x, dy: the 16-bit operands, by token); ``lo_halves``: the lo halves
        of x, dy, dg, du and aw for bf16×3 products (None: plain products)."""


@runtime_checkable
class SlotProjectionDesign(Protocol):
    """Kernel D: out_slot[slot] = W1_eᵀ v1 + W2_eᵀ v2 (backward: Wg, Wu [E, I, H], ``transposed_weights``) or
    W1_e v1 (forward: Wd [E, H, I]) for every routed slot, into a [T·K, H] fp32 workspace."""

    name: str
    needs: str

    def supports(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        target: Target,
        *,
        transposed_weights: bool = True,
        weights_aligned: bool = True,
    ) -> str | None:
        """Why it cannot run on inputs of that shape and dtype on ``target`` (None: it can); ``weights_aligned``:
        whether the weights' base addresses are multiples of 16 bytes."""

    def plan(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        config: LaunchConfig,
        num_programs: int,
        launched: bool,
    ) -> KernelLaunch:
        """Its backward launch, "D"."""

    def run(
        self,
        config: LaunchConfig,
        routing,
        weights1,
        weights2,
        rows1,
        rows2,
        out_slot,
        *,
        transposed_weights: bool,
        num_programs: int,
    ) -> None:
        """Writes out_slot's routed rows (weights2, rows2: None in the forward)."""


# name -> design, the preferred first
WEIGHT_GRAD: dict[str, WeightGradDesign] = {d.name: d for d in (w_tma.DESIGN, w_pointer.DESIGN)}
SLOT_PROJECTION: dict[str, SlotProjectionDesign] = {d.name: d for d in (d_tma.DESIGN, d_pointer.DESIGN)}
