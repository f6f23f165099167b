"""Compile the TMA-fed kernel D (``moe_experts.tma_slot_projection``) for sm_90 without a GPU and report its resources.

    PYTHONPATH=. python scripts/p2/p2_tma_d_compile_check.py [--cases bf16:2048,bf16:32768,fp32:2048]
        [--uses backward,forward] [--configs default,r128_s3,...] [--all-candidates]

Per case (``dtype:num_tokens`` of the P2 benchmark shape: H 4096, I 2048, E 256, K 8) and use (backward: two
terms Wgᵀ dg + Wuᵀ du over [E, I, H] weights; forward: one term Wd aw over [E, H, I]) it compiles the launch
of the configuration ``choose_tma_slot_projection_config`` picks, and with ``--all-candidates`` (or
``--configs``) the candidates ``scripts/p2/p2_tma_d_bench.py`` times. Per launch: registers and stack (a spill
shows as a non-zero STACK), shared memory (flagged above the 227 KB a block may use: such a config cannot
launch), warps, and what the code contains: wgmma and TMA loads (``cp.async.bulk.tensor`` global → shared)
in the PTX, cp.async (pointer loads pipelined into shared memory: the fp32 ``weight_tma=False`` path), and
their SASS forms HGMMA, UTMALDG, LDGSTS (cuobjdump). Also compiles the one-program tile-offsets prologue.
Needs only the triton wheel (its ptxas and cuobjdump).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

import triton.language as tl
from p2_tma_d_bench import CANDIDATES, NUM_SMS_H200

from moe_lib import problems
from moe_lib.bench.sm90 import (
    compile_for_sm90,
    first_error_line,
    over_limit,
    resources,
    sass_counts,
    wgmma_serialized,
)
from moe_lib.bench.tuning import parse_case
from moe_lib.moe_experts.choose import choose_tma_slot_projection_config
from moe_lib.moe_experts.tma_slot_projection import slot_projection_tma_kernel, tile_offsets_kernel

WEIGHT_TYPES = {"bf16": "*bf16", "fp32": "*fp32"}  # kernel D's rows are bf16 either way
SASS_OPS = ("HGMMA", "UTMALDG", "LDGSTS")
USES = ("backward", "forward")


def compile_use(config, use: str, dtype: str, num_experts: int, paired: bool = False):
    """The launch of one use as ``launch_slot_projection_tma`` makes it (16-aligned pointers and strides); the
    backward in its default form (both terms through one descriptor) or ``paired`` (its fallback: nested loops)."""
    two_terms = use == "backward"
    concat = two_terms and config.concat_terms and not paired
    tile, warps, stages = config.launch_params(two_terms, paired=two_terms and not concat)
    weight_type = WEIGHT_TYPES[dtype]
    types = dict(
        weights_ptr=weight_type,
        weights_term_stride="i64",
        weights_flip="i32",
        rows_ptr="*bf16",
        rows_term_stride="i64",
        rows_flip="i32",
        out_slot_ptr="*fp32",
        sorted_slot_ptr="*i32",
        expert_offsets_ptr="*i32",
        tile_offsets_ptr="*i32",
        num_experts="i32",
        num_rows="i32",
        hidden_size="i32",
        inter_size="i32",
    )
    constexprs = dict(
        TWO_TERMS=two_terms,
        CONCAT_TERMS=concat,
        TRANSPOSED_WEIGHTS=two_terms,
        WEIGHT_TMA=dtype != "fp32" or config.weight_tma,
        OPERAND_DTYPE=tl.bfloat16,
        NUM_PROGRAMS=NUM_SMS_H200,
        SEARCH_STEPS=(num_experts - 1).bit_length(),
        ROW_BLOCKS_INNER=config.row_blocks_inner,
        FLATTEN=config.flatten and (concat or not two_terms),
        INTERPRETER=False,
        BLOCK_H=tile[0],
        BLOCK_ROWS=tile[1],
        BLOCK_I=tile[2],
    )
    aligned = [name for name in types if name not in ("weights_flip", "rows_flip")]
    return compile_for_sm90(slot_projection_tma_kernel, types, constexprs, aligned, warps=warps, stages=stages)


def report(compiled) -> str:
    ptx = compiled.asm["ptx"]
    tma_loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx))
    cp_async = len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx))
    sass = sass_counts(compiled, SASS_OPS)
    too_large = over_limit(compiled)
    return (
        f"{resources(compiled)}{too_large} warps={compiled.metadata.num_warps} ptx: tma_load={tma_loads} "
        f"cp.async={cp_async} | sass: "
        + " ".join(f"{op}={sass[op]}" for op in SASS_OPS)
        + f" | wgmma serialized: {wgmma_serialized(compiled)}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="bf16:2048,bf16:32768,fp32:2048", help="dtype:num_tokens,…")
    parser.add_argument("--uses", default=",".join(USES), help="backward,forward")
    parser.add_argument("--configs", default="default", help="names of CANDIDATES in p2_tma_d_bench.py")
    parser.add_argument("--all-candidates", action="store_true", help="every candidate of p2_tma_d_bench.py")
    parser.add_argument("--paired", action="store_true", help="also the backward's paired form (its fallback)")
    args = parser.parse_args()
    sizes = problems.load("moe_experts_backward").sizes(0)
    slots_per_token, num_experts = sizes["top_k"], sizes["num_experts"]
    names = list(CANDIDATES) if args.all_candidates else [n.strip() for n in args.configs.split(",") if n.strip()]
    uses = [u.strip() for u in args.uses.split(",") if u.strip()]
    unknown = [n for n in names if n not in CANDIDATES] + [u for u in uses if u not in USES]
    if unknown:
        parser.error(f"unknown configs or uses: {unknown}")
    try:
        prologue = compile_for_sm90(
            tile_offsets_kernel,
            dict(expert_offsets_ptr="*i32", tile_offsets_ptr="*i32", num_experts="i32", num_h_tiles="i32"),
            dict(BLOCK_ROWS=64, BLOCK_E=256),
            ["expert_offsets_ptr", "tile_offsets_ptr"],
            warps=4,
            stages=1,
        )
        print(f"tile_offsets_kernel (1 program): {resources(prologue)}", flush=True)
    except Exception as exc:
        print(f"tile_offsets_kernel FAIL {first_error_line(exc)}", flush=True)
    for case in args.cases.split(","):
        try:
            problem, num_tokens = parse_case(case)
        except ValueError as exc:
            parser.error(f"--cases: {exc}")
        input_bytes = problem.dtype.itemsize
        dtype = "fp32" if input_bytes == 4 else "bf16"
        default = choose_tma_slot_projection_config(
            num_tokens * slots_per_token, num_experts, input_bytes, interpreter=False
        )
        for name in names:
            try:
                config = dataclasses.replace(default, **CANDIDATES[name])
            except ValueError as exc:
                print(f"{case:11s} {name:14s} invalid: {exc}")
                continue
            print(f"{case:11s} {name:14s} {config}", flush=True)
            forms = [(use, False) for use in uses]
            if args.paired and "backward" in uses:
                forms.append(("backward", True))
            for use, paired in forms:
                paired = paired or (use == "backward" and not config.concat_terms)
                tile, warps, stages = config.launch_params(use == "backward", paired=paired)
                try:
                    line = report(compile_use(config, use, dtype, num_experts, paired))
                except Exception as exc:  # report and go on with the other launches
                    line = "FAIL " + first_error_line(exc)
                name = "paired" if paired else use
                print(f"    {name:8s} {'x'.join(map(str, tile))} w{warps} s{stages}: {line}", flush=True)


if __name__ == "__main__":
    main()
