"""P2's chooser: every kernel's tiles, the designs of kernels W and D and kernel W's products, from
(T·K, E, H, I, dtype, target) and K.

Pure functions, one line of why per rule, as FlashAttention-3's ``heuristics.h``; the measurements are in
notes/index.md (cited by section). The designs (:mod:`.designs`) say what they can run on: the chooser
takes the TMA-fed one where it can run, the pointer-based one otherwise. Kernel W multiplies fp32 inputs'
operands rounded to bf16 where the weight gradients stay within the element rule with a margin, and as bf16×3
products of hi and lo halves where they would not (:func:`weight_grad_products`)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .config import LaunchConfig
from .designs import SLOT_PROJECTION, WEIGHT_GRAD, SlotProjectionDesign, WeightGradDesign
from .precision_rule import bf16_margin
from .runtime import PLAIN_PRODUCTS, SPLIT_PRODUCTS, WEIGHT_GRAD_PRODUCTS, Target
from .tma_slot_projection import TmaSlotProjectionConfig
from .tma_weight_grad import TmaWeightGradConfig


@dataclass(frozen=True)
class Choice:
    """What one call runs: every kernel's tiles, and the design of kernel W and of kernel D in each use."""

    config: LaunchConfig
    weight_grad: WeightGradDesign  # kernel W
    slot_projection: SlotProjectionDesign  # kernel D in the backward: Wgᵀ dg + Wuᵀ du
    slot_projection_forward: SlotProjectionDesign  # kernel D in the forward: Wd aw
    weight_grad_products: str = PLAIN_PRODUCTS  # kernel W's: "plain" or "bf16x3" (:func:`weight_grad_products`)


def choose(
    num_slots: int,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: torch.dtype,
    target: Target,
    *,
    config: LaunchConfig | None = None,
    weights_aligned: bool = True,
    top_k: int | None = None,
    products: str | None = None,
) -> Choice:
    """The choice for T·K = ``num_slots`` slots over ``num_experts`` experts, K = ``top_k`` of them per token (None:
    unknown, see :func:`weight_grad_products`); ``config`` overrides the tiles (a config without a TMA-fed form's
    tiles asks for the pointer-based design), ``products`` kernel W's products ("plain" or "bf16x3"). Pure: the
    answer is kept per arguments (every call of the layers asks again with the same shapes)."""
    key = (
        num_slots,
        num_experts,
        hidden_size,
        intermediate_size,
        dtype,
        target,
        config,
        weights_aligned,
        top_k,
        products,
    )
    try:
        hash(key)
    except TypeError:  # a config built with lists: chosen afresh
        return _choose(*key)
    return _choose_kept(*key)


def _choose(
    num_slots, num_experts, hidden_size, intermediate_size, dtype, target, config, weights_aligned, top_k, products
) -> Choice:
    if products is None:
        products = weight_grad_products(num_slots, num_experts, hidden_size, dtype, top_k=top_k)
    elif products not in WEIGHT_GRAD_PRODUCTS:
        raise ValueError(f"products: expected one of {WEIGHT_GRAD_PRODUCTS}, got {products!r}")
    elif products == SPLIT_PRODUCTS and dtype != torch.float32:
        raise ValueError(f"products: bf16x3 splits fp32 operands into bf16 halves, got {dtype} inputs")
    config = config or launch_config(
        num_slots,
        num_experts,
        input_bytes=dtype.itemsize,
        interpreter=target.interpreter,
        split_weight_grads=products == SPLIT_PRODUCTS,
    )
    shape = (hidden_size, intermediate_size, dtype, target)
    return Choice(
        config,
        _design(WEIGHT_GRAD, config.tma_weight_grad, *shape),
        _design(SLOT_PROJECTION, config.tma_slot_projection, *shape, weights_aligned=weights_aligned),
        _design(
            SLOT_PROJECTION,
            config.tma_slot_projection,
            *shape,
            transposed_weights=False,
            weights_aligned=weights_aligned,
        ),
        products,
    )


_choose_kept = functools.lru_cache(maxsize=1024)(_choose)


# z below which kernel W splits fp32 inputs' operands: the tolerance 0.11 in predicted error RMS of bf16 operands
BF16_MARGIN = 4.0


def weight_grad_products(
    num_slots: int, num_experts: int, hidden_size: int, dtype: torch.dtype, *, top_k: int | None = None
) -> str:
    """How kernel W multiplies: "plain" (16-bit inputs in their dtype; fp32 inputs' x, dy, dg, du and aw rounded
    to bf16) or "bf16x3" (fp32 inputs: hi·hi + hi·lo + lo·hi of bf16 halves, :mod:`.precision_rule`'s error
    gone). No host synchronisation: the mean rows per expert of a uniform routing stand for each expert's, and
    ``top_k`` None (K unknown) takes every routing weight as 1, the largest a softmax gives."""
    if dtype != torch.float32 or num_slots == 0 or num_experts == 0:
        return PLAIN_PRODUCTS
    # bf16 operands where their error stays 4 RMS inside the tolerance (notes/p2/fp32-precision-rule.md)
    margin = bf16_margin(num_slots / num_experts, hidden_size, top_k or 1)
    return PLAIN_PRODUCTS if margin >= BF16_MARGIN else SPLIT_PRODUCTS


def _design(designs: dict, tma_config, *args, **kwargs):
    """The TMA-fed design where the config has its tiles and it supports the operands, else the pointer-based one."""
    # TMA-fed W and D measured faster than pointer-based (notes/p2/design-04-w.md, notes/p2/design-04-d.md)
    for name in ("tma", "pointer") if tma_config is not None else ("pointer",):
        if (reason := designs[name].supports(*args, **kwargs)) is None:
            return designs[name]
    raise ValueError(reason)


