"""P1's host side: tile configs, the launch plan, workspaces and the two launches of :mod:`.kernels`.

:func:`launch_plan` describes every tile kind of both launches (output, reduction, tile, split,
programs, first program id); the launcher takes its grids and workspace sizes from it, and notebook 04
draws it. No host synchronisation anywhere: a call captures in a CUDA graph.
Workspace: dGate and dUp, 2·T·I elements in the input dtype (T = 8192: 25 MB in bf16), twice that
on the faithful path (hi/lo pairs), plus the fp32 partials of split tiles (at most a few MB; none when
nothing is split).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch

from ..dispatch import interpreter_enabled
from ..encoded_launch import can_launch_as_one_graph, launch_as_one_graph
from ..tiling import cdiv
from . import kernels
from .checks import check_precision
from .gluon_launch1 import GluonFirstLaunchConfig, prepare_first_launch_gluon
from .gluon_launch2 import TRACE_FIELDS, GluonSecondLaunchConfig, prepare_second_launch_gluon
from .tma_launches import (
    TmaFirstLaunchConfig,
    TmaSecondLaunchConfig,
    aligned,
    fits,
    launch_first_launch_tma,
    launch_second_launch_tma,
)

# Every output and workspace is allocated through this function (tests replace it with one that
# fills the memory with NaN, to prove that every element the kernels read or return was written).
allocate = torch.empty


def carries_low_halves(dtype: torch.dtype, precision: str) -> bool:
    """Whether dGate and dUp travel as hi/lo pairs: the faithful path with 16-bit inputs."""
    check_precision(precision)
    return precision == "faithful" and dtype != torch.float32


@dataclass(frozen=True)
class TileConfig:
    """Tile shapes of both launches: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT) per tile kind."""

    d_intermediate: tuple  # dA -> dGate, dUp tiles: [tokens, I] reducing over H
    grad_down: tuple  # dWd tiles: [H, I] reducing over T
    grad_x: tuple  # dx tiles: [tokens, H] reducing over 2I
    grad_gate_up: tuple  # dWg, dWu tiles: [I, H] reducing over T
    warps: tuple = (4, 4)  # num_warps of launch 1, launch 2
    stages: tuple = (3, 3)  # num_stages of launch 1, launch 2
    group_m: int = 8  # row tiles grouped for L2 reuse of the column operand
    # launch 1 / launch 2 as one persistent TMA-fed kernel each (:mod:`.tma_launches`, with their own tiles: the
    # fields above for that launch then unused) where TMA can address the rows; None: the pointer-based launch
    tma_first_launch: TmaFirstLaunchConfig | None = None
    tma_second_launch: TmaSecondLaunchConfig | None = None
    # launch 2 in Gluon (:mod:`.gluon_launch2`: one TMA-loading warp, two warpgroups issuing wgmma) on a Hopper GPU
    # with 16-bit operands whose rows TMA can address; elsewhere, and under the interpreter, launch 2 as above
    gluon_second_launch: GluonSecondLaunchConfig | None = None
    # launch 1 likewise (:mod:`.gluon_launch1`: dWd's tiles and dA's with the dSwiGLU epilogue)
    gluon_first_launch: GluonFirstLaunchConfig | None = None
    # launch 2's dx tiles take its first program ids (else the dWg, dWu tiles do): where launch 2 is a few waves of
    # tiles of unequal length, the longest first leaves a shorter tail
    grad_x_first: bool = False
    # the two Gluon launches submitted as one CUDA graph in eager calls (:func:`~moe_lib.encoded_launch.
    # launch_as_one_graph`): both reach the GPU before the first starts, whatever the host's time between them
    gluon_as_one_graph: bool = False

    def __post_init__(self):
        first, second = self.gluon_first_launch, self.gluon_second_launch
        second_takes_grad_down = second is not None and second.grad_down_tiles
        first_leaves_grad_down = first is not None and not first.grad_down_tiles
        if second_takes_grad_down != first_leaves_grad_down:
            raise ValueError("config: dWd's tiles go in exactly one launch: gluon_second_launch.grad_down_tiles "
                             "needs a gluon_first_launch with grad_down_tiles False, and the other way round")
        # (where the Gluon launches cannot run, both give way together to the Triton launches, which compute dWd)


# the faithful path (the benchmark's function) runs in one launch up to this many tokens: in NVIDIA's
# harness, which times a call from its first kernel's start to its last kernel's end, the second launch's
# host work shows as a gap wherever the first kernel is shorter than it: at 1–16 tokens two launches took
# about 50 µs in that method (the fast path) against 20–27 µs for one, even with every workspace allocated
# before the first launch (data/results/NOTES.md)
ONE_LAUNCH_MAX_TOKENS = 64
# in this band the faithful path runs both launches' tiles as one launch (:mod:`.chained`): on the H200 in NVIDIA's
# method 45.9 against 57.2 µs at 128 tokens (design 3's one launch), 61.3 against 112.1 at 512 and 81.7 against
# 123.0 at 1087 (the two launches: the second one's host work showed as a gap). The launch holds launch 2's
# registers and shared memory for every program, one per SM, so launch 1's tiles are twice as wide as in the two
# launches (128×256 dWd tiles) from 512 tokens: by graph replay then within 1 µs of the two Triton launches at 512 and
# 1321 tokens, 6 µs faster at 1087, and slower from 2767 (185.5 against 172.7 µs), where the first launch outlasts
# the second one's host work anyway; below 512, 64×128 dWd tiles (measured at 128 tokens: 50.8 µs by graph replay
# against design 3's 62.3) (data/results/NOTES.md, design 8). It ends where the two launches in Gluon
# (gluon_launch1.py, gluon_launch2.py) with 128-row tiles pass it: by graph replay a tie at 1200 tokens (93.1 against
# 92.7 µs), 96.3-96.9 against 101.0 at 1321 (design 14). Where the Gluon launches run, their 64-row forms pass it
# everywhere (GLUON_FORMS), so there the band is not used.
CHAINED_LAUNCH_TOKENS = range(ONE_LAUNCH_MAX_TOKENS + 1, 1250)
# The faithful path's two launches in Gluon where they run (a Hopper GPU, 16-bit operands whose rows TMA can address),
# from CHAINED_LAUNCH_TOKENS.start on (below that, and up to FEW_TOKENS_MAX_TOKENS, the one-launch designs), their
# forms by token count. Tiles 64 rows tall (one warpgroup) make twice as many tiles, each half as long, so where the
# 128-row tiles fill the 132 SMs in one wave and a bit their last wave is short; with 128-row tiles the tensor cores
# are busier per tile. Where the tiles of K = H (dA) or K = 2I (dx) are a launch's longest, they take the first
# program ids (``d_a_first``, ``grad_x_first``), so that the tiles reducing over the T tokens fill in around them
# instead of leaving them as a tail. Measured on the H200 by graph replay (data/results/NOTES.md, design 15), µs,
# against the designs before (the chained launch to 1249 tokens, then both launches 128 rows tall, dWd's and the
# weight-gradient tiles first):
#   both launches 64 rows, the long tiles first, launch 1's ring 8 deep: 256 tokens 34.8 against 51.3, 512 40.8
#     against 56.3, 768 51.5 against 70.7, 1087 69.1 against 79.3; in NVIDIA's method (its host work between the two
#     launches counted, which the one-launch designs do not pay) 38.3 against 46.5 at 256, 42.1 against 51.6 at 512,
#     but 38.0 against 37.5 at 128 and 38.2 against 31.3 at 65 (submitted one after the other; as one CUDA graph
#     they pass the few-token launch from 65 tokens: GLUON_MIN_TOKENS);
#   launch 2 alone 64 rows, launch 1's dA tiles first: 1200 74.1 against 78.8 (75.6 with both launches 64 rows), 1321
#     76.4 against 95.2, 1571 82.7 against 102.5, a tie at 1800 (108.6 against 108.3);
#   launch 2 alone 64 rows, in its usual order: 3500 176.0 against 181.1, 4093 201.5-202.7 against 212.1; slower at
#     2447-3089 (129.0 against 125.6, 150.7 against 145.8) and 5000-6000 (249.9 against 242.7, 289.0 against 281.1), a
#     tie at 7168, 6% slower at 12288: where the 128-row tiles end in a full wave.
#   launch 2's dx tiles first too (launch 1 at 128 rows, dA first), both by PDL: 1100 68.8 against 72.5 (both
#     launches 64 rows), 1150 69.4 against 72.4 (dx tiles in their usual order), 1200 71.0 against 73.9, 1321 74.8
#     against 75.8; a tie at 1400, slower from 1571 (83.8 against 83.2, 2047 118.7 against 113.9, plainly issued).
# Launch 2 is issued by programmatic dependent launch (``GluonSecondLaunchConfig.programmatic``): its programs start on
# the SMs launch 1's last wave leaves free and wait on the device for launch 1's end and writes
# (``griddepcontrol.wait``), which launch 1 allows as each of its programs starts (``early_dependents``): 0.6-1.2 µs
# off each band's form at 129-8192 tokens by graph replay (512 40.1 against 40.8, 1321 75.6 against 76.6, 8192 377.0
# against 377.5); launch 1 allowing it only as its programs end gave nothing (34.5 against 34.7 at 129).
# Launch 1's dSwiGLU epilogue stores its four output halves at once, each through a saved tile's buffer once read
# (``stores_in_flight``): 0.2-1.8 µs off at 129-8192 tokens by graph replay (4093 201.9 against 202.9 and 210.5
# against 212.3, 8192 381.6 against 383.3), a tie at 1087 and 1571 (within ±0.3).
# Launch 1's loading warp asks for a dA tile's four saved tiles as soon as the main loop has released their buffers
# (``saved_tiles_early``, the ring rotated so that its last K steps fall in its last buffers): ncu had the dSwiGLU
# epilogue waiting for them 5% of launch 1's time at 8192 tokens. By graph replay, two runs, 0.1-1.3 µs off in 14 of
# 17 pairs (4093 199.5 and 199.2 against 200.3 and 199.9, 7168 330.0 against 330.8, 8192 375.5 and 377.3 against
# 376.8 and 377.6, 512 39.2 against 39.8), ties within ±0.3 in the rest (1321, 2447, a second 512).
_GLUON_WIDE = GluonFirstLaunchConfig(buffers=6, early_dependents=True, stores_in_flight=True, saved_tiles_early=True)
_GLUON_WIDE_D_A_FIRST = GluonFirstLaunchConfig(buffers=6, d_a_first=True, early_dependents=True,
                                               stores_in_flight=True, saved_tiles_early=True)
_GLUON_TALL = GluonSecondLaunchConfig(block_m=64, warps=4, buffers=6, programmatic=True)
_GLUON_TALL_GRAD_X_FIRST = GluonSecondLaunchConfig(block_m=64, warps=4, buffers=6, grad_x_first=True, programmatic=True)
# To 256 tokens dx's reduction over 2I is split over programs (``grad_x_splits``: 4 a tile to 128 tokens, 2 to 256,
# at most 64 programs), the last of a tile's splits to arrive summing the partials in split order: there launch 2's
# 16-32 dx tiles each ran the whole K on one SM and ended the call ~9 µs after its other tiles (program traces,
# ``scripts/p1_program_trace.py``). By graph replay (NOTES, design 18), faithful: 65-128 tokens 28.5-28.9 against
# 32.3-32.4 µs, 192 30.4 against 32.8, 256 32.3 against 33.1; slower from 384 (38.8 against 35.0).
_GLUON_TALL_64 = GluonFirstLaunchConfig(block_m=64, warps=4, buffers=8, d_a_first=True, early_dependents=True,
                                        stores_in_flight=True, saved_tiles_early=True)  # fmt: skip
# To 512 tokens launch 2's 192 weight-gradient tiles go to 68 programs that take them in turn
# (``weight_grad_programs``), which with dx's 64 programs (at most) fill the 132 SMs: one tile a program, they ran as
# three waves beside dx's tiles and ended the call 5 µs after them at 512 tokens (program traces); each program's
# set-up, first round trip and store drain are now paid once. By graph replay (NOTES, design 19), faithful: 512 tokens
# 36.0 against 39.6 µs, 384 33.9 against 34.9, 256 30.9 against 32.9, 65-128 28.4-28.6 against 28.7-29.0; fast (dx
# unsplit) 512 30.2-30.4 against 32.7-33.3, 65-384 0.3-0.7 µs off. From 576 tokens (72 or more dx programs: fewer
# persistent programs fit beside them) slower: faithful 43.7 against 42.8 at 576, 46.9 against 44.4 at 639.
# There too the loading warps send their first K steps' tiles of the call's inputs (x, Wg, Wu) before the wait for
# launch 1 (``inputs_before_wait``), where launch 2's programs wait 3-6 µs for it: by graph replay (NOTES, design 19)
# faithful 65 tokens 27.3 against 28.8 µs, 256 30.1 against 31.0, 384 32.7 against 33.9, 128 and 512 within 0.3; fast
# 128-512 0.7-0.9 µs off; from 768 tokens, where few programs wait, within ±1.3 either way.
_PERSISTENT_WEIGHT_GRAD = dataclasses.replace(_GLUON_TALL_GRAD_X_FIRST, weight_grad_programs=68,
                                              inputs_before_wait=True)  # fmt: skip
# To 256 tokens launch 1's dA tiles are 64 wide (twice as many, each streaming 512 KB of dy's rows and Wd's columns
# through its SM instead of 768 KB: launch 2 waits on them), its dWd tiles still 128 wide (``grad_down_block_n`` twice
# ``block_n``; 64-wide dWd tiles, twice as many, measured slower). By graph replay (NOTES, design 20), faithful: 65-128
# tokens 24.7-25.2 against 27.0-28.1 µs, 160-256 26.8-28.6 against 28.9-30.1; fast 65-192 24.3-24.6 against
# 25.4-26.3, a tie at 256; slower from 320 (more dA tiles than SMs beside the dWd tiles).
_GLUON_NARROW_D_A = dataclasses.replace(_GLUON_TALL_64, block_n=64, d_a_block_n=64, grad_down_block_n=128)
# From 513 tokens to 1099 and again at 3600-5199 dWd's tiles run in launch 2 (``grad_down_tiles``): they read only the
# call's inputs, so there they wait for nothing, start on the SMs launch 1's last wave leaves free, and launch 1 is
# dA's tiles alone. By graph replay (NOTES, design 20), faithful: 640 tokens 43.2 against 44.4 µs, 896 56.1 against
# 60.9, 1087 63.7 against 67.4-67.5, 1099 67.3 against 71.2 (a tie at 1150, slower at 1200); fast 640-896 0.8-4.6 µs
# off. At 3600-5199 with launch 2's 128-row tiles and launch 1's dA tiles 256 wide: 3600 181.2-181.5 against
# 186.2-186.3, 4093 191.9-193.0 against 198.6-198.8, 4500 203.2 against 221.1, 5000 230.0-230.9 against 237.8-238.4;
# slower at 3300 (173.0 against 166.5), 3500 (178.2 against 173.0), 5300 (251.6 against 244.8) and 6144 (297.4 against
# 277.9); at 8192 a tie, as dWd's 48 tiles of 128 x 256 (84 µs each) hold 48 SMs while launch 2's 96
# weight-gradient tiles want the rest and more (program traces).
# At 1500-2299 tokens the same with the 1400 band's tiles (NOTES, design 21; two runs at 2047): 1571 81.9-82.0 against
# 82.4 µs, 1700 96.6 against 101.2, 1800 100.1 against 107.8, 2047 106.2-106.3 against 112.4-113.0, 2200 117.5 against
# 119.9.
def grad_down_in_second_launch(form):
    """A (launch 1, launch 2) form with dWd's tiles moved to launch 2."""
    launch1, launch2 = form
    return (dataclasses.replace(launch1, grad_down_tiles=False), dataclasses.replace(launch2, grad_down_tiles=True))


