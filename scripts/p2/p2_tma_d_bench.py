"""Time the TMA-fed persistent kernel D (``moe_experts.tma_slot_projection``) against today's kernel D on the GPU.

    PYTHONPATH=. python scripts/p2/p2_tma_d_bench.py [--cases bf16:2048,bf16:8192,bf16:32768,fp32:2048]
        [--uses backward,forward] [--configs default,rows128,...|NAME:FIELD=VALUE,...;...] [--routing uniform]
        [--experts E] [--list]

Per case (``dtype:num_tokens``, the P2 benchmark shape: H 4096, I 2048, E 256 or ``--experts``, K 8) the script
draws the inputs as the tests do (``Problem.make_inputs``, seed 0) and runs the pipeline up to kernel A's workspaces
(routing; kernel A: dg, du, aw, rows in sorted order, bf16 for fp32 inputs), as ``moe_experts_backward_triton``
makes them. Per use — backward: dX_slot = Wgᵀ dg + Wuᵀ du; forward: y_slot = Wd aw (the layer's forward
uses the same aw, here kernel A's backward one: the same shapes and dtypes) — it times, by CUDA-graph replay
with the L2 flushed before each replay (``moe_lib.bench.timing.time_graph``):

    (a) the pointer-based kernel D, ``launch_slot_projection`` (pointer loads, (expert, H-tile, row split) grid), the
        baseline;
    (b) per candidate config: ``launch_slot_projection_tma`` (its one-program tile-offsets prologue included).

Every (b) is first checked against (a)'s output: relative Frobenius error < 1e-2 (both multiply the same bf16
operands with fp32 accumulation: expect ~1e-6), no NaN (its output is NaN-poisoned before the first call,
as is (a)'s: every slot row must be written) and the same NaN-free structure (the rows (a) writes, (b)
writes). A config that fails to compile or run is reported by its first error line and the run goes on (a
CUDA error that leaves the context unusable ends the run, with what was measured so far still written).
Prints one table (case, use, config, ms, speedup over (a), relative error, check; "[paired]" where the
backward's two terms could not share a descriptor) and writes every row as JSON to
``$OUT/p2_tma_d_bench.json`` when OUT is set (or to --out). ``--list`` prints the resolved configs
per case and exits (no GPU needed).

A config is a name of :data:`CANDIDATES` or ``NAME:FIELD=VALUE,…`` over the case's default config
(``choose_tma_slot_projection_config``); tiles are written ``128x64x64`` (BLOCK_H x BLOCK_ROWS x BLOCK_I),
booleans 0/1. A candidate's fields are absolute: one that does not fit a case's shared memory fails to
compile (``scripts/p2/p2_tma_d_compile_check.py --all-candidates`` shows which) and is reported as such.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from moe_lib.bench import timing
from moe_lib.bench.checks import compare_output
from moe_lib.bench.tuning import (
    candidate_verdict,
    check_and_time,
    p2_kernel_a_workspaces,
    parse_candidates,
    parse_case,
    print_configs,
    replace_fields,
    run_cases,
)
from moe_lib.moe_experts.choose import choose_tma_slot_projection_config
from moe_lib.moe_experts.designs.d_pointer import launch_slot_projection
from moe_lib.moe_experts.tma_slot_projection import launch_slot_projection_tma, two_term_form

NUM_SMS_H200 = 132  # the persistent grid where the device is not queried (scripts/p2/p2_tma_d_compile_check.py)


# name -> fields replaced in the case's default config (choose_tma_slot_projection_config). Tiles are
# (BLOCK_H, BLOCK_ROWS, BLOCK_I): weight rows (M side), expert rows (N side), intermediate columns per step;
# stages count reduction steps of one term in flight. backward_* is the two-term launch (Wg, Wu, dg, du),
# forward_* the one-term launch (Wd, aw).
def _both(tile, stages, warps=8) -> dict:
    return dict(
        backward_tile=tile,
        backward_stages=stages,
        backward_warps=warps,
        forward_tile=tile,
        forward_stages=stages,
        forward_warps=warps,
    )


CANDIDATES = {
    "default": {},
    # 64-row blocks (≈ one per expert at 2048 tokens): depth of the TMA pipeline
    "r64_s4": _both((128, 64, 64), 4),
    "r64_s8": _both((128, 64, 64), 8),
    # 32-row blocks: less padding for experts of ~64 ± 8 rows, the weight slab read by more tiles (from L2)
    "r32_s8": _both((128, 32, 64), 8),
    # 128-row blocks: one block for almost every expert at 2048 tokens; the compute-bound regime's width
    "r128_s4": _both((128, 128, 64), 4),
    "r128_s6": _both((128, 128, 64), 6),
    "r128_i128_s3": _both((128, 128, 128), 3),
    # 256-row blocks (busy experts): a 128×256 accumulator
    "r256_s4": _both((128, 256, 64), 4),
    # 256 weight rows per tile (M side): half the tiles, the rows re-read half as often
    "h256_r64_s4": _both((256, 64, 64), 4),
    "h256_r128_w16": _both((256, 128, 64), 4, warps=16),  # four warp groups of 64 weight rows
    # 64 weight rows and 4 warps (one warp group): twice the tiles
    "h64_w4": _both((64, 64, 64), 8, warps=4),
    # an expert's tiles numbered H-tile inner (its row blocks shared by neighbouring tiles instead of weights)
    "h_inner": dict(row_blocks_inner=False),
    # loop forms: one pipeline per tile (nested), or across tiles (flat; ptxas serialises the wgmma of fp32)
    "nested": dict(flatten=False),
    "flat": dict(flatten=True),
    # the backward's fallback: two descriptors, both terms in each step, half the stages, nested loops
    "paired": dict(concat_terms=False),
    # fp32 weights (fp32 interface only; a no-op for 16-bit inputs): pointer loads instead of TMA
    "fp32_pointer": dict(weight_tma=False),
    "fp32_i32_s8": _both((128, 64, 32), 8),
}
ALL_CASES = "bf16:2048,bf16:8192,bf16:32768,fp32:2048"
USES = ("backward", "forward")


def use_operands(w: dict, use: str) -> tuple:
    """(weights1, weights2, rows1, rows2) of a use; weights2 and rows2 None for the one-term forward."""
    if use == "backward":
        return w["gate"], w["up"], w["dgate"], w["dup"]
    return w["down"], None, w["scaled_act"], None


def slot_output(w: dict) -> torch.Tensor:
    """A NaN-poisoned fp32 [T·K, H] per-slot workspace."""
    return torch.full((w["T"] * w["K"], w["H"]), float("nan"), dtype=torch.float32, device=w["dgate"].device)


def run_existing(w: dict, use: str, out: torch.Tensor) -> None:
    """Today's kernel D: Wg[e][i, h] at i·H + h (backward: stride_h 1, stride_i H); Wd[e][h, i] at h·I + i."""
    w1, w2, r1, r2 = use_operands(w, use)
    if use == "backward":
        launch_slot_projection(w["config"], w["routing"], w1, w2, r1, r2, out, 1, w["H"])
    else:
        launch_slot_projection(w["config"], w["routing"], w1, w1, r1, r1, out, w["I"], 1)