def launch_config(
    num_slots: int,
    num_experts: int,
    *,
    input_bytes: int = 4,
    interpreter: bool = False,
    split_weight_grads: bool = False,
) -> LaunchConfig:
    """Tiles of kernels A, W, D and C for T·K = ``num_slots`` slots over ``num_experts`` experts: 128 weight rows
    × 64 expert rows in A and D on 8 warps by default (notes/p2/design-02.md); ``split_weight_grads``: kernel W
    multiplies bf16×3 (twice the operand tiles per step)."""
    mean_rows = num_slots / max(num_experts, 1)
    # R covers an expert 4 standard deviations busier than the mean (binomial counts): R programs share its weights
    likely_max_rows = mean_rows + 4.0 * math.sqrt(mean_rows) + 1.0
    tma = choose_tma_weight_grad_config(num_slots, num_experts, input_bytes, interpreter, split=split_weight_grads)
    tma_d = choose_tma_slot_projection_config(num_slots, num_experts, input_bytes, interpreter)
    if interpreter:  # 16-wide tiles, the smallest tl.dot takes: tiny test shapes get several tiles and masked edges
        row_split = min(max(1, math.ceil(likely_max_rows / 16)), 3)
        tiny = (16, 16, 16)
        return LaunchConfig(16, 16, 32, tiny, tiny, 2, 32, 16, 32, row_split, 1, 1, 1, 1, 1, 1, 1, 1, tma, tma_d)
    block_h = 32 if input_bytes == 4 else 64  # fp32: A splits its three weight tiles to hi/lo in registers
    # busy experts: 128-row blocks (notes/p2/busy-experts.md); not in fp32, whose W tiles and A, D would not fit
    if mean_rows >= 512 and input_bytes == 2:
        row_split = min(max(1, math.ceil(likely_max_rows / 128)), 8)
        return LaunchConfig(
            128,
            64,
            block_h,
            (128, 128, 128),
            (128, 256, 128),
            32,
            128,
            64,
            1024,
            row_split,
            stages_gu=2,
            stages_dn=2,
            tma_weight_grad=tma,
            tma_slot_projection=tma_d,
        )
    row_split = min(max(1, math.ceil(likely_max_rows / 64)), 8)
    rows_w = 32 if split_weight_grads else 64  # bf16×3: W loads hi and lo tiles, half the rows a step fit
    return LaunchConfig(
        64,
        128,
        block_h,
        (128, 128, rows_w),
        (128, 256, rows_w),
        32,
        128,
        64,
        1024,
        row_split,
        stages_gu=2,
        stages_dn=2,
        tma_weight_grad=tma,
        tma_slot_projection=tma_d,
    )


def choose_tma_weight_grad_config(
    num_slots: int, num_experts: int, input_bytes: int, interpreter: bool, *, split: bool = False
) -> TmaWeightGradConfig:
    """Tiles of the TMA-fed kernel W (shared memory: at most 227 KB per SM, ``scripts/p2/p2_tma_compile_check.py``);
    ``split``: bf16×3 products, each step's operands in hi and lo halves."""
    if interpreter:
        return TmaWeightGradConfig((16, 16, 16), (16, 16, 16), 1, 1, 1, 1)
    mean_rows = num_slots / max(num_experts, 1)
    # few rows per expert: G groups, each program visits E / G experts, fewer descriptors built
    # (notes/p2/design-04-w.md)
    groups = 4 if mean_rows < 128 else 2 if mean_rows < 512 else 1
    if split:  # hi and lo halves: steps of 32 rows keep a stage's bytes and the stages of fp32's plain tiles
        return TmaWeightGradConfig((128, 128, 32), (128, 128, 32), 8, 3, 8, 4, expert_groups=groups)
    if input_bytes == 4:  # fp32 output tiles: a 128×256 dWd tile would need 272 KB of shared memory
        return TmaWeightGradConfig((128, 128, 64), (128, 128, 64), 8, 3, 8, 3, expert_groups=groups)
    stages = 4 if mean_rows >= 512 else 3  # busy experts: 4 stages measured faster (notes/p2/design-04-w.md)
    return TmaWeightGradConfig((128, 128, 64), (128, 256, 64), 8, stages, 8, stages, expert_groups=groups)


def choose_tma_slot_projection_config(
    num_slots: int, num_experts: int, input_bytes: int, interpreter: bool
) -> TmaSlotProjectionConfig:
    """Tiles of the TMA-fed kernel D (none spills or serialises its wgmma: ``scripts/p2/p2_tma_d_compile_check.py``)."""
    if interpreter:
        return TmaSlotProjectionConfig((16, 16, 16), 1, 2, (16, 16, 16), 1, 2)
    mean_rows = num_slots / max(num_experts, 1)
    if input_bytes == 4:  # fp32 weights: 128 × 128, nested loops (flattened, ptxas serialises this form's wgmma)
        return TmaSlotProjectionConfig((128, 128, 64), 8, 4, (128, 128, 64), 8, 4, flatten=False)
    if mean_rows >= 128:  # busy experts: 256 × 128 on 16 warps (notes/parallel/rank-work.md)
        return TmaSlotProjectionConfig((256, 128, 64), 16, 4, (256, 128, 64), 16, 4)
    # few rows per expert: 256 × 64, the weight slab read by half as many tiles (notes/p2/design-04-d.md)
    return TmaSlotProjectionConfig((256, 64, 64), 8, 4, (256, 64, 64), 8, 4)
