"""Timeline of P1 calls made NVIDIA's way: where the host is while the GPU waits between two launches.

    PYTHONPATH=. python scripts/p1/p1_call_timeline.py [--tokens 2447] [--configs default,triton_faithful] [--calls 5]

Per design (``--configs``: "default" or names of ``moe_lib.bench.tuning.P1_CANDIDATES``): ``--calls`` eager
faithful calls, each on freshly copied inputs after an L2-clearing memset and a synchronisation (as in
:mod:`moe_lib.bench.official_timing`), under ``torch.profiler`` with Python stacks. Prints, for the last call, every
kernel's start and end and every launch API call, in µs from the first kernel's start, and the ten costliest Python
functions between the end of kernel 1 and the start of kernel 2. With $OUT set, the Chrome traces go there.
"""

from __future__ import annotations

import argparse
import os

import torch

from moe_lib import problems
from moe_lib.bench.tuning import p1_call, p1_candidate_names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2447)
    parser.add_argument("--configs", default="default,triton_faithful")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    try:
        names = p1_candidate_names(args.configs)
    except ValueError as exc:
        raise SystemExit(f"--configs: {exc}") from None
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    T = args.tokens
    inputs = problems.load("swiglu_down_backward").make_inputs(T, seed=T, device="cuda", distribution="harness")
    clear = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.int8, device="cuda")
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for name in names:
        for _ in range(3):  # compiled and warm
            p1_call(name, inputs, "faithful")()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities, with_stack=True) as profiler:
            for _ in range(args.calls):
                fresh = {key: value.clone() for key, value in inputs.items()}
                call = p1_call(name, fresh, "faithful")
                clear.zero_()
                torch.cuda.synchronize()
                clear.zero_()
                out = call()
                torch.cuda.synchronize()
                del out
        if os.environ.get("OUT"):
            profiler.export_chrome_trace(os.path.join(os.environ["OUT"], f"timeline-{T}-{name}.json"))
        events = [e for e in profiler.events() if e.time_range.end > e.time_range.start]
        kernels = sorted(
            (
                e
                for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA
                and "memset" not in e.name.lower()
                and "elementwise" not in e.name.lower()
                and "fill" not in e.name.lower()
                and "copy" not in e.name.lower()
            ),
            key=lambda e: e.time_range.start,
        )
        ours = kernels[-2:] if len(kernels) >= 2 else kernels
        origin = ours[0].time_range.start
        print(f"=== T={T} {name}: the last call's kernels and launches, µs from its first kernel's start")
        for e in ours:
            print(f"  kernel {e.name[:60]:60} {e.time_range.start - origin:9.1f} .. {e.time_range.end - origin:9.1f}")
        launches = [e for e in events if "LaunchKernel" in e.name and e.time_range.start > origin - 2000]
        for e in sorted(launches, key=lambda e: e.time_range.start)[-4:]:
            print(f"  api    {e.name[:60]:60} {e.time_range.start - origin:9.1f} .. {e.time_range.end - origin:9.1f}")
        if len(ours) == 2:
            gap_start, gap_end = ours[0].time_range.end, ours[1].time_range.start
            between = [
                e
                for e in events
                if e.device_type == torch.autograd.DeviceType.CPU
                and e.time_range.start >= ours[0].time_range.start - 500
                and e.time_range.end <= gap_end
            ]
            between.sort(key=lambda e: e.time_range.end - e.time_range.start, reverse=True)
            print(f"  GPU idle between the kernels: {gap_end - gap_start:.1f} µs; longest host events around it:")
            for e in between[:14]:
                start, length = e.time_range.start - origin, e.time_range.end - e.time_range.start
                print(f"    {e.name[:80]:80} {start:9.1f} +{length:7.1f}")


if __name__ == "__main__":
    main()