# At 129-256 tokens dWd's tiles go to launch 2 too, on its first program ids before the persistent weight-gradient
# programs: launch 1 is then dA's 64-wide tiles alone, and dWd's (K = T) run on the SMs launch 1 leaves free. By graph
# replay (NOTES, design 22, two runs), faithful: 160 tokens 26.6 against 27.2 µs, 192 26.4-26.9 against 27.0-27.1,
# 224 27.2 against 28.8, 256 27.4-27.5 against 28.6-29.0; at 65-128 (dx in 4) ties within ±0.4 either way
GLUON_FORMS = {  # from this many tokens: (launch 1, launch 2)
    0: (_GLUON_NARROW_D_A, dataclasses.replace(_PERSISTENT_WEIGHT_GRAD, grad_x_splits=4)),
    129: grad_down_in_second_launch((_GLUON_NARROW_D_A, dataclasses.replace(_PERSISTENT_WEIGHT_GRAD,
                                                                             grad_x_splits=2))),
    257: (_GLUON_TALL_64, _PERSISTENT_WEIGHT_GRAD),
    513: grad_down_in_second_launch((_GLUON_TALL_64, _GLUON_TALL_GRAD_X_FIRST)),
    1100: (_GLUON_WIDE_D_A_FIRST, _GLUON_TALL_GRAD_X_FIRST),
    1400: (_GLUON_WIDE_D_A_FIRST, _GLUON_TALL),
    1500: grad_down_in_second_launch((_GLUON_WIDE_D_A_FIRST, _GLUON_TALL)),
    2300: (_GLUON_WIDE, GluonSecondLaunchConfig(programmatic=True)),
    3300: (_GLUON_WIDE, _GLUON_TALL),
    3600: grad_down_in_second_launch((dataclasses.replace(_GLUON_WIDE, d_a_block_n=256, buffers=4,
                                                          saved_tiles_early=False),
                                      GluonSecondLaunchConfig(programmatic=True))),
    5200: (_GLUON_WIDE, GluonSecondLaunchConfig(programmatic=True)),
}
# the faithful path's Triton tiles beyond the chained launch's band where the Gluon launches cannot run, and the
# Triton fields of GLUON_FORMS' configs (what an explicit Gluon config falls back to on operands TMA cannot address)
FAITHFUL_TILES = TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3))
# From 512 tokens launch 2's dx tiles take their tickets before the dWg, dWu tiles (``grad_x_first``): there launch 2
# is one to two waves of tiles, the dx tiles the longest (with the hi/lo halves 1.5x a dWg tile's products at 512
# tokens), and started last they ran as a tail: 56.1 against 65.5 us at 512 tokens by graph replay, within 0.7 us at
# 1087-1571 (data/results/NOTES.md, design 8, third round)
# From 1153 tokens (dx in 10 or more 128-row blocks) the dWd tiles take the last tickets instead, after launch 2's
# tiles, which go in their usual order (dWg, dWu first): the dWd tiles depend on nothing, so they fill the SMs that
# launch 2's last wave leaves free (``CHAINED_GRAD_DOWN_LAST_MIN_TOKENS``). On the H200 by graph replay, two rounds:
# 92.5-93.0 against 94.8-95.4 us at 1170-1200 tokens, 101.1-101.9 against 107.1-107.7 at 1300-1321, 122.1-124.9
# against 127.2-130.0 at 1450-1500, a tie at 1550-1599; at 1087-1150 tokens 5-7 us slower (data/results/NOTES.md,
# design 8, third round)
CHAINED_GRAD_DOWN_LAST_MIN_TOKENS = 1153
_CHAINED_WIDE_TILES = TileConfig((64, 128, 64, 1), (128, 256, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1))
CHAINED_TILES = {  # from this many tokens: these tiles
    0: TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)),
    512: dataclasses.replace(_CHAINED_WIDE_TILES, grad_x_first=True),
    CHAINED_GRAD_DOWN_LAST_MIN_TOKENS: _CHAINED_WIDE_TILES,
}
# up to this many tokens each path runs the few-token design (:mod:`.few_tokens`), its tokens in one block of up to 64
# (data/results/NOTES.md, designs 5 and 10; on the H200 by graph replay): at 1–16 tokens 19–21 µs against 23–32 µs
# for the two-launch (fast) and one-launch (faithful) designs, and 14–16 µs against 20–27 µs in NVIDIA's timing; at
# 24 and 32 tokens (one 32-token block) 22.7–23.6 µs faithful against the one launch's 40.2–42.0, and 21.8–22.7 fast
# against the cuBLAS design's 25.8–26.2; at 48 and 64 tokens (one 64-token block) 29.6–30.3 µs faithful against
# 41.8–42.8 (24.4–27.3 against 36.8–37.7 in NVIDIA's timing), but 27.6–28.5 fast against cuBLAS's 25.7–26.5; at 65
# to 128 tokens (one 128-token block, the saved tiles loaded after phase 1) faithful 42.3–44.2 µs against the chained
# launch's 49.4–50.0 at 65–96 tokens (37.9–39.7 against 44.7–45.4 in NVIDIA's timing), a tie at 128 (49.8–50.2
# against 50.3–50.5; 45.2–45.4 against 45.2–45.3); on the fast path 46.0 against cuBLAS's 29.6 at 128. Beyond one
# block its token loops are slower than every other design (63–75 µs at 128 tokens). With dx's sum split by rows
# (``few_tokens.DX_SUM_SLICES``) 40.5–41.4 µs faithful at 128 tokens (37.8–38.4 in NVIDIA's timing), and on the
# fast path 26.9–27.1 against cuBLAS's 25.5–25.7 at 64. With 64 × 256 phase-2 tiles
# (``few_tokens.ONE_BLOCK_PHASE2_TILE``) and the saved tiles loaded late, the fast path in two runs 23.7–24.1
# against cuBLAS's 26.5–26.9 at 48 tokens and a tie at 64 (25.6–26.4 against 26.0–26.4); eagerly 21–23 µs against
# the cuBLAS design's 290–490 (its host work): the fast path keeps cuBLAS from 65 tokens (at 96 and 128 34.6–41.2
# against 28.0–28.7)
FEW_TOKENS_MAX_TOKENS = {"fast": 64, "faithful": 128}
# Where the Gluon launches run, the faithful path takes them from this many tokens instead of the few-token launch:
# submitted as one CUDA graph (``TileConfig.gluon_as_one_graph``), the two launches no longer show the host's time
# between them in NVIDIA's method. On the H200 (data/results/NOTES.md, design 16), NVIDIA's method: 29.2 µs against
# the few-token launch's 31.0 at 65 tokens, 29.6 against 34.7 at 100, 29.7 against 37.8 at 128 (graph replay 32.7–32.9
# against 34.9–41.7); the few-token launch's 64-token block stays ahead below (23.2 µs at 64)
GLUON_MIN_TOKENS = 65


