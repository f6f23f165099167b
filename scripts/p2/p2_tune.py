"""Time the P2 Triton kernels under several launch configurations, kernel by kernel.

    PYTHONPATH=. python3 scripts/p2/p2_tune.py --cases fp32:2048,bf16:2048 \
        --configs "default;m32:block_m=32,block_i_dx=32;a_s2:stages_a=2"

Each config is NAME:FIELD=VALUE,… over the LaunchConfig that ``launch_config`` picks ("default" alone
is that config). A case is ``dtype:num_tokens``: the P2 problem with
inputs of that dtype. Per case and config: the outputs against the fp32 reference (relative error,
the problem's element rule's pass fraction on the worst output, "-" for a problem without one), each
kernel's median GPU time over 5 eager calls (torch.profiler; the weights are 10–50× the L2, so no
flush is needed), and the whole call replayed from a CUDA graph (median of 5). A table is printed
last and written as JSON to --out (or to $OUT/p2_tune.json where OUT is set).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from moe_lib.bench import timing
from moe_lib.bench.checks import compare_output, reference_outputs
from moe_lib.bench.tuning import parse_case, parse_fields, replace_fields, write_out
from moe_lib.moe_experts.choose import launch_config
from moe_lib.moe_experts.launch import moe_experts_backward_triton

# kernel name -> column; the weight-gradient kernel runs twice per call: dWg and dWu, then dWd
KERNEL_NAMES = {
    "swiglu_grad_kernel": "A",
    "expert_weight_grad_kernel": ("Wgu", "Wd"),
    "slot_projection_kernel": "D",
    "token_sum_kernel": "C",
    # the persistent TMA-fed forms of W and D (tma_weight_grad.py, tma_slot_projection.py)
    "grouped_weight_grad_kernel": ("Wgu", "Wd"),
    "slot_projection_tma_kernel": "D",
}
COLUMNS = ("A", "Wgu", "Wd", "D", "C", "other")


def parse_configs(text: str) -> dict[str, dict]:
    """``NAME:FIELD=VALUE,…;NAME:…`` -> name -> fields."""
    configs = {}
    for item in text.split(";"):
        name, _, fields = item.partition(":")
        configs[name] = parse_fields(fields)
    return configs


def kernel_times(call, reps=5) -> dict[str, float]:
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    times = defaultdict(list)
    seen = defaultdict(int)
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    for event in events:
        column = KERNEL_NAMES.get(event.name, "other")
        if isinstance(column, tuple):  # the n-th launch of a kernel within a call
            column, seen[event.name] = column[seen[event.name] % len(column)], seen[event.name] + 1
        times[column].append(event.device_time / 1e3)
    out = {k: statistics.median(v) for k, v in times.items() if k != "other"}
    out["other"] = sum(times["other"]) / reps
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="fp32:2048")
    parser.add_argument("--configs", default="default")
    parser.add_argument("--out", default=None, help="JSON file (default: $OUT/p2_tune.json where OUT is set)")
    args = parser.parse_args()
    configs = parse_configs(args.configs)
    rows = []
    for case in args.cases.split(","):
        problem, num_tokens = parse_case(case)
        inputs = problem.make_inputs(num_tokens, seed=0, device="cuda")
        T, K = inputs["topk_indices"].shape
        E = inputs["gate_weights"].shape[0]
        want, _ = reference_outputs(problem, inputs, small=False)  # fp32 with TF32 off
        base = launch_config(T * K, E, input_bytes=inputs["hidden_states"].element_size())
        for name, fields in configs.items():
            call = None
            try:
                config = replace_fields(base, fields)
                call = functools.partial(moe_experts_backward_triton, *inputs.values(), config=config)
                got = call()
                stats = [compare_output(g, w, problem.element_rule) for g, w in zip(got, want, strict=True)]
                del got
                fractions = [s["pass_fraction"] for s in stats if s["pass_fraction"] is not None]
                row = dict(
                    case=case,
                    config=name,
                    fields=fields,
                    rel={n: s["rel_error"] for n, s in zip(problem.output_names, stats, strict=True)},
                    element_rule=min(fractions) if fractions else None,
                    finite=all(s["finite"] for s in stats),
                    kernels=kernel_times(call),
                    graph_ms=timing.graph_median_ms(call, None, reps=5),
                )
            except Exception as exc:  # report and go on with the other configs
                row = dict(case=case, config=name, fields=fields, error=str(exc).strip().splitlines()[-1][:200])
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
        del inputs, want, call
        torch.cuda.empty_cache()
    write_out("p2_tune.json", rows, path=args.out)
    print(
        f"\n{'case':11s} {'config':14s} "
        + " ".join(f"{c:>6s}" for c in COLUMNS)
        + f" {'graph ms':>8s} {'worst rel':>9s} {'elem rule':>9s}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['case']:11s} {r['config']:14s} ERROR {r['error']}")
            continue
        k = r["kernels"]
        element_rule = "-" if r["element_rule"] is None else f"{r['element_rule']:.4f}"
        print(
            f"{r['case']:11s} {r['config']:14s} "
            + " ".join(f"{k.get(c, 0):6.2f}" for c in COLUMNS)
            + f" {r['graph_ms']:8.2f} {max(r['rel'].values()):9.1e} {element_rule:>9s}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
