"""What the tuning, profiling and checking scripts under ``scripts/`` share.

- :data:`P1_CANDIDATES`: named tile configurations of P1's Triton backward that ``p1_tune.py`` times,
  ``p1_compile_check.py`` compiles and ``p1_profile.py --config`` profiles.
- ``FIELD=VALUE`` overrides of a launch config (:func:`parse_field`, :func:`replace_fields`).
- Cases written ``dtype:num_tokens`` (``fp32:2048``, ``bf16:8192``): the problem of an op whose inputs
  have that dtype (:func:`parse_case`).
- The kernel benchmarks' frame: one candidate checked and timed (:func:`check_and_time`), the configs of
  ``--list`` (:func:`print_configs`), and the run over the cases that keeps what was measured
  (:func:`run_cases`).
"""

from __future__ import annotations

import dataclasses

from .. import problems
from ..swiglu_down.chained import ChainedConfig
from ..swiglu_down.gluon_launch1 import GluonFirstLaunchConfig
from ..swiglu_down.gluon_launch2 import GluonSecondLaunchConfig
from ..swiglu_down.launch import TileConfig, choose_config, grad_down_in_second_launch
from ..swiglu_down.library_gemms import LibraryGemmsConfig
from ..swiglu_down.one_launch import OneLaunchConfig
from ..swiglu_down.tma_launches import TmaFirstLaunchConfig, TmaSecondLaunchConfig
from .cli import DTYPE_ALIASES, problems_by_dtype