# from this many tokens the fast path runs the design on cuBLAS GEMMs (:mod:`.library_gemms`) instead of the
# Triton launches, with 16-bit inputs: on the H200 (data/results/NOTES.md, design 7) it took 29.8 against
# 37.0 µs at 128 tokens and 242 against 315 µs at 8192 by graph replay. The faithful path never: it is judged in
# NVIDIA's method (eager calls, CUPTI span), where the design's host-side operations (GEMM calls, the weight
# stacking, a Triton launch, allocations) take 140–520 µs a call and leave gaps between the kernels wherever the
# GPU finishes first: 449 against 148 µs at 1321 tokens; at 7168 tokens 370.8 against 395.1 µs in one run, but
# 519–576 µs in two others, on hosts that took 500 µs a call, against the Triton launches' ≈ 395 (NOTES)
LIBRARY_GEMMS_MIN_TOKENS = {"fast": FEW_TOKENS_MAX_TOKENS["fast"] + 1}
# except in these bands where the Gluon launches run: there the fast path takes them too (the forms of GLUON_FORMS
# without the lo halves, dx's tiles unsplit: half as long, they end with the rest), by graph replay on the H200
# (NOTES, design 18) 26.6-27.2 against 28.1-29.7 µs at 65-160 tokens, 33.2 against 37.3 at 512, 36.7 against 39.4 at
# 640, 47.4 against 49.6 at 896; from 1024 tokens cuBLAS leads (48.8 against 50.7, 1321 57.9 against 62.6). Again at
# 2300-3299 tokens (the band's form with 128-row tiles in both launches; NOTES, design 19, two runs): 2447 84.7-84.8
# against 85.5-86.2, 3089 97.6-98.3 against 103.9-105.0, a tie at 2767 (94.4-94.7 against 93.8-94.7); cuBLAS ahead
# at 1087-1571 (by 1-5%), 3300 (109.6 against 115.7) and 4093-7168. With dWd's tiles in launch 2 (the forms at
# 513-1099 and 3600-5199; NOTES, design 20) the Gluon launches lead at 960-1099 too (960 44.7 against 51.8, 1024 47.2
# against 49.1, 1087 48.4 against 50.6; a tie at 1150, cuBLAS ahead from 1200) and at 3600-4299 (3600 117.2 against
# 118.6, 4093 124.7 against 128.9; cuBLAS ahead at 4500 and 5000). At 65-512 and 1100-2599 the fast path has forms
# of its own (GLUON_FAST_FORMS), with which the Gluon launches lead at 1100-1249 too.
GLUON_FAST_TOKENS = (range(FEW_TOKENS_MAX_TOKENS["fast"] + 1, 3300), range(3600, 4300))


