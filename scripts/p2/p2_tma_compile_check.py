"""Compile the TMA-fed kernel W (``moe_experts.tma_weight_grad``) for sm_90 without a GPU and report its resources.

    PYTHONPATH=. python scripts/p2/p2_tma_compile_check.py [--cases bf16:2048,bf16:32768,fp32:2048] [--all-candidates]
        [--split]

Per case (``dtype:num_tokens`` of the P2 benchmark shape) it compiles both launches (dWg·dWu, dWd)
of the configuration ``choose_tma_weight_grad_config`` picks, and with ``--all-candidates`` every
candidate that ``scripts/p2/p2_tma_bench.py`` times. ``--split``: the fp32 cases' bf16×3 form instead
(hi and lo halves of every operand, three products a step, its own tiles), the form the chooser takes
where the weight gradients would leave the element rule (notes/p2/fp32-precision-rule.md). Per launch:
registers and stack (a spill shows as a non-zero STACK), shared memory (flagged above the 227 KB a block
may use), warps (12 where Triton's warp specialisation took effect: one producer and two consumer warp
groups), and what the code contains: wgmma, TMA loads (``cp.async.bulk.tensor`` global → shared) and TMA
stores in the PTX, ``setmaxnreg`` (warp specialisation's register split), and their SASS forms UTMALDG,
UTMASTG, HGMMA, USETMAXREG (cuobjdump); and whether ptxas serialises the wgmma (its reason). Needs only
the triton wheel (its ptxas and cuobjdump).
"""

from __future__ import annotations

import argparse
import dataclasses
import re

from p2_tma_bench import CANDIDATES, NUM_SMS_H200

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
from moe_lib.moe_experts.choose import choose_tma_weight_grad_config
from moe_lib.moe_experts.tma_weight_grad import grouped_weight_grad_kernel

OUTPUT_TYPES = {"bf16": "*bf16", "fp32": "*fp32"}  # kernel W's operands are bf16 either way
SASS_OPS = ("UTMALDG", "UTMASTG", "HGMMA", "USETMAXREG")


def compile_family(config, two_outputs: bool, output_type: str, split: bool = False):
    """One launch of the kernel: the dWg·dWu family (two outputs) or the dWd family, as the launcher makes it
    (``split``: bf16×3 products)."""
    if two_outputs:
        tile, warps, stages = config.gate_up_tile, config.warps_gate_up, config.stages_gate_up
    else:
        tile, warps, stages = config.down_tile, config.warps_down, config.stages_down
    types = dict(
        a_ptr="*bf16",
        a2_ptr="*bf16",
        b_ptr="*bf16",
        a_lo_ptr="*bf16",
        a2_lo_ptr="*bf16",
        b_lo_ptr="*bf16",
        out_ptr=output_type,
        out2_ptr=output_type,
        expert_offsets_ptr="*i32",
        num_experts="i32",
        size_m="i32",
        size_n="i32",
    )
    groups = config.expert_groups
    constexprs = dict(
        TWO_OUTPUTS=two_outputs,
        SPLIT=split,
        NUM_PROGRAMS=NUM_SMS_H200 // groups * groups,
        EXPERT_GROUPS=groups,
        WARP_SPECIALIZE=config.warp_specialize,
        TMA_STORE=config.tma_store,
        INTERPRETER=False,
        BLOCK_M=tile[0],
        BLOCK_N=tile[1],
        BLOCK_ROWS=tile[2],
    )
    return compile_for_sm90(grouped_weight_grad_kernel, types, constexprs, list(types), warps=warps, stages=stages)


def report(compiled) -> str:
    ptx = compiled.asm["ptx"]
    tma_loads = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx))
    tma_stores = len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared", ptx))
    sass = sass_counts(compiled, SASS_OPS)
    too_large = over_limit(compiled)
    return (
        f"{resources(compiled)}{too_large} warps={compiled.metadata.num_warps} ptx: tma_load={tma_loads} "
        f"tma_store={tma_stores} setmaxnreg={ptx.count('setmaxnreg')} | sass: "
        + " ".join(f"{op}={sass[op]}" for op in SASS_OPS)
        + f" | wgmma serialised: {wgmma_serialized(compiled)}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="bf16:2048,bf16:32768,fp32:2048", help="dtype:num_tokens,…")
    parser.add_argument("--all-candidates", action="store_true", help="also every candidate of p2_tma_bench.py")
    parser.add_argument("--split", action="store_true", help="the fp32 cases' bf16×3 form")
    args = parser.parse_args()
    sizes = problems.load("moe_experts_backward").sizes(0)
    slots_per_token, num_experts = sizes["top_k"], sizes["num_experts"]
    names = list(CANDIDATES) if args.all_candidates else ["default"]
    for case in args.cases.split(","):
        try:
            problem, num_tokens = parse_case(case)
        except ValueError as exc:
            parser.error(f"--cases: {exc}")
        input_bytes = problem.dtype.itemsize
        dtype = "fp32" if input_bytes == 4 else "bf16"
        split = args.split and dtype == "fp32"  # bf16×3 splits fp32 inputs only
        default = choose_tma_weight_grad_config(
            num_tokens * slots_per_token, num_experts, input_bytes, interpreter=False, split=split
        )
        for name in names:
            try:
                config = dataclasses.replace(default, **CANDIDATES[name])
            except ValueError as exc:
                print(f"{case:11s} {name:14s} invalid: {exc}")
                continue
            print(f"{case:11s} {name:14s} {'bf16×3 ' if split else ''}{config}", flush=True)
            for family, two_outputs in (("dWg·dWu", True), ("dWd", False)):
                try:
                    line = report(compile_family(config, two_outputs, OUTPUT_TYPES[dtype], split))
                except Exception as exc:  # report and go on with the other launches
                    line = "FAIL " + first_error_line(exc)
                print(f"    {family:8s} {line}", flush=True)


if __name__ == "__main__":
    main()