# the chained launch's tiles from 512 tokens (64×128 dA, 128×256 dWd, 128×128 dx, 128×256 dWg/dWu): what the
# chained candidates below vary
CHAIN_FA3 = TileConfig((64, 128, 64, 1), (128, 256, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1))
# name -> tiles (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT) of dA, dWd, dx, dWg/dWu; warps; stages
P1_CANDIDATES = {
    "tiny_s8": TileConfig((16, 64, 128, 8), (64, 128, 16, 1), (16, 64, 128, 8), (64, 128, 16, 1), (4, 4), (3, 3)),
    "tiny_s16": TileConfig((16, 32, 128, 16), (64, 128, 16, 1), (16, 128, 128, 16), (64, 128, 16, 1), (4, 4), (3, 3)),
    "tiny_s4": TileConfig((16, 64, 256, 4), (64, 64, 16, 1), (16, 128, 256, 4), (64, 64, 16, 1), (4, 4), (3, 3)),
    "tiny_s16b": TileConfig((16, 64, 64, 16), (32, 128, 16, 1), (16, 64, 64, 16), (32, 128, 16, 1), (4, 4), (2, 2)),
    "mid_s4": TileConfig((64, 64, 64, 4), (64, 128, 64, 1), (64, 128, 64, 4), (64, 128, 64, 1), (4, 4), (3, 3)),
    "mid_s2": TileConfig((64, 128, 64, 2), (128, 128, 64, 1), (64, 128, 64, 2), (128, 128, 64, 1), (4, 4), (3, 3)),
    "mid_s2w": TileConfig((64, 64, 64, 2), (64, 128, 64, 2), (64, 128, 64, 2), (64, 128, 64, 2), (4, 4), (3, 3)),
    "mid_s8": TileConfig((32, 64, 64, 8), (64, 128, 32, 1), (32, 128, 64, 8), (64, 128, 32, 1), (4, 4), (3, 3)),
    "mid_w4s4": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (64, 128, 64, 1), (64, 128, 64, 1), (4, 4), (4, 4)),
    "l_dwsplit": TileConfig((64, 128, 64, 1), (64, 128, 64, 2), (128, 256, 64, 1), (128, 256, 64, 2), (4, 8), (4, 4)),
    "wide2_w8s4": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (4, 8), (4, 4)),
    "widedw_w8s3": TileConfig((128, 128, 64, 1), (128, 256, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1),
                              (8, 8), (3, 3)),
    "l_mix": TileConfig((64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 4)),
    "l_128": TileConfig((128, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 4)),
    # for the faithful path (dGate, dUp as hi/lo pairs: a second A tile per step, and both halves stored)
    "f_w8s3": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3)),
    "f_dx128": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3)),
    "f_128s4": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 128, 64, 1), (8, 8), (4, 4)),
    "f_a64": TileConfig((64, 64, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (4, 8), (4, 3)),
    "f_mid": TileConfig((64, 64, 64, 2), (64, 128, 64, 1), (64, 128, 64, 2), (64, 128, 64, 1), (4, 4), (3, 3)),
    "f_mid_w8": TileConfig((64, 128, 64, 2), (64, 128, 64, 1), (64, 128, 64, 2), (64, 128, 64, 1), (8, 8), (3, 3)),
    "f_a4": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), (4, 8), (4, 3)),
    "f_a4_gu": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), (4, 8), (3, 3)),
    "f_gusplit": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 2), (8, 8), (4, 3)),
    # launch 2 as one persistent TMA-fed kernel (tma_launches.py), launch 1 as f_w8s3 has it. Compiled for
    # sm_90 (scripts/p1_compile_check.py): 128×128 tiles on 8 warps serialise their wgmma, on 4 warps they do not
    "tma_128": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3),
                          tma_second_launch=TmaSecondLaunchConfig((128, 128, 64), (128, 128, 64), 4, 3)),
    "tma_128s4": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3),
                            tma_second_launch=TmaSecondLaunchConfig((128, 128, 64), (128, 128, 64), 4, 4)),
    "tma_256": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3),
                          tma_second_launch=TmaSecondLaunchConfig((128, 256, 64), (128, 256, 64), 8, 3)),
    "tma_256dx": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3),
                            tma_second_launch=TmaSecondLaunchConfig((128, 256, 64), (128, 128, 64), 8, 3)),
    # both launches fed by TMA: launch 1's 128×128 dA tiles need 8 warps (on 4 they spill 1.3 KB; with the hi/lo
    # epilogue 96 B on 8), its 64×128 ones fit 4
    "tma12_a": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3),
                          tma_first_launch=TmaFirstLaunchConfig((128, 128, 64), (128, 128, 64), 8, 3),
                          tma_second_launch=TmaSecondLaunchConfig((128, 128, 64), (128, 128, 64), 4, 3)),
    "tma12_b": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3),
                          tma_first_launch=TmaFirstLaunchConfig((128, 128, 64), (128, 256, 64), 8, 3),
                          tma_second_launch=TmaSecondLaunchConfig((128, 256, 64), (128, 256, 64), 8, 3)),
    "tma12_c": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1), (8, 8), (4, 3),
                          tma_first_launch=TmaFirstLaunchConfig((64, 128, 64), (128, 128, 64), 4, 3),
                          tma_second_launch=TmaSecondLaunchConfig((128, 256, 64), (128, 128, 64), 8, 3)),
    "f_128s3": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 128, 64, 1), (8, 8), (4, 3)),
    "f_wide_a": TileConfig((128, 128, 64, 1), (128, 256, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1), (8, 8), (3, 3)),
    "f_gu128k": TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 128, 128, 1), (8, 8), (4, 2)),
    # the design on cuBLAS GEMMs (library_gemms.py): dA in fp32 or in the input dtype, one stream or two
    "lib": LibraryGemmsConfig(d_a_fp32=True, streams=False),
    "lib_s": LibraryGemmsConfig(d_a_fp32=True, streams=True),
    "lib_b": LibraryGemmsConfig(d_a_fp32=False, streams=False),
    "lib_bs": LibraryGemmsConfig(d_a_fp32=False, streams=True),
    # dx as two GEMMs, the second accumulating onto the first, instead of stacking [Wg; Wu] per call
    "lib_s2": LibraryGemmsConfig(d_a_fp32=True, streams=True, dx_in_two=True),
    "lib_bs2": LibraryGemmsConfig(d_a_fp32=False, streams=True, dx_in_two=True),
    # [Wg; Wu] stacked on the second stream beside dA and the dSwiGLU pass
    "lib_s3": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True),
    "lib_bs3": LibraryGemmsConfig(d_a_fp32=False, streams=True, stack_aside=True),
    # the dSwiGLU pass in smaller blocks (more programs at few tokens) or larger ones
    "lib_s3_g8": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True, grads_block=(8, 128)),
    "lib_s3_g32": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True, grads_block=(32, 128),
                                     grads_warps=8),
    "lib_bs3_g8": LibraryGemmsConfig(d_a_fp32=False, streams=True, stack_aside=True, grads_block=(8, 128)),
    "lib_bs3_g32": LibraryGemmsConfig(d_a_fp32=False, streams=True, stack_aside=True, grads_block=(32, 128),
                                      grads_warps=8),
    # the dSwiGLU pass by runs of consecutive elements (grads_flat_block), beside each default of the design
    **{f"{name}_fl{block}{'' if warps == 4 else f'w{warps}'}": LibraryGemmsConfig(
        d_a_fp32=name == "lib_s3", streams=True, stack_aside=name != "lib_bs", grads_flat_block=block,
        grads_warps=warps)
       for name in ("lib_s3", "lib_bs", "lib_bs3") for block, warps in ((512, 4), (1024, 4), (2048, 8))},
    # [Wg; Wu] stacked by two device-to-device memcpys instead of a copy kernel, beside each default of the design
    "lib_s3_mc": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True, stack_by_memcpy=True),
    "lib_bs_mc": LibraryGemmsConfig(d_a_fp32=False, streams=True, stack_by_memcpy=True),
    "lib_bs3_mc": LibraryGemmsConfig(d_a_fp32=False, streams=True, stack_aside=True, stack_by_memcpy=True),
    "lib_s3_mc_fl512": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True, stack_by_memcpy=True,
                                          grads_flat_block=512),
    "lib_bs3_mc_fl2048w8": LibraryGemmsConfig(d_a_fp32=False, streams=True, stack_aside=True, stack_by_memcpy=True,
                                              grads_flat_block=2048, grads_warps=8),
    # dx by Triton's split-K tiles reading Wg and Wu where they lie: no copy of [Wg; Wu]
    "lib_s_gx": LibraryGemmsConfig(d_a_fp32=True, streams=True, grad_x_tile=(64, 64, 64, 4)),
    "lib_s_gx8": LibraryGemmsConfig(d_a_fp32=True, streams=True, grad_x_tile=(64, 64, 64, 8)),
    "lib_s_gx128": LibraryGemmsConfig(d_a_fp32=True, streams=True, grad_x_tile=(128, 64, 64, 4), grad_x_warps=8),
    "lib_s_gx2": LibraryGemmsConfig(d_a_fp32=True, streams=True, grad_x_tile=(64, 128, 64, 2), grad_x_warps=8),
    # dA and the dSwiGLU pass as one Triton launch (d_a_tile: dA's split-K tiles with the pass as their epilogue)
    "lib_s3_da": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True, d_a_tile=(64, 64, 64, 4)),
    "lib_s3_da2": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True, d_a_tile=(64, 64, 64, 2)),
    "lib_s3_da8": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True, d_a_tile=(64, 64, 64, 8)),
    "lib_bs_da": LibraryGemmsConfig(d_a_fp32=False, streams=True, d_a_tile=(64, 128, 64, 1), d_a_warps=8,
                                    d_a_stages=4),
    "lib_bs_da2": LibraryGemmsConfig(d_a_fp32=False, streams=True, d_a_tile=(64, 64, 64, 2)),
    # ... and dWd's tiles in that launch too, instead of cuBLAS's dWd on the second stream
    "lib_s3_da_dwd": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True, d_a_tile=(64, 64, 64, 4),
                                        grad_down_tile=(64, 128, 64, 1)),
    "lib_s3_da8_dwd": LibraryGemmsConfig(d_a_fp32=True, streams=True, stack_aside=True, d_a_tile=(64, 64, 64, 8),
                                         grad_down_tile=(64, 128, 64, 1)),
    # the faithful path from 1600 tokens: launch 1's tiles as they are (dA with the dSwiGLU epilogue, hi/lo halves
    # in [T, 4I] rows, beside dWd; compiled for sm_90 at 8 warps, 4 stages: 169 registers, 96 KB, no stack), then
    # cuBLAS for dx and [dWg; dWu] (one stream: its host work shows in NVIDIA's method)
    "lib_f_rows": LibraryGemmsConfig(d_a_fp32=True, d_a_tile=(64, 128, 64, 1), d_a_warps=8, d_a_stages=4,
                                     grad_down_tile=(64, 128, 64, 1)),
    # the one-launch path: (block_t, block_i, block_h_down, block_h, block_k, block_n, warps, stages)
    "one_t16": OneLaunchConfig(16, 16, 32, 16, 128, 128, 4, 3),
    "one_t32": OneLaunchConfig(32, 16, 32, 16, 128, 128, 4, 3),
    "one_t64": OneLaunchConfig(64, 16, 32, 16, 128, 128, 4, 3),
    "one_t128": OneLaunchConfig(128, 16, 32, 16, 64, 128, 4, 3),
    "one_t64_h32": OneLaunchConfig(64, 16, 32, 32, 128, 128, 4, 3),
    "one_t16_k256": OneLaunchConfig(16, 16, 32, 16, 256, 256, 4, 2),
    "one_t16_w8": OneLaunchConfig(16, 16, 32, 16, 128, 128, 8, 3),
    "one_t64_n64": OneLaunchConfig(64, 16, 32, 16, 64, 64, 4, 4),
    "one_k512": OneLaunchConfig(16, 16, 32, 16, 512, 128, 4, 3),
    "one_k256_s4": OneLaunchConfig(16, 16, 32, 16, 256, 128, 4, 4),
    "one_i32_k256": OneLaunchConfig(16, 32, 32, 16, 256, 128, 4, 3),
    "one_h32_k256": OneLaunchConfig(16, 16, 32, 32, 256, 128, 4, 3),
    "one_k512_w8": OneLaunchConfig(16, 16, 32, 16, 512, 128, 8, 3),
    "one_t64_k256": OneLaunchConfig(64, 16, 32, 16, 256, 128, 4, 3),
    # the faithful path's default from 17 to 128 tokens as a cooperative launch (CUDA guarantees residency)
    "one_t64_k256_coop": OneLaunchConfig(64, 16, 32, 16, 256, 128, 4, 3, cooperative=True),
    # the two launches chained into one by tickets (chained.py): (tiles, warps, stages). The tiles of the
    # defaults up to 256 tokens, of the faithful path above, and of the fast path above
    "chain_mid": ChainedConfig(TileConfig((64, 64, 64, 4), (64, 128, 64, 1), (64, 128, 64, 4), (64, 128, 64, 1)), 4, 3),
    "chain_mid8": ChainedConfig(TileConfig((64, 64, 64, 4), (64, 128, 64, 1), (64, 128, 64, 4), (64, 128, 64, 1)), 8,
                                3),
    "chain_f": ChainedConfig(TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)),
                             8, 3),
    "chain_f4": ChainedConfig(TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)),
                              8, 4),
    # the dWd tiles first (as in launch 1), 2 stages, and the ≤ 256-token tiles with the dWd tiles first
    "chain_f_dwd": ChainedConfig(TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)),
                                 8, 3, grad_down_first=True),
    "chain_f_s2": ChainedConfig(TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)),
                                8, 2),
    "chain_mid8_dwd": ChainedConfig(TileConfig((64, 64, 64, 4), (64, 128, 64, 1), (64, 128, 64, 4), (64, 128, 64, 1)),
                                    8, 3, grad_down_first=True),
    # launch 1's tiles as wide as launch 2's (the launch holds one program per SM for launch 2's tiles anyway)
    "chain_fa": ChainedConfig(TileConfig((128, 64, 64, 1), (128, 128, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)),
                              8, 3),
    "chain_fa2": ChainedConfig(TileConfig((128, 64, 64, 1), (128, 256, 64, 1), (128, 128, 64, 1), (128, 256, 64, 1)),
                               8, 3),
    "chain_fa3": ChainedConfig(CHAIN_FA3, 8, 3),
    # launch 2's dx tiles first (the longest tiles of a few waves first), with 128×128 dWg, dWu tiles or their
    # reduction split in two (more, shorter tiles: a shorter tail)
    "chain_fa3_dxf": ChainedConfig(dataclasses.replace(CHAIN_FA3, grad_x_first=True), 8, 3),
    "chain_fa3_gu128": ChainedConfig(dataclasses.replace(CHAIN_FA3, grad_gate_up=(128, 128, 64, 1)), 8, 3),
    "chain_fa3_gu128_dxf": ChainedConfig(dataclasses.replace(CHAIN_FA3, grad_gate_up=(128, 128, 64, 1),
                                                             grad_x_first=True), 8, 3),  # fmt: skip
    "chain_fa3_gus2_dxf": ChainedConfig(dataclasses.replace(CHAIN_FA3, grad_gate_up=(128, 256, 64, 2),
                                                            grad_x_first=True), 8, 3),  # fmt: skip
    # dx's reduction split in two (dGate · Wg and dUp · Wu as two programs, summed by the later one): more, shorter
    # tiles for the launch's last wave, the dWg, dWu tiles first or after them
    "chain_fa3_dx2": ChainedConfig(dataclasses.replace(CHAIN_FA3, grad_x=(128, 128, 64, 2)), 8, 3),
    "chain_fa3_dx2_dxf": ChainedConfig(dataclasses.replace(CHAIN_FA3, grad_x=(128, 128, 64, 2), grad_x_first=True),
                                       8, 3),  # fmt: skip
    # the dWd tiles' tickets last, after launch 2's (they depend on nothing: filler for launch 2's last wave)
    "chain_fa3_dxf_dwdl": ChainedConfig(dataclasses.replace(CHAIN_FA3, grad_x_first=True), 8, 3, grad_down_last=True),
    "chain_fa3_dwdl": ChainedConfig(CHAIN_FA3, 8, 3, grad_down_last=True),
    # the dWd tiles' tickets first and launch 2's dWg, dWu tiles before its dx tiles, beyond 1600 tokens where the
    # faithful path runs two launches (one launch has no host gap in NVIDIA's method)
    "chain_fa3_dwdf": ChainedConfig(CHAIN_FA3, 8, 3, grad_down_first=True),
    "chain_wide": ChainedConfig(TileConfig((64, 128, 64, 1), (64, 128, 64, 1), (128, 256, 64, 1), (128, 256, 64, 1)),
                                8, 4),
}