# The fast path's own forms where they are not the faithful path's of the same token count: dWd's tiles in launch 2
# (where they wait for nothing) with the 2300 band's tiles and launch 1's dA tiles 64 wide at 1250-1407 tokens (there
# those are at most 11 × 12 = 132, one wave), the 1400 band's tiles at 1408-1499 and the 2300 band's at 1500-2299;
# and the 3600 band's form at 2300-2599. By graph replay on the H200 (NOTES, design 21), against cuBLAS's design:
# 1250 tokens 52.5 against 54.6-54.9 µs, 1321 54.0-54.4 against 57.6-58.9, 1400 53.8-54.1 against 58.7-60.0 (the 1400
# band's tiles with dWd in launch 2 56.2-57.5 at 1321-1400; from 1450 the 64-wide dA tiles come in two waves: 1450
# 64.0 against 60.5), 1571 60.1-61.2 against 62.8-63.9, 1800 63.6-63.9 against 69.9-72.4, 2047 69.6-70.0 against
# 74.2-75.3; against the 2300 band's form 2447 82.7 against 84.0 (2300 80.1 against 80.5, a tie at 2767, slower at
# 3089); cuBLAS ahead at 1100-1200 (1200 53.9-54.4 against 54.6-55.8 with dWd's tiles in launch 2; the 64-wide dA
# tiles were not measured below 1250 then, and at 1087 were 3 µs behind the 513 band's form). The 64-wide dA tiles at
# 1100-1249 too (NOTES, design 22, two runs): 1100 tokens 51.0 against cuBLAS's 52.2-52.4, 1150 51.6-51.7 against
# 52.2-52.4, 1200 53.1-53.2 against 53.4-54.5, 1249 53.3 against 55.1 (a second run: 50.8, 51.4, 52.9 and 52.8 against
# 53.6, 52.4, 54.7 and 55.0). And at 65-512 tokens the faithful path's forms to 512 tokens with dWd's tiles in launch 2
# (launch 1 dA's tiles alone, beside the persistent weight-gradient programs), by graph replay (NOTES, design 22),
# against the forms before: with launch 1's dA tiles 64 wide and dx in 4 at 65-128 tokens (65 23.6-23.7 against
# 23.9-24.3, 96 22.9-23.3 against 23.6-24.5, 128 23.3-23.5 against 23.8-24.4), in 2 at 129-192 (144 23.8 against 24.4,
# 160 23.9-24.0 against 23.9-24.7, 192 23.0-24.0 against 24.4-24.8), unsplit at 193-384 (256 24.3-24.6 against
# 26.4-26.7, 320 25.0-25.2 against 26.9-27.1, 384 25.9-26.4 against 26.5-27.1); with launch 1's dA tiles 128 wide at
# 385-512 (416 26.9-27.3 against 28.0-28.5, 448 27.0-27.2 against 28.0-28.4, ties at 480 and 512)
GLUON_FAST_FORMS = {
    range(65, 129): grad_down_in_second_launch(GLUON_FORMS[0]),
    range(129, 193): GLUON_FORMS[129],
    range(193, 385): grad_down_in_second_launch((_GLUON_NARROW_D_A, _PERSISTENT_WEIGHT_GRAD)),
    range(385, 513): grad_down_in_second_launch(GLUON_FORMS[257]),
    range(1100, 1408): grad_down_in_second_launch(
        (dataclasses.replace(GLUON_FORMS[2300][0], block_n=64, d_a_block_n=64), GLUON_FORMS[2300][1])),
    range(1408, 1500): grad_down_in_second_launch(GLUON_FORMS[1400]),
    range(1500, 2300): grad_down_in_second_launch(GLUON_FORMS[2300]),
    range(2300, 2600): GLUON_FORMS[3600],
}