def check(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> dict:
    """Relative Frobenius error against (a), NaN-free, and the same structure: rows (a) wrote (all of them), written."""
    stats = compare_output(got, want, None)
    got_nan, want_nan = torch.isnan(got), torch.isnan(want)
    structure = int((got_nan != want_nan).sum())
    ok = bool(stats["finite"]) and structure == 0 and not bool(want_nan.any()) and stats["rel_error"] < tolerance
    return dict(rel=stats["rel_error"], finite=bool(stats["finite"]), structure_problems=structure, ok=ok)


def run_case(
    case: str, uses, configs: dict, routing: str, flush, num_programs: int, reps: int, num_experts: int | None = None
) -> list[dict]:
    problem, num_tokens = parse_case(case)
    axes = {} if num_experts is None else dict(num_experts=num_experts)
    inputs = problem.make_inputs(num_tokens, seed=0, device="cuda", routing=routing, **axes)
    w = p2_kernel_a_workspaces(inputs)
    del inputs
    torch.cuda.empty_cache()
    tolerance = 1e-2
    default = choose_tma_slot_projection_config(num_tokens * w["K"], w["E"], w["dtype"].itemsize, interpreter=False)
    rows = []
    for use in uses:
        baseline = slot_output(w)
        run_existing(w, use, baseline)
        torch.cuda.synchronize()
        base_ms = timing.time_graph(lambda use=use, out=baseline: run_existing(w, use, out), flush, reps=reps)[
            "median_ms"
        ]
        rows.append(
            dict(
                case=case,
                use=use,
                routing=routing,
                config="(a) launch_slot_projection",
                ms=base_ms,
                speedup=1.0,
                experts=w["E"],
            )
        )
        print(json.dumps(rows[-1]), flush=True)
        w1, w2, r1, r2 = use_operands(w, use)
        for name, fields in configs.items():
            as_json = {key: list(value) if isinstance(value, tuple) else value for key, value in fields.items()}
            row = dict(case=case, use=use, routing=routing, config=name, fields=as_json, experts=w["E"])

            def prepare(fields=fields, row=row, w1=w1, w2=w2, r1=r1, r2=r2, use=use, baseline=baseline):
                config = replace_fields(default, fields)
                row["resolved"] = str(config)
                out = slot_output(w)
                if use == "backward":  # the two terms through one descriptor, or the paired fallback
                    row["terms"] = two_term_form(config, w1, w2, r1, r2)

                def run_tma():
                    launch_slot_projection_tma(
                        config,
                        w["routing"],
                        w1,
                        w2,
                        r1,
                        r2,
                        out,
                        transposed_weights=use == "backward",
                        num_programs=num_programs,
                    )

                return run_tma, lambda: check(out, baseline, tolerance)

            rows.append(
                check_and_time(row, prepare, flush=flush, reps=reps, base_ms=base_ms, label=f"{case} {use} {name}")
            )
        del baseline
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':11s} {'use':8s} {'config':28s} {'ms':>8s} {'speedup':>7s} {'rel err':>9s}  check")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:11s} {r['use']:8s} {r['config']:28s} ERROR {r['error']}")
            continue
        speedup = f"{r['speedup']:7.2f}" if "speedup" in r else f"{'':7s}"
        rel = f"{r['rel']:9.1e}" if "rel" in r else f"{'':9s}"
        terms = f" [{r['terms']}]" if r.get("terms") == "paired" else ""
        print(
            f"{r['case']:11s} {r['use']:8s} {r['config']:28s} {r['ms']:8.3f} {speedup} {rel}  "
            f"{candidate_verdict(r)}{terms}"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=ALL_CASES, help="dtype:num_tokens,… (default: %(default)s)")
    parser.add_argument("--uses", default=",".join(USES), help="backward,forward (default: both)")
    parser.add_argument(
        "--configs",
        default=",".join(CANDIDATES),
        help="names of CANDIDATES, or NAME:FIELD=VALUE,… items separated by ';' (default: all candidates)",
    )
    parser.add_argument("--routing", default="uniform", choices=("uniform", "skewed", "hot"))
    parser.add_argument(
        "--experts",
        type=int,
        default=None,
        help="E of every case (default: the benchmark's 256); fewer experts, more rows each, as one "
        "rank of a larger expert-parallel group holds",
    )
    parser.add_argument("--reps", type=int, default=30, help="timed replays per measurement (fewer past 10 ms)")
    parser.add_argument("--out", default=None, help="JSON file (default: $OUT/p2_tma_d_bench.json where OUT is set)")
    parser.add_argument("--list", action="store_true", help="print the configs of every case and exit")
    args = parser.parse_args(argv)
    try:
        configs = parse_candidates(args.configs, CANDIDATES)
        cases = [(case, parse_case(case)) for case in args.cases.split(",") if case]
        uses = [u.strip() for u in args.uses.split(",") if u.strip()]
        if not uses or set(uses) - set(USES):
            raise ValueError(f"--uses: expected some of {USES}, got {args.uses!r}")
        if args.experts is not None and args.experts < 8:
            raise ValueError(f"--experts: expected at least K = 8 experts, got {args.experts}")
    except ValueError as exc:
        parser.error(str(exc))

    if args.list:
        print_configs(cases, configs, choose_tma_slot_projection_config, name_width=14)
        return 0
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --list to see the configs)")

    flush = timing.L2Flusher("cuda")
    num_programs = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return run_cases(
        lambda case: run_case(case, uses, configs, args.routing, flush, num_programs, args.reps, args.experts),
        cases,
        out=args.out,
        out_name="p2_tma_d_bench.json",
        print_table=print_table,
    )


if __name__ == "__main__":
    sys.exit(main())