def one_tile_per_program(config: TileConfig) -> TileConfig:
    """``config`` with its TMA-fed launches run as one program per tile instead of a persistent grid (each program's
    pipeline fills once, as in the pointer-based launches; what is left is TMA against pointer loads)."""
    first, second = config.tma_first_launch, config.tma_second_launch
    return dataclasses.replace(
        config, tma_first_launch=None if first is None else dataclasses.replace(first, persistent=False),
        tma_second_launch=None if second is None else dataclasses.replace(second, persistent=False))  # fmt: skip


# the TMA-fed candidates with one program per tile (``_np``)
P1_CANDIDATES.update({f"{name}_np": one_tile_per_program(P1_CANDIDATES[name])
                      for name in ("tma_256", "tma_256dx", "tma12_b")})  # fmt: skip

# launch 2 in Gluon (gluon_launch2.py: one TMA-loading warp, two warpgroups issuing wgmma, its wgmma unserialised by
# ptxas), launch 1 as f_w8s3 has it; compiled for sm_90: 168 registers, 192 KB (faithful), no stack
P1_CANDIDATES["gluon2"] = dataclasses.replace(P1_CANDIDATES["f_w8s3"], gluon_second_launch=GluonSecondLaunchConfig())
# both launches in Gluon (gluon_launch1.py: dWd's tiles and dA's with the dSwiGLU epilogue, 128 × 128 × 64 tiles)
P1_CANDIDATES["gluon12"] = dataclasses.replace(P1_CANDIDATES["gluon2"], gluon_first_launch=GluonFirstLaunchConfig())
# launch 2's dWg, dWu tiles 128 wide (192 of them at H = 2048, I = 768, more than the SMs) beside 128 × 256 dx tiles
P1_CANDIDATES["gluon2_w128"] = dataclasses.replace(P1_CANDIDATES["f_w8s3"],
                                                   gluon_second_launch=GluonSecondLaunchConfig(weight_block_n=128))
P1_CANDIDATES["gluon12_w128"] = dataclasses.replace(P1_CANDIDATES["gluon2_w128"],
                                                    gluon_first_launch=GluonFirstLaunchConfig())
# launch 1's dWd tiles 64 wide (192 of them) beside 128 × 128 dA tiles
P1_CANDIDATES["gluon12_d64"] = dataclasses.replace(P1_CANDIDATES["gluon2"],
                                                   gluon_first_launch=GluonFirstLaunchConfig(grad_down_block_n=64))
# launch 1's ring 5 or 6 buffers deep (192 or 224 KB with the output tile)
P1_CANDIDATES["gluon12_b5"] = dataclasses.replace(P1_CANDIDATES["gluon2"],
                                                  gluon_first_launch=GluonFirstLaunchConfig(buffers=5))
P1_CANDIDATES["gluon12_b6"] = dataclasses.replace(P1_CANDIDATES["gluon2"],
                                                  gluon_first_launch=GluonFirstLaunchConfig(buffers=6))
# launch 1's ring as deep in bytes with 32-deep K steps: 12 buffers of 16 KB (224 KB with the output tile)
P1_CANDIDATES["gluon12_k32b12"] = dataclasses.replace(
    P1_CANDIDATES["gluon2"], gluon_first_launch=GluonFirstLaunchConfig(block_k=32, buffers=12))
# gluon12_b6 (the faithful default at 2300-3299 tokens and from 4600) with launch 2's ring 5 buffers deep too (224 KB)
P1_CANDIDATES["gluon12_b6_l2b5"] = dataclasses.replace(P1_CANDIDATES["gluon12_b6"],
                                                       gluon_second_launch=GluonSecondLaunchConfig(buffers=5))