def fast_path_on_gluon(num_tokens: int) -> bool:
    """Whether the fast path takes the Gluon launches (where they run) at this many tokens (GLUON_FAST_TOKENS)."""
    return any(num_tokens in band for band in GLUON_FAST_TOKENS)


def gluon_form(num_tokens: int, with_lo: bool):
    """The Gluon launches' (launch 1, launch 2) configs at this many tokens: the faithful path's form of
    :data:`GLUON_FORMS`; on the fast path its own where :data:`GLUON_FAST_FORMS` has one, else the faithful path's
    with dx's tiles unsplit (without the lo halves they are half as long and end with the rest). The lo halves are
    set by :func:`choose_config`."""
    if not with_lo:
        for band, form in GLUON_FAST_FORMS.items():
            if num_tokens in band:
                return form
    launch1, launch2 = GLUON_FORMS[max(first for first in GLUON_FORMS if first <= num_tokens)]
    return launch1, launch2 if with_lo else dataclasses.replace(launch2, grad_x_splits=1)


# from here on the fast path keeps dA in the input dtype, as torch.compile's code does (236.7 against
# 242.2 µs at 8192 tokens; within 1 µs of fp32 from 1087 to 2447); below, in fp32
LIBRARY_GEMMS_16BIT_DA_MIN_TOKENS = 1024
# the copy of [Wg; Wu] runs first thing on the second stream, beside dA and the dSwiGLU pass (``stack_aside``); from
# here on as two device-to-device memcpys (``stack_by_memcpy``: the copy engines, leaving every SM to the GEMMs),
# below as a copy kernel (the memcpys are slower, 8 µs for the 6 MB, and at few tokens dx waits for them). On the
# H200 by graph replay (data/results/NOTES.md): the kernel aside 28.3 against 29.1–29.7 µs at 128 tokens; the
# memcpys aside 50.6 against 52.0–53.4 at 1087, 57.9 against 60.1–60.6 at 1321, 104.0 against 106.0 at 3089,
# within 1 µs of the kernel at 4093–8192
LIBRARY_GEMMS_MEMCPY_STACK_MIN_TOKENS = 1024


@functools.lru_cache(maxsize=4096)  # a pure function of its arguments, called on every call: 10-30 µs of host work
def choose_design(num_tokens: int, hidden_size: int, intermediate_size: int, *, interpreter: bool,
                  with_lo: bool = False, max_programs: int = 0, element_bytes: int = 2,
                  gluon: bool = True):  # fmt: skip
    """What ``swiglu_down_backward`` runs: on the fast path from :data:`LIBRARY_GEMMS_MIN_TOKENS` with 16-bit inputs
    the design on cuBLAS GEMMs (:class:`~.library_gemms.LibraryGemmsConfig`, two streams), else the Triton designs
    of :func:`choose_config` (same arguments; ``gluon``: the Gluon launches can run, see there). A faithful threshold
    in that dict would run the design on one stream from there."""
    first = LIBRARY_GEMMS_MIN_TOKENS.get("faithful" if with_lo else "fast")
    gluon_band = gluon and not with_lo and fast_path_on_gluon(num_tokens)
    if not interpreter and element_bytes == 2 and first is not None and num_tokens >= first and not gluon_band:
        from .library_gemms import LibraryGemmsConfig  # it builds on this module's allocation

        if with_lo:
            return LibraryGemmsConfig(d_a_fp32=True, streams=False)
        return LibraryGemmsConfig(d_a_fp32=num_tokens < LIBRARY_GEMMS_16BIT_DA_MIN_TOKENS, streams=True,
                                  stack_aside=True,
                                  stack_by_memcpy=num_tokens >= LIBRARY_GEMMS_MEMCPY_STACK_MIN_TOKENS)  # fmt: skip
    return choose_config(num_tokens, hidden_size, intermediate_size, interpreter=interpreter, with_lo=with_lo,
                         max_programs=max_programs, element_bytes=element_bytes, gluon=gluon)  # fmt: skip


