"""Time the TMA-fed kernel W (``moe_experts.tma_weight_grad``) against the pointer-based kernel W.

    PYTHONPATH=. python scripts/p2/p2_tma_bench.py [--cases bf16:2048,bf16:8192,bf16:32768,fp32:2048]
        [--configs default,rows128,...|NAME:FIELD=VALUE,...;...] [--routing uniform] [--list]

Per case (``dtype:num_tokens``, the P2 benchmark shape: H 4096, I 2048, E 256, K 8) the script draws the
inputs as the tests do (``Problem.make_inputs``, seed 0), runs the pipeline up to kernel W's workspaces
(routing, x and dy as kernel W's bf16 operands, kernel A: dg, du, aw), then times, by CUDA-graph replay
with the L2 flushed before each replay (``moe_lib.bench.timing.time_graph``):

    (a) the pointer-based kernel W, ``launch_weight_grads`` (gathered-row pointer loads), the baseline;
    gather  the host-side gather alone: x_s, dy_s = x[sorted_slot // K], dy[sorted_slot // K];
    (b) per candidate config: the gather + ``launch_weight_grads_tma`` (one persistent launch per family).

Every (b) is first checked against (a)'s outputs: relative Frobenius error of each of dWg, dWu, dWd
(< 1e-2 for 16-bit outputs, < 1e-4 for fp32 ones, where both sum the same bf16 products in fp32), no
NaN (its outputs are NaN-poisoned before the first call) and the same structure (an element that (a)
leaves exactly zero is zero in (b), and whole experts are zero in both or neither). A config that fails to
compile or run is reported by its first error line and the run goes on (a CUDA error that leaves the
context unusable ends the run, with what was measured so far still written). Prints one table (case,
config, ms, speedup over (a), worst relative error, check) and writes every row as JSON to
``$OUT/p2_tma_bench.json`` when OUT is set (or to --out). ``--list`` prints the configs per case and exits
(no GPU needed).

A config is a name of :data:`CANDIDATES` or ``NAME:FIELD=VALUE,…`` over the case's default config
(``choose_tma_weight_grad_config``); tiles are written ``128x128x64``, booleans 0/1. The warp-specialised
and TMA-store forms are refused on the GPU (they leave tiles unwritten there: notes/p2/runs-design-04.md).
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
from moe_lib.moe_experts.choose import choose_tma_weight_grad_config
from moe_lib.moe_experts.designs.w_pointer import launch_weight_grads
from moe_lib.moe_experts.tma_weight_grad import gather_sorted_rows, launch_weight_grads_tma

NUM_SMS_H200 = 132  # the persistent grid where the device is not queried (scripts/p2/p2_tma_compile_check.py)

# name -> fields replaced in the case's default config (choose_tma_weight_grad_config); tiles are
# (M, N, rows per step): dWg·dWu (I, H, rows), dWd (H, I, rows)
ROWS_128 = dict(gate_up_tile=(128, 128, 128), down_tile=(128, 256, 128), stages_gate_up=2, stages_down=2)
CANDIDATES = {
    "default": {},
    "rows128": ROWS_128,
    "rows64_s4": dict(gate_up_tile=(128, 128, 64), down_tile=(128, 256, 64), stages_gate_up=4, stages_down=4),
    "down128": dict(down_tile=(128, 128, 64)),
    "groups1": dict(expert_groups=1),
    "groups2": dict(expert_groups=2),
    "groups4": dict(expert_groups=4),
    "groups6": dict(expert_groups=6),
}
OUTPUT_NAMES = ("grad_gate", "grad_up", "grad_down")
ALL_CASES = "bf16:2048,bf16:8192,bf16:32768,fp32:2048"


def weight_grad_outputs(w: dict, fill: float | None = None) -> tuple[torch.Tensor, ...]:
    """dWg, dWu [E, I, H] and dWd [E, H, I] in the interface dtype (``fill``: poisoned with that value)."""
    E, I, H, dtype, device = w["E"], w["I"], w["H"], w["dtype"], w["x"].device
    make = (
        (lambda shape: torch.empty(shape, dtype=dtype, device=device))
        if fill is None
        else (lambda shape: torch.full(shape, fill, dtype=dtype, device=device))
    )
    return make((E, I, H)), make((E, I, H)), make((E, H, I))


def structure_problems(got: torch.Tensor, want: torch.Tensor) -> int:
    """How many elements are zero in ``want`` but not in ``got``, plus how many experts are all-zero in exactly
    one of the two (expert by expert: bounded temporaries)."""
    count = 0
    for e in range(want.shape[0]):
        want_zero, got_zero = want[e] == 0, got[e] == 0
        count += int((want_zero & ~got_zero).sum())
        count += int(bool(want_zero.all()) != bool(got_zero.all()))
    return count


def check(got, want, tolerance: float) -> dict:
    stats = [compare_output(g, w, None) for g, w in zip(got, want, strict=True)]
    rel = {name: s["rel_error"] for name, s in zip(OUTPUT_NAMES, stats, strict=True)}
    finite = all(s["finite"] for s in stats)
    structure = sum(structure_problems(g, w) for g, w in zip(got, want, strict=True))
    ok = finite and structure == 0 and max(rel.values()) < tolerance
    return dict(rel=rel, finite=finite, structure_problems=structure, ok=ok)


def run_case(case: str, configs: dict, routing: str, flush, num_programs: int, reps: int) -> list[dict]:
    problem, num_tokens = parse_case(case)
    inputs = problem.make_inputs(num_tokens, seed=0, device="cuda", routing=routing)
    w = p2_kernel_a_workspaces(inputs)
    del inputs  # the expert weights (up to 25.8 GB in fp32) are not needed any more
    torch.cuda.empty_cache()
    K, sorted_slot, offsets = w["K"], w["routing"].sorted_slot, w["routing"].expert_offsets
    tolerance = 1e-4 if w["dtype"] == torch.float32 else 1e-2
    rows = []

    baseline = weight_grad_outputs(w)

    def run_baseline():
        launch_weight_grads(
            w["config"], w["routing"], sorted_slot, K, w["x"], w["dy"], w["dgate"], w["dup"], w["scaled_act"], *baseline
        )

    run_baseline()
    base_ms = timing.time_graph(run_baseline, flush, reps=reps)["median_ms"]
    rows.append(dict(case=case, config="(a) launch_weight_grads", ms=base_ms, speedup=1.0))
    print(json.dumps(rows[-1]), flush=True)

    def gather():
        return gather_sorted_rows(w["x"], sorted_slot, K), gather_sorted_rows(w["dy"], sorted_slot, K)

    rows.append(dict(case=case, config="gather only", ms=timing.time_graph(gather, flush, reps=reps)["median_ms"]))
    print(json.dumps(rows[-1]), flush=True)

    default = choose_tma_weight_grad_config(num_tokens * K, w["E"], w["dtype"].itemsize, interpreter=False)
    for name, fields in configs.items():
        as_json = {key: list(value) if isinstance(value, tuple) else value for key, value in fields.items()}
        row = dict(case=case, config=name, fields=as_json)

        def prepare(fields=fields, row=row):
            config = replace_fields(default, fields)
            row["resolved"] = str(config)
            outputs = weight_grad_outputs(w, fill=float("nan"))

            def run_tma():
                x_sorted, dy_sorted = gather()
                launch_weight_grads_tma(
                    config,
                    offsets,
                    x_sorted,
                    dy_sorted,
                    w["dgate"],
                    w["dup"],
                    w["scaled_act"],
                    *outputs,
                    num_programs=num_programs,
                )

            return run_tma, lambda: check(outputs, baseline, tolerance)

        rows.append(check_and_time(row, prepare, flush=flush, reps=reps, base_ms=base_ms, label=f"{case} {name}"))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'case':11s} {'config':24s} {'ms':>8s} {'speedup':>7s} {'worst rel':>9s}  check")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:11s} {r['config']:24s} ERROR {r['error']}")
            continue
        speedup = f"{r['speedup']:7.2f}" if "speedup" in r else f"{'':7s}"
        rel = f"{max(r['rel'].values()):9.1e}" if "rel" in r else f"{'':9s}"
        print(f"{r['case']:11s} {r['config']:24s} {r['ms']:8.3f} {speedup} {rel}  {candidate_verdict(r)}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=ALL_CASES, help="dtype:num_tokens,… (default: %(default)s)")
    parser.add_argument(
        "--configs",
        default=",".join(CANDIDATES),
        help="names of CANDIDATES, or NAME:FIELD=VALUE,… items separated by ';' (default: all candidates)",
    )
    parser.add_argument("--routing", default="uniform", choices=("uniform", "skewed", "hot"))
    parser.add_argument("--reps", type=int, default=30, help="timed replays per measurement (fewer past 10 ms)")
    parser.add_argument("--out", default=None, help="JSON file (default: $OUT/p2_tma_bench.json where OUT is set)")
    parser.add_argument("--list", action="store_true", help="print the configs of every case and exit")
    args = parser.parse_args(argv)
    try:
        configs = parse_candidates(args.configs, CANDIDATES)
        cases = [(case, parse_case(case)) for case in args.cases.split(",") if case]
    except ValueError as exc:
        parser.error(str(exc))

    if args.list:
        print_configs(cases, configs, choose_tma_weight_grad_config)
        return 0
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (use --list to see the configs)")

    flush = timing.L2Flusher("cuda")
    num_programs = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return run_cases(
        lambda case: run_case(case, configs, args.routing, flush, num_programs, args.reps),
        cases,
        out=args.out,
        out_name="p2_tma_bench.json",
        print_table=print_table,
    )


if __name__ == "__main__":
    sys.exit(main())
