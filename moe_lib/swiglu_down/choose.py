"""Which design runs a P1 call: a readable heuristic over the shape (T, H, I), the dtype and the device.

    few tokens (T ≤ 64; the faithful path to 128 where the Gluon launches cannot run) of a modest expert (T·H·I)
        → few_tokens: the work is streaming the weights once, and one launch has no gap between launches;
          a larger expert's few tokens on the fast path → the Gluon launches' narrow form where it applies
    the fast path, bf16, from a token count measured for the shape class (:data:`ENGINE_FROM`, empty: no class yet)
        → engine (three launches of the grouped GEMM engine with one expert)
    a shape class with a measured table (the H200 at the benchmark's H 2048, I 768)
        → the table's form for T: Gluon launches, or cuBLAS's GEMMs
    the fast path, 16-bit                                  → library_gemms (cuBLAS's products at any shape)
    the faithful path on Hopper, rows TMA can address      → gluon_launches, a form from the tile counts
    the faithful path, 16-bit rows TMA cannot address      → library_gemms (the Triton kernels lose vector loads)
    the faithful path elsewhere                            → chained to 1249 tokens (one launch), then triton_launches
    fp32, or the interpreter                               → triton_launches

Every choice is checked against the design's ``supports`` before it is returned. Why each rule: the notes
(notes/index.md), by design number.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..tiling import cdiv
from ..tma import rows_fit
from .designs.chained import ChainedConfig
from .designs.engine import EngineDesign
from .designs.few_tokens import FewTokensConfig
from .designs.gluon import FORMS, GluonLaunches, grad_down_in_second_launch, with_second
from .designs.library_gemms import LibraryGemmsConfig
from .designs.triton_launches import FP32_TILES, INTERPRETER_TILES, tiles_for
from .runtime import Device, carries_low_halves

FEW_TOKENS_MAX = {"fast": 64, "faithful": 128}  # one token block of at most 128 (designs 5, 10-12)
GLUON_MIN_TOKENS = 65  # the faithful path takes the Gluon launches from here where they run (design 16)
CHAINED_MAX_TOKENS = 1249  # the chained launch passes two launches in NVIDIA's eager timing up to here (design 8)
# the few-token launch's products run on one program an SM: past this many T·H·I the two-launch designs spread the
# same work over more programs and pass it (design 26: a tie at 64 × 2048 × 1408, slower at 64 × 4096 × 1536)
FEW_TOKENS_MAX_WORK = 2**28

# (H, I, SMs) -> the token count from which the fast path takes the engine design, where a GPU A/B has measured it
# ahead (design 28 times it; none yet). An entry makes every fast call of its class compute σ and silu from the
# saved gate, the saved gate_sigmoid and gate_silu unread: the same only where they are the forward's
# (designs/engine.py)
ENGINE_FROM: dict[tuple[int, int, int], int] = {}

# Measured on the H200 at H 2048, I 768 (designs 14-22): from this many tokens, a form of designs.gluon.FORMS with
# dWd's tiles in launch 2 or not, and dx's reduction split over so many programs; or cuBLAS's GEMMs
MEASURED = {
    (2048, 768, 132): {
        "faithful": (
            (65, "narrow", False, 4),
            (129, "narrow", True, 2),
            (257, "tall", False, 1),
            (513, "tall_dx_first", True, 1),
            (1100, "wide_da_first", False, 1),
            (1400, "wide_da_first_tall", False, 1),
            (1500, "wide_da_first_tall", True, 1),
            (2300, "wide", False, 1),
            (3300, "wide_tall", False, 1),
            (3600, "wide_da256", True, 1),
            (5200, "wide", False, 1),
        ),
        "fast": (
            (65, "narrow", True, 4),
            (129, "narrow", True, 2),
            (193, "narrow", True, 1),
            (385, "tall", True, 1),
            (513, "tall_dx_first", True, 1),
            (1100, "wide_narrow_da", True, 1),
            (1408, "wide_da_first_tall", True, 1),
            (1500, "wide", True, 1),
            (2300, "wide_da256", True, 1),
            (2600, "wide", False, 1),
            (3300, "library_gemms", False, 1),
            (3600, "wide_da256", True, 1),
            (4300, "library_gemms", False, 1),
        ),
    },
}


@functools.lru_cache(maxsize=4096)  # a pure function, called on every call: its host work stays off the call
def choose_design(
    num_tokens: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    dtype: torch.dtype,
    precision: str,
    device: Device,
    aligned: bool = True,
):
    """The design (a configured instance of one of :data:`.designs.DESIGNS`) for one call; ``aligned``: every
    operand starts on a 16-byte boundary."""
    T, H, I = num_tokens, hidden_size, intermediate_size
    with_lo = carries_low_halves(dtype, precision)
    call = (T, H, I, dtype, device)

    def runs(design):
        return design if design is not None and design.supports(*call, aligned=aligned) is None else None

    if device.kind == "interpreter":
        return INTERPRETER_TILES  # every CPU test runs the portable design on tiny shapes
    gluon = runs(generic_gluon_form(T, H, I, device.sms))
    if T <= FEW_TOKENS_MAX[precision] and not (with_lo and gluon and T >= GLUON_MIN_TOKENS):
        few = runs(FewTokensConfig.for_shape(T, H, I, device.sms)) if T * H * I <= FEW_TOKENS_MAX_WORK else None
        if few:
            return few
        if gluon and not with_lo and gluon.first == FORMS["narrow"].first:  # a large expert's few tokens (design 26)
            return gluon
    if not with_lo and T >= ENGINE_FROM.get((H, I, device.sms), float("inf")):
        engine = runs(EngineDesign())
        if engine:
            return engine
    measured = MEASURED.get((H, I, device.sms), {}).get(precision)
    if measured and gluon and T >= measured[0][0]:
        return runs(measured_form(measured, T, H, I, device.sms)) or gluon
    sixteen_bit = dtype in (torch.bfloat16, torch.float16)
    if sixteen_bit and not with_lo:
        return runs(LibraryGemmsConfig.for_shape(T, I)) or tiles_for(T, with_lo=False)
    if not with_lo:  # fp32: exact fp32 products on the portable design, in tiles sized for 4-byte operands
        return FP32_TILES
    if gluon:
        return gluon
    if not rows_fit(H, I, element_bytes=2):  # rows the Triton kernels cannot load 16 bytes at a time (design 7)
        return runs(LibraryGemmsConfig(d_a_fp32=True)) or tiles_for(T, with_lo=True)
    if T <= CHAINED_MAX_TOKENS:
        return runs(ChainedConfig.for_tokens(T)) or tiles_for(T, with_lo=True)
    return tiles_for(T, with_lo=True)


def measured_form(table, T: int, H: int, I: int, sms: int):
    """The entry of a measured table for T tokens (its last entry that starts at or below T)."""
    _, name, grad_down_second, dx_splits = max(entry for entry in table if entry[0] <= T)
    if name == "library_gemms":
        return LibraryGemmsConfig.for_shape(T, I)
    form = FORMS[name]
    form = grad_down_in_second_launch(form) if grad_down_second else form
    return fit_persistent_programs(with_second(form, grad_x_splits=dx_splits), T, H, sms)


def generic_gluon_form(T: int, H: int, I: int, sms: int) -> GluonLaunches:
    """A form for a shape no table covers, from each launch's tile count against the SMs: the measured bands at the
    benchmark's shape fall near these boundaries (design 15)."""
    if cdiv(T, 64) * cdiv(I, 64) <= sms // 2:  # few dA tiles even at 64 × 64: narrow ones, weight grads persistent
        form = FORMS["narrow"]
    elif cdiv(T, 128) * cdiv(I, 128) < sms // 2:  # 64-row tiles double the tile count where 128-row ones are few
        form = FORMS["tall"]
    elif cdiv(T, 128) * cdiv(H, 256) < sms:  # launch 2's 128-row dx tiles less than one wave: 64-row ones
        form = FORMS["wide_tall"]
    else:
        form = FORMS["wide"]
    dx_tiles = form.second.grad_x_tiles(T, H)
    splits = next(s for s in (4, 2, 1) if dx_tiles * s <= sms // 2 or s == 1)  # dx's few tiles over more SMs (18)
    return fit_persistent_programs(with_second(form, grad_x_splits=splits), T, H, sms)


def fit_persistent_programs(form: GluonLaunches, T: int, H: int, sms: int) -> GluonLaunches:
    """Launch 2's persistent weight-gradient programs only where all of them fit beside dx's programs on the SMs:
    fewer were slower than one program a tile (design 19)."""
    second = form.second
    dx_programs = second.grad_x_tiles(T, H) * second.grad_x_splits
    if second.weight_grad_programs and dx_programs + second.weight_grad_programs > sms:
        return dataclasses.replace(form, second=dataclasses.replace(second, weight_grad_programs=0))
    return form