def choose_config(num_tokens: int, hidden_size: int, intermediate_size: int, *, interpreter: bool,
                  with_lo: bool = False, max_programs: int = 0, element_bytes: int = 2,
                  gluon: bool = True):  # fmt: skip
    """Tile shapes by token count (tuned on the H200 for H = 2048, I = 768).

    ``with_lo`` (the faithful path) takes a second A tile per step in launch 2 and stores two halves in
    launch 1's epilogue, so from 257 tokens it gets tiles that keep both within the registers and shared
    memory (launch 1 on 8 warps, dx on 128×128 tiles, 3 stages). Where its grid fits in ``max_programs``
    (the programs surely resident at once: one per SM, :func:`resident_programs`), both paths run the
    few-token design (:class:`~.few_tokens.FewTokensConfig`) up to :data:`FEW_TOKENS_MAX_TOKENS` (per path; the
    faithful path below :data:`GLUON_MIN_TOKENS` where the Gluon launches run) with 16-bit inputs
    (``element_bytes``; its tiles are sized for them); where its grid does not fit, the
    faithful path takes the one-launch design (:class:`~.one_launch.OneLaunchConfig`) up to
    :data:`ONE_LAUNCH_MAX_TOKENS`; beyond, where ``gluon`` (the Gluon launches run on the call's device and operands:
    a Hopper GPU, 16-bit, rows TMA can address), both launches in Gluon (:mod:`.gluon_launch1`,
    :mod:`.gluon_launch2`) in the forms of :data:`GLUON_FORMS` (the fast path only in :data:`GLUON_FAST_TOKENS`,
    without the lo halves and with dx's tiles unsplit, in forms of its own where :data:`GLUON_FAST_FORMS` has them);
    elsewhere in :data:`CHAINED_LAUNCH_TOKENS` the two launches' tiles chained into one launch
    (:class:`~.chained.ChainedConfig`; any grid size: it needs no residency), beyond that the two Triton launches.
    Under the interpreter: 16-wide tiles split in two, so that tiny test shapes still have several
    tiles, splits and edges."""
    if interpreter:
        return TileConfig((16, 16, 16, 2), (16, 16, 16, 2), (16, 16, 16, 2), (16, 16, 16, 1), (1, 1), (1, 1), 2)
    if gluon and element_bytes == 2 and num_tokens >= GLUON_MIN_TOKENS and (with_lo or fast_path_on_gluon(num_tokens)):
        launch1, launch2 = gluon_form(num_tokens, with_lo)
        dx_programs = launch2.grad_x_tiles(num_tokens, hidden_size) * launch2.grad_x_splits
        if launch2.weight_grad_programs and max_programs and dx_programs + launch2.weight_grad_programs > max_programs:
            # the persistent programs only where all of them fit beside dx's on the SMs: fewer were slower than one
            # program a tile (NOTES, design 19: 34 at 512 tokens, 52-60 at 576-639)
            launch2 = dataclasses.replace(launch2, weight_grad_programs=0)
        return dataclasses.replace(FAITHFUL_TILES, gluon_first_launch=launch1, gluon_second_launch=launch2,
                                   gluon_as_one_graph=True)  # fmt: skip
    if num_tokens <= FEW_TOKENS_MAX_TOKENS["faithful" if with_lo else "fast"] and element_bytes == 2:
        from .few_tokens import choose_few_tokens_config  # it builds on this module's workspaces

        few_tokens = choose_few_tokens_config(num_tokens, hidden_size, intermediate_size, interpreter=False,
                                              with_lo=with_lo, max_programs=max_programs)  # fmt: skip
        if few_tokens.grid_size(hidden_size, intermediate_size) <= max_programs:
            return few_tokens
    if with_lo and num_tokens in CHAINED_LAUNCH_TOKENS:
        from .chained import ChainedConfig  # it builds on this module's workspaces

        tiles = CHAINED_TILES[max(first for first in CHAINED_TILES if first <= num_tokens)]
        return ChainedConfig(tiles, warps=8, stages=3, grad_down_last=num_tokens >= CHAINED_GRAD_DOWN_LAST_MIN_TOKENS)
    if with_lo and num_tokens <= ONE_LAUNCH_MAX_TOKENS:
        from .one_launch import OneLaunchConfig  # it builds on this module's workspaces

        block_t, stages = (16, 4) if num_tokens <= 16 else (64, 3)
        one_launch = OneLaunchConfig(block_t=block_t, block_i=16, block_h_down=32, block_h=16, block_k=256,
                                     block_n=128, warps=4, stages=stages)  # fmt: skip
        if one_launch.grid_size(hidden_size, intermediate_size) <= max_programs:
            return one_launch
    if num_tokens <= 16:
        return TileConfig((16, 64, 128, 8), (64, 128, 16, 1), (16, 64, 128, 8), (64, 128, 16, 1), (4, 4), (3, 3))
    if num_tokens <= 256:
        return TileConfig((64, 64, 64, 4), (64, 128, 64, 1), (64, 128, 64, 4), (64, 128, 64, 1), (4, 4), (3, 3))
    if with_lo:
        return FAITHFUL_TILES
    return TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (4, 8), (4, 4))


def resident_programs(device: torch.device) -> int:
    """Programs surely resident at once for a grid barrier: one per SM (any count under the interpreter)."""
    if device.type != "cuda":
        return 1 << 30
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class TileKind:
    """One kind of tile in one launch: what it computes and how the launch covers it."""

    launch: int  # 1 or 2
    kind: str  # "dWd", "dA", "dWg", "dWu", "dx"
    computes: str
    M: int  # output rows
    N: int  # output columns
    reduce_name: str  # what the reduction runs over ("T", "H", "2I")
    reduce_length: int
    block_m: int
    block_n: int
    block_k: int
    split: int  # programs per tile, each one piece of the reduction
    first_program: int  # program id of this kind's first program in its launch

    @property
    def tiles(self) -> int:
        return cdiv(self.M, self.block_m) * cdiv(self.N, self.block_n)

    @property
    def programs(self) -> int:
        return self.tiles * self.split


def launch_plan(num_tokens: int, hidden_size: int, intermediate_size: int, config: TileConfig) -> list[TileKind]:
    """Every tile kind of both launches under ``config``, in program order (the kernels put the
    weight-gradient kinds, long reductions over T, first; launch 2's dx tiles first with ``grad_x_first``)."""
    T, H, I = num_tokens, hidden_size, intermediate_size
    grad_x = (2, "dx", "dx = dGate · Wg + dUp · Wu", T, H, "2I", 2 * I, config.grad_x)
    kinds = [  # (launch, kind, computes, M, N, reduction name, reduction length, config field)
        (1, "dWd", "dWd = dyᵀ · intermediate", H, I, "T", T, config.grad_down),
        (1, "dA", "dA = dy · Wd, epilogue dGate, dUp", T, I, "H", H, config.d_intermediate),
        *([grad_x] if config.grad_x_first else []),
        (2, "dWg", "dWg = dGateᵀ · x", I, H, "T", T, config.grad_gate_up),
        (2, "dWu", "dWu = dUpᵀ · x", I, H, "T", T, config.grad_gate_up),
        *([] if config.grad_x_first else [grad_x]),
    ]
    plan, first = [], {1: 0, 2: 0}
    for launch, kind, computes, m, n, reduce_name, reduce_length, (bm, bn, bk, split) in kinds:
        tile_kind = TileKind(launch, kind, computes, m, n, reduce_name, reduce_length, bm, bn, bk, split, first[launch])
        plan.append(tile_kind)
        first[launch] += tile_kind.programs
    return plan


