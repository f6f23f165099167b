"""Time the P2 Triton kernels under several launch configurations, kernel by kernel.

    PYTHONPATH=. python3 scripts/p2_tune.py --cases fp32:2048,bf16:2048 \
        --configs "default;m32:block_m=32,block_i_dx=32;a_s2:stages_a=2"

Each config is NAME:FIELD=VALUE,… over the LaunchConfig that ``launch_config`` picks ("default" alone
is that config). Per case and config: the outputs against the fp32 reference (relative error, the
element rule's pass fraction on the worst output), each kernel's median GPU time over 5 eager calls
(torch.profiler; the weights are 10–50× the L2, so no flush is needed), and the whole call replayed
from a CUDA graph (median of 5). A table is printed last and written as JSON to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from p2_gpu_check import ELEMENT_RULE, OUTPUT_NAMES, make_case_inputs  # noqa: E402

from moe_lib import reference  # noqa: E402
from moe_lib.bench import compare_output  # noqa: E402
from moe_lib.kernels import moe_experts_backward as kernels  # noqa: E402

# kernel name -> column; the weight-gradient kernel runs twice per call: dWg and dWu, then dWd
KERNEL_NAMES = {"_swiglu_grad_kernel": "A", "_expert_weight_grad_kernel": ("Wgu", "Wd"), "_slot_projection_kernel": "D",
                "_token_sum_kernel": "C", "_gate_up_grad_kernel": "G"}  # fmt: skip
COLUMNS = ("A", "G", "Wgu", "Wd", "D", "C", "other")


def parse_field(text: str) -> tuple[str, object]:
    """FIELD=VALUE with VALUE an int, or ints joined by x for a tile (grad_down_tile=128x256x64)."""
    name, _, value = text.partition("=")
    return name, tuple(int(v) for v in value.split("x")) if "x" in value else int(value)


def parse_configs(text: str) -> dict[str, dict]:
    configs = {}
    for item in text.split(";"):
        name, _, fields = item.partition(":")
        configs[name] = dict(parse_field(f) for f in fields.split(",") if f)
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
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)  # fmt: skip
    for event in events:
        column = KERNEL_NAMES.get(event.name, "other")
        if isinstance(column, tuple):  # the n-th launch of a kernel within a call
            column, seen[event.name] = column[seen[event.name] % len(column)], seen[event.name] + 1
        times[column].append(event.device_time / 1e3)
    out = {k: statistics.median(v) for k, v in times.items() if k != "other"}
    out["other"] = sum(times["other"]) / reps
    return out


def graph_time(call, reps=5) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="fp32:2048")
    parser.add_argument("--configs", default="default")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for case in args.cases.split(","):
        dtype, num_tokens = case.split(":")
        inputs = make_case_inputs(dtype, int(num_tokens), seed=0)
        T, K = inputs["topk_indices"].shape
        E = inputs["gate_weights"].shape[0]
        upcast = {k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()}
        with reference.tf32_disabled():
            want = reference.moe_experts_backward_reference(*upcast.values())
        del upcast
        base = kernels.launch_config(T * K, E, input_bytes=inputs["hidden_states"].element_size())
        for name, fields in parse_configs(args.configs).items():
            config = dataclasses.replace(base, **fields)

            call = functools.partial(kernels.moe_experts_backward_triton, *inputs.values(), config=config)

            try:
                got = call()
                stats = [compare_output(g, w, ELEMENT_RULE) for g, w in zip(got, want, strict=True)]
                del got
                row = dict(case=case, config=name, fields=fields,
                           rel={n: s["rel_error"] for n, s in zip(OUTPUT_NAMES, stats, strict=True)},
                           element_rule=min(s["pass_fraction"] for s in stats),
                           finite=all(s["finite"] for s in stats),
                           kernels=kernel_times(call), graph_ms=graph_time(call))  # fmt: skip
            except Exception as exc:  # report and go on with the other configs
                row = dict(case=case, config=name, fields=fields, error=str(exc).strip().splitlines()[-1][:200])
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
        del inputs, want, call
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{'case':11s} {'config':14s} " + " ".join(f"{c:>6s}" for c in COLUMNS)
          + f" {'graph ms':>8s} {'worst rel':>9s} {'elem rule':>9s}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['case']:11s} {r['config']:14s} ERROR {r['error']}")
            continue
        k = r["kernels"]
        print(f"{r['case']:11s} {r['config']:14s} " + " ".join(f"{k.get(c, 0):6.2f}" for c in COLUMNS)
              + f" {r['graph_ms']:8.2f} {max(r['rel'].values()):9.1e} {r['element_rule']:9.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
