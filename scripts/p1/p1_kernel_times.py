"""Each kernel of a P1 call and how long it ran: our candidates beside ``torch.compile``, from one profiler trace.

    PYTHONPATH=. python scripts/p1/p1_kernel_times.py [--tokens 128,1321] [--configs library_gemms_fast]

On a GPU, per token count: every candidate of ``moe_lib.bench.tuning.P1_CANDIDATES`` named (fast path) and the
``torch_compile`` peer are captured in a CUDA graph; ``--runs`` replays, each after an L2 flush, run under
``torch.profiler``. Prints, per candidate, the median span of a call (first kernel's start to last kernel's end)
and each kernel (known by its name and occurrence in the call) in order of its median start (µs after the call's
first kernel), with its median duration and its stream. Tells where one design's chain of kernels loses time
against another's. With $OUT set, writes the table as JSON.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from moe_lib import problems
from moe_lib.bench import timing
from moe_lib.bench.peers.swiglu_down import eager_arguments, swiglu_down_backward_eager
from moe_lib.bench.tuning import p1_call, p1_candidate_names, write_out

FLUSH_KERNEL = "FillFunctor"  # the L2 flush between calls (timing.L2Flusher fills a buffer)


def call_of(name: str, inputs: dict):
    if name == "torch_compile":
        torch._dynamo.reset()
        compiled = torch.compile(swiglu_down_backward_eager, dynamic=False)
        arguments = eager_arguments(inputs)
        return lambda: compiled(*arguments)
    return p1_call(name, inputs, "fast")


def kernels_per_call(fn, runs: int) -> list[list[dict]]:
    """The kernels of each of ``runs`` graph replays of ``fn`` (each after an L2 flush), in start order."""
    flush = timing.L2Flusher("cuda")
    graph, _ = timing.capture(fn)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            flush()
            graph.replay()
        torch.cuda.synchronize()
    events = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: e.time_range.start
    )
    calls, current = [], []
    for event in events:
        if FLUSH_KERNEL in event.name:
            if current:
                calls.append(current)
            current = []
            continue
        current.append(
            dict(
                name=event.name,
                start=event.time_range.start,
                end=event.time_range.end,
                stream=getattr(event, "device_resource_id", None),
            )
        )
    if current:
        calls.append(current)
    return calls


def summary(calls: list[list[dict]]) -> dict:
    """Median span and, per kernel, median start offset and duration (µs), in order of median start.

    A kernel is known by its name and how many kernels of that name came before it in its call: with two streams
    the order in which kernels start changes from call to call, so the i-th kernel of one call need not be the
    i-th of another. A kernel missing from some calls is summarised over the calls that have it (``calls``)."""
    spans = [max(k["end"] for k in c) - c[0]["start"] for c in calls]
    seen: dict[tuple[str, int], list[dict]] = {}
    for call in calls:
        occurrences: dict[str, int] = {}
        for kernel in call:
            index = occurrences.get(kernel["name"], 0)
            occurrences[kernel["name"]] = index + 1
            seen.setdefault((kernel["name"], index), []).append(dict(kernel, offset=kernel["start"] - call[0]["start"]))
    kernels = [
        dict(
            name=name,
            stream=found[0]["stream"],
            calls=len(found),
            start_us=statistics.median(k["offset"] for k in found),
            duration_us=statistics.median(k["end"] - k["start"] for k in found),
        )
        for (name, _), found in seen.items()
    ]
    kernels.sort(key=lambda k: k["start_us"])
    return dict(span_us=statistics.median(spans), calls=len(calls), kernels=kernels)


def short(name: str, width: int = 60) -> str:
    name = name.replace("void ", "")
    return name if len(name) <= width else name[: width - 1] + "…"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,1321")
    parser.add_argument("--configs", default="library_gemms_fast,library_gemms_fast_many")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    try:
        names = p1_candidate_names(args.configs, default=False)
    except ValueError as exc:
        raise SystemExit(f"--configs: {exc}") from None
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    problem = problems.load("swiglu_down_backward")
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        inputs = problem.make_inputs(T, seed=T, device="cuda")
        for name in [*names, "torch_compile"]:
            result = summary(kernels_per_call(call_of(name, inputs), args.runs)) | dict(T=T, impl=name)
            rows.append(result)
            print(f"\nT={T} {name}: span {result['span_us']:.1f} µs (median of {result['calls']} calls)")
            for k in result["kernels"]:
                print(f"  +{k['start_us']:6.1f} {k['duration_us']:6.1f} µs  stream {k['stream']}  {short(k['name'])}")
    write_out("p1_kernel_times.json", rows)


if __name__ == "__main__":
    main()