def grid_sizes(plan: list[TileKind]) -> dict[int, int]:
    """Programs of each launch: {1: ..., 2: ...}."""
    return {launch: sum(k.programs for k in plan if k.launch == launch) for launch in (1, 2)}


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class SplitWorkspace:
    """fp32 partials (uninitialised, per call) and int32 arrival counters (zeroed once, kept) of one tile kind."""

    # (device, stream, tile kind, SPLIT) -> int32 counters; each call adds SPLIT to every counter of the
    # tiles it splits, so a counter is a multiple of its SPLIT whenever no call is running
    _counters: dict = {}

    @classmethod
    def make(cls, slot: str, num_tiles: int, kind: TileKind, device: torch.device):
        return cls.for_tiles(slot, num_tiles, kind.split, kind.block_m, kind.block_n, device)

    @classmethod
    def for_tiles(cls, slot: str, num_tiles: int, split: int, block_m: int, block_n: int, device: torch.device):
        """(partials, counters) of ``num_tiles`` tiles of [block_m, block_n], each split over ``split`` programs
        (one-element placeholders, which no kernel reads or writes, where nothing is split)."""
        if split == 1 or num_tiles == 0:
            return cls.placeholders(device)
        if split & (split - 1):
            raise ValueError(f"config: SPLIT must be a power of two, got {split}")
        partials = allocate((num_tiles * split * block_m * block_n,), dtype=torch.float32, device=device)
        return partials, cls.counters(slot, split, num_tiles, device)

    _placeholders: dict = {}  # str(device) -> (one fp32 element, the same as int32), kept

    @classmethod
    def placeholders(cls, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The workspace arguments of a tile kind that is not split: one element, allocated once per device (not
        every call: an unsplit kind's kernel arguments are never dereferenced)."""
        pair = cls._placeholders.get(str(device))
        if pair is None:
            empty = allocate((1,), dtype=torch.float32, device=device)
            pair = (empty, empty.view(torch.int32))
            if not capturing(device):  # memory of a graph's private pool must not outlive the graph
                cls._placeholders[str(device)] = pair
        return pair

    # (device, slot, split) -> zeroed int32 counters no launch has used yet, made by an eager call for the next CUDA
    # graph captured with that slot (a capture cannot zero memory outside the graph, and zeros made inside it are a
    # memset node that every replay runs first: 0.8-1.3 us of a 15-25 us call at 1-128 tokens on the H200)
    _spares: dict = {}
    _graph_owned: list = []  # the spares captures took: graphs keep no references, so they live as long as the process

    @classmethod
    def counters(cls, slot: str, split: int, size: int, device: torch.device) -> torch.Tensor:
        """int32 counters (at least ``size``) for the calls of one slot on the current stream: zeroed once, then
        kept, each call adding to them. A CUDA graph's capture takes a spare set an eager call made ready (the graph's
        own from then on, so that no launch outside it moves its counts), else zeros made inside the graph."""
        spare_key = (str(device), slot, split)
        if capturing(device):
            spare = cls._spares.pop(spare_key, None)
            if spare is not None and spare.numel() >= size:
                cls._graph_owned.append(spare)
                return spare
            return torch.zeros(max(size, 1024), dtype=torch.int32, device=device)  # in the graph's private pool
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (str(device), stream, slot, split)
        buffer = cls._counters.get(key)
        if buffer is None or buffer.numel() < size:
            buffer = cls._counters[key] = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
        spare = cls._spares.get(spare_key)
        if spare is None or spare.numel() < size:
            cls._spares[spare_key] = torch.zeros(max(size, 1024), dtype=torch.int32, device=device)
        return buffer


def dot_flags(x: torch.Tensor) -> tuple[bool, str]:
    """(UPCAST, PRECISION): fp32 dots under the interpreter (its bf16 dot is wrong); exact fp32 products
    for fp32 inputs."""
    return interpreter_enabled(), ("ieee" if x.dtype == torch.float32 else "tf32")


_PROGRAM_TRACES: list | None = None  # set inside traced_programs(): where the calls' program traces go


@contextlib.contextmanager
def traced_programs():
    """A diagnostic: inside it, the faithful path's Gluon launches run a build that records, per program, when it
    started, when it could go on (launch 2: past its wait for launch 1), when it ended (the GPU's global timer, ns), its
    SM and its tile kind (0: the weight-gradient tiles, 1: dA's or dx's). Yields a list; each call inside appends
    {"launch 1": tensor, "launch 2": tensor}, int64 [programs, len(TRACE_FIELDS)], filled as the launches run (on the
    device, so read them after a synchronisation). Calls of other designs append nothing.
    ``scripts/p1_program_trace.py`` reads them."""
    global _PROGRAM_TRACES
    if _PROGRAM_TRACES is not None:
        raise RuntimeError("traced_programs: already inside one")
    _PROGRAM_TRACES = []
    try:
        yield _PROGRAM_TRACES
    finally:
        _PROGRAM_TRACES = None


def swiglu_down_backward_triton(
    grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
    *, config=None, precision: str = "faithful",
):  # fmt: skip
    """P1 backward on Triton; inputs already validated (same float dtype and device, contiguous).

    Returns freshly allocated (grad_x, grad_gate_weight, grad_up_weight, grad_down_weight).
    ``config`` overrides the design chosen by :func:`choose_design` (a :class:`TileConfig`, a
    one-launch design's :class:`~.few_tokens.FewTokensConfig` or :class:`~.one_launch.OneLaunchConfig`, or
    the design on cuBLAS GEMMs, :class:`~.library_gemms.LibraryGemmsConfig`);
    ``precision`` is one of
    :data:`~.checks.PRECISIONS`.
    """
    T, H = x.shape
    I = gate_weight.shape[0]
    with_lo = carries_low_halves(x.dtype, precision)
    # TMA can address every operand (a descriptor needs T ≥ 1; our outputs and workspaces start aligned)
    tma = T > 0 and fits(H, I, x.element_size()) and aligned(grad_output, x, gate_weight, up_weight, down_weight, gate,
                                                              gate_sigmoid, gate_silu, up, intermediate)  # fmt: skip
    gluon = tma and gluon_runs_here(x)
    config = config or choose_design(T, H, I, interpreter=interpreter_enabled(), with_lo=with_lo,
                                     max_programs=resident_programs(x.device), element_bytes=x.element_size(),
                                     gluon=gluon)  # fmt: skip
    from .library_gemms import LibraryGemmsConfig  # it builds on this module's allocation

    if isinstance(config, LibraryGemmsConfig):  # it allocates its own outputs ([dWg; dWu] as one)
        return config.run(grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up,
                          intermediate, with_lo=with_lo)  # fmt: skip
    grad_x = allocate(x.shape, dtype=x.dtype, device=x.device)
    grad_gate_weight = allocate(gate_weight.shape, dtype=x.dtype, device=x.device)
    grad_up_weight = allocate(up_weight.shape, dtype=x.dtype, device=x.device)
    grad_down_weight = allocate(down_weight.shape, dtype=x.dtype, device=x.device)
    outputs = (grad_x, grad_gate_weight, grad_up_weight, grad_down_weight)
    if not isinstance(config, TileConfig):  # a one-launch design brings its own launcher
        return config.run(grad_output, x, gate_weight, up_weight, down_weight, gate, gate_sigmoid, gate_silu, up,
                          intermediate, *outputs, with_lo=with_lo)  # fmt: skip
    # dGate, dUp: [hi] or [hi, lo] halves of [T, I] each, in the input dtype
    d_gate = allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
    d_up = allocate((2 if with_lo else 1, T, I), dtype=x.dtype, device=x.device)
    plan = launch_plan(T, H, I, config)
    # everything both launches need is allocated before the first: the second follows it with no other host work
    workspaces = split_workspaces(plan, x.device)
    gluon_launch1, gluon_launch2 = config.gluon_first_launch, config.gluon_second_launch
    if (gluon_launch1 is not None or gluon_launch2 is not None) and not gluon:
        gluon_launch1 = gluon_launch2 = None  # the Triton launches instead
    traces = {}  # with traced_programs(): a row per program of each Gluon launch
    if _PROGRAM_TRACES is not None:
        for name, launch in (("launch 1", gluon_launch1), ("launch 2", gluon_launch2)):
            if launch is not None:
                traces[name] = torch.zeros((launch.programs(T, H, I), len(TRACE_FIELDS)), dtype=torch.int64,
                                           device=x.device)  # fmt: skip
        if traces:
            _PROGRAM_TRACES.append(traces)
    if gluon_launch2 is not None:  # made ready before launch 1: between the launches only the launch
        grad_x_workspace = SplitWorkspace.for_tiles("gluon dx", gluon_launch2.grad_x_tiles(T, H),
                                                    gluon_launch2.grad_x_splits, gluon_launch2.block_m,
                                                    gluon_launch2.block_n, x.device)  # fmt: skip
        launch_gluon_second_launch = prepare_second_launch_gluon(gluon_launch2, x, gate_weight, up_weight, d_gate,
                                                                 d_up, grad_x, grad_gate_weight, grad_up_weight,
                                                                 grad_x_workspace, with_lo=with_lo,
                                                                 grad_down_operands=(grad_output, intermediate,
                                                                                     grad_down_weight),
                                                                 trace=traces.get("launch 2"))  # fmt: skip
    if gluon_launch1 is not None:
        d_a_workspace = SplitWorkspace.for_tiles("gluon dA", gluon_launch1.d_a_tiles(T, I), gluon_launch1.d_a_splits,
                                                 gluon_launch1.block_m, gluon_launch1.block_n, x.device)  # fmt: skip
        launch_gluon_first_launch = prepare_first_launch_gluon(gluon_launch1, grad_output, down_weight, gate,
                                                               gate_sigmoid, gate_silu, up, intermediate, d_gate, d_up,
                                                               grad_down_weight, d_a_workspace, with_lo=with_lo,
                                                               trace=traces.get("launch 1"))  # fmt: skip
        if config.gluon_as_one_graph and gluon_launch2 is not None:
            both = (launch_gluon_first_launch, launch_gluon_second_launch)
            if can_launch_as_one_graph(both):
                launch_as_one_graph((x.device, x.dtype, with_lo, gluon_launch1, gluon_launch2, T, H, I, bool(traces)),
                                    both, x.device)  # fmt: skip
                return outputs
        launch_gluon_first_launch()
    elif config.tma_first_launch is not None and tma:
        launch_first_launch_tma(config.tma_first_launch, grad_output, down_weight, gate, gate_sigmoid, gate_silu,
                                up, intermediate, d_gate, d_up, grad_down_weight, with_lo=with_lo,
                                num_programs=resident_programs(x.device), dot_flags=dot_flags(x))  # fmt: skip
    else:
        launch_d_intermediate_and_grad_down(grad_output, down_weight, gate, gate_sigmoid, gate_silu, up,
                                            intermediate, d_gate, d_up, grad_down_weight, config, plan, with_lo,
                                            workspaces)  # fmt: skip
    if gluon_launch2 is not None:
        launch_gluon_second_launch()
    elif config.tma_second_launch is not None and tma:
        launch_second_launch_tma(config.tma_second_launch, x, gate_weight, up_weight, d_gate, d_up, grad_x,
                                 grad_gate_weight, grad_up_weight, with_lo=with_lo,
                                 num_programs=resident_programs(x.device), dot_flags=dot_flags(x))  # fmt: skip
    else:
        launch_grad_x_and_grad_gate_up(x, gate_weight, up_weight, d_gate, d_up, grad_x, grad_gate_weight,
                                       grad_up_weight, config, plan, with_lo, workspaces)  # fmt: skip
    return outputs


def gluon_runs_here(x: torch.Tensor) -> bool:
    """Whether :mod:`.gluon_launch1` and :mod:`.gluon_launch2` can run on ``x``'s device: a Hopper GPU (sm_90), not
    the interpreter, 16-bit."""
    return (x.is_cuda and not interpreter_enabled() and x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device)[0] == 9)  # fmt: skip


def split_workspaces(plan: list[TileKind], device: torch.device) -> dict:
    """The fp32 partials and arrival counters of every tile kind of both launches, by slot name."""
    kinds = {k.kind: k for k in plan}
    return {slot: SplitWorkspace.make(slot, tiles * kinds[kind].tiles, kinds[kind], device)
            for slot, kind, tiles in (("dA", "dA", 1), ("dWd", "dWd", 1), ("dx", "dx", 1), ("dWgu", "dWg", 2))}


def launch_d_intermediate_and_grad_down(grad_output, down_weight, gate, gate_sigmoid, gate_silu, up,
                                        intermediate, d_gate, d_up, grad_down_weight, config, plan,
                                        with_lo, workspaces):  # fmt: skip
    """Launch 1: dGate, dUp (through dA = dy · Wd; with ``with_lo`` as hi/lo pairs) and dWd."""
    T, H = grad_output.shape
    I = down_weight.shape[1]
    kernels.d_intermediate_and_grad_down_kernel[(grid_sizes(plan)[1],)](
        grad_output, down_weight, gate, gate_sigmoid, gate_silu, up, intermediate,
        d_gate, d_up, T * I, grad_down_weight, *workspaces["dA"], *workspaces["dWd"], T, H, I,
        *config.d_intermediate, *config.grad_down, config.group_m, *dot_flags(grad_output), with_lo,
        num_warps=config.warps[0], num_stages=config.stages[0],
    )  # fmt: skip


def launch_grad_x_and_grad_gate_up(x, gate_weight, up_weight, d_gate, d_up, grad_x, grad_gate_weight,
                                   grad_up_weight, config, plan, with_lo, workspaces):  # fmt: skip
    """Launch 2: dx, dWg and dWu from dGate and dUp (with ``with_lo``, both halves of each)."""
    T, H = x.shape
    I = gate_weight.shape[0]
    kernels.grad_x_and_grad_gate_up_kernel[(grid_sizes(plan)[2],)](
        x, gate_weight, up_weight, d_gate, d_up, T * I, grad_x, grad_gate_weight, grad_up_weight,
        *workspaces["dx"], *workspaces["dWgu"], T, H, I,
        *config.grad_x, *config.grad_gate_up, config.group_m, *dot_flags(x), with_lo, config.grad_x_first,
        num_warps=config.warps[1], num_stages=config.stages[1],
    )  # fmt: skip


ACTIVATION_BLOCK = 1024  # elements per program of the layer's elementwise step


def swiglu_activation(gate: torch.Tensor, up: torch.Tensor, *, with_saved: bool):
    """The layer's elementwise step in one launch (:func:`.kernels.swiglu_activation_kernel`): the
    intermediate silu(gate) ⊙ up, and with ``with_saved`` (σ(gate), silu(gate), intermediate), each
    rounded to the input dtype as the benchmark's forward rounds it. ``gate`` and ``up`` contiguous, of
    one shape, float dtype and device."""
    intermediate = allocate(gate.shape, dtype=gate.dtype, device=gate.device)
    if with_saved:
        saved = (allocate(gate.shape, dtype=gate.dtype, device=gate.device),
                 allocate(gate.shape, dtype=gate.dtype, device=gate.device))  # fmt: skip
    else:
        saved = (intermediate, intermediate)  # not written
    n = gate.numel()
    if n:
        kernels.swiglu_activation_kernel[(cdiv(n, ACTIVATION_BLOCK),)](
            gate, up, *saved, intermediate, n, with_saved, interpreter_enabled(), BLOCK=ACTIVATION_BLOCK,
            num_warps=4,
        )  # fmt: skip
    return (*saved, intermediate) if with_saved else intermediate