# launch 2's tiles 64 rows tall (one warpgroup): twice as many dx and weight-gradient tiles, for the band where its
# 128-row tiles come in one wave and a bit (1087 tokens: 72 dx and 96 weight tiles on 132 SMs)
P1_CANDIDATES["gluon12_b6_l2m64"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_b6"], gluon_second_launch=GluonSecondLaunchConfig(block_m=64, warps=4))
P1_CANDIDATES["gluon12_b6_l2m64b6"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_b6"], gluon_second_launch=GluonSecondLaunchConfig(block_m=64, warps=4, buffers=6))
# both launches' tiles 64 rows tall (launch 1: dA tiles of [64 of T, 128 of I], dWd tiles of [64 of H, 128 of I])
P1_CANDIDATES["gluon12_m64"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_b6_l2m64b6"], gluon_first_launch=GluonFirstLaunchConfig(block_m=64, warps=4, buffers=6))
# gluon12_m64 with deeper rings (64-row tiles: 24 KB a buffer in either launch) or launch 1's dA tiles 256 wide
P1_CANDIDATES["gluon12_m64_l1b8"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_m64"], gluon_first_launch=GluonFirstLaunchConfig(block_m=64, warps=4, buffers=8))
P1_CANDIDATES["gluon12_m64_l2b8"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_m64"], gluon_second_launch=GluonSecondLaunchConfig(block_m=64, warps=4, buffers=8))
# gluon12_m64_l1b8 with launch 1's ring in 32-deep K steps (16 buffers of 12 KB), or launch 2's in 64-deep ones (4 of
# 48 KB)
P1_CANDIDATES["gluon12_m64_k32b16"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_m64"], gluon_first_launch=GluonFirstLaunchConfig(block_m=64, block_k=32, warps=4,
                                                                          buffers=16))
P1_CANDIDATES["gluon12_m64_l1b8_l2k64"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_m64_l1b8"], gluon_second_launch=GluonSecondLaunchConfig(block_m=64, block_k=64, warps=4,
                                                                                   buffers=4))
# gluon12_m64_l1b8 with the long tiles first: launch 2's dx tiles (K = 2I) and/or launch 1's dA tiles (K = H) take
# the first program ids, ahead of the weight-gradient tiles (K = T)
_M64_L1B8 = P1_CANDIDATES["gluon12_m64_l1b8"]
P1_CANDIDATES["gluon12_m64_dxf"] = dataclasses.replace(
    _M64_L1B8, gluon_second_launch=dataclasses.replace(_M64_L1B8.gluon_second_launch, grad_x_first=True))
P1_CANDIDATES["gluon12_m64_daf"] = dataclasses.replace(
    _M64_L1B8, gluon_first_launch=dataclasses.replace(_M64_L1B8.gluon_first_launch, d_a_first=True))
P1_CANDIDATES["gluon12_m64_lf"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_m64_dxf"], gluon_first_launch=P1_CANDIDATES["gluon12_m64_daf"].gluon_first_launch)
P1_CANDIDATES["gluon12_l2m64_daf"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_b6_l2m64b6"], gluon_first_launch=GluonFirstLaunchConfig(buffers=6, d_a_first=True))
# the 1150-2299 band's form (gluon12_l2m64_daf) with launch 2's dx tiles first too: the order model
# (lab.kernels.gluon_launch_schedule) puts launch 2 5% shorter at 1321 tokens, no shorter at 1571
P1_CANDIDATES["gluon12_l2m64_lf"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_l2m64_daf"], gluon_second_launch=GluonSecondLaunchConfig(block_m=64, warps=4, buffers=6,
                                                                                    grad_x_first=True))
P1_CANDIDATES["gluon12_b6_daf"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_b6"], gluon_first_launch=GluonFirstLaunchConfig(buffers=6, d_a_first=True))
# gluon12_m64 with launch 2's ring 3 buffers deep (104 KB: two programs to an SM; launch 1's ring holds four saved
# tiles, so it cannot be as short)
P1_CANDIDATES["gluon12_m64_l2b3"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_m64"], gluon_second_launch=GluonSecondLaunchConfig(block_m=64, warps=4, buffers=3))
P1_CANDIDATES["gluon12_m64_a256"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_m64"], gluon_first_launch=GluonFirstLaunchConfig(block_m=64, warps=4, buffers=5,
                                                                          d_a_block_n=256))
# launch 1's dA tiles 256 wide (two 128 × 128 accumulators over one dy tile per K step: 43 products per byte brought
# in against 32), their epilogues one after the other; the ring 4 × 48 KB, 224 KB in all
P1_CANDIDATES["gluon12_a256"] = dataclasses.replace(P1_CANDIDATES["gluon2"],
                                                    gluon_first_launch=GluonFirstLaunchConfig(d_a_block_n=256))

# the default forms with launch 2 issued by programmatic dependent launch (``_pdl``: from launch 1's last wave on,
# launch 1 letting it start as each of its programs starts; ``_pdl_end``: once launch 1's programs have all ended)
def programmatic(config: TileConfig, *, early: bool) -> TileConfig:
    """``config``'s Gluon launch 2 issued by programmatic dependent launch, launch 1 letting it start early or not."""
    return dataclasses.replace(
        config, gluon_first_launch=dataclasses.replace(config.gluon_first_launch, early_dependents=early),
        gluon_second_launch=dataclasses.replace(config.gluon_second_launch, programmatic=True))  # fmt: skip


P1_CANDIDATES.update({f"{name}_pdl": programmatic(P1_CANDIDATES[name], early=True)
                      for name in ("gluon12_m64_lf", "gluon12_l2m64_daf", "gluon12_l2m64_lf", "gluon12_b6",
                                   "gluon12_b6_l2m64b6")})  # fmt: skip
P1_CANDIDATES["gluon12_m64_lf_pdl_end"] = programmatic(P1_CANDIDATES["gluon12_m64_lf"], early=False)

# launch 1 at 64 rows with a 4-deep ring (112 KB: two programs an SM, one's epilogue beside the other's products),
# with the default's launch 2 of each band, issued by programmatic dependent launch
_LAUNCH1_TWO_AN_SM = GluonFirstLaunchConfig(block_m=64, warps=4, buffers=4, early_dependents=True)
for _name, _base in (("gluon12_b6_l1m64b4", "gluon12_b6_pdl"), ("gluon12_m64_lf_l1b4", "gluon12_m64_lf_pdl"),
                     ("gluon12_l2m64_lf_l1m64b4", "gluon12_l2m64_lf_pdl"),
                     ("gluon12_b6_l2m64b6_l1m64b4", "gluon12_b6_l2m64b6_pdl")):
    _first = dataclasses.replace(_LAUNCH1_TWO_AN_SM, d_a_first=P1_CANDIDATES[_base].gluon_first_launch.d_a_first)
    P1_CANDIDATES[_name] = dataclasses.replace(P1_CANDIDATES[_base], gluon_first_launch=_first)
P1_CANDIDATES["gluon12_b6_l1m64b4_daf"] = dataclasses.replace(
    P1_CANDIDATES["gluon12_b6_pdl"], gluon_first_launch=dataclasses.replace(_LAUNCH1_TWO_AN_SM, d_a_first=True))

# each band's default (launch 2 by PDL) with launch 1's dSwiGLU epilogue storing its four output halves at once, each
# through a saved tile's buffer (``stores_in_flight``), instead of one after the other through one output buffer
for _base in ("gluon12_m64_lf_pdl", "gluon12_l2m64_lf_pdl", "gluon12_l2m64_daf_pdl", "gluon12_b6_pdl",
              "gluon12_b6_l2m64b6_pdl"):
    P1_CANDIDATES[f"{_base}_sif"] = dataclasses.replace(P1_CANDIDATES[_base], gluon_first_launch=dataclasses.replace(
        P1_CANDIDATES[_base].gluon_first_launch, stores_in_flight=True))
P1_CANDIDATES["gluon12_a256_sif"] = dataclasses.replace(P1_CANDIDATES["gluon12_a256"], gluon_first_launch=(
    dataclasses.replace(P1_CANDIDATES["gluon12_a256"].gluon_first_launch, stores_in_flight=True)))

# the day's default forms at 129-1099 and 1100-1399 tokens with both launches submitted as one CUDA graph in eager calls
for _base in ("gluon12_m64_lf_pdl_sif", "gluon12_l2m64_lf_pdl_sif"):
    P1_CANDIDATES[f"{_base}_graph"] = dataclasses.replace(P1_CANDIDATES[_base], gluon_as_one_graph=True)

# the 65-1099 token band's default (gluon12_m64_lf_pdl_sif_graph) with dA's reduction over H and/or dx's over 2I split
# over 2, 4 or 8 programs a tile (``d_a_splits``, ``grad_x_splits``), each tile's sum in split order by the program
# that arrives last: there the few dA and dx tiles each stream their whole reduction's operands through one SM
_M64_DEFAULT = P1_CANDIDATES["gluon12_m64_lf_pdl_sif_graph"]
for _d_a, _d_x in ((2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 2), (4, 4), (8, 4)):
    P1_CANDIDATES[f"gluon12_m64_da{_d_a}_dx{_d_x}"] = dataclasses.replace(
        _M64_DEFAULT, gluon_first_launch=dataclasses.replace(_M64_DEFAULT.gluon_first_launch, d_a_splits=_d_a),
        gluon_second_launch=dataclasses.replace(_M64_DEFAULT.gluon_second_launch, grad_x_splits=_d_x))  # fmt: skip

# the same splits on 128-row tiles in both launches (1 CTA an SM either way): at 65-256 tokens 96 dWd tiles and 6 dA
# tiles' splits in launch 1, 96 weight-gradient tiles and 8 dx tiles' splits in launch 2, each launch one wave (dA's
# splits were measured so; since their sum is staged in the ring, launch 1's 128-row ring is too small for it)
_M128 = dataclasses.replace(_M64_DEFAULT, gluon_first_launch=GluonFirstLaunchConfig(
    buffers=6, d_a_first=True, early_dependents=True, stores_in_flight=True),
    gluon_second_launch=GluonSecondLaunchConfig(grad_x_first=True, programmatic=True))  # fmt: skip
for _d_a, _d_x in ((1, 1), (1, 2), (1, 4)):
    P1_CANDIDATES[f"gluon12_m128_da{_d_a}_dx{_d_x}"] = dataclasses.replace(
        _M128, gluon_first_launch=dataclasses.replace(_M128.gluon_first_launch, d_a_splits=_d_a),
        gluon_second_launch=dataclasses.replace(_M128.gluon_second_launch, grad_x_splits=_d_x))  # fmt: skip

# each band's default form (launch.GLUON_FORMS, submitted as one graph) with launch 1's saved tiles asked for by the
# loading warp as the main loop frees their buffers (``saved_tiles_early``)
for _base in ("gluon12_l2m64_daf_pdl_sif", "gluon12_b6_pdl_sif", "gluon12_b6_l2m64b6_pdl_sif"):
    P1_CANDIDATES[f"{_base}_graph"] = dataclasses.replace(P1_CANDIDATES[_base], gluon_as_one_graph=True)
for _base in ("gluon12_m64_lf_pdl_sif_graph", "gluon12_l2m64_lf_pdl_sif_graph", "gluon12_l2m64_daf_pdl_sif_graph",
              "gluon12_b6_pdl_sif_graph", "gluon12_b6_l2m64b6_pdl_sif_graph"):
    P1_CANDIDATES[f"{_base}_early"] = dataclasses.replace(P1_CANDIDATES[_base], gluon_first_launch=dataclasses.replace(
        P1_CANDIDATES[_base].gluon_first_launch, saved_tiles_early=True))

def with_first_launch(config: TileConfig, **fields) -> TileConfig:
    """``config`` with these fields of its Gluon launch 1 changed."""
    return dataclasses.replace(config, gluon_first_launch=dataclasses.replace(config.gluon_first_launch, **fields))


def with_second_launch(config: TileConfig, **fields) -> TileConfig:
    """``config`` with these fields of its Gluon launch 2 changed."""
    return dataclasses.replace(config, gluon_second_launch=dataclasses.replace(config.gluon_second_launch, **fields))


def with_grad_down_in_second_launch(config: TileConfig) -> TileConfig:
    """``config`` with dWd's tiles moved from its Gluon launch 1 to its launch 2 (``grad_down_in_second_launch``)."""
    launch1, launch2 = grad_down_in_second_launch((config.gluon_first_launch, config.gluon_second_launch))
    return dataclasses.replace(config, gluon_first_launch=launch1, gluon_second_launch=launch2)


# the 65-1099 token band's default (early saved tiles) with dx's reduction over 2I split over 2, 4 or 8 programs a tile,
# the last to arrive summing the partials row block by row block in 16-byte loads: at 65-256 tokens the 16 dx tiles
# each run the whole K = 2I (hi and lo) on one SM and end the call ~9 us after launch 2's other tiles
_M64_EARLY = P1_CANDIDATES["gluon12_m64_lf_pdl_sif_graph_early"]
for _d_x in (2, 4, 8):
    P1_CANDIDATES[f"gluon12_m64_early_dx{_d_x}"] = with_second_launch(_M64_EARLY, grad_x_splits=_d_x)

# at 257-1099 tokens launch 2 is two waves of unequal tiles (at 512: 64 dx tiles end at 30.5 µs, the 192
# weight-gradient tiles behind them at 35.5): dx split in 2 behind the weight-gradient tiles (``_wfirst``: the short
# splits fill the second wave), and/or the weight-gradient tiles 128 wide (``_w128``: 96 of each kind, each twice as
# many K steps per byte of output)
for _name, _fields in (("dx2_wfirst", dict(grad_x_splits=2, grad_x_first=False)), ("w128", dict(weight_block_n=128)),
                       ("dx2_w128", dict(grad_x_splits=2, weight_block_n=128)),
                       ("dx2_wfirst_w128", dict(grad_x_splits=2, grad_x_first=False, weight_block_n=128))):
    P1_CANDIDATES[f"gluon12_m64_early_{_name}"] = with_second_launch(_M64_EARLY, **_fields)

# the 65-1099 band's forms with the weight-gradient tiles taken in turn by the programs the grid has beside dx's
# (``weight_grad_programs``: at 65-512 tokens 40-64 dx programs and 192 weight-gradient tiles, each ~3 µs of fixed
# cost beside 1-4.5 µs of products; 68 programs fill the 132 SMs with dx's 64, 34 take six tiles each)
for _d_x in (1, 2, 4):
    for _programs in (34, 52, 68):
        P1_CANDIDATES[f"gluon12_m64_early_dx{_d_x}_wp{_programs}"] = with_second_launch(
            _M64_EARLY, grad_x_splits=_d_x, weight_grad_programs=_programs)
# the same with the weight-gradient tiles 128 wide (twice as many, half as long: finer pieces to fill the SMs around
# dx's tiles, their fixed cost paid once a program)
P1_CANDIDATES["gluon12_m64_early_dx1_w128_wp68"] = with_second_launch(_M64_EARLY, weight_block_n=128,
                                                                      weight_grad_programs=68)  # fmt: skip

# the 65-1099 band's form with launch 1's K steps twice as deep (128, 4 buffers: the same ring bytes): at 65-256
# tokens each dA tile streams its 768 KB of operands through one SM at about the SM's share of the L2, in 32 steps
# of 24 KB; 16 of 48 KB halve the copies issued and waited on
P1_CANDIDATES["gluon12_m64_early_l1k128b4"] = with_first_launch(_M64_EARLY, block_k=128, buffers=4)

# each band's form with launch 2's loading warps sending their first K steps' tiles of the call's inputs (x, Wg, Wu)
# before the wait for launch 1 (``inputs_before_wait``): at 65-512 tokens launch 2's programs wait 3-6 µs for launch 1
# (program traces), then start every K step's loads from nothing
for _name in ("gluon12_m64_early_dx4_wp68", "gluon12_m64_early_dx2_wp68", "gluon12_m64_early_dx1_wp68",
              "gluon12_m64_lf_pdl_sif_graph_early", "gluon12_l2m64_daf_pdl_sif_graph_early",
              "gluon12_l2m64_lf_pdl_sif_graph_early", "gluon12_b6_pdl_sif_graph_early",
              "gluon12_b6_l2m64b6_pdl_sif_graph_early"):
    P1_CANDIDATES[f"{_name}_ibw"] = with_second_launch(P1_CANDIDATES[_name], inputs_before_wait=True)
# the fast path's launch 2 (no lo halves: 24 KB a K step at 128 x 256 x 32) on a ring of 6 instead of 4, and the
# 64-row form's on 9 instead of 6
P1_CANDIDATES["gluon12_b6_l2b6_fast"] = with_second_launch(P1_CANDIDATES["gluon12_b6_pdl_sif_graph_early"], buffers=6)
P1_CANDIDATES["gluon12_b6_l2m64b9_fast"] = with_second_launch(P1_CANDIDATES["gluon12_b6_l2m64b6_pdl_sif_graph_early"],
                                                              buffers=9)  # fmt: skip
# the 2300-3299 band's form (gluon12_b6_pdl_sif_graph_early; on the fast path with dx unsplit) where at 2767 tokens
# it trails torch.compile: launch 1's dA tiles first (`_daf`: at 2767 tokens its 132 dA tiles are one wave, the 96 dWd
# tiles after them), launch 2's weight-gradient tiles 128 wide (`_w128`: the order model, lab.kernels.
# gluon_launch_schedule, puts launch 2 3% shorter at 2767 tokens, 192 tiles of K = T beside dx's 176)
_BAND_2300 = P1_CANDIDATES["gluon12_b6_pdl_sif_graph_early"]
P1_CANDIDATES["gluon_band2300_daf"] = with_first_launch(_BAND_2300, d_a_first=True)
P1_CANDIDATES["gluon_band2300_w128"] = with_second_launch(_BAND_2300, weight_block_n=128)
P1_CANDIDATES["gluon_band2300_daf_w128"] = with_second_launch(P1_CANDIDATES["gluon_band2300_daf"], weight_block_n=128)
# the forms to 512 tokens with launch 1's K steps half as deep on twice the buffers (32 x 16 and 32 x 12: more, smaller
# copies in flight; gluon12_m64_k32b16 measured the same on the forms before, 3-5% slower): at 128 tokens each dA
# tile's 768 KB streams through one SM, and 4 copies of 48 KB in flight were 4 µs slower than 8 of 24 KB
# (gluon12_m64_early_l1k128b4)
for _name in ("gluon12_m64_early_dx4_wp68_ibw", "gluon12_m64_early_dx2_wp68_ibw", "gluon12_m64_early_dx1_wp68_ibw"):
    for _buffers in (12, 16):
        P1_CANDIDATES[f"{_name}_l1k32b{_buffers}"] = with_first_launch(P1_CANDIDATES[_name], block_k=32,
                                                                       buffers=_buffers)  # fmt: skip

# the forms to 512 tokens with launch 1's dA tiles 64 wide instead of 128 (`_n64`): at 65-256 tokens launch 2 waits for
# launch 1's 12-24 dA tiles, each streaming 768 KB (dy's 64 rows over H, 256 KB, and Wd's 128 columns, 512 KB) through
# one SM; 64 wide, twice as many tiles stream 512 KB each. The dWd tiles stay 128 wide (`grad_down_block_n` twice
# block_n: the ring's B buffers twice as many), or go 64 wide with them (`_n64d64`: twice as many dWd tiles); `_b12`:
# the ring 12 deep (a K step of 64 x 64 tiles is 16 KB against 24)
for _name in ("gluon12_m64_early_dx4_wp68_ibw", "gluon12_m64_early_dx2_wp68_ibw", "gluon12_m64_early_dx1_wp68_ibw"):
    _narrow = dict(block_n=64, d_a_block_n=64)
    P1_CANDIDATES[f"{_name}_n64"] = with_first_launch(P1_CANDIDATES[_name], **_narrow, grad_down_block_n=128)
    P1_CANDIDATES[f"{_name}_n64d64"] = with_first_launch(P1_CANDIDATES[_name], **_narrow, grad_down_block_n=64)
    P1_CANDIDATES[f"{_name}_n64d64_b12"] = with_first_launch(P1_CANDIDATES[_name], **_narrow, grad_down_block_n=64,
                                                             buffers=12)  # fmt: skip

# each band's faithful form from 513 tokens (as it was before these candidates) with dWd's tiles in launch 2 instead of
# launch 1 (`gluon_dwd2_from<band>`): dWd reads only the call's inputs, so in launch 2 its tiles wait for nothing,
# start on the SMs launch 1's last wave leaves free, and take launch 2's tile shape (128 x 256 from 2300 tokens) where
# launch 1's 128 x 128 tiles ran at 58-62% of the tensor pipe (ncu at 8192 tokens, design 14); launch 1 is then dA's
# tiles alone. `_a256`: launch 1's dA tiles 256 wide too (two accumulators over one dy tile a K step, on a ring of 4:
# 43 products a byte against 32)
for _band, _name in ((513, "gluon12_m64_lf_pdl_sif_graph_early"), (1100, "gluon12_l2m64_lf_pdl_sif_graph_early"),
                     (1400, "gluon12_l2m64_daf_pdl_sif_graph_early"), (2300, "gluon12_b6_pdl_sif_graph_early"),
                     (3300, "gluon12_b6_l2m64b6_pdl_sif_graph_early"), (4600, "gluon12_b6_pdl_sif_graph_early")):
    _form = P1_CANDIDATES[_name]  # the band's form before (launch.GLUON_FORMS on 2026-12-02)
    _moved = with_grad_down_in_second_launch(_form)
    P1_CANDIDATES[f"gluon_dwd2_from{_band}"] = _moved
    if _form.gluon_first_launch.block_m == 128:
        P1_CANDIDATES[f"gluon_dwd2_from{_band}_a256"] = with_first_launch(_moved, d_a_block_n=256, buffers=4,
                                                                                  saved_tiles_early=False)

# the 3600-5199 form (and the same without 256-wide dA tiles) with dWd's programs after the weight-gradient tiles'
# (`_late`): at 8192 tokens dWd's 48 tiles first held 48 SMs for 84 µs, and 12 of the 96 weight-gradient tiles (163 µs
# each) started only when they ended (program traces, design 20)
for _name in ("gluon_dwd2_from4600", "gluon_dwd2_from4600_a256"):
    P1_CANDIDATES[f"{_name}_late"] = with_second_launch(P1_CANDIDATES[_name], grad_down_after_weight_grad=True)

# the 3600-5199 form with dWd's tiles in launch 2 128 wide (`_d128`: 96 tiles of 128 x 128, ~42 µs each at 8192
# tokens, instead of 48 of 128 x 256, so that with the 96 weight-gradient tiles they fit the SMs' first wave), and the
# 2300-3299 and 4600 forms likewise (dWd's tiles in launch 2, 128 wide)
for _name in ("gluon_dwd2_from4600_a256", "gluon_dwd2_from4600", "gluon_dwd2_from2300"):
    P1_CANDIDATES[f"{_name}_d128"] = with_second_launch(P1_CANDIDATES[_name], grad_down_block_n=128)
# the forms to 256 tokens with launch 1's dA tiles 32 wide (`_n32`: four times the tiles of the 128-wide ones, 384 KB
# each through its SM) and its dWd tiles still 128 wide (four of the ring's B buffers a K step)
for _name in ("gluon12_m64_early_dx4_wp68_ibw", "gluon12_m64_early_dx2_wp68_ibw", "gluon12_m64_early_dx1_wp68_ibw"):
    P1_CANDIDATES[f"{_name}_n32"] = with_first_launch(P1_CANDIDATES[_name], block_n=32, d_a_block_n=32,
                                                      grad_down_block_n=128)  # fmt: skip

# the forms with dWd's tiles in launch 2 and launch 1's dA tiles 64 wide (`_n64`): launch 1 is then dA's tiles alone,
# and at 1100-1399 tokens its 128-row tiles 128 wide are 54-66, half the SMs; 64 wide, twice as many, each streaming
# 768 KB instead of 1 MB (dy's 128 rows over H, Wd's columns), beside dWd's tiles of launch 2 on the SMs left
for _name in ("gluon_dwd2_from513", "gluon_dwd2_from1100", "gluon_dwd2_from1400", "gluon_dwd2_from2300"):
    P1_CANDIDATES[f"{_name}_n64"] = with_first_launch(P1_CANDIDATES[_name], block_n=64, d_a_block_n=64,
                                                      grad_down_block_n=128)  # fmt: skip

# the forms to 512 tokens with dWd's tiles in launch 2 (`_dwd2`, on its first program ids, beside the persistent
# weight-gradient programs): launch 1 is then dA's 24-96 tiles alone, and dWd's tiles (K = T, reading only the call's
# inputs) run on the SMs launch 1 leaves free instead of as 192 tiles of launch 1 beside dA's
for _name in ("gluon12_m64_early_dx4_wp68_ibw_n64", "gluon12_m64_early_dx2_wp68_ibw_n64",
              "gluon12_m64_early_dx1_wp68_ibw_n64", "gluon12_m64_early_dx1_wp68_ibw"):
    P1_CANDIDATES[f"{_name}_dwd2"] = with_grad_down_in_second_launch(P1_CANDIDATES[_name])

# the 513 band's form with dx's reduction split in 2 (`_dx2`): with dWd's tiles in launch 2 the fast path's dx split
# paid again to 192 tokens (design 22), and at 513-768 tokens its dx tiles of K = 2I are launch 2's longest
P1_CANDIDATES["gluon_dwd2_from513_dx2"] = with_second_launch(P1_CANDIDATES["gluon_dwd2_from513"], grad_x_splits=2)

# the forms from 2300 tokens with dWd's tiles in launch 2 (as `gluon_dwd2_from<band>`) and launch 1 in the pingpong form
# (`gluon_pingpong_from<band>`: 132 persistent programs, each taking its dA tiles in turn on two warpgroups, one tile's
# dSwiGLU epilogue beside the next one's main loop; at 8192 tokens a dA tile took 20.6 µs, ≈ 7 of them the epilogue
# with the tensor cores idle); `_d128`: dWd's tiles in launch 2 128 wide
_PINGPONG = dict(pingpong_programs=132, buffers=4, block_n=128, d_a_block_n=128, saved_tiles_early=False,
                 stores_in_flight=False)  # fmt: skip
for _band in (2300, 3300, 4600):
    _pingpong = with_first_launch(P1_CANDIDATES[f"gluon_dwd2_from{_band}"], **_PINGPONG)
    P1_CANDIDATES[f"gluon_pingpong_from{_band}"] = _pingpong
    P1_CANDIDATES[f"gluon_pingpong_from{_band}_d128"] = with_second_launch(_pingpong, grad_down_block_n=128)
    # the ring deeper: 5 buffers (hi's and lo's stores in flight), or 6 with one output buffer a warpgroup
    P1_CANDIDATES[f"gluon_pingpong_from{_band}_b5"] = with_first_launch(_pingpong, buffers=5)
    P1_CANDIDATES[f"gluon_pingpong_from{_band}_b6"] = with_first_launch(_pingpong, buffers=6, pingpong_out_buffers=1)
    # two K steps' products in flight (ncu at 2447 tokens, one tile a program: one warpgroup's main loop kept the
    # tensor pipe 23% busy against 47% for two warpgroups on the tile)
    P1_CANDIDATES[f"gluon_pingpong_from{_band}_b6_f2"] = with_first_launch(_pingpong, buffers=6,
                                                                          pingpong_out_buffers=1, pingpong_in_flight=2)
    P1_CANDIDATES[f"gluon_pingpong_from{_band}_b5_f2"] = with_first_launch(_pingpong, buffers=5, pingpong_in_flight=2)

# each path's default form to 512 tokens (as choose_config picks it at 128, 192, 384 and 512 tokens) with dA's
# reduction over H split over 2 or 4 programs a tile (`_da<n>`; the saved tiles then asked for after the sum, not
# early): since dWd's tiles went to launch 2 at 65-512 tokens on the fast path (design 22), launch 1 there is dA's 24-48
# tiles alone on 132 SMs, each streaming 512-768 KB through one SM (ncu at 128 tokens: launch 1 8.7 us at 14% of
# DRAM's peak); dA split was last measured beside launch 1's dWd tiles (design 18: closer, still slower)
for _path, _with_lo in (("fast", False), ("faithful", True)):
    for _tokens in (128, 192, 384, 512):
        _form = choose_config(_tokens, 2048, 768, interpreter=False, with_lo=_with_lo, max_programs=132)
        for _splits in (2, 4):
            P1_CANDIDATES[f"gluon_{_path}{_tokens}_da{_splits}"] = with_first_launch(
                _form, d_a_splits=_splits, saved_tiles_early=False)


def parse_field(text: str) -> tuple[str, object]:
    """``FIELD=VALUE`` with VALUE an int, or ints joined by x for a tile (``grad_down_tile=128x256x64``)."""
    name, sign, value = text.partition("=")
    try:
        if not sign or not name:
            raise ValueError
        return name, tuple(int(v) for v in value.split("x")) if "x" in value else int(value)
    except ValueError:
        raise ValueError(f"field: expected FIELD=VALUE with an integer or ints joined by x, got {text!r}") from None


def parse_fields(text: str) -> dict:
    """Comma-separated ``FIELD=VALUE`` items as a dict (empty text: no fields)."""
    return dict(parse_field(item) for item in text.split(",") if item)


def parse_candidates(text: str, candidates: dict[str, dict]) -> dict[str, dict]:
    """A kernel benchmark's ``--configs``: names of ``candidates`` (comma-separated) or ``NAME:FIELD=VALUE,…``
    items, separated by ``;`` -> name -> the fields it replaces in the case's default config."""
    configs = {}
    for item in (part.strip() for part in text.split(";")):
        if not item:
            continue
        if ":" in item:
            name, _, fields = item.partition(":")
            configs[name] = parse_fields(fields)
            continue
        for name in (n.strip() for n in item.split(",") if n.strip()):
            if name not in candidates:
                raise ValueError(f"config {name!r}: not one of {sorted(candidates)} (or write NAME:FIELD=VALUE,…)")
            configs[name] = candidates[name]
    return configs


def replace_fields(config, fields: dict):
    """``config`` (a dataclass) with ``fields`` replaced; an unknown field is an error naming it."""
    known = {field.name for field in dataclasses.fields(config)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{unknown}: not fields of {type(config).__name__} (fields: {sorted(known)})")
    return dataclasses.replace(config, **fields)


def parse_case(text: str, op: str = "moe_experts_backward") -> tuple[problems.Problem, int]:
    """``dtype:num_tokens`` (``fp32:2048``) -> (the problem of ``op`` whose inputs have that dtype, num_tokens)."""
    dtype, sign, count = text.partition(":")
    by_dtype = problems_by_dtype(op)
    name = DTYPE_ALIASES.get(dtype.strip())
    if not sign or name not in by_dtype or not count.strip().isdigit():
        raise ValueError(f"case: expected dtype:num_tokens with dtype in {sorted(by_dtype)} (or an alias such as "
                         f"fp32, bf16) and num_tokens an integer, got {text!r}")  # fmt: skip
    return by_dtype[name], int(count)


# --------------------------------------------------------------------------------------------------
# what the GPU kernel benchmarks share


def first_line(exc: BaseException) -> str:
    """``<ExceptionType>: <first line>``, at most 200 characters (a failed candidate's row)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]


def cuda_usable() -> bool:
    """False after a sticky CUDA error (an illegal address, a trap): nothing more can run in this process."""
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


def p2_kernel_a_workspaces(inputs: dict) -> dict:
    """P2's routing and kernel A's workspaces dg, du, aw (rows in sorted order), made the way
    ``moe_experts_backward_triton`` makes them, for benchmarks of the kernels that follow A: dict of the
    launch config and plan, the routing, sizes (T, K, E, I, H), the interface dtype, kernel W's operands x
    and dy (bf16 hi halves for fp32 inputs), the weights, and dgate, dup, scaled_act."""
    import torch

    from ..moe_experts import launch
    from ..moe_experts.choose import launch_config
    from ..moe_experts.routing import route_by_expert
    from ..moe_experts.runtime import WORKSPACE_DTYPES, operand_halves

    x, dy = inputs["hidden_states"], inputs["grad_output"]
    T, K = inputs["topk_indices"].shape
    E, I, H = inputs["gate_weights"].shape
    dtype, device = x.dtype, x.device
    config = launch_config(T * K, E, input_bytes=x.element_size())
    plan = launch.launch_plan(T, H, I, E, K, config)
    routing = route_by_expert(inputs["topk_indices"], E)
    workspace_dtype = WORKSPACE_DTYPES[dtype]
    split = dtype == torch.float32
    dgate, dup, scaled_act = (torch.empty((T * K, I), dtype=workspace_dtype, device=device) for _ in range(3))
    topk_partial = torch.empty((plan["A"].grid["I-tiles"], T * K), dtype=torch.float32, device=device)
    x_halves = operand_halves(x, split, workspace_dtype)
    dy_halves = operand_halves(dy, split, workspace_dtype)
    launch.launch_swiglu_grad(config, plan, routing, x_halves, dy_halves, inputs["topk_weights"],
                              inputs["gate_weights"], inputs["up_weights"], inputs["down_weights"], dgate, dup,
                              scaled_act, topk_partial, forward_only=False)  # fmt: skip
    torch.cuda.synchronize()
    return dict(config=config, plan=plan, routing=routing, T=T, K=K, E=E, I=I, H=H, dtype=dtype, x=x_halves[0],
                dy=dy_halves[0], gate=inputs["gate_weights"], up=inputs["up_weights"], down=inputs["down_weights"],
                dgate=dgate, dup=dup, scaled_act=scaled_act)  # fmt: skip


def candidate_verdict(row: dict) -> str:
    """The check column of a candidate's row: "ok", "WRONG (...)", or "" where it was not checked."""
    if "ok" not in row:
        return ""
    return "ok" if row["ok"] else f"WRONG (finite={row['finite']}, structure={row['structure_problems']})"


def check_and_time(row: dict, prepare, *, flush, reps: int, base_ms: float, label: str) -> dict:
    """One candidate of a kernel benchmark, recorded in ``row``: ``prepare()`` returns (run, check) — the
    launch to time and a function returning the check's fields —; ``run`` goes once, its check is merged
    into ``row``, then its CUDA-graph replays are timed (``ms``, ``speedup`` over ``base_ms``). A failure is
    kept as ``row["error"]`` (its first line) and printed, and the benchmark goes on with the next candidate,
    unless the failure left the CUDA context unusable (then RuntimeError). Prints the row as JSON."""
    import json

    import torch

    from . import timing

    try:
        run, check = prepare()
        run()
        torch.cuda.synchronize()
        row.update(check())
        ms = timing.time_graph(run, flush, reps=reps)["median_ms"]
        row.update(ms=ms, speedup=base_ms / ms)
    except Exception as exc:  # report and go on with the other candidates
        row["error"] = first_line(exc)
        print(f"{label}: {row['error']}", flush=True)
    print(json.dumps(row), flush=True)
    if "error" in row and not cuda_usable():
        raise RuntimeError(f"{label} left the CUDA context unusable: {row['error']}")
    torch.cuda.empty_cache()
    return row


def print_configs(cases, configs: dict[str, dict], choose_config, name_width: int = 16) -> None:
    """A P2 kernel benchmark's ``--list``: per case (``(text, (problem, num_tokens))``) each named candidate's
    fields over the case's default, ``choose_config(T·K, E, input bytes, interpreter=False)``, resolved, or
    why they are invalid."""
    for case, (problem, num_tokens) in cases:
        sizes = problem.sizes(num_tokens)
        default = choose_config(num_tokens * sizes["top_k"], sizes["num_experts"], problem.dtype.itemsize,
                                interpreter=False)  # fmt: skip
        for name, fields in configs.items():
            try:
                print(f"{case:11s} {name:{name_width}s} {replace_fields(default, fields)}")
            except ValueError as exc:
                print(f"{case:11s} {name:{name_width}s} invalid: {exc}")


def run_cases(run_case, cases, *, out: str | None, out_name: str, print_table) -> int:
    """A kernel benchmark's run: ``run_case(case)`` rows for every case, stopping early where a CUDA error
    left the context unusable (RuntimeError) but keeping what was measured: the rows go as JSON to ``out``
    (default ``$OUT/<out_name>`` where OUT is set) and to ``print_table``. Returns the exit code: 0 when
    every row is correct and ran."""
    import json
    import os
    from pathlib import Path

    rows = []
    try:
        for case, _ in cases:
            rows += run_case(case)
    except RuntimeError as exc:  # a sticky CUDA error: keep what was measured
        print(f"stopped: {exc}", flush=True)
    finally:
        path = out or (os.path.join(os.environ["OUT"], out_name) if os.environ.get("OUT") else None)
        if path:
            Path(path).write_text(json.dumps(rows, indent=1))
        print_table(rows)
    return 0 if all(r.get("ok", True) and "error" not in r for r in rows) else 1
